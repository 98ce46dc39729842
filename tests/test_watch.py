"""`pdscope watch`: windowed figures, absent series, reading rules, unreachable and recovery,
foreign pages, --once/--json/--record, and the Grafana export.

SGLang and TGI cannot run here, so their pages are recorded samples (from
tests/test_server_metrics.py) served by a real HTTP server on 127.0.0.1, as is llama.cpp's, so
that it runs on every machine; a real llama-server is watched in tests/test_llamacpp_peer.py where
`make llamacpp` built one. `pdscope serve` is run for real.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from pdscope.analysis import probe as probe_analysis
from pdscope.analysis import rules
from pdscope.cli import app
from pdscope.commands.grafana import dashboard, panels, prometheus_config
from pdscope.commands.watch import (
    FIGURES,
    NotPrometheusError,
    Watcher,
    WatchSettings,
    WatchSnapshot,
)
from pdscope.report.watch import render_watch, sparkline
from pdscope.server.launch import free_port
from tests.conftest import Server, watch_once_under_load
from tests.test_server_metrics import LLAMACPP_TEXT, SGLANG_TEXT, TGI_TEXT

runner = CliRunner()

# --- a real HTTP server whose /metrics page the test sets ---------------------------------------


@dataclass
class Page:
    text: str = ""
    status: int = 200
    content_type: str = "text/plain; version=0.0.4"
    models: list[dict] = field(default_factory=list)


class _Handler(BaseHTTPRequestHandler):
    page: Page

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            body, status, kind = json.dumps({"data": self.page.models}), 200, "application/json"
        else:
            body, status, kind = self.page.text, self.page.status, self.page.content_type
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:  # keep test output quiet
        pass


@dataclass
class PageServer:
    page: Page
    httpd: ThreadingHTTPServer
    url: str

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def serve_page(page: Page, port: int = 0) -> PageServer:
    handler = type("Handler", (_Handler,), {"page": page})
    httpd = ThreadingHTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return PageServer(page, httpd, f"http://127.0.0.1:{httpd.server_address[1]}")


@pytest.fixture
def page() -> Iterator[PageServer]:
    srv = serve_page(Page())
    yield srv
    srv.close()


def vllm_page(
    ttft: dict[float, int],
    running: float = 0,
    waiting: float = 0,
    kv: float = 0.0,
    gen: int = 0,
    above: int = 0,
) -> str:
    """A vLLM-named page: TTFT buckets given as {upper bound: cumulative count}, then +Inf with
    `above` more."""
    total = max(ttft.values(), default=0) + above
    lines = ["# TYPE vllm:time_to_first_token_seconds histogram"]
    for bound, count in sorted(ttft.items()):
        lines.append(
            f'vllm:time_to_first_token_seconds_bucket{{le="{bound}",model_name="m"}} {count}'
        )
    lines += [
        f'vllm:time_to_first_token_seconds_bucket{{le="+Inf",model_name="m"}} {total}',
        f'vllm:time_to_first_token_seconds_count{{model_name="m"}} {total}',
        f'vllm:time_to_first_token_seconds_sum{{model_name="m"}} {total * 0.1}',
        "# TYPE vllm:num_requests_running gauge",
        f'vllm:num_requests_running{{model_name="m"}} {running}',
        "# TYPE vllm:num_requests_waiting gauge",
        f'vllm:num_requests_waiting{{model_name="m"}} {waiting}',
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f'vllm:kv_cache_usage_perc{{model_name="m"}} {kv}',
        "# TYPE vllm:generation_tokens counter",
        f'vllm:generation_tokens_total{{model_name="m"}} {gen}',
    ]
    return "\n".join(lines) + "\n"


def ticks(
    settings: WatchSettings,
    pages: list[str | None],
    page: Page,
    pause_s: float | list[float] = 0.0,
) -> list[WatchSnapshot]:
    """Tick a Watcher once per page text (None: leave the page as it is), pausing `pause_s`
    (or the next of a list) after each tick; return the snapshots."""
    pauses = pause_s if isinstance(pause_s, list) else [pause_s] * len(pages)

    async def main() -> list[WatchSnapshot]:
        out = []
        async with httpx.AsyncClient() as client:
            watcher = Watcher(settings, client)
            for text, pause in zip(pages, pauses, strict=True):
                if text is not None:
                    page.text = text
                out.append(await watcher.tick())
                await asyncio.sleep(pause)
        return out

    return asyncio.run(main())


# --- figures over the window --------------------------------------------------------------------


def test_quantiles_come_from_bucket_deltas_over_the_window(page: PageServer) -> None:
    # Before the window: 100 fast requests (all <= 0.1 s). In the window: 10 more, 2 at
    # (0.1, 0.5] and 8 at (0.5, 1.0]; the window's p50 is inside (0.5, 1.0], not 0.1's bucket.
    before = vllm_page({0.1: 100, 0.5: 100, 1.0: 100}, gen=1000)
    after = vllm_page({0.1: 100, 0.5: 102, 1.0: 110}, running=3, waiting=2, kv=0.5, gen=1600)
    settings = WatchSettings(url=page.url, window_s=60, interval_s=0.1)
    first, second = ticks(settings, [before, after], page.page, pause_s=0.05)
    assert first.values["ttft_p50_ms"] is None
    assert "one scrape so far" in first.missing["ttft_p50_ms"]
    # Hand computed: rank 5 of 10 is the 3rd of 8 in (0.5, 1.0]: 0.5 + 0.5 * 3/8 = 0.6875 s.
    assert second.values["ttft_p50_ms"] == pytest.approx(687.5)
    # rank 9.9: the 7.9th of 8 in (0.5, 1.0]
    assert second.values["ttft_p99_ms"] == pytest.approx(500 + 500 * 7.9 / 8)
    assert (second.values["running"], second.values["waiting"]) == (3, 2)
    assert second.values["kv_usage"] == 0.5
    rate = second.values["generation_tok_s"]
    assert rate is not None and rate == pytest.approx(600 / second.covered_s)
    # The page lacks the ITL histogram, prefix-cache and preemption counters: absent, not 0.
    for figure in ("itl_p50_ms", "itl_p99_ms", "preemptions", "prefix_hit_rate", "prompt_tok_s"):
        assert second.values[figure] is None
        assert figure in second.absent and "not on /metrics" in second.missing[figure]
    # waiting > 0: the capacity rule holds, with vLLM's knob (the page is not pdscope's).
    (capacity,) = [r for r in second.rules if r["kind"] == "capacity"]
    assert "2 waiting, 3 running, KV use 50%" in capacity["evidence"]
    assert capacity["action"] == rules.KNOBS["capacity"]["vllm"]


def test_old_scrapes_leave_the_window(page: PageServer) -> None:
    # a window wide enough that a slow scrape on a loaded host keeps tick 0 in it at tick 1
    settings = WatchSettings(url=page.url, window_s=1.0, interval_s=0.1)
    pages = [vllm_page({0.1: 0}), vllm_page({0.1: 10}), None]
    snaps = ticks(settings, pages, page.page, pause_s=[0.02, 2.0, 0.0])
    assert snaps[1].values["ttft_p50_ms"] == pytest.approx(50.0)
    # 2 s later the scrape before the 10 requests is out of the 1 s window: none in it.
    assert snaps[2].values["ttft_p50_ms"] is None
    assert "no TTFT observations" in snaps[2].missing["ttft_p50_ms"]
    assert snaps[2].scrapes_in_window == 2


def test_edge_quantiles_and_impossible_gauges_are_not_shown_as_figures(page: PageServer) -> None:
    """Every TTFT of the window under the first bound (0.1 s): Prometheus' p50 is 50 ms, the
    bucket's middle, but the view says "< 100.0 ms". A p99 past the last bound reads "> 2.00 s".
    A negative waiting count and a KV usage of 7 are a broken page: no figure, the reading
    named instead."""
    from rich.console import Console

    settings = WatchSettings(url=page.url, window_s=60, interval_s=0.1)
    low = [vllm_page({0.1: 0, 1.0: 0}), vllm_page({0.1: 10, 1.0: 10}, waiting=-5, kv=7.0)]
    snap = ticks(settings, low, page.page)[1]
    assert snap.values["ttft_p50_ms"] == pytest.approx(50.0)  # as Prometheus computes it
    assert snap.edges["ttft_p50_ms"] == ["below", 100.0]
    assert snap.values["waiting"] is None and snap.values["kv_usage"] is None
    assert "read -5: a count of requests is never negative" in snap.missing["waiting"]
    assert "read 7: KV usage is a fraction" in snap.missing["kv_usage"]
    assert not [r for r in snap.rules if r["kind"] in ("capacity", "kv_full")]
    high = [vllm_page({0.1: 0, 2.0: 0}), vllm_page({0.1: 0, 2.0: 96}, above=4)]
    top = ticks(settings, high, page.page)[1]
    assert top.edges["ttft_p99_ms"] == ["above", 2000.0]
    views = []
    for s in (snap, top):
        console = Console(width=160, record=True)
        console.print(render_watch(json.loads(json.dumps(s.to_dict()))))  # as --record keeps it
        views.append(console.export_text())
    assert "< 100.0 ms" in views[0] and "50.0 ms" not in views[0], views[0]
    assert "read -5" in views[0] and "read 7" in views[0]  # the reason, in place of a figure
    assert "> 2.00 s" in views[1], views[1]
    from pdscope.report.watch_html import render_watch_html

    page = render_watch_html([snap.to_dict(), top.to_dict()])  # edges drawn as markers
    assert page.count("data:image/png;base64,") == 1


@pytest.mark.parametrize(("gen", "shown"), [(math.nan, "read NaN"), (math.inf, "read inf")])
def test_a_counter_that_is_not_a_count_has_no_rate(
    page: PageServer, gen: float, shown: str
) -> None:
    """A generated-tokens counter at NaN gave a rate of 0.0 (NaN was read as absent, then as
    0); at +Inf, NaN in the JSON. Neither is a rate: no figure, and the reading named."""
    settings = WatchSettings(url=page.url, window_s=60, interval_s=0.1)
    pages = [vllm_page({0.1: 0}, gen=100), vllm_page({0.1: 0}, gen=gen)]  # type: ignore[arg-type]
    snap = ticks(settings, pages, page.page)[1]
    assert snap.values["generation_tok_s"] is None
    assert (
        shown in snap.missing["generation_tok_s"]
        and "not a count" in snap.missing["generation_tok_s"]
    )
    json.dumps(snap.to_dict(), allow_nan=False)  # valid JSON: no NaN


def test_server_restart_resets_the_window(page: PageServer) -> None:
    settings = WatchSettings(url=page.url, window_s=60, interval_s=0.1)
    snaps = ticks(settings, [vllm_page({0.1: 50}, gen=500), vllm_page({0.1: 1}, gen=3)], page.page)
    assert any("server restarted" in e for e in snaps[1].events)
    assert snaps[1].scrapes_in_window == 1


def test_a_restart_whose_counters_passed_their_old_values_resets_the_window(
    page: PageServer,
) -> None:
    """Counters that read higher after a restart looked like traffic; the process start time
    moved, and says so."""
    settings = WatchSettings(url=page.url, window_s=60, interval_s=0.1)
    start = "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {}\n"
    pages = [
        vllm_page({0.1: 5}, gen=50) + start.format(1.7e9),
        vllm_page({0.1: 50}, gen=900) + start.format(1.7e9 + 30),
    ]
    snaps = ticks(settings, pages, page.page)
    assert any("the server restarted" in e for e in snaps[1].events), snaps[1].events
    assert snaps[1].scrapes_in_window == 1


def test_a_server_that_started_inside_the_window_counts_from_its_start(page: PageServer) -> None:
    """After a restart the window held one scrape, so every rate and quantile read "one scrape
    so far" until the next, and what the new process served before it was lost (a whole window
    of it when watch itself was paused across the restart). Its counters started at 0 at its
    process start time: deltas from there are exact to within that time's second. A server
    older than the window, or younger than MIN_BASE_AGE_S (where that second is a large share
    of the span), or a page without a start time, still needs two scrapes."""
    import time

    from pdscope.commands.watch import MIN_BASE_AGE_S

    start = "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {}\n"
    settings = WatchSettings(url=page.url, window_s=60, interval_s=0.1)
    age = MIN_BASE_AGE_S + 10
    old = vllm_page({0.1: 50}, gen=500) + start.format(time.time() - 600)
    pages = [old, vllm_page({0.1: 4}, gen=400) + start.format(time.time() - age)]
    snaps = ticks(settings, pages, page.page)
    assert "one scrape so far" in snaps[0].missing["ttft_p50_ms"]  # 600 s old: outside
    after = snaps[1]
    assert any("the server restarted" in e for e in after.events), after.events
    assert after.scrapes_in_window == 1  # the base is no scrape watch made
    assert age <= after.covered_s < age + 2.0, after.covered_s
    rate = after.values["generation_tok_s"]
    assert rate is not None and rate == pytest.approx(400 / after.covered_s)
    assert after.values["ttft_p50_ms"] is not None and after.values["ttft_p50_ms"] <= 100
    # a fresh server at watch's first scrape: the same, from the first tick
    page_at = vllm_page({0.1: 4}, gen=300) + start.format(time.time() - age)
    first = ticks(settings, [page_at], page.page)[0]
    assert first.values["generation_tok_s"] == pytest.approx(300 / first.covered_s)
    # too young for its start time's second, or ahead of this clock: no base
    for offset in (-MIN_BASE_AGE_S / 4, 5.0):
        young = vllm_page({0.1: 4}, gen=30) + start.format(time.time() + offset)
        assert (
            "one scrape so far"
            in ticks(settings, [young], page.page)[0].missing["generation_tok_s"]
        )


def test_once_keeps_the_events_of_its_whole_window(page: PageServer) -> None:
    """`watch --once` returned only its last tick, whose events were empty: a restart inside
    the window left no trace in its JSON."""
    from pdscope.commands.watch import run

    start = "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {}\n"
    page.page.text = vllm_page({0.1: 5}, gen=50) + start.format(1.7e9)
    settings = WatchSettings(url=page.url, window_s=1.0, interval_s=0.1)
    ticked: list[WatchSnapshot] = []

    def on_snapshot(snap: WatchSnapshot, _: object) -> None:
        ticked.append(snap)
        if len(ticked) == 2:  # the server restarts early in the window
            page.page.text = vllm_page({0.1: 1}, gen=900) + start.format(1.7e9 + 30)

    last = asyncio.run(run(settings, on_snapshot, once=True))
    assert last is not None and len(ticked) > 3
    assert last.window_events is not None
    assert any("the server restarted" in e for e in last.window_events), last.window_events
    # the recording's report lists it (it showed nothing of a restart between two scrapes)
    from pdscope.report.watch_html import render_watch_html

    page_html = render_watch_html([snap.to_dict() for snap in ticked])
    assert page_html.count("the server restarted (process_start_time_seconds moved by +30 s)") == 1


def test_ctrl_c_during_once_prints_the_window_so_far_with_its_events(
    page: PageServer, tmp_path: Path
) -> None:
    """Ctrl-C during `watch --once` printed the last tick as if the window had run, without the
    window's events (a restart inside it vanished) and exited 0. It now prints the window so far
    with every event seen, marked interrupted, and exits 1."""
    import signal
    import subprocess
    import sys
    import time

    start = "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {}\n"
    page.page.text = vllm_page({0.1: 5}, gen=50) + start.format(1.7e9)
    record = tmp_path / "watch.jsonl"
    args = [page.url, "--once", "--window", "60", "--interval", "0.2", "--json"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdscope.cli", "watch", *args, "--record", str(record)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # see test_bench
    )

    def lines() -> list[dict]:
        text = record.read_text() if record.exists() else ""
        return [json.loads(line) for line in text.splitlines() if line.endswith("}")]

    deadline = time.monotonic() + 60
    while len(lines()) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    page.page.text = vllm_page({0.1: 1}, gen=900) + start.format(1.7e9 + 30)  # restarts
    while len(lines()) < 5 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    last = json.loads(out)
    assert last["interrupted"] is True
    assert any("the server restarted" in e for e in last["window_events"]), last
    assert not any("restarted" in e for e in last["events"])  # not the last tick's own event
    assert "s into the 60 s window; the figures cover" in err


@pytest.mark.parametrize(
    ("text", "runtime", "absent"),
    [
        (
            TGI_TEXT,
            "tgi",
            {"ttft_p50_ms": "tgi exports no TTFT histogram", "kv_usage": "tgi exports no KV"},
        ),
        (LLAMACPP_TEXT, "llama.cpp", {"kv_usage": "llamacpp:kv_cache_usage_ratio not on"}),
        (SGLANG_TEXT, "sglang", {"ttft_p50_ms": "sglang:time_to_first_token_seconds not on"}),
    ],
)
def test_other_runtimes_and_absent_series(
    page: PageServer, text: str, runtime: str, absent: dict[str, str]
) -> None:
    settings = WatchSettings(url=page.url, window_s=60, interval_s=0.1)
    (snap,) = ticks(settings, [text], page.page)
    assert snap.runtime == runtime and snap.reachable
    for figure, reason in absent.items():
        assert snap.values[figure] is None
        assert figure in snap.absent
        assert snap.missing[figure].startswith(reason)
    assert snap.values["running"] is not None and snap.values["waiting"] is not None
    data = snap.to_dict()
    assert set(FIGURES) <= set(data)
    json.dumps(data)
    # The view says "absent" and why, never 0.
    from rich.console import Console

    console = Console(width=160, record=True)
    console.print(render_watch(data))
    text_out = console.export_text()
    for reason in absent.values():
        assert reason in text_out
    assert "absent" in text_out


# --- foreign pages, unreachable servers ---------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "status", "message"),
    [
        ("<html><body>It works!</body></html>", 200, "not Prometheus text"),
        ("# TYPE up gauge\nup 1\n", 200, "no series of a known runtime"),
        ("not found", 404, "no /metrics there"),
    ],
)
def test_a_page_that_is_not_a_runtimes_metrics_ends_the_watch(
    page: PageServer, text: str, status: int, message: str
) -> None:
    page.page.text, page.page.status = text, status
    with pytest.raises(NotPrometheusError, match=message):
        ticks(WatchSettings(url=page.url, window_s=60, interval_s=0.1), [None], page.page)
    result = runner.invoke(app, ["watch", page.url, "--once", "--json", "--window", "1"])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())


def test_unreachable_then_recovered() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    settings = WatchSettings(url=url, window_s=60, interval_s=0.1, timeout_s=2)

    async def main() -> tuple[list[WatchSnapshot], Watcher]:
        out = []
        async with httpx.AsyncClient() as client:
            watcher = Watcher(settings, client)
            out.append(await watcher.tick())
            out.append(await watcher.tick())
            srv = serve_page(Page(text=vllm_page({0.1: 1}, running=1)), port=port)
            try:
                out.append(await watcher.tick())
            finally:
                srv.close()
            out.append(await watcher.tick())
        return out, watcher

    (down, still_down, back, gone), watcher = asyncio.run(main())
    assert not down.reachable and down.unreachable_since is not None and down.error
    assert still_down.unreachable_since == down.unreachable_since  # since the first failure
    assert all(v is None for v in down.values.values())
    assert back.reachable and back.values["running"] == 1
    assert any(e.startswith("recovered at") for e in back.events)
    assert not gone.reachable and gone.unreachable_since is not None
    from rich.console import Console

    console = Console(width=160, record=True)
    console.print(render_watch(gone.to_dict(), recent_events=watcher.recent_events))
    view = console.export_text()
    assert f"unreachable since {gone.unreachable_since}" in view
    assert "recovered at" in view  # the recovery stays on screen after its own tick
    # --once on a server that never answers: one JSON snapshot saying so, exit 1.
    args = ["watch", url, "--once", "--json", "--window", "0.3", "--interval", "0.1"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert data["reachable"] is False and data["unreachable_since"]


def test_settings_reject_nonsense() -> None:
    with pytest.raises(ValueError, match="window_s"):
        WatchSettings(url="http://x", window_s=0)
    with pytest.raises(ValueError, match="at least one scrape interval"):
        WatchSettings(url="http://x", window_s=1, interval_s=5)
    result = runner.invoke(app, ["watch", "http://127.0.0.1:9", "--interval", "-1"])
    assert result.exit_code == 2 and "interval_s" in result.output


# --- the reading rules: one table with probe ----------------------------------------------------


def test_probe_and_watch_share_one_knob_table() -> None:
    assert probe_analysis.knob is rules.knob
    r = {
        "sweep": [],
        "prefix_cache": {
            "prompt_tokens": 1000,
            "cold_ttft_ms": 100.0,
            "warm_ttft_ms": 99.0,
            "warm_over_cold": 0.99,
            "cached_tokens": 0,
        },
        "failures": [],
    }
    (finding,) = probe_analysis.findings(r, "llama.cpp")
    assert finding["action"] == rules.KNOBS["prefix_cache"]["llama.cpp"]
    for rule in rules.RULES:
        assert rule.knob_kind in rules.KNOBS
        assert set(rules.KNOBS[rule.knob_kind]) >= {"vllm", "pdscope", "llama.cpp", "ollama"}


def _figures(**kw: float | None) -> rules.LiveFigures:
    base: dict[str, float | None] = dict(
        running=4,
        waiting=0,
        kv_usage=0.3,
        ttft_p50_ms=100,
        itl_p50_ms=20,
        itl_p99_ms=30,
        prompt_tok_s=100,
    )
    return rules.LiveFigures(**(base | kw))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("figures", "kinds"),
    [
        (_figures(), []),
        (_figures(waiting=3), ["capacity"]),
        (_figures(waiting=3, kv_usage=0.95), ["capacity", "kv_full"]),
        (_figures(kv_usage=0.99), []),  # a full pool with nobody waiting is a busy pool
        (_figures(itl_p99_ms=90), ["prefill_interrupts"]),
        (_figures(itl_p99_ms=90, prompt_tok_s=0), []),  # no prompts arriving: not prefill
        (
            _figures(
                ttft_p50_first_half_ms=100,
                ttft_p50_second_half_ms=400,
                running_max_first_half=8,
                running_max_second_half=8,
            ),
            ["queueing"],
        ),
        (
            _figures(
                ttft_p50_first_half_ms=100,
                ttft_p50_second_half_ms=400,
                running_max_first_half=2,
                running_max_second_half=8,
            ),
            [],  # the batch grew with the load: TTFT grew from batching, not queueing
        ),
    ],
)
def test_live_rules(figures: rules.LiveFigures, kinds: list[str]) -> None:
    found = rules.live_findings(figures, "ollama")
    assert [f["kind"] for f in found] == kinds
    for f in found:
        assert f["action"] == rules.knob(rules.RULES_BY_ID[f["kind"]].knob_kind, "ollama")
        assert f["evidence"]


def test_sparkline() -> None:
    assert sparkline([]) == ""
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7]) == "▁▂▃▄▅▆▇█"
    assert sparkline([1, None, 1]) == "█ █"  # the scale starts at 0
    assert sparkline([0, None, 0]) == "▁ ▁"
    # 100 values into 10 columns: each column shows its bin's maximum, so a spike survives.
    line = sparkline([0.0] * 50 + [9.0] + [0.0] * 49, width=10)
    assert len(line) == 10 and line[5] == "█" and set(line) - {"█"} == {"▁"}


# --- against a real `pdscope serve` -------------------------------------------------------------


def test_once_json_and_record_against_pdscope_serve(server: Server, tmp_path: Path) -> None:
    record = tmp_path / "watch.jsonl"
    record.write_text("")  # --record appends to what is there

    body = {"model": server.model, "prompt": "Hello there", "max_tokens": 16}
    snap = watch_once_under_load(server.url, body, 2, 0.25, ("--record", str(record)))
    assert snap["reachable"] and snap["runtime"] == "vllm" and snap["knobs_for"] == "pdscope"
    assert snap["absent"] == []  # pdscope serve exports every figure watch shows
    for figure in ("running", "waiting", "kv_usage", "generation_tok_s", "preemptions"):
        assert snap[figure] is not None, figure
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(lines) >= 5 and lines[-1] == snap
    assert (snap["generation_tok_s"] or 0) > 0 and (snap["ttft_p50_ms"] or 0) > 0
    assert [line["t_s"] for line in lines] == sorted(line["t_s"] for line in lines)
    # The recording draws as a page: bench's server timeline, quantiles and rates.
    drawn = runner.invoke(app, ["watch", "--report", str(record)])
    assert drawn.exit_code == 0, drawn.output
    page = (tmp_path / "watch.html").read_text()
    assert page.count("data:image/png;base64,") == 1 and str(server.url) in page
    (tmp_path / "bad.jsonl").write_text('{"not": "a snapshot"}\n')
    bad = runner.invoke(app, ["watch", "--report", str(tmp_path / "bad.jsonl")])
    assert bad.exit_code == 2
    assert "not a pdscope watch snapshot" in " ".join(bad.output.split()) and ":1:" in bad.output


# --- Grafana and Prometheus files ---------------------------------------------------------------


def test_export_grafana_writes_dashboard_and_scrape_config(tmp_path: Path) -> None:
    result = runner.invoke(
        app, ["watch", "http://10.0.0.7:8011", "--export", "grafana", str(tmp_path / "g")]
    )
    assert result.exit_code == 0, result.output
    board = json.loads((tmp_path / "g" / "grafana-dashboard.json").read_text())
    titles = [p["title"] for p in board["panels"]]
    assert titles == [
        "Time to first token",
        "Inter-token latency",
        "Requests running",
        "Requests waiting",
        "KV-cache use",
        "Token throughput",
        "Preemptions",
    ]
    (variable,) = board["templating"]["list"]
    assert variable["name"] == "runtime"
    assert [o["text"] for o in variable["options"]] == ["vllm", "sglang", "tgi"]
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    assert all("$runtime" in e for e in exprs)
    ttft = board["panels"][0]["targets"][0]["expr"]
    assert (
        "histogram_quantile(0.5, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket" in ttft
    )
    assert "[$__rate_interval]" in ttft
    # Every runtime gets a target in the panels whose series it exports; TGI has no TTFT.
    assert {t.runtime for t in panels()[0].targets} == {"vllm", "sglang"}
    assert {t.runtime for t in panels()[2].targets} == {"vllm", "sglang", "tgi"}
    config = (tmp_path / "g" / "prometheus.yml").read_text()
    assert 'targets: ["10.0.0.7:8011"]' in config and 'metrics_path: "/metrics"' in config
    assert prometheus_config("http://h:1/x/metrics").count('"/x/metrics"') == 1
    with pytest.raises(ValueError, match="offers"):
        dashboard(runtime="ollama")
    bad = runner.invoke(app, ["watch", "--export", "kibana", str(tmp_path)])
    assert bad.exit_code == 2 and "grafana DIR" in bad.output
