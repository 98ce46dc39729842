"""`pdscope watch --report REC.jsonl`: a recording (`watch --record`) drawn as one page.

The first plot is the server timeline exactly as `bench --report` draws it (running and waiting
on the left axis, KV use on the right); below it the windowed TTFT and ITL quantiles and the
token rates. Gaps where the server was unreachable stay gaps; each snapshot's events (a
restart, a recovery) are a dashed line on every plot and a row of the events table.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from pdscope.report.bench_html import _png


def read_recording(path: Path) -> list[dict[str, Any]]:
    """The snapshots of a `watch --record` file, in order. Raises ValueError naming a bad line."""
    out = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            snap = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not a JSON line ({exc})") from None
        if not isinstance(snap, dict) or "reachable" not in snap or "t_s" not in snap:
            raise ValueError(f"{path}:{number}: not a pdscope watch snapshot")
        out.append(snap)
    if not out:
        raise ValueError(f"{path} holds no snapshots")
    return out


def _figures(snaps: list[dict[str, Any]]) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t_s"] for s in snaps]
    fig, axes = plt.subplots(3, 1, figsize=(11, 8.4), sharex=True)
    ax = axes[0]
    for key in ("running", "waiting"):
        ax.plot(t, [s.get(key) for s in snaps], label=key)
    ax.set(ylabel="requests", title="Server timeline (/metrics)")
    twin = ax.twinx()
    twin.plot(t, [s.get("kv_usage") for s in snaps], "k:", label="KV usage")
    twin.set(ylabel="KV usage (0-1)", ylim=(0, 1.05))
    ax.legend(loc="upper left", fontsize=8)
    twin.legend(loc="upper right", fontsize=8)
    window = snaps[-1].get("window_s")
    for key, style in (
        ("ttft_p50_ms", "-"),
        ("ttft_p99_ms", "--"),
        ("itl_p50_ms", "-"),
        ("itl_p99_ms", "--"),
    ):
        # A quantile known only by a bucket bound is drawn at the bound, as a triangle pointing
        # the way the true value lies (below the first bound, above the last), not on the line.
        edges = [(s.get("edges") or {}).get(key) for s in snaps]
        line = [None if e else s.get(key) for s, e in zip(snaps, edges, strict=True)]
        (drawn,) = axes[1].plot(t, line, style, label=key)
        for side, marker in (("below", "v"), ("above", "^")):
            at = [(x, e[1]) for x, e in zip(t, edges, strict=True) if e and e[0] == side]
            if at:
                xs, ys = zip(*at, strict=True)
                axes[1].plot(xs, ys, marker, color=drawn.get_color(), linestyle="none")
    axes[1].set(
        ylabel="ms",
        yscale="log",
        title=f"Latency quantiles over a {window:g} s window (triangles: only known to lie "
        "below the first bucket bound or above the last)",
    )
    for key in ("prompt_tok_s", "generation_tok_s"):
        axes[2].plot(t, [s.get(key) for s in snaps], label=key)
    axes[2].set(ylabel="tokens/s", xlabel="seconds into the watch", title="Token rates")
    for a in axes:
        a.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    axes[2].legend(fontsize=8)
    # A restart leaves no gap when it falls between two scrapes: the line says one happened.
    for s in snaps:
        if s.get("events"):
            for a in axes:
                a.axvline(s["t_s"], color="tab:red", linestyle="--", linewidth=0.8, alpha=0.7)
    return [("Watch timeline", _png(fig))]


def render_watch_html(snaps: list[dict[str, Any]]) -> str:
    first, last = snaps[0], snaps[-1]
    down = sum(1 for s in snaps if not s["reachable"])
    rules: dict[str, int] = {}
    for s in snaps:
        for r in s.get("rules") or []:
            rules[r["finding"]] = rules.get(r["finding"], 0) + 1
    rule_rows = (
        "".join(
            f"<tr><td>{html.escape(finding)}</td><td>{count}</td></tr>"
            for finding, count in rules.items()
        )
        or "<tr><td>none held</td><td></td></tr>"
    )
    event_rows = (
        "".join(
            f"<tr><td>{s['t_s']:.1f}</td><td>{html.escape(event)}</td></tr>"
            for s in snaps
            for event in s.get("events") or []
        )
        or "<tr><td></td><td>none</td></tr>"
    )
    plots = "".join(
        f"<h2>{html.escape(title)}</h2><img alt='{html.escape(title)}' "
        f"src='data:image/png;base64,{data}'>"
        for title, data in _figures(snaps)
    )
    meta = html.escape(
        f"{last['url']} · {last.get('runtime') or '?'} · {first['time']} to {last['time']} · "
        f"{len(snaps)} snapshots, {down} unreachable"
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>pdscope watch report</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1150px; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; font-size: 14px; }}
th, td {{ border: 1px solid #ccc; padding: 4px 8px; }}
img {{ max-width: 100%; }}
</style></head><body>
<h1>pdscope watch</h1>
<p>{meta}</p>
<h2>Reading rules (snapshots in which each held)</h2>
<table><tr><th>finding</th><th>snapshots</th></tr>{rule_rows}</table>
<h2>Events (restarts, outages; dashed red lines below)</h2>
<table><tr><th>seconds</th><th>event</th></tr>{event_rows}</table>
{plots}
</body></html>
"""
