"""Terminal lines and HTML for `pdscope simulate`'s result: bench's report, then the
calibration, the cluster's pools, workers and KV link, and the cost parameters simulated."""

from __future__ import annotations

import html
from typing import Any

from rich.console import Console

from pdscope.report.bench import per_sequence, render_bench, render_calibration
from pdscope.report.bench_html import render_html


def render_simulation(result: dict[str, Any], console: Console) -> None:
    """Bench's tables, then what only a simulation has: the fit, the cluster, the clock."""
    render_bench(result, console)
    if result["metadata"].get("calibration"):
        render_calibration(result["metadata"]["calibration"], console)
    for line in render_cluster(result) if "cluster" in result else []:
        console.print(line)
    c = result["metadata"]["cost_params"]
    above = [[n, cost * 1e3] for n, cost in c.get("seq_overhead_above") or []]
    console.print(
        f"simulated: {c['bandwidth_gb_s']:g} GB/s, {c['tflops']:g} TFLOP/s, step overhead "
        f"{c['step_overhead_s'] * 1e3:g} ms, a step with a prefill "
        f"{c.get('prefill_step_overhead_s', 0.0) * 1e3:g} ms more, per sequence "
        f"{per_sequence(c['seq_overhead_s'] * 1e3, above)}, "
        f"per request {c['request_overhead_s'] * 1e3:g} ms ({c['source']}); KV pool "
        f"{result['metadata']['kv_pool_tokens']:,} tokens"
    )


def simulation_html(result: dict[str, Any]) -> str:
    """Bench's HTML page, with the cluster section before the end of the body."""
    page = render_html(result)
    if "cluster" in result:
        page = page.replace("</body>", cluster_html(result) + "\n</body>", 1)
    return page


def render_cluster(r: dict[str, Any]) -> list[str]:
    """Terminal lines for the cluster part of a result (rich markup)."""
    cl = r["cluster"]
    lines = [f"[bold]cluster[/]: {cl['mode']}, {cl['gpus']} GPUs, router {cl['router']}"]
    good = cl["request_goodput_per_gpu"]
    lines.append(
        f"  per GPU: {cl['output_tok_s_per_gpu']:,.1f} output tok/s"
        + ("" if good is None else f", goodput {good:.3f} req/s")
    )
    for name, pool in cl["pools"].items():
        lines.append(
            f"  {name}: {pool['workers']} x {pool['device']} TP {pool['tensor_parallel_size']}, "
            f"budget {pool['max_num_batched_tokens']}, {pool['max_num_seqs']} seqs, KV "
            f"{pool['kv_pool_tokens']:,} tokens each; utilization {pool['utilization']:.0%}, "
            f"completed {pool['completed']}"
        )
    shown = cl["workers"][:16]
    for w in shown:
        lines.append(
            f"    #{w['index']} {w['pool']}: {w['completed']} done, {w['steps']} steps, busy "
            f"{w['utilization']:.0%}, preempted {w['preemptions']}, most waiting "
            f"{w['max_waiting']}"
        )
    if len(cl["workers"]) > len(shown):
        lines.append(f"    ... {len(cl['workers']) - len(shown)} more in the JSON")
    link = cl.get("link")
    if link:
        t, q = link["transfer_ms"], link["queue_ms"]
        lines.append(
            f"  KV link {link['gb_s']:g} GB/s + {link['latency_ms']:g} ms: {link['transfers']} "
            f"transfers, {link['bytes'] / 1e9:,.2f} GB, busy {link['utilization']:.0%}, most "
            f"queued {link['max_queue']}; first token from the {cl['first_token']} worker"
        )
        if t and q:
            lines.append(
                f"    transfer ms p50 {t['p50']:.2f} p99 {t['p99']:.2f} max {t['max']:.2f}; "
                f"queue ms p50 {q['p50']:.2f} p99 {q['p99']:.2f} max {q['max']:.2f}"
            )
    return lines


def cluster_html(r: dict[str, Any]) -> str:
    """The cluster section for bench's HTML report: pools, workers and the link as tables."""
    cl = r["cluster"]
    rows = "".join(
        f"<tr><td>{html.escape(name)}</td><td>{p['workers']}</td><td>{p['device']}</td>"
        f"<td>{p['tensor_parallel_size']}</td><td>{p['kv_pool_tokens']:,}</td>"
        f"<td>{p['utilization']:.1%}</td><td>{p['completed']}</td></tr>"
        for name, p in cl["pools"].items()
    )
    workers = "".join(
        f"<tr><td>{w['index']}</td><td>{w['pool']}</td><td>{w['completed']}</td>"
        f"<td>{w['steps']}</td><td>{w['utilization']:.1%}</td><td>{w['preemptions']}</td>"
        f"<td>{w['max_waiting']}</td></tr>"
        for w in cl["workers"]
    )
    parts = [
        f"<h2>Cluster: {cl['mode']}, {cl['gpus']} GPUs, router {html.escape(cl['router'])}</h2>",
        "<table><tr><th>pool</th><th>workers</th><th>device</th><th>TP</th><th>KV tokens</th>"
        f"<th>utilization</th><th>completed</th></tr>{rows}</table>",
        "<table><tr><th>worker</th><th>pool</th><th>done</th><th>steps</th><th>busy</th>"
        f"<th>preempted</th><th>most waiting</th></tr>{workers}</table>",
    ]
    link = cl.get("link")
    if link:
        cells = "".join(
            f"<tr><td>{label}</td>"
            + "".join(f"<td>{d[k]:.3f}</td>" for k in ("mean", "p50", "p90", "p99", "max"))
            + "</tr>"
            for label, d in (("transfer ms", link["transfer_ms"]), ("queue ms", link["queue_ms"]))
            if d
        )
        parts.append(
            f"<h2>KV link: {link['gb_s']:g} GB/s, {link['latency_ms']:g} ms; "
            f"{link['transfers']} transfers, {link['bytes'] / 1e9:,.2f} GB, busy "
            f"{link['utilization']:.1%}, most queued {link['max_queue']}; first token from the "
            f"{html.escape(cl['first_token'])} worker</h2>"
            "<table><tr><th></th><th>mean</th><th>p50</th><th>p90</th><th>p99</th><th>max</th>"
            f"</tr>{cells}</table>"
        )
    return "\n".join(parts)
