"""Terminal view of `pdscope watch`: the figures, a sparkline each, the rules that hold.

Everything is drawn from a snapshot's JSON dict (`WatchSnapshot.to_dict()`) and the watcher's
history of values, so a recorded line draws the same as a live one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from pdscope.report.units import fmt_quantile, fmt_rate

LABELS: dict[str, str] = {
    "ttft_p50_ms": "TTFT p50",
    "ttft_p99_ms": "TTFT p99",
    "itl_p50_ms": "ITL p50",
    "itl_p99_ms": "ITL p99",
    "running": "running",
    "waiting": "waiting",
    "kv_usage": "KV use",
    "generation_tok_s": "generation",
    "prompt_tok_s": "prompt",
    "preemptions": "preemptions",
    "prefix_hit_rate": "prefix-cache hits",
}
_BLOCKS = "▁▂▃▄▅▆▇█"


def format_value(figure: str, value: float | None, window_s: float = 0.0) -> str:
    """One figure for the terminal, with its unit."""
    if value is None:
        return "-"
    if figure.endswith("_ms"):
        return f"{value / 1e3:,.2f} s" if value >= 1e3 else f"{value:,.1f} ms"
    if figure in ("kv_usage", "prefix_hit_rate"):
        return f"{value:.0%}"
    if figure.endswith("_tok_s"):
        return fmt_rate(value)
    if figure == "preemptions":
        return f"{value:,.0f} in {window_s:,.0f} s"
    return f"{value:,.0f}"


def sparkline(values: Sequence[float | None], width: int = 30) -> str:
    """`values` (oldest first) as block characters, at most `width` wide.

    Consecutive values are binned to fit, each bin drawn at its maximum (a spike stays
    visible); a bin with no value is a space. The scale runs from 0 (or the minimum, if
    negative) to the maximum shown.
    """
    if width < 1 or not values:
        return ""
    n = len(values)
    bins: list[float | None] = []
    for i in range(min(width, n)):
        lo, hi = i * n // min(width, n), (i + 1) * n // min(width, n)
        chunk = [v for v in values[lo:hi] if v is not None and math.isfinite(v)]
        bins.append(max(chunk) if chunk else None)
    present = [b for b in bins if b is not None]
    if not present:
        return " " * len(bins)
    low, high = min(0.0, *present), max(present)
    span = high - low
    out = []
    for b in bins:
        if b is None:
            out.append(" ")
        elif span <= 0:
            out.append(_BLOCKS[0])
        else:
            out.append(_BLOCKS[min(len(_BLOCKS) - 1, int((b - low) / span * len(_BLOCKS)))])
    return "".join(out)


def render_watch(
    snap: dict[str, Any],
    history: Sequence[tuple[float, dict[str, float | None]]] = (),
    *,
    history_s: float = 300.0,
    width: int = 30,
    recent_events: Sequence[str] = (),
) -> Group:
    """The live view of one snapshot and the history behind it.

    `recent_events` (restarts, recoveries) are shown in place of the snapshot's own, so they
    stay on screen after the tick that saw them."""
    header = Text()
    header.append("pdscope watch ", style="bold")
    header.append(f"{snap['url']}  ")
    runtime, knobs = snap["runtime"] or "?", snap.get("knobs_for")
    header.append(
        f"{knobs} ({runtime} names)" if knobs and knobs != runtime else runtime, style="bold"
    )
    header.append(
        f"  ·  window {snap['window_s']:g} s (covers {snap['covered_s']:.0f} s, "
        f"{snap['scrapes_in_window']} scrapes)  ·  {snap['time']}"
    )
    parts: list[Any] = [header]
    if not snap["reachable"]:
        parts.append(
            Text(
                f"unreachable since {snap['unreachable_since']}: {snap['error']}",
                style="bold red",
            )
        )
    for event in recent_events or snap.get("events") or []:
        parts.append(Text(event, style="yellow"))
    span = (history[-1][0] - history[0][0]) if len(history) >= 2 else 0.0
    table = Table(title_justify="left", box=None, pad_edge=False)
    table.add_column("figure")
    table.add_column("now", justify="right")
    table.add_column(f"last {min(span, history_s) / 60:.1f} min", no_wrap=True, overflow="crop")
    table.add_column("series / why absent", overflow="fold")
    for figure, label in LABELS.items():
        value = snap.get(figure)
        why = snap["missing"].get(figure)
        spark = sparkline([h[1].get(figure) for h in history], width)
        if figure in snap.get("absent", ()):
            table.add_row(label, Text("absent", style="dim"), "", Text(why, style="dim"))
            continue
        shown = fmt_quantile(
            value,
            (snap.get("edges") or {}).get(figure),
            partial(format_value, figure, window_s=snap["covered_s"]),
        )
        table.add_row(
            label,
            shown,
            spark,
            Text(why, style="dim") if value is None and why else snap["names"].get(figure, ""),
        )
    parts.append(table)
    rules = snap.get("rules") or []
    if rules:
        parts.append(Text("Reading rules that hold now:", style="bold"))
        for r in rules:
            line = Text("  ● ", style="bold yellow")
            line.append(r["finding"], style="bold")
            line.append(f"\n    {r['evidence']}\n    → {r['action']}")
            parts.append(line)
    else:
        parts.append(Text("No reading rule holds now.", style="dim"))
    return Group(*parts)
