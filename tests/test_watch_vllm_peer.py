"""`pdscope watch` against a real vLLM (CPU build), when `make peers` has installed it.

Marked `vllm` like tests/test_vllm_peer.py, whose vLLM server fixture it shares; `make
test-vllm` runs it.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from typer.testing import CliRunner

from pdscope.cli import app
from tests.test_vllm_peer import VLLM, vllm_url  # noqa: F401 (the module's vLLM server fixture)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM.exists(), reason="vLLM not installed (make peers)"),
]


def test_watch_real_vllm(vllm_url: str) -> None:  # noqa: F811
    stop = threading.Event()

    def load() -> None:  # requests one after another for as long as the watch runs
        body = {"model": "llama", "prompt": "Prefill, then decode.", "max_tokens": 48}
        for _ in range(200):
            if stop.is_set():
                return
            httpx.post(f"{vllm_url}/v1/completions", json=body, timeout=120).raise_for_status()

    thread = threading.Thread(target=load)
    thread.start()
    args = ["watch", vllm_url, "--once", "--json", "--window", "4", "--interval", "0.5"]
    try:
        result = CliRunner().invoke(app, args)
    finally:
        stop.set()
        thread.join()
    assert result.exit_code == 0, result.output
    snap = json.loads(result.stdout)
    assert snap["runtime"] == "vllm" and snap["knobs_for"] == "vllm"
    assert snap["absent"] == []  # vLLM exports every figure watch shows
    for figure in ("running", "waiting", "kv_usage", "generation_tok_s", "prefix_hit_rate"):
        assert figure in snap["names"], figure
    assert snap["generation_tok_s"] is not None and snap["generation_tok_s"] > 0
    assert snap["itl_p50_ms"] is not None and snap["itl_p50_ms"] > 0
