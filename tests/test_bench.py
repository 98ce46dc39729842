"""`pdscope bench` against the embedded server over real HTTP, and its analysis."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdscope.analysis.bench import SLO, SLOError, summarize
from pdscope.cli import app as cli
from pdscope.client.load import LoadPlan
from pdscope.client.trace import Chunk, Trace
from pdscope.client.workloads import Lengths, WorkloadError, file_workload
from pdscope.commands.bench import Bench, BenchSettings, BenchState, bench
from tests.conftest import Server, start_server


def run(settings: BenchSettings) -> dict:
    return asyncio.run(bench(settings, BenchState()))


@pytest.mark.slow
def test_random_workload_run(medium_server: Server) -> None:
    r = run(
        BenchSettings(
            url=medium_server.url,
            num_prompts=16,
            input_len="64-128",
            output_len="16",
            concurrencies=[4],
            goodput_slo="ttft=30s",
        )
    )
    assert r["completed"] == 16 and r["failed"] == 0
    assert r["total_output_tokens"] == 16 * 16
    for key in (
        "duration",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "mean_ttft_ms",
        "median_tpot_ms",
        "std_itl_ms",
        "p99_e2el_ms",
        "request_goodput",
    ):
        assert r[key] is not None, key
    assert r["median_ttft_ms"] <= r["p99_ttft_ms"]
    assert r["goodput_fraction"] == 1.0
    server = r["runs"][0]["server"]
    assert server["available"] and server["deltas"]["generation_tokens"] == 16 * 16
    assert r["metadata"]["runtime"] == "pdscope" and r["metadata"]["exact_prompt_tokens"]
    assert r["metadata"]["runtime_version"]  # from /api/version
    records = r["runs"][0]["requests"]
    assert len(records) == 16 and all(len(rec["itl_ms"]) == 15 for rec in records)


@pytest.mark.slow
def test_concurrency_series_batches(medium_server: Server) -> None:
    r = run(
        BenchSettings(
            url=medium_server.url,
            num_prompts=16,
            input_len="32",
            output_len="48",
            concurrencies=[1, 8],
        )
    )
    one, eight = (run_["summary"] for run_ in r["runs"])
    # The article's batching claim: more concurrent streams, more output per second.
    assert eight["output_throughput"] > 1.5 * one["output_throughput"]


@pytest.mark.slow
def test_shared_prefix_hits_the_cache(medium_server: Server) -> None:
    r = run(
        BenchSettings(
            url=medium_server.url,
            workload="shared-prefix",
            num_prompts=12,
            groups=2,
            prefix_len=256,
            suffix_len=16,
            output_len="4",
            concurrencies=[2],
        )
    )
    assert r["completed"] == 12
    assert r["total_cached_tokens"] >= (12 - 2) * 240  # all but each group's first request
    assert r["runs"][0]["server"]["prefix_hit_rate"] > 0.5


@pytest.mark.slow
def test_long_prompt_workload_by_kind(medium_server: Server) -> None:
    r = run(
        BenchSettings(
            url=medium_server.url,
            workload="long-prompt",
            streams=4,
            stream_output=64,
            long_len=800,
            long_rate=4.0,
            duration_s=1.0,
        )
    )
    kinds = r["runs"][0]["by_kind"]
    assert set(kinds) == {"decode", "long-prompt"}
    assert kinds["decode"]["completed"] == 4


@pytest.mark.slow
def test_overload_failures_are_counted_not_averaged(medium: Path, tmp_path: Path) -> None:
    srv = start_server(medium, tmp_path, "--max-num-seqs", "1", "--max-queue", "1", name="medium")
    try:
        r = run(
            BenchSettings(url=srv.url, num_prompts=12, input_len="32", output_len="32", warmup=0)
        )
    finally:
        srv.stop()
    assert r["failed"] > 0 and r["completed"] + r["failed"] == 12
    assert r["failures_by_kind"].get("HTTP 503") == r["failed"]
    assert r["total_output_tokens"] == 32 * r["completed"]
    assert r["runs"][0]["summary"]["mean_ttft_ms"] > 0  # computed from successes only


@pytest.mark.slow
def test_cli_save_and_compare(medium_server: Server, tmp_path: Path) -> None:
    runner = CliRunner()
    paths = []
    for c in ("1", "4"):
        out = tmp_path / f"c{c}.json"
        res = runner.invoke(
            cli,
            [
                "bench",
                medium_server.url,
                "--num-prompts",
                "8",
                "--input-len",
                "32",
                "--output-len",
                "8",
                "--max-concurrency",
                c,
                "--save-result",
                str(out),
                "--report",
                str(tmp_path / f"c{c}.html"),
            ],
        )
        assert res.exit_code == 0, res.output
        paths.append(out)
        data = json.loads(out.read_text())
        assert data["completed"] == 8 and data["metadata"]["pdscope_version"]
        page = (tmp_path / f"c{c}.html").read_text()
        assert page.count("data:image/png;base64,") >= 2  # latency CDFs and server timeline
        assert "<table>" in page and "p99_itl_ms" in page
    res = runner.invoke(cli, ["bench", "compare", *map(str, paths)])
    assert res.exit_code == 0 and "output_throughput" in res.output and "x" in res.output


def test_cli_rejects_bad_flags() -> None:
    runner = CliRunner()
    for args, needle in (
        (["--workload", "zipf"], "--workload"),
        (["--slo", "ttft=fast"], "SLO"),
        (["--find-capacity"], "--slo"),
        (["--request-rate", "1,2", "--max-concurrency", "1,2"], "not both"),
        (["--percentiles", "50,120"], "--percentiles"),
    ):
        res = runner.invoke(cli, ["bench", "http://127.0.0.1:9", *args])
        assert res.exit_code == 2 and needle in res.output, (args, res.output)


def test_arrival_schedule() -> None:
    times = LoadPlan(request_rate=4.0, seed=1).schedule(4000)
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.05)  # mean gap = 1 / rate
    bursty = LoadPlan(request_rate=4.0, burstiness=0.25, seed=1).schedule(4000)
    bgaps = [b - a for a, b in zip([0.0, *bursty], bursty, strict=False)]
    var = lambda xs: sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / len(xs)  # noqa: E731
    assert var(bgaps) > 2 * var(gaps)  # burstiness < 1: same mean, clumpier arrivals
    assert LoadPlan().schedule(3) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        LoadPlan(request_rate=0)


def test_lengths_and_files(tmp_path: Path) -> None:
    import random

    rng = random.Random(0)
    assert Lengths.parse("128", "x").draw(rng) == 128
    assert all(64 <= Lengths.parse("64-256", "x").draw(rng) <= 256 for _ in range(100))
    assert all(Lengths.parse("normal:5:50", "x").draw(rng) >= 1 for _ in range(100))
    with pytest.raises(WorkloadError, match="--input-len"):
        Lengths.parse("lots", "--input-len")
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(
        '{"prompt": "hi", "output_tokens": 5}\n{"messages": [{"role": "user", "content": "yo"}]}\n'
    )
    specs = file_workload(jsonl, 3, 7)
    assert [s.output_tokens for s in specs] == [5, 7, 5]
    sharegpt = tmp_path / "s.json"
    sharegpt.write_text(
        json.dumps(
            [{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}]
        )
    )
    assert file_workload(sharegpt, None, 9)[0].prompt == "q"
    with pytest.raises(WorkloadError, match="prompt"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"text": "x"}\n')
        file_workload(bad, None, 9)


def _trace(ttft: float, tokens: int = 3, gap: float = 0.01, error: str | None = None) -> Trace:
    chunks = [Chunk(ttft + i * gap, "x") for i in range(tokens)]
    return Trace(
        "openai-completions",
        "u",
        "m",
        start_s=0.0,
        end_s=chunks[-1].t_s,
        output_tokens=tokens,
        prompt_tokens=10,
        chunks=[] if error else chunks,
        error=error,
    )


def test_summary_and_goodput() -> None:
    traces = [_trace(0.1), _trace(0.2), _trace(3.0), _trace(0.1, error="HTTP 500: boom")]
    s = summarize(traces, 2.0, (50, 99), SLO.parse("ttft=1s,tpot=50ms"))
    assert s["completed"] == 3 and s["failed"] == 1
    assert s["median_ttft_ms"] == pytest.approx(200)
    assert s["request_goodput"] == pytest.approx(1.0)  # 2 of 4 met the SLO, over 2 s
    assert s["goodput_fraction"] == pytest.approx(0.5)
    assert s["failures_by_kind"] == {"HTTP 500": 1}
    assert s["total_output_tokens"] == 9
    with pytest.raises(SLOError):
        SLO.parse("latency=1s")
    assert SLO.parse("p99_ttft=2s,p99_itl=100ms", aggregate=True).met_by_run(
        {"p99_ttft_ms": 1500, "p99_itl_ms": 90}
    )


def test_capacity_search_bisects() -> None:
    class Synthetic(Bench):
        def __init__(self) -> None:
            self.s = BenchSettings(url="x", max_runs=12)
            self.state = BenchState()
            self.tried: list[int] = []

        async def run(self, rate: float, concurrency: int | None) -> dict:
            assert math.isinf(rate)
            self.tried.append(concurrency)
            p99 = 100.0 * concurrency  # p99 TTFT grows with load
            run = {"summary": {"p99_ttft_ms": p99, "failed": 0, "output_throughput": 1.0}}
            self.state.runs.append(run)
            return run

    b = Synthetic()
    asyncio.run(b.find_capacity(SLO.parse("p99_ttft=650ms", aggregate=True)))
    assert b.state.capacity["max_concurrency_meeting_slo"] == 6
    assert b.state.capacity["first_failing_concurrency"] == 7
    assert b.tried[:4] == [1, 2, 4, 8]


@pytest.mark.slow
def test_html_report_renders_in_a_browser(medium_server: Server, tmp_path: Path) -> None:
    """Headless Chromium screenshot of a series report; skipped where no browser is installed
    (CI machines have none unless installed by hand)."""
    import shutil
    import subprocess

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if not browser:
        pytest.skip("no chromium on this machine")
    from pdscope.report.bench_html import render_html

    r = run(
        BenchSettings(
            url=medium_server.url,
            num_prompts=8,
            input_len="32",
            output_len="8",
            concurrencies=[1, 4],
        )
    )
    page = tmp_path / "report.html"
    page.write_text(render_html(r))
    shot = tmp_path / "shot.png"
    subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}",
            f"--screenshot={shot}",
            "--window-size=1200,2400",
            page.as_uri(),
        ],
        check=True,
        timeout=120,
        capture_output=True,
    )
    assert shot.stat().st_size > 20_000  # a page with plots, not a blank or error page


def test_auto_sweep_stops_at_saturation() -> None:
    class Synthetic(Bench):
        def __init__(self) -> None:
            self.s = BenchSettings(url="x", max_runs=10)
            self.state = BenchState()
            self.tried: list[int] = []

        async def run(self, rate: float, concurrency: int | None) -> dict:
            self.tried.append(concurrency)
            # Throughput grows with the batch until 8 streams, then flattens.
            run = {"summary": {"output_throughput": 100.0 * min(concurrency, 8)}}
            self.state.runs.append(run)
            return run

    b = Synthetic()
    asyncio.run(b.auto_sweep())
    assert b.tried == [1, 2, 4, 8, 16]
    assert b.state.metadata["saturation_concurrency"] == 8


@pytest.mark.slow
def test_ctrl_c_writes_partial_results(medium_server: Server, tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "partial.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdscope.cli",
            "bench",
            medium_server.url,
            "--num-prompts",
            "64",
            "--input-len",
            "32",
            "--output-len",
            "400",
            "--max-concurrency",
            "2",
            "--save-result",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    time.sleep(6)  # start-up, warm-up, then a few requests in flight
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, output
    data = json.loads(out.read_text())
    assert data["partial"] and data["runs"]
    done = data["runs"][0]["summary"]["completed"]
    assert done < 64  # stopped early, and what finished is kept
    assert "partial results" in output


def test_capacity_search_by_rate() -> None:
    class Synthetic(Bench):
        def __init__(self) -> None:
            self.s = BenchSettings(url="x", max_runs=12, request_rates=[1.0])
            self.state = BenchState()
            self.tried: list[float] = []

        async def run(self, rate: float, concurrency: int | None) -> dict:
            assert concurrency is None and not math.isinf(rate)
            self.tried.append(rate)
            run = {"summary": {"p99_ttft_ms": 100.0 * rate, "failed": 0, "output_throughput": 1.0}}
            self.state.runs.append(run)
            return run

    b = Synthetic()
    asyncio.run(b.find_capacity(SLO.parse("p99_ttft=500ms", aggregate=True)))
    cap = b.state.capacity
    assert cap["by"] == "rate" and b.tried[:4] == [1.0, 2.0, 4.0, 8.0]
    assert 4.5 <= cap["max_rate_meeting_slo"] <= 5.0 < cap["first_failing_rate"] <= 5.5


@pytest.mark.slow
def test_find_capacity_cli(medium_server: Server, tmp_path: Path) -> None:
    out = tmp_path / "cap.json"
    res = CliRunner().invoke(
        cli,
        [
            "bench",
            medium_server.url,
            "--num-prompts",
            "8",
            "--input-len",
            "32",
            "--output-len",
            "8",
            "--find-capacity",
            "--slo",
            "p99_ttft=60s",
            "--save-result",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    cap = json.loads(out.read_text())["capacity"]
    # Every level passes a 60 s SLO; the search stops where concurrency exceeds the requests.
    assert cap["by"] == "concurrency" and cap["max_concurrency_meeting_slo"] == 8
    assert cap["first_failing_concurrency"] is None and cap["searched_runs"] == 4
    assert "capacity under" in res.output
