"""The MLP's widest prefill outputs in the model's Scratch: against glibc's real malloc, in a
fresh process (the fault counts are the process's own)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdscope.checkpoint.make_model import make_model
from tests.conftest import glibc_as_it_starts

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/status").is_file(), reason="needs Linux's per-process fault counts"
)


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One layer whose fused gate/up output at 2,000 rows is 2,000 x 16,384 bf16 (65.5 MB)."""
    return make_model(
        tmp_path_factory.mktemp("wide") / "m",
        "tiny",
        num_hidden_layers=1,
        hidden_size=128,
        intermediate_size=8192,
        num_attention_heads=2,
        num_key_value_heads=2,
    )


def test_a_prefill_reuses_the_mlps_widest_outputs(wide: Path) -> None:
    """The MLP's gate/up output and its SiLU product at prefill sizes live in the model's
    Scratch, reused layer after layer and prefill after prefill: no new page is faulted in
    for them after the first prefill, where a 65.5 MB output of its own (glibc maps it afresh
    each time) took ~16,000 faults a prefill. The matmul path is forced to one that writes into
    the buffer (oneDNN's packed one, a trial's pick on some CPUs, cannot)."""
    code = f"""
import json, resource
from pdscope import LLM, SamplingParams
llm = LLM(model={str(wide)!r}, kv_cache_memory="64MiB", max_model_len=2048,
          max_num_batched_tokens=2048, enable_prefix_caching=False,
          kernels="prefill_linear=transposed")
one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
llm.generate([[7] * 2000], one)
faults = []
for first in (8, 9):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    llm.generate([[first] * 2000], one)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
buffers = llm.engine.runner.model.scratch.buffers
print(json.dumps({{"faults": faults, "gate_up": buffers["gate_up"].numel(),
                  "prefill_linear": llm.engine.kernels.prefill_linear,
                  "act": buffers["act"].numel()}}))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=glibc_as_it_starts()
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["prefill_linear"] == "transposed", got
    assert (got["gate_up"], got["act"]) == (2000 * 16384, 2000 * 8192), got
    assert max(got["faults"]) < 4000, got
