"""Terminal report for `pdscope bench` and `pdscope bench compare`."""

from __future__ import annotations

import math
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from pdscope.report.fit import fit_figures
from pdscope.report.units import fmt as _f
from pdscope.report.units import fmt_quantile


def render_bench(r: dict[str, Any], console: Console) -> None:
    """bench's tables and notes; for `simulate`'s result (``simulated``) without the lines
    about a client, a network or a /metrics page that a simulation does not have."""
    m = r["metadata"]
    simulated = bool(r.get("simulated"))
    console.print(
        f"[bold]pdscope bench[/] {m['url']}: [bold]{m['runtime']}[/], model "
        f"[bold]{m['model']}[/], workload {m['workload']}, API {m['api']}, prompt "
        f"tokens {_prompt_mode(m)}, seed {m.get('seed')} "
        f"({'given' if m.get('seed_given') else 'fresh prompts'})"
    )
    table = Table(
        title="Runs (latencies in ms; percentiles by numpy linear interpolation)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    goodput = any(run["summary"].get("goodput_fraction") is not None for run in r["runs"])
    cols = [
        "load",
        "ok",
        "fail",
        "req/s",
        "tok/s",
        "TTFT50",
        "TTFT99",
        "TPOT50",
        "ITL50",
        "ITL99",
        "E2E99",
        *(["good"] if goodput else []),
    ]
    for col in cols:
        table.add_column(col, justify="right")
    for run in r["runs"]:
        s = run["summary"]
        row = [
            _load(run),
            str(s["completed"]),
            str(s["failed"]),
            _f(s["request_throughput"], "{:,.2f}"),
            _f(s["output_throughput"], "{:,.0f}"),
            _f(s["median_ttft_ms"], "{:,.0f}"),
            _f(s.get("p99_ttft_ms"), "{:,.0f}"),
            _f(s["median_tpot_ms"]),
            _f(s["median_itl_ms"]),
            _f(s.get("p99_itl_ms")),
            _f(s.get("p99_e2el_ms"), "{:,.0f}"),
        ]
        if goodput:
            row.append(_f(s.get("goodput_fraction"), "{:.0%}"))
        table.add_row(*row)
    console.print(fit_figures(table, console))
    for run in r["runs"]:
        got = run["summary"].get("input_tokens_achieved")
        console.print(
            f"input tokens at {_load(run)}: asked {run.get('input_tokens_requested', '?')}, "
            + (
                f"simulated median {got['median']:,.0f} (range {got['min']:,}–{got['max']:,})"
                if got and simulated
                else f"sent median {got['median']:,.0f} (range {got['min']:,}–{got['max']:,}, "
                f"{got['source']})"
                if got
                else "sent unknown (the server reports no prompt counts)"
            )
        )
        by_chunks = {
            k: n for k, n in (run["summary"].get("output_tokens_source") or {}).items()
            if k.startswith("chunks")
        }  # fmt: skip
        if by_chunks:
            why = "; ".join(
                f"{k.removeprefix('chunks ').strip('()')}: {n}" for k, n in by_chunks.items()
            )
            console.print(
                f"[yellow]output tokens at {_load(run)}: {sum(by_chunks.values())} of "
                f"{run['summary']['completed']} requests counted one a content chunk ({why}); "
                "TPOT and tokens/s assume one token a chunk there[/]"
            )
        for warning in run.get("warnings") or []:
            console.print(f"[yellow]warning at {_load(run)}:[/] {warning}")
        if run["summary"].get("retried"):
            console.print(
                f"[yellow]{run['summary']['retried']} request(s) at {_load(run)} were sent again[/]"
                " after the server had closed the keep-alive connection they were written on "
                "(see requests[].retried)"
            )
        if bursty := run["summary"].get("read_in_bursts"):
            console.print(
                f"[yellow]{bursty} of {run['summary']['completed']} requests at {_load(run)} "
                "were read by the client in bursts[/] (their first tokens waited in this "
                "process): their TPOT and gaps measure the client, not the server, and are in "
                "the figures above as vllm bench serve keeps them"
                + (
                    "; the server's own ITL is in its view below"
                    if ((run.get("server") or {}).get("histograms") or {}).get("itl")
                    else ""
                )
            )
    for run in [] if simulated else r["runs"]:  # no client, no connection: nothing measured
        sm = run["summary"]
        if sm.get("mean_setup_ms") is not None or sm.get("p99_close_ms") is not None:
            # The two places where vLLM's clocks would give other numbers (docs/metrics.md).
            console.print(
                f"[dim]at {_load(run)}: connection setup mean "
                f"{_f(sm.get('mean_setup_ms'), '{:,.2f}')} ms (outside TTFT here; vLLM's TTFT "
                "includes it); close p99 "
                f"{_f(sm.get('p99_close_ms'), '{:,.1f}')} ms after the last content token "
                "(outside E2E, as in vLLM)[/]"
            )
    for run in [] if simulated else r["runs"]:
        lag = run["summary"]["client_lag_ms"] or {}
        if run["request_rate"] is not None and lag.get("p99") is not None:
            # Open loop only: behind a concurrency cap, waiting is the point, not client lag.
            console.print(
                f"client lag behind the arrival schedule at {_load(run)}: p99 "
                f"{lag['p99']:,.1f} ms, max {lag['max']:,.1f} ms"
            )

    server = Table(
        title="The simulated engine's gauges and counters (read off its steps)"
        if simulated
        else "Server's view (/metrics, sampled during each run; ms)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    # A simulation has no latency histograms: its latencies are in the runs' table
    quantiles = () if simulated else ("TTFT50", "TTFT99", "ITL99")
    for col in ("load", "running", "waiting", "KV use", "preempt", "prefix hit", *quantiles):
        server.add_column(col, justify="right")
    shown = False
    for run in r["runs"]:
        v = run["server"]
        if not v.get("available"):
            continue
        shown = True
        h = v.get("histograms") or {}
        deltas = v.get("deltas") or {}
        server.add_row(
            _load(run),
            _f(v.get("max_running"), "{:,.0f}"),
            _f(v.get("max_waiting"), "{:,.0f}"),
            _f(v.get("max_kv_usage"), "{:.0%}"),
            _f(deltas.get("preemptions"), "{:,.0f}"),
            _f(v.get("prefix_hit_rate"), "{:.0%}"),
            *(
                ()
                if simulated
                else (
                    _quantile(h.get("ttft"), "p50_ms"),
                    _quantile(h.get("ttft"), "p99_ms"),
                    _quantile(h.get("itl"), "p99_ms"),
                )
            ),
        )
    if shown:
        console.print(fit_figures(server, console))
        for run in [] if simulated else r["runs"]:
            v = run["server"]
            if v.get("available") and v.get("load_scrapes") == 0:
                why = (
                    f"no scrape inside the load answered ({v['scrape_errors']} failed; the "
                    f"first: {(v.get('errors') or ['?'])[0]})"
                    if v.get("scrape_errors")
                    else "the run was too short to sample (no scrape fell inside the load, "
                    f"scraped every {v.get('interval_s') or 0:g} s, only the idle ones before "
                    "and after it)"
                )
                console.print(
                    f"[yellow]server's view at {_load(run)}:[/] running, waiting and KV use "
                    f"'-': {why}; its counters and histograms still cover it"
                )
            for warning in v.get("warnings") or []:
                console.print(f"[yellow]server's view at {_load(run)}:[/] {warning}")
        if not simulated:
            console.print(
                "[dim]server TTFT starts when the server has the request and ends at the "
                "engine's first token; the client's adds the network and the client's "
                "own scheduling. Histogram quantiles are interpolated within buckets; '<' or "
                "'>' marks one known only by the first or the last bound.[/]"
            )
    else:
        reasons = {run["server"].get("reason") for run in r["runs"]}
        console.print(f"[dim]no server metrics: {', '.join(str(x) for x in reasons)}[/]")
    for run in r["runs"]:
        kinds = run.get("by_kind") or {}
        if len(kinds) > 1:
            t = Table(title=f"By request kind at {_load(run)}", title_justify="left")
            for col in ("kind", "done", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99"):
                t.add_column(col, justify="right")
            for kind, s in kinds.items():
                t.add_row(
                    kind,
                    str(s["completed"]),
                    _f(s["median_ttft_ms"]),
                    _f(s.get("p99_ttft_ms")),
                    _f(s["median_itl_ms"]),
                    _f(s.get("p99_itl_ms")),
                )
            console.print(fit_figures(t, console))
        failures = run["summary"]["failures_by_kind"]
        if failures:
            console.print(
                f"[red]failures at {_load(run)}:[/] "
                + ", ".join(f"{k}: {n}" for k, n in failures.items())
            )
    if m.get("saturation_concurrency"):
        console.print(f"throughput saturates near concurrency {m['saturation_concurrency']}")
    cap = r.get("capacity")
    if cap:
        unit = cap.get("by", "concurrency")
        slo = ", ".join(f"{k} ≤ {v * 1e3:g} ms" for k, v in cap["slo"].items())
        best, broke = cap[f"max_{unit}_meeting_slo"], cap[f"first_failing_{unit}"]
        what = (
            (lambda x: f"{x:.3g} requests/s served")
            if unit == "rate"
            else (lambda x: f"{x:g} concurrent requests")
        )
        console.print(
            f"capacity under {slo}: "
            + (
                f"[bold]{what(best)}[/] ({_f(cap['run']['output_throughput'])} output tok/s)"
                if best
                else f"no {unit} tried meets it"
            )
            + (
                f"; {broke:.3g} requests/s offered breaks it"
                if broke and unit == "rate"
                else (f"; {what(broke)} breaks it" if broke else "")
            )
            + f" ({cap['searched_runs']} runs)"
        )
        if cap.get("stopped"):
            console.print(f"search stopped: {cap['stopped']}")
        for note in cap.get("notes") or []:
            console.print(f"[dim]{note}[/]")
    if r.get("partial"):
        console.print(f"[red]partial results:[/] {r['partial']}")


def _prompt_mode(m: dict[str, Any]) -> str:
    if m.get("prompt_mode"):  # a source that says what its prompts are (simulate)
        return str(m["prompt_mode"])
    if m.get("exact_prompt_tokens"):
        return "exact (/tokenize)"
    cal = m.get("prompt_calibration")
    if cal and cal.get("reported") and not cal.get("error"):
        return f"calibrated on the server's counts ({cal['requests']} requests)"
    if cal:
        return f"estimated, not calibrated ({cal.get('error')})"
    return "from the workload file" if str(m.get("workload", "")).startswith("file:") else "?"


def _quantile(histogram: dict[str, Any] | None, key: str) -> str:
    h = histogram or {}
    return fmt_quantile(h.get(key), (h.get("edges") or {}).get(key))


def _load(run: dict[str, Any]) -> str:
    parts = []
    if run.get("request_rate") not in (None, math.inf, "inf"):
        parts.append(f"{run['request_rate']:g}/s")
    if run.get("max_concurrency"):
        parts.append(f"c={run['max_concurrency']}")
    return " ".join(parts) or "all at once"


COMPARED = (
    "completed",
    "failed",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
    "request_goodput",
)


def runs_of(result: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every run in a saved result, labelled by its load: a pdscope file holds one run or a
    series (`runs`); a vllm bench serve file is one run with its figures at the top level."""
    if not isinstance(result, dict):
        raise ValueError("not a bench result (a JSON object with runs)")
    runs = result.get("runs")
    if runs:
        if not isinstance(runs, list):
            raise ValueError("'runs' is not a list")
        out = []
        for i, run in enumerate(runs, 1):
            if not isinstance(run, dict) or not isinstance(run.get("summary"), dict):
                raise ValueError(f"run {i} has no summary")
            out.append((_compared(run, i), run["summary"]))
        return out
    if "completed" in result:
        return [(_compared(result, 1), result)]
    raise ValueError("no run in this file")


def _compared(run: dict[str, Any], i: int) -> str:
    """The run's label, once its compared figures are known to be figures: a number that is
    negative, infinite or not a number would print as a ratio no run can have."""
    figures = run.get("summary", run)
    for key in COMPARED:
        x = figures.get(key)
        if x is None:
            continue
        if isinstance(x, bool) or not isinstance(x, int | float) or not 0 <= x < math.inf:
            raise ValueError(f"run {i}: {key} is {x!r}, not a figure a run can have")
    for key in ("request_rate", "max_concurrency"):
        x = run.get(key)
        if x is None or (key == "request_rate" and x == "inf"):  # vllm bench serve's "inf"
            continue
        if isinstance(x, bool) or not isinstance(x, int | float) or not x > 0:
            raise ValueError(f"run {i}: {key} is {x!r}")
    return _load(run)


def render_compare(
    a: list[tuple[str, dict[str, Any]]],
    b: list[tuple[str, dict[str, Any]]],
    names: tuple[str, str],
    console: Console,
) -> None:
    """Run i of A against run i of B for every run (a single run is set against each run of a
    series); series of different lengths are refused rather than silently cut."""
    if len(a) != len(b) and 1 not in (len(a), len(b)):
        raise ValueError(
            f"{names[0]} holds {len(a)} runs and {names[1]} {len(b)}: compare series of equal "
            "length, or one run against a series"
        )
    pairs = list(
        zip(a * len(b) if len(a) == 1 else a, b * len(a) if len(b) == 1 else b, strict=True)
    )
    for (la, x), (lb, y) in pairs:
        title = f"{names[0]} ({la}) vs {names[1]} ({lb})"
        _compare_table(x, y, title, names, console)
    if len(pairs) > 1:
        console.print(f"compared {len(pairs)} pairs of runs, in order")


def _compare_table(
    a: dict[str, Any], b: dict[str, Any], title: str, names: tuple[str, str], console: Console
) -> None:
    table = Table(title=title, title_justify="left")
    for col in ("figure", names[0], names[1], "B / A"):
        table.add_column(col, justify="right")
    for key in COMPARED:
        x, y = a.get(key), b.get(key)
        if x is None and y is None:
            continue
        ratio = (
            f"{y / x:.2f}x"
            if isinstance(x, int | float) and isinstance(y, int | float) and x
            else "-"
        )
        shape = "{:,.0f}" if key in ("completed", "failed") else "{:,.2f}"  # counts
        table.add_row(key, _f(x, shape), _f(y, shape), ratio)
    console.print(fit_figures(table, console))


def per_sequence(first_ms: float, above_ms: list[list[float]]) -> str:
    """The per-sequence overhead as text: "0.4 ms" or "0.4 ms (past 2: 0.1 ms, past 8: 0.3 ms)"."""
    text = f"{first_ms:.3g} ms"
    if above_ms:
        text += " (" + ", ".join(f"past {n:g}: {ms:.3g} ms" for n, ms in above_ms) + ")"
    return text


def render_calibration(c: dict[str, Any], console: Console) -> None:
    """`simulate --calibrate`: the fitted cost parameters and how well each probe figure fits."""
    console.print(
        f"calibrated ({c['source']}): {c['bandwidth_gb_s']:.3g} GB/s, {c['tflops']:.3g} "
        f"TFLOP/s, step overhead {c['step_overhead_ms']:.3g} ms, a step with a prefill "
        f"{c.get('prefill_step_overhead_ms', 0.0):.3g} ms more, per sequence "
        f"{per_sequence(c['seq_overhead_ms'], c.get('seq_overhead_above_ms') or [])}, "
        f"per request {c['request_overhead_ms']:.3g} ms"
    )
    table = Table(box=box.SIMPLE, title="calibration residuals (fitted / measured - 1)")
    for name in ("probe figure", "kind", "measured ms", "fitted ms", "error"):
        table.add_column(name, justify="left" if name in ("probe figure", "kind") else "right")
    for r in c["residuals"]:
        table.add_row(
            r["label"],
            r["kind"],
            f"{r['measured_ms']:.2f}",
            f"{r['fitted_ms']:.2f}",
            f"{r['error']:+.1%}",
        )
    console.print(table)
    jitter = c.get("step_jitter")
    if jitter:
        console.print(
            f"step-time scatter from the probe's {jitter['samples']:,} decode gaps (each step's "
            f"cost times a draw, mean 1): p50 {jitter['p50']:.2f}, p90 {jitter['p90']:.2f}, "
            f"p99 {jitter['p99']:.2f}"
            + (
                f"; {jitter['bursty_requests_left_out']} request(s) read in bursts by the "
                "client left out"
                if jitter.get("bursty_requests_left_out")
                else ""
            )
        )
    for note in c.get("notes") or []:
        console.print(f"note: {note}")
