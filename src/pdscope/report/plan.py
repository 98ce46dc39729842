"""Terminal rendering of `pdscope plan` results (the same dicts that --json prints)."""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table

from pdscope.report.units import fmt_bytes, fmt_count, fmt_rate, fmt_seconds
from pdscope.specs import Device, ModelSpec
from pdscope.specs.local import computed_in_note

# What bounds a step when the device's figures are known (else the bound says what is missing).
BOUNDS = ("compute", "memory")


def _kv_table(rows: list[tuple[str, str, str]], title: str) -> Table:
    table = Table(title=title, title_justify="left", show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_column(style="dim")
    for row in rows:
        table.add_row(*row)
    return table


def render_plan(r: dict[str, Any], console: Console) -> None:
    m, d = r["model"], r["device"]
    c, n = r["context_tokens"], r["prompt_tokens"]
    params = f"{fmt_count(m['total_params'])} params"
    if m["moe"]:
        # Cards differ: Mixtral's active count includes the embeddings, gpt-oss's leaves the
        # input embedding out, which is what a token reads (a gathered row of it).
        params += (
            f": {fmt_count(m['active_params'])} active with the embeddings, "
            f"{fmt_count(m['params_read_per_token'])} read a token;"
        )
    else:
        params += ","
    head = (
        f"[bold]{m['name']}[/] ({params} {m['num_layers']} layers) on "
        f"[bold]{d['label'] or d['name']}[/] ({d['bandwidth_gb_s']:,g} GB/s"
        + (f", {d['peak_tflops_used']:,g} TFLOP/s" if d["peak_tflops_used"] else "")
        + (f", {d['memory_gb']:,g} GB" if d["memory_gb"] else "")
        + f"); weights {r['dtype']} ({r['bits_per_weight']:g} bits"
        + (", experts only" if r.get("experts_only") else "")
        + f"), KV {r['kv_dtype']}"
    )
    pool = r["kv_pool_bytes"]
    short_by = -pool if pool is not None and pool < 0 else None  # the weights do not fit
    decode = _kv_table(
        [
            ("weights", fmt_bytes(r["weight_bytes"]), r["dtype_note"]),
            (
                "bytes read per token",
                fmt_bytes(r["decode_bytes_per_token"]),
                f"active weights + KV at {c:,} tokens",
            ),
            (
                "decode ceiling, 1 stream",
                fmt_rate(r["decode_ceiling_tok_s"]),
                f"at {c:,} tokens of context",
            ),
            (
                "decode ceiling, weights only",
                fmt_rate(r["decode_ceiling_weights_only_tok_s"]),
                "empty context (the seed article's table)",
            ),
            (
                "decode intensity",
                f"{r['decode_intensity_flops_per_byte']:,.1f} FLOP/B",
                "memory-bound while below the ridge",
            ),
        ],
        "Decode (bandwidth-bound)",
    )
    kv = _kv_table(
        [
            ("KV per token", fmt_bytes(r["kv_bytes_per_token"]), f"{r['kv_bytes_per_token']:,} B"),
            ("KV per request", fmt_bytes(r["kv_bytes_at_context"]), f"at {c:,} tokens"),
            (
                "KV pool",
                "none" if short_by is not None else fmt_bytes(r["kv_pool_bytes"]),
                f"the weights need {fmt_bytes(short_by)} more"
                if short_by is not None
                else f"{r['gpu_memory_utilization']:.0%} of memory minus weights",
            ),
            ("pool tokens", fmt_count(r["kv_pool_tokens"]), "at the full-attention rate"),
            (
                "concurrent requests",
                fmt_count(r["max_concurrent_requests"]),
                f"of {c:,} tokens each",
            ),
        ],
        "KV cache",
    )
    ridge = r["ridge_flops_per_byte"]
    prefill = _kv_table(
        [
            ("prefill FLOPs", fmt_count(r["prefill_flops"], "FLOP"), f"{n:,}-token prompt"),
            ("  linear (matmuls)", fmt_count(r["prefill_flops_linear"], "FLOP"), "grows with N"),
            ("  attention", fmt_count(r["prefill_flops_attention"], "FLOP"), "grows with N²"),
            (
                "TTFT floor",
                fmt_seconds(r["ttft_floor_s"]),
                f"{bound}-bound" if (bound := r["ttft_floor_bound"]) in BOUNDS else bound,
            ),
            ("prefill ceiling", fmt_rate(r["prefill_ceiling_tok_s"]), "prompt tokens / TTFT floor"),
            (
                "prefill intensity",
                f"{r['prefill_intensity_flops_per_byte']:,.0f} FLOP/B",
                "ridge " + (f"{ridge:,.0f} FLOP/B" if ridge else "unknown"),
            ),
        ],
        "Prefill (compute-bound)",
    )

    batch = Table(title="Batched decode", title_justify="left")
    for col in ("batch", "aggregate", "per stream", "step", "bound"):
        batch.add_column(col, justify="right")
    marks = {
        r["compute_bound_batch"]: " ← compute-bound",
        r["pool_limited_batch"]: " ← KV pool full",
    }
    for point in r["batched_decode"]:
        batch.add_row(
            f"{point['batch']:,}",
            fmt_rate(point["aggregate_tok_s"]),
            fmt_rate(point["per_stream_tok_s"]),
            fmt_seconds(point["step_s"]),
            point["bound"] + marks.get(point["batch"], ""),
        )
    parts: list[Any] = [head]
    if short_by is not None:
        parts.append(
            f"[bold yellow]the weights ({fmt_bytes(r['weight_bytes'])}) do not fit "
            f"{r['gpu_memory_utilization']:.0%} of this device's {d['memory_gb']:,g} GB: every "
            "figure below is for a device with room for them (more memory, more devices, or "
            "narrower weights)[/]"
        )
    parts += ["", decode, "", kv, "", prefill, "", batch]
    cb, pb = r["compute_bound_batch"], r["pool_limited_batch"]
    parts.append(
        f"turns compute-bound at batch {cb:,}" if cb else "never compute-bound at this context"
    )
    if pb is not None:
        parts.append(f"KV pool holds {pb:,} requests of {c:,} tokens")
    if r.get("local_measurement"):
        lm = r["local_measurement"]
        parts.append(
            f"measured here: read {lm['read_gb_s']:.1f} GB/s, triad {lm['triad_gb_s']:.1f} "
            f"GB/s, {lm['matmul_dtype']} matmul {lm['matmul_tflops']:.2f} TFLOP/s"
            f"{computed_in_note(lm)}, {lm['threads']} threads"
        )
    parts.extend(f"[yellow]note:[/] {note}" for note in r["notes"])
    console.print(Panel(Group(*parts), title="pdscope plan", expand=False))


def render_compare(rows: list[dict[str, Any]], title: str, console: Console) -> None:
    table = Table(title=title, title_justify="left")
    table.add_column("device")
    table.add_column("bandwidth GB/s", justify="right")
    table.add_column("ceiling tok/s", justify="right")
    for row in rows:
        table.add_row(
            row["device"], f"{row['mem_bandwidth_gb_s']:,}", f"{row['decode_ceiling_tok_s']:,}"
        )
    console.print(table)


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:,g}"


def render_device_catalog(devices: list[Device], console: Console) -> None:
    table = Table(title="Device catalog (dense peaks)", title_justify="left")
    for col in ("name", "device", "GB", "GB/s", "bf16 TFLOPS", "fp8 TFLOPS"):
        table.add_column(col, justify="left" if col in ("name", "device") else "right")
    for d in devices:
        table.add_row(
            d.name,
            d.label,
            _g(d.memory_gb),
            _g(d.bandwidth_gb_s),
            _g(d.tflops_bf16),
            _g(d.tflops_fp8),
        )
    console.print(table)


def render_model_presets(specs: list[ModelSpec], console: Console) -> None:
    table = Table(title="Model presets", title_justify="left")
    numbers = ("params", "active", "read/token", "layers")
    for col in ("name", *numbers, "description"):
        table.add_column(col, justify="right" if col in numbers else "left")
    for s in specs:
        table.add_row(
            s.name,
            f"{s.total_params / 1e9:.2f}B",
            f"{s.active_params / 1e9:.2f}B",
            f"{s.params_read_per_token / 1e9:.2f}B",
            str(s.num_layers),
            s.description,
        )
    console.print(table)
