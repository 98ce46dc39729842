"""`pdscope probe` against a real vLLM (CPU build), when `make peers` has installed it.

Marked `vllm` and left out of `make test` (vLLM takes a minute or more to start on 2 cores);
`make test-vllm` runs it. Skipped when .venv-peers is absent.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdscope.commands.probe import ProbeSettings, probe
from pdscope.engine.make_model import make_model
from pdscope.server.launch import free_port

VLLM = Path(__file__).resolve().parents[1] / ".venv-peers" / "bin" / "vllm"

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM.exists(), reason="vLLM not installed (make peers)"),
]


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # head_dim 64: a shape vLLM's CPU attention is known to take (PEERS.md).
    model = make_model(
        tmp_path_factory.mktemp("m") / "llama",
        "tiny",
        num_hidden_layers=4,
        hidden_size=256,
        intermediate_size=704,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    port = free_port()
    log = tmp_path_factory.mktemp("logs") / "vllm.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                str(VLLM),
                "serve",
                str(model),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--dtype",
                "bfloat16",
                "--max-model-len",
                "2048",
                "--served-model-name",
                "llama",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(1)
        else:
            pytest.fail(f"vLLM did not start:\n{log.read_text()[-3000:]}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_probe_real_vllm(vllm_url: str) -> None:
    r = asyncio.run(
        probe(
            ProbeSettings(
                url=vllm_url,
                prompt_tokens=[100, 400, 1200],
                output_tokens=24,
                repeats=2,
                context_tokens=1500,
            )
        )
    )
    assert r["runtime"]["name"] == "vllm" and r["settings"]["exact_prompt_tokens"]
    sweep = r["sweep"]
    assert [p["prompt_tokens"] for p in sweep] == [100, 400, 1200]
    assert sweep[-1]["ttft_ms"] > sweep[0]["ttft_ms"]
    assert not r["failures"]
    for t in r["traces"]:
        assert t["token_source"] == "server-usage" and t["output_tokens"] == 24
        assert all(c["text"] for c in t["chunks"])
