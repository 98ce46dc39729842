"""`pdscope watch` as a person runs it: in a terminal (tmux), beside `pdscope bench` loading a
`pdscope serve` whose KV pool is small enough that requests wait.

The pane is read with `tmux capture-pane`, as one would look at it: the five figures must be on
screen, change while the load runs, and the capacity rule must appear while requests wait.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Server, start_server

TMUX = shutil.which("tmux")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(TMUX is None, reason="tmux is not installed (apt-get install tmux)"),
]
FIVE = ("TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "running", "waiting", "KV use")


@pytest.fixture
def small_pool_server(tiny_model: Path, tmp_path: Path) -> Iterator[Server]:
    # 256 bytes of KV per token for the tiny model: 256 KiB holds 1,024 tokens, about three
    # requests of 200 + 128 tokens, so a load of 16 at once leaves most of them waiting.
    srv = start_server(
        tiny_model, tmp_path, "--kv-cache-memory", "256KiB", "--max-model-len", "512"
    )
    yield srv
    srv.stop()


def _tmux(socket: str, *args: str) -> str:
    """tmux on a socket of its own: its own server, started with this test's environment."""
    assert TMUX is not None
    return subprocess.run(
        [TMUX, "-L", socket, *args], check=True, capture_output=True, text=True, timeout=10
    ).stdout


def _value(pane: str, label: str) -> str | None:
    """The 'now' cell of a figure's row, e.g. '3' for 'waiting   3  ▁▂▅  vllm:...'."""
    # "< 10.0 ms": a quantile known only by its bucket's bound
    m = re.search(rf"^{re.escape(label)}\s+(-|absent|[<>]? ?[\d.,]+(?: \S+)?)", pane, re.MULTILINE)
    return m.group(1) if m else None


def test_watch_in_tmux_under_bench_load(small_pool_server: Server, tmp_path: Path) -> None:
    session = f"pdscope-watch-{small_pool_server.url.rsplit(':', 1)[1]}"
    pdscope = [sys.executable, "-m", "pdscope.cli"]
    watch = [*pdscope, "watch", small_pool_server.url, "--window", "5", "--interval", "0.5"]
    record = tmp_path / "watch.jsonl"
    _tmux(
        session, "new-session", "-d", "-s", session, "-x", "160", "-y", "40",
        " ".join([*watch, "--record", str(record)]),
    )  # fmt: skip
    # Keep the pane after watch exits, to read what it printed on the way out.
    _tmux(session, "set-option", "-t", session, "remain-on-exit", "on")
    bench = None
    try:
        panes: list[str] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the view is up once every label is on screen
            pane = _tmux(session, "capture-pane", "-p", "-t", session)
            if all(_value(pane, label) is not None for label in FIVE):
                panes.append(pane)
                break
            time.sleep(0.5)
        assert panes, f"watch never drew its view:\n{pane}"
        bench = subprocess.Popen(
            [
                *pdscope, "bench", small_pool_server.url, "--num-prompts", "48",
                "--max-concurrency", "16", "--input-len", "200", "--output-len", "128",
                "--warmup", "0", "--timeout", "60",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        saw_waiting = saw_rule = generating = False
        deadline = time.monotonic() + 60
        # Until the queue and the rule have shown and the view's generation rate is up: the
        # first panes under load can come while the window holds only prefill (CI saw one
        # draw 'waiting' and the rule with generation still 0.0 tok/s over its first second).
        while time.monotonic() < deadline and not (saw_waiting and saw_rule and generating):
            time.sleep(0.5)
            pane = _tmux(session, "capture-pane", "-p", "-t", session)
            panes.append(pane)
            waiting = _value(pane, "waiting")
            saw_waiting |= waiting not in (None, "-", "0", "absent")
            saw_rule |= "Requests are waiting" in pane
            generating = _value(pane, "generation") not in (None, "-", "0.0 tok/s")
            if bench.poll() is not None and not (saw_waiting and saw_rule and generating):
                break
        assert saw_waiting, "waiting never rose above 0:\n" + panes[-1]
        assert saw_rule, "the capacity rule never appeared:\n" + panes[-1]
        during = panes[-1]
        for label in FIVE:
            assert _value(during, label) not in (None, "absent"), (label, during)
        # The figures moved: the idle first view and the loaded one differ in the five.
        first = panes[0]
        assert [_value(first, x) for x in FIVE] != [_value(during, x) for x in FIVE]
        assert _value(during, "generation") not in (None, "-", "0.0 tok/s")
        assert bench.wait(timeout=90) == 0
        # Ctrl-C ends the watch cleanly and keeps what it recorded. A few ticks first: on a
        # fast host the bench can finish within three of them (CI read 3 lines where 5 were
        # asked), and a short record would test nothing about keeping it.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(record.read_text().splitlines()) < 5:
            time.sleep(0.3)
        recorded = len(record.read_text().splitlines())
        _tmux(session, "send-keys", "-t", session, "C-c")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "recorded to" not in pane:
            time.sleep(0.3)
            pane = _tmux(session, "capture-pane", "-p", "-t", session)
        assert "recorded to" in pane, pane
        lines = record.read_text().splitlines()
        assert len(lines) >= max(5, recorded) and '"waiting"' in lines[-1]
    finally:
        if bench is not None and bench.poll() is None:
            bench.kill()
        subprocess.run([TMUX, "-L", session, "kill-server"], capture_output=True, timeout=10)
