"""`pdscope bench --report FILE.html`: one self-contained page (plots inlined as PNG)."""

from __future__ import annotations

import base64
import html
import io
from typing import Any

from pdscope.report.bench import _load


def _png(fig: Any) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _cdf(ax: Any, values: list[float], label: str) -> None:
    if not values:
        return
    xs = sorted(values)
    ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)


def figures(r: dict[str, Any]) -> list[tuple[str, str]]:
    """(title, base64 PNG) for every plot the result supports."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for run in r["runs"]:
        ok = [q for q in run["requests"] if q["ok"]]
        _cdf(left, [q["ttft_ms"] for q in ok if q["ttft_ms"] is not None], _load(run))
        _cdf(right, [x for q in ok for x in q["itl_ms"]], _load(run))
    left.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF")
    right.set(xlabel="ITL (ms)", ylabel="fraction of tokens", title="Inter-token latency CDF")
    right.set_xscale("log")
    for ax in (left, right):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    out.append(("Latency distributions", _png(fig)))

    if len(r["runs"]) > 1:
        xs = list(range(len(r["runs"])))
        labels = [_load(run) for run in r["runs"]]
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        for key, style in (("median_ttft_ms", "o-"), ("p99_ttft_ms", "s--")):
            left.plot(xs, [run["summary"].get(key) for run in r["runs"]], style, label=key)
        for key, style in (("median_itl_ms", "o-"), ("p99_itl_ms", "s--")):
            left.plot(xs, [run["summary"].get(key) for run in r["runs"]], style, label=key)
        left.set_xticks(xs, labels)
        left.set(ylabel="ms", title="Percentiles across the series", yscale="log")
        left.legend(fontsize=8)
        right.plot(
            [run["summary"].get("p99_itl_ms") for run in r["runs"]],
            [run["summary"].get("output_throughput") for run in r["runs"]],
            "o-",
        )
        for run, label in zip(r["runs"], labels, strict=True):
            right.annotate(
                label,
                (
                    run["summary"].get("p99_itl_ms") or 0,
                    run["summary"].get("output_throughput") or 0,
                ),
                fontsize=8,
            )
        right.set(
            xlabel="p99 ITL (ms)", ylabel="output tok/s", title="Throughput against tail latency"
        )
        for ax in (left, right):
            ax.grid(alpha=0.3)
        out.append(("Across the series", _png(fig)))

    timelines = [
        (run, run["server"].get("timeline") or [])
        for run in r["runs"]
        if run["server"].get("available")
    ]
    if timelines:
        fig, axes = plt.subplots(
            len(timelines), 1, figsize=(11, 2.6 * len(timelines)), squeeze=False
        )
        for ax, (run, points) in zip(axes[:, 0], timelines, strict=True):
            t = [p["t_s"] for p in points]
            for key in ("running", "waiting"):
                ax.plot(t, [p.get(key) for p in points], label=key)
            ax.set(ylabel="requests", title=f"Server timeline at {_load(run)}")
            twin = ax.twinx()
            twin.plot(t, [p.get("kv_usage") for p in points], "k:", label="KV usage")
            twin.set(ylabel="KV usage (0-1)", ylim=(0, 1.05))
            ax.legend(loc="upper left", fontsize=8)
            twin.legend(loc="upper right", fontsize=8)
        axes[-1, 0].set_xlabel("seconds into the run")
        out.append(("Server timeline (/metrics)", _png(fig)))
    return out


TABLE_KEYS = (
    "completed",
    "failed",
    "request_throughput",
    "output_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "p99_e2el_ms",
    "goodput_fraction",
)


def render_html(r: dict[str, Any]) -> str:
    m = r["metadata"]
    rows = []
    for run in r["runs"]:
        s = run["summary"]
        cells = "".join(f"<td>{_cell(s.get(k))}</td>" for k in TABLE_KEYS)
        rows.append(f"<tr><th>{html.escape(_load(run))}</th>{cells}</tr>")
    head = "".join(f"<th>{k}</th>" for k in TABLE_KEYS)
    plots = "".join(
        f"<h2>{html.escape(title)}</h2><img alt='{html.escape(title)}' "
        f"src='data:image/png;base64,{data}'>"
        for title, data in figures(r)
    )
    meta = html.escape(
        f"{m['url']} · {m['runtime']} · model {m['model']} · workload "
        f"{m['workload']} · pdscope {m['pdscope_version']}"
    )
    partial = (
        f"<p class='partial'>Partial results: {html.escape(r['partial'])}</p>"
        if r.get("partial")
        else ""
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>pdscope bench report</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1150px; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; font-size: 14px; }}
th, td {{ border: 1px solid #ccc; padding: 4px 8px; text-align: right; }}
img {{ max-width: 100%; }}
.wide {{ overflow-x: auto; }}
th {{ font-size: 12px; }}
.partial {{ color: #b00; font-weight: bold; }}
</style></head><body>
<h1>pdscope bench</h1>
<p>{meta}</p>{partial}
<h2>Numbers (latencies in ms; percentiles by numpy linear interpolation)</h2>
<div class="wide"><table><tr><th>load</th>{head}</tr>{"".join(rows)}</table></div>
{plots}
</body></html>
"""


def _cell(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:,.2f}"
    return html.escape("-" if x is None else str(x))
