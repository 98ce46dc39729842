"""The exported Grafana dashboard, checked by a real Prometheus (Debian's `prometheus` package)
scraping `pdscope serve` under a short `pdscope bench` load.

Every PromQL expression of the dashboard is evaluated through Prometheus' HTTP API with
Grafana's variables filled in: the vLLM targets must return data, the other runtimes' targets
must parse and return nothing (their guard is off), and the dashboard's TTFT p99 must agree with
bench's client-side p99 within the histogram's bucket resolution.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdscope.commands.grafana import DASHBOARD_RUNTIMES, export_grafana, prometheus_config
from pdscope.server.launch import free_port
from pdscope.server.metrics import TTFT_BUCKETS
from tests.conftest import Server, peer_server

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        PROMETHEUS is None,
        reason="Debian's prometheus is not installed (.ci/run installs it: apt-get install "
        "prometheus)",
    ),
]
SCRAPE_S = 1.0


@pytest.fixture
def prometheus(server: Server, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """Prometheus on a free loopback port scraping `server` every second, and the export dir."""
    export = tmp_path / "export"
    export_grafana(export, server.url)
    # The exported config scrapes every 5 s; a short test needs more points in its minute.
    config = export / "prometheus-test.yml"
    config.write_text(prometheus_config(server.url, scrape_interval_s=SCRAPE_S))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "prometheus.log"
    assert PROMETHEUS is not None
    cmd = [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}"]
    cmd.append(f"--web.listen-address=127.0.0.1:{port}")
    with peer_server("prometheus", cmd, url, log, 30, health="/-/ready"):
        yield url, export


def _query(url: str, expr: str, at_s: float) -> list[dict]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr, "time": at_s}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


def _wait_for(url: str, expr: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _query(url, expr, time.time()):
            return
        time.sleep(0.5)
    pytest.fail(f"no data for {expr} in {timeout_s:.0f} s")


def test_dashboard_against_real_prometheus(
    server: Server, prometheus: tuple[str, Path], tmp_path: Path
) -> None:
    prom, export = prometheus
    _wait_for(prom, 'up{job="pdscope"} == 1')  # the first scrape landed, before the load
    started_s = time.time()
    result_file = tmp_path / "bench.json"
    bench = subprocess.run(
        [
            sys.executable, "-m", "pdscope.cli", "bench", server.url,
            "--num-prompts", "24", "--max-concurrency", "4", "--input-len", "64",
            "--output-len", "32", "--warmup", "0", "--save-result", str(result_file),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert bench.returncode == 0, bench.stdout[-2000:] + bench.stderr[-2000:]
    run = json.loads(result_file.read_text())["runs"][0]
    assert run["summary"]["completed"] == 24
    client_p99_ms = run["summary"]["p99_ttft_ms"]
    # Two more scrapes after the last response, so the final counts are in Prometheus.
    time.sleep(2.5 * SCRAPE_S)
    at_s = time.time()
    window = f"{int(at_s - started_s) + 5}s"  # the whole load, as $__rate_interval

    board = json.loads((export / "grafana-dashboard.json").read_text())
    numbers = dict(DASHBOARD_RUNTIMES)
    checked = 0
    for panel in board["panels"]:
        for target in panel["targets"]:
            runtime = target["legendFormat"].rsplit("(", 1)[1].rstrip(")")
            expr = target["expr"].replace("$runtime", str(numbers[runtime]))
            expr = expr.replace("$__rate_interval", window)
            result = _query(prom, expr, at_s)
            if runtime == "vllm":
                assert result, f"{panel['title']}: no data for {expr}"
                value = float(result[0]["value"][1])
                assert value == value, f"{panel['title']}: NaN for {expr}"  # NaN: no data
                checked += 1
            else:
                assert result == [], f"{panel['title']}: the {runtime} target is not guarded"
    assert checked == 10  # 2 quantiles x 2 histograms, 3 gauges, 2 throughputs, preemptions

    ttft = next(p for p in board["panels"] if p["title"] == "Time to first token")
    p99_expr = next(t["expr"] for t in ttft["targets"] if t["legendFormat"] == "p99 (vllm)")
    p99_expr = p99_expr.replace("$runtime", "1").replace("$__rate_interval", window)
    server_p99_ms = float(_query(prom, p99_expr, at_s)[0]["value"][1]) * 1e3
    # Bucket resolution: the server interpolates within the bucket holding its p99. Each
    # client TTFT is the server's plus the network and the client's event loop, so the
    # server's p99 is never above the bucket holding the client's. Below, the client's p99 is
    # one request of 24, and a client stalled once on a loaded host moves it buckets up (55 vs
    # 81 ms measured on 2 cores): the floor is the bucket under the one holding the client's
    # median, which a p99 cannot be below.
    bounds_ms = [0.0, *(b * 1e3 for b in TTFT_BUCKETS)]

    def bucket(ms: float) -> int:
        return next(k for k in range(1, len(bounds_ms)) if ms <= bounds_ms[k])

    client_median_ms = run["summary"]["median_ttft_ms"]
    low_ms = bounds_ms[max(0, bucket(client_median_ms) - 2)]
    high_ms = bounds_ms[bucket(client_p99_ms)]
    print(
        f"TTFT p99: dashboard {server_p99_ms:.1f} ms, bench client {client_p99_ms:.1f} ms "
        f"(median {client_median_ms:.1f})"
    )
    assert low_ms <= server_p99_ms <= high_ms, (
        f"dashboard TTFT p99 {server_p99_ms:.1f} ms vs bench's client p99 {client_p99_ms:.1f} ms "
        f"(median {client_median_ms:.1f} ms; bounds by bucket: {low_ms:g}-{high_ms:g} ms)"
    )
