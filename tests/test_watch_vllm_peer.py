"""`pdscope watch` against a real vLLM (CPU build), when `make peers` has installed it.

Marked `vllm` like tests/test_vllm_peer.py, whose vLLM server fixture it shares; `make
test-vllm` runs it.
"""

from __future__ import annotations

import pytest

from tests.conftest import watch_once_under_load
from tests.test_vllm_peer import VLLM, vllm_url  # noqa: F401 (the module's vLLM server fixture)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM.exists(), reason="vLLM not installed (make peers)"),
]


def test_watch_real_vllm(vllm_url: str) -> None:  # noqa: F811
    body = {"model": "llama", "prompt": "Prefill, then decode.", "max_tokens": 48}
    snap = watch_once_under_load(vllm_url, body)
    assert snap["runtime"] == "vllm" and snap["knobs_for"] == "vllm"
    assert snap["absent"] == []  # vLLM exports every figure watch shows
    for figure in ("running", "waiting", "kv_usage", "generation_tok_s", "prefix_hit_rate"):
        assert figure in snap["names"], figure
    assert snap["generation_tok_s"] is not None and snap["generation_tok_s"] > 0
    assert snap["itl_p50_ms"] is not None and snap["itl_p50_ms"] > 0
