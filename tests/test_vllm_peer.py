"""`pdscope probe` against a real vLLM (CPU build), when `make peers` has installed it.

Marked `vllm` and left out of `make test` (vLLM takes a minute or more to start on 2 cores);
`make test-vllm` runs it. Skipped when .venv-peers is absent.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdscope.commands.probe import ProbeSettings, probe
from pdscope.server.launch import free_port
from tests.conftest import peer_server
from tests.test_probe import output_asked

VLLM = Path(__file__).resolve().parents[1] / ".venv-peers" / "bin" / "vllm"

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM.exists(), reason="vLLM not installed (make peers)"),
]


@pytest.fixture(scope="module")
def vllm_url(medium: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = medium  # head_dim 64: a shape vLLM's CPU attention takes (PEERS.md)
    port = free_port()
    log = tmp_path_factory.mktemp("logs") / "vllm.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    cmd = [str(VLLM), "serve", str(model), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--dtype", "bfloat16", "--max-model-len", "2048", "--served-model-name", "llama"]
    with peer_server("vLLM", cmd, f"http://127.0.0.1:{port}", log, 600, env) as url:
        yield url


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
        assert t["token_source"] == "server-usage"
        assert t["output_tokens"] == output_asked(t)
        # a chunk a token at most; some of empty text where vLLM held a token's text back
        assert 0 < len(t["chunks"]) <= t["output_tokens"]


def test_bench_real_vllm(vllm_url: str) -> None:
    from pdscope.commands.bench import BenchSettings, BenchState, bench

    r = asyncio.run(
        bench(
            BenchSettings(
                url=vllm_url, num_prompts=8, input_len="64", output_len="16", concurrencies=[4]
            ),
            BenchState(),
        )
    )
    # A random-weight model can emit a response whose tokens decode to no visible text (bytes
    # that never form a character): vLLM still sends a chunk of empty text for each, so it is
    # timed, not counted as failed.
    assert r["completed"] == 8 and not r["failures"], r["failures"]
    assert r["total_output_tokens"] == r["completed"] * 16  # read from vLLM's usage chunks
    assert r["metadata"]["runtime"] == "vllm" and r["metadata"]["exact_prompt_tokens"]
    server = r["runs"][0]["server"]
    assert server["available"] and server["runtime"] == "vllm"
    assert server["deltas"]["generation_tokens"] == 8 * 16  # vLLM counted every request
    assert server["histograms"]["ttft"]["count"] == 8
