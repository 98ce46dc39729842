"""`pdscope watch --export grafana DIR`: a Grafana dashboard of watch's figures, and a
Prometheus scrape config for one server.

The dashboard has the article's five panels (TTFT and ITL quantiles, running, waiting, KV use)
plus token throughput and preemptions. A `runtime` variable chooses whose names the panels read:
each target is one runtime's expression, kept only while the variable selects that runtime
(``... and on() (vector($runtime) == N)``), because vLLM, SGLang and TGI name the same figure
differently, not just with another prefix. The names come from `client/server_metrics.py`'s
table, the one watch and bench use.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from pdscope.client.server_metrics import RUNTIME_NAMES

# Runtimes the dashboard offers, in the variable's order; the number is the variable's value.
DASHBOARD_RUNTIMES: tuple[tuple[str, int], ...] = (("vllm", 1), ("sglang", 2), ("tgi", 3))
RATE = "$__rate_interval"


@dataclass(frozen=True)
class Target:
    runtime: str
    legend: str
    expr: str  # PromQL with Grafana's $runtime and $__rate_interval left in


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str  # Grafana unit id
    description: str
    targets: tuple[Target, ...]


def _guard(expr: str, runtime: str) -> str:
    number = dict(DASHBOARD_RUNTIMES)[runtime]
    return f"({expr}) and on() (vector($runtime) == {number})"


def _quantile(q: float, base: str) -> str:
    return f"histogram_quantile({q:g}, sum by (le) (rate({base}_bucket[{RATE}])))"


def panels() -> list[Panel]:
    """The dashboard's panels, each with one target per runtime that exports the series."""
    out: list[Panel] = []

    def per_runtime(role: str, build: Callable[[str], str], legend: str) -> list[Target]:
        targets = []
        for runtime, _ in DASHBOARD_RUNTIMES:
            name = RUNTIME_NAMES[runtime].get(role)
            if name:
                targets.append(Target(runtime, legend, _guard(build(name), runtime)))
        return targets

    for role, title, doc in (
        ("ttft", "Time to first token", "Arrival to first token, as the server measures it."),
        ("itl", "Inter-token latency", "Gap between output tokens, one sample per gap."),
    ):
        targets: list[Target] = []
        for q in (0.5, 0.99):
            targets += per_runtime(role, lambda n, q=q: _quantile(q, n), f"p{q * 100:g}")
        out.append(Panel(title, "s", doc, tuple(targets)))
    for role, title, unit, doc in (
        ("running", "Requests running", "none", "Requests in the running batch."),
        (
            "waiting",
            "Requests waiting",
            "none",
            "Requests not yet started: above 0 is a capacity problem, not the model.",
        ),
        (
            "kv_usage",
            "KV-cache use",
            "percentunit",
            "Fraction of the KV pool in use; near 1 with waiting rising, the pool is full.",
        ),
    ):
        # KV use averaged over engines and models (summed, two pools at 0.6 would read 1.2)
        agg = "avg" if role == "kv_usage" else "sum"
        out.append(
            Panel(title, unit, doc, tuple(per_runtime(role, lambda n, a=agg: f"{a}({n})", role)))
        )
    throughput = per_runtime(
        "prompt_tokens", lambda n: f"sum(rate({n}[{RATE}]))", "prompt tok/s"
    ) + per_runtime("generation_tokens", lambda n: f"sum(rate({n}[{RATE}]))", "generation tok/s")
    out.append(Panel("Token throughput", "none", "Tokens per second.", tuple(throughput)))
    out.append(
        Panel(
            "Preemptions",
            "none",
            "Requests preempted (SGLang: retracted) per interval: a full KV pool evicting work.",
            tuple(
                per_runtime("preemptions", lambda n: f"sum(increase({n}[{RATE}]))", "preemptions")
            ),
        )
    )
    return out


def dashboard(
    title: str = "pdscope watch: prefill and decode", runtime: str = "vllm"
) -> dict[str, object]:
    """A Grafana dashboard (JSON model) with a `runtime` variable selecting `runtime`."""
    numbers = dict(DASHBOARD_RUNTIMES)
    if runtime not in numbers:
        raise ValueError(f"the dashboard offers {', '.join(numbers)}; got runtime {runtime!r}")
    datasource = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    grafana_panels = []
    for i, p in enumerate(panels()):
        grafana_panels.append(
            {
                "id": i + 1,
                "type": "timeseries",
                "title": p.title,
                "description": p.description,
                "datasource": datasource,
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
                "targets": [
                    {
                        "datasource": datasource,
                        "refId": chr(ord("A") + j),
                        "expr": t.expr,
                        "legendFormat": f"{t.legend} ({t.runtime})",
                        "range": True,
                    }
                    for j, t in enumerate(p.targets)
                ],
            }
        )
    options = [
        {"text": name, "value": str(number), "selected": name == runtime}
        for name, number in DASHBOARD_RUNTIMES
    ]
    return {
        "__inputs": [
            {
                "name": "DS_PROMETHEUS",
                "label": "Prometheus",
                "type": "datasource",
                "pluginId": "prometheus",
                "pluginName": "Prometheus",
            }
        ],
        "title": title,
        "uid": "pdscope-watch",
        "description": "pdscope watch's figures: the article's five metrics, throughput, "
        "preemptions. Written by pdscope watch --export grafana.",
        "editable": True,
        "schemaVersion": 39,
        "time": {"from": "now-30m", "to": "now"},
        "refresh": "10s",
        "templating": {
            "list": [
                {
                    "name": "runtime",
                    "label": "runtime",
                    "type": "custom",
                    "query": ", ".join(f"{n} : {v}" for n, v in DASHBOARD_RUNTIMES),
                    "current": {"text": runtime, "value": str(numbers[runtime])},
                    "options": options,
                }
            ]
        },
        "panels": grafana_panels,
    }


def prometheus_config(url: str, scrape_interval_s: float = 5.0, job: str = "pdscope") -> str:
    """prometheus.yml scraping `url` (a base URL or a full /metrics URL)."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if not parts.hostname:
        raise ValueError(f"cannot read a host from URL {url!r}")
    path = parts.path.rstrip("/")
    metrics_path = path if path.endswith("/metrics") else f"{path}/metrics"
    port = f":{parts.port}" if parts.port else ""
    interval = f"{scrape_interval_s:g}s"
    # YAML by hand: a config this small needs no YAML library; json.dumps quotes strings safely.
    return (
        "# Written by pdscope watch --export grafana: Prometheus scrapes one server.\n"
        "global:\n"
        f"  scrape_interval: {interval}\n"
        f"  evaluation_interval: {interval}\n"
        "scrape_configs:\n"
        f"  - job_name: {json.dumps(job)}\n"
        f"    scheme: {parts.scheme}\n"
        f"    metrics_path: {json.dumps(metrics_path)}\n"
        "    static_configs:\n"
        f"      - targets: [{json.dumps(f'{parts.hostname}{port}')}]\n"
    )


def export_grafana(directory: Path, url: str, runtime: str = "vllm") -> list[Path]:
    """Write grafana-dashboard.json and prometheus.yml into `directory`; return their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    board = directory / "grafana-dashboard.json"
    board.write_text(json.dumps(dashboard(runtime=runtime), indent=2) + "\n")
    config = directory / "prometheus.yml"
    config.write_text(prometheus_config(url))
    return [board, config]
