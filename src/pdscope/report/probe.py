"""Terminal report and plot for `pdscope probe` (both read the same result dict)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pdscope.report.fit import fit_figures, fit_prose
from pdscope.report.units import fmt, fmt_bytes, fmt_seconds


def _f(x: float | None, pattern: str = "{:,.0f}") -> str:
    return fmt(x, pattern)


def _ms(x: float | None) -> str:
    """Milliseconds to three figures or so: a tiny model's 0.8 ms TTFT read "1" as whole ms."""
    if x is None:
        return "-"
    return _f(x, "{:,.0f}" if x >= 100 else "{:.1f}" if x >= 10 else "{:.2f}")


def render_probe(r: dict[str, Any], console: Console) -> None:
    rt = r["runtime"]
    console.print(
        f"[bold]pdscope probe[/] {rt['url']}: [bold]{rt['name']}[/] "
        f"({', '.join(rt['evidence'])}), model [bold]{r['model']}[/], API {rt['api']}"
    )
    s = r["settings"]
    console.print(
        f"{s['repeats']} repeats per point, {s['output_tokens']} output tokens, "
        f"prompt tokens {'exact (/tokenize)' if s['exact_prompt_tokens'] else 'calibrated'}, "
        f"seed {s.get('seed')} ({'given' if s.get('seed_given') else 'fresh prompts'})"
        + (f", cache hits read from {r['prefix_counter']}" if r.get("prefix_counter") else "")
    )
    if r.get("cold"):
        c = r["cold"]
        console.print(
            f"cold request (not mixed in): TTFT {_ms(c['ttft_ms'])} ms, decode "
            + (
                "unread (the client read it in bursts)"
                if c.get("read_in_bursts")
                else f"{_f(c['decode_tok_s'], '{:,.1f}')} tok/s"
            )
            + (
                f" [yellow](not cold: {c['cached_tokens']:,} of {c['prompt_tokens']:,} prompt "
                "tokens came from the prefix cache)[/]"
                if c.get("cache_hit")
                else ""
            )
        )

    table = Table(
        title="Prefill and decode by prompt length (medians; range over repeats)",
        title_justify="left",
    )
    for col in (
        "prompt tokens",
        "TTFT ms",
        "TTFT range",
        "decode tok/s",
        "decode range",
        "setup ms",
    ):
        table.add_column(col, justify="right")
    server_cols = any("server_prompt_eval_ms" in p or "server_prompt_ms" in p for p in r["sweep"])
    if server_cols:
        table.add_column("server prefill ms", justify="right")
        table.add_column("server decode tok/s", justify="right")
    ceiling = {p["prompt_tokens"]: p for p in (r.get("ceiling") or {}).get("points", [])}
    if ceiling:
        table.add_column("% decode ceiling", justify="right")
        table.add_column("TTFT floor ms", justify="right")
    for p in r["sweep"]:
        row = [
            f"{p['prompt_tokens']:,}",
            _ms(p["ttft_ms"]),
            f"{_ms(p['ttft_ms_min'])}–{_ms(p['ttft_ms_max'])}",
            _f(p["decode_tok_s"], "{:,.1f}"),
            f"{_f(p['decode_tok_s_min'], '{:,.1f}')}–{_f(p['decode_tok_s_max'], '{:,.1f}')}",
            _f(p["setup_ms"], "{:,.2f}"),
        ]
        if server_cols:
            row += [
                _f(p.get("server_prompt_eval_ms", p.get("server_prompt_ms"))),
                _f(p.get("server_eval_tok_s", p.get("server_predicted_tok_s")), "{:,.1f}"),
            ]
        if ceiling:
            c = ceiling.get(p["prompt_tokens"], {})
            row += [_f(c.get("decode_pct_of_ceiling"), "{:.0f}%"), _ms(c.get("ttft_floor_ms"))]
        table.add_row(*row)
    console.print(fit_figures(table, console))
    if server_cols:
        console.print(
            "[dim]server prefill/decode: the server's own phase timings; client TTFT "
            "minus server prefill = network + queue + response handoff[/]"
        )

    fit = r.get("ttft_fit")
    if fit:
        console.print(
            f"TTFT ≈ {fit['intercept_ms']:.1f} ms + {fit['ms_per_token']:.3f} ms × N "
            f"+ {fit['ms_per_token2'] * 1e6:.2f} ms × (N/1000)²   (least squares)"
        )
    console.print(
        f"prefill {_f(r['prefill_tok_s'])} tok/s at the longest prompt; decode "
        f"{_f(r['decode_tok_s'], '{:,.1f}')} tok/s; prefill/decode "
        f"{_f(r['prefill_to_decode_ratio'], '{:,.0f}x')}; decode slope "
        f"{_f(r['decode_slope_tok_s_per_1k_prompt'], '{:+.2f}')} tok/s per 1k prompt "
        "tokens"
    )
    pc = r.get("prefix_cache")
    if pc:
        console.print(
            f"prefix cache: {_f(pc.get('prefix_tokens'), '{:,}')}-token prefix (+ a fresh "
            f"{pc.get('tail_tokens')}), TTFT "
            f"{_ms(pc['cold_ttft_ms'])} → {_ms(pc['warm_ttft_ms'])} ms "
            f"({pc['warm_over_cold']:.0%}), cached tokens reported: "
            f"{_f(pc['cached_tokens'])}"
        )
    ctx = r.get("context")
    if ctx and ctx["long_over_short"]:
        console.print(
            f"context: decode {_f(ctx['short']['decode_tok_s'], '{:,.1f}')} tok/s at "
            f"{ctx['short']['prompt_tokens']:,} tokens, "
            f"{_f(ctx['long']['decode_tok_s'], '{:,.1f}')} at "
            f"{ctx['long']['prompt_tokens']:,} ({ctx['long_over_short']:.0%})"
        )
    for key in ("batch_decode", "batch_decode_long"):
        batch = r.get(key)
        if not batch:
            continue
        head = f"batched decode: {batch['streams']} streams of "
        head += f"{_f(batch['prompt_tokens'], '{:,}')} prompt tokens"
        left_out = _left_out(batch)
        if batch.get("itl_ms"):
            console.print(
                f"{head}, one step with {batch['decoding_together']} decoding at "
                f"{_f(batch['context_tokens'], '{:,}')} tokens of context "
                f"{fmt_seconds(batch['itl_ms'] / 1e3)}"
                + (f" (left out: {left_out})" if left_out else "")
                + _against_one_stream(batch)
            )
        else:
            console.print(
                f"{head}: step unread [yellow]({_unread(batch)}: their timing is the "
                "client's, not the server's steps)[/]"
            )
    if line := _batch_curve(r):
        console.print(line)
    for j in r.get("prefill_join") or []:
        without = j.get("decode_step_ms")
        console.print(
            f"a {j['prompt_tokens']:,}-token prompt joining {j['decoding_together']} decoding "
            f"streams: their step {fmt_seconds(j['step_ms'] / 1e3)}"
            + (
                f" against {fmt_seconds(without / 1e3)} without it ({j['step_ms'] / without:.1f}x)"
                if without
                else ""
            )
        )
    if r.get("ceiling"):
        c = r["ceiling"]
        margin = c.get("decode_pct_range")
        console.print(
            f"vs {c['device']} ({c.get('model') or 'model'}): decode at "
            f"{_f(c['decode_pct_of_ceiling'], '{:.0f}%')}"
            + (f" (margin {margin[0]:.0f}–{margin[1]:.0f}%)" if margin else "")
            + f" of the bandwidth ceiling, prefill at "
            f"{_f(c['prefill_pct_of_floor'], '{:.0f}%')} of the compute floor"
        )
    served = r.get("served_model") or {}
    if served.get("params") or served.get("max_model_len"):
        console.print(
            f"served model {served.get('name')}: "
            f"{_params(served.get('params'))}, "
            + (
                f"{fmt_bytes(served['weight_bytes'])} of weights"
                + (f" ({served['weights_type']})" if served.get("weights_type") else "")
                + ", "
                if served.get("weight_bytes")
                else ""
            )
            + f"context {_f(served.get('max_model_len'), '{:,}')} tokens"
        )

    findings = Table(title="Findings", title_justify="left", show_lines=True)
    for col in ("finding", "evidence", "what to change"):
        findings.add_column(col)
    for f in r["findings"]:
        findings.add_row(f["finding"], f["evidence"], f["action"])
    console.print(fit_prose(findings, console))
    for note in r.get("notes", []):
        console.print(f"[yellow]note:[/] {note}")
    for failure in r["failures"]:
        console.print(
            f"[red]failed[/] {failure['label']} ({failure['prompt_tokens']} tokens): "
            f"{failure['error']}"
        )
    for what in r.get("unmeasured", []):
        console.print(f"[red]not measured:[/] {what}")
    if r.get("partial"):
        console.print(f"[red]partial results:[/] {r['partial']}")


def plot_probe(r: dict[str, Any], path: Path) -> None:
    """TTFT vs prompt tokens and decode tok/s vs prompt tokens, side by side, ceiling drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [p for p in r["sweep"] if p["ttft_ms"] is not None]
    xs = [p["prompt_tokens"] for p in points]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.errorbar(
        xs,
        [p["ttft_ms"] for p in points],
        yerr=[
            [p["ttft_ms"] - p["ttft_ms_min"] for p in points],
            [p["ttft_ms_max"] - p["ttft_ms"] for p in points],
        ],
        fmt="o",
        capsize=3,
        label="measured (median, range)",
    )
    fit = r.get("ttft_fit")
    if fit and xs:
        grid = [min(xs) + (max(xs) - min(xs)) * i / 50 for i in range(51)]
        left.plot(
            grid,
            [
                fit["intercept_ms"] + fit["ms_per_token"] * g + fit["ms_per_token2"] * g * g
                for g in grid
            ],
            "-",
            label="fit",
        )
    ceiling = {p["prompt_tokens"]: p for p in (r.get("ceiling") or {}).get("points", [])}
    floors = [
        (n, ceiling[n]["ttft_floor_ms"]) for n in xs if ceiling.get(n, {}).get("ttft_floor_ms")
    ]
    if floors:
        left.plot(*zip(*floors, strict=True), "--", label="compute floor")
    left.set(xlabel="prompt tokens", ylabel="TTFT (ms)", title="Prefill: time to first token")
    left.legend()
    decode = [p for p in points if p["decode_tok_s"]]
    right.plot(
        [p["prompt_tokens"] for p in decode],
        [p["decode_tok_s"] for p in decode],
        "o-",
        label="measured (median)",
    )
    ceil = [
        (n, ceiling[n]["decode_ceiling_tok_s"])
        for n in xs
        if ceiling.get(n, {}).get("decode_ceiling_tok_s")
    ]
    if ceil:
        right.plot(*zip(*ceil, strict=True), "--", label="bandwidth ceiling")
    right.set(
        xlabel="prompt tokens",
        ylabel="decode tok/s",
        title="Decode: tokens per second",
        ylim=(0, None),
    )
    right.legend()
    fig.suptitle(f"{r['model']} on {r['runtime']['name']} ({r['runtime']['url']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _batch_curve(r: dict[str, Any]) -> str | None:
    """One line of the decode step by streams decoding together, at short prompts: one
    stream's mean step (the context check's short point), the batched check's and the batch
    sweep's median gaps, each against one stream's, with the streams each left out (read in
    bursts or whole); a point without a step is "unread" and says why. None without a sweep
    point."""
    sweep = [p for p in r.get("batch_sweep") or [] if p.get("decoding_together")]
    if not sweep:
        return None
    ctx = r.get("context") or {}
    one_tok_s = (ctx.get("short") or {}).get("decode_tok_s")
    points: dict[int, dict[str, Any]] = {1: {"itl_ms": 1e3 / one_tok_s}} if one_tok_s else {}
    for p in [r.get("batch_decode") or {}, *sweep]:
        k = p.get("decoding_together")
        if k and (k not in points or (p.get("itl_ms") and not points[k].get("itl_ms"))):
            points[k] = p  # a point with a step over one without
    one = points.get(1, {}).get("itl_ms")
    parts = []
    below = False  # a batched step read under one stream's
    for k, p in sorted(points.items()):
        ms, left_out = p.get("itl_ms"), _left_out(p)
        if not ms:
            parts.append(f"{k}: unread ({_unread(p)})" if "streams" in p else f"{k}: unread")
            continue
        notes = [f"{ms / one:.2f}x"] if one and k > 1 else []
        # under 0.9x: one stream's figure is a mean step, the batches' median gaps
        below = below or bool(one and k > 1 and ms < 0.9 * one)
        notes += [f"left out: {left_out}"] if left_out else []
        parts.append(f"{k}: {fmt_seconds(ms / 1e3)}" + (f" ({'; '.join(notes)})" if notes else ""))
    line = "decode step by streams decoding together (short prompts): " + ", ".join(parts)
    if below:  # the 7B-shaped model on 2 CPU cores read 2 streams' step at 0.64x one's
        line += (
            " [yellow](a step under 1x is no batched step cheaper than one stream's: each "
            "point is read at its own moment, so the host's speed moving between them, or one "
            "stream's mean step against the batches' median gaps, decides it)[/]"
        )
    return line


def _left_out(batch: dict[str, Any]) -> str:
    """The streams of a batch point whose gaps its step leaves out, and why ("2 of 8 streams
    read in bursts, 1 of 8 came whole"); "" where none."""
    n = batch.get("streams")
    parts = []
    if bursty := batch.get("bursty_streams"):
        parts.append(f"{bursty} of {n} streams read in bursts")
    if whole := batch.get("one_read_streams"):
        parts.append(f"{whole} of {n}{'' if parts else ' streams'} came whole")
    return ", ".join(parts)


def _unread(batch: dict[str, Any]) -> str:
    """Why a batch point has no step: no stream read steadily, or the steady ones' median gap
    was 0 (reads of several tokens each, too few to call bursts)."""
    left_out = _left_out(batch)
    unsteady = (batch.get("bursty_streams") or 0) + (batch.get("one_read_streams") or 0)
    if unsteady >= batch["streams"]:
        return f"no stream read steadily: {left_out}"
    return "the steady streams' median gap was 0" + (f"; left out: {left_out}" if left_out else "")


def _against_one_stream(batch: dict[str, Any]) -> str:
    """The batched step against one stream's (", 1.40x one stream's"), with a caveat where the
    batched step reads the faster: the batch's figure is the median gap over its steadily read
    streams, one stream's the mean step (TPOT) of the context check's requests, sent alone
    before the batch, so a few slow steps there or the host between the two put it below 1."""
    ratio = batch.get("step_over_one_stream")
    if not ratio:
        return ""
    text = f", {ratio:.2f}x one stream's"
    if ratio >= 1:
        return text
    return (
        text + " [yellow](no batched step is faster than one stream's: this sets the batch's "
        "median gap against one stream's mean step, measured alone at another moment, so "
        "host noise or a few slow single-stream steps decide it)[/]"
    )


def _params(count: int | None) -> str:
    """'8.03B parameters', or in millions below a billion ('0.000224B' read as nothing)."""
    if not count:  # the server did not say (or stopped answering before it could)
        return "parameters not reported"
    return f"{count / 1e9:.3g}B parameters" if count >= 1e9 else f"{count / 1e6:.3g}M parameters"
