"""The MLP's widest prefill outputs, in the model's Scratch or in blocks under glibc's line:
against glibc's real malloc, in a fresh process (the fault counts are the process's own)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pdscope.checkpoint.make_model import make_model
from pdscope.engine.model import onednn_bf16
from tests.conftest import glibc_as_it_starts, prefill_faults

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/status").is_file(), reason="needs Linux's per-process fault counts"
)


# Prefills counted after the warm-up: a block's pages are taken afresh now and then (below), so
# the blocks' test reads six and bounds how many of them take pages and their sum.
TIMED = 6
# What a child reports of its prefills (prefill_faults) and of the MLP: the rows of each of
# layer 0's gate/up matmuls, and the Scratch buffers' sizes.
PREFILLS = (
    """
import json, resource, sys
from pdscope import LLM, SamplingParams
llm = LLM(model=sys.argv[1], kv_cache_memory="64MiB", max_model_len=2048,
          max_num_batched_tokens=2048, enable_prefix_caching=False, kernels=sys.argv[2])
blocks = []
gate_up = llm.engine.runner.model.layers[0].mlp.gate_up_proj
run = gate_up.forward
def counted(x, out=None):
    blocks.append(x.shape[0])
    return run(x, out)
gate_up.forward = counted
"""
    + prefill_faults(TIMED)
    + """
buffers = {k: v.numel() for k, v in llm.engine.runner.model.scratch.buffers.items()}
print(json.dumps({"faults": faults, "blocks": blocks, "buffers": buffers,
                  "prefill_linear": llm.engine.kernels.prefill_linear}))
"""
)


def prefills(model: Path, kernels: str) -> dict[str, Any]:
    """PREFILLS in a fresh process whose malloc is glibc's as it starts."""
    out = subprocess.run(
        [sys.executable, "-c", PREFILLS, str(model), kernels],
        capture_output=True,
        text=True,
        env=glibc_as_it_starts(),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


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
    got = prefills(wide, "prefill_linear=transposed")
    assert got["prefill_linear"] == "transposed", got
    assert got["buffers"] == {"gate_up": 2000 * 16384, "act": 2000 * 8192}, got
    assert got["blocks"] == [2000] * (1 + TIMED), got
    assert max(got["faults"]) < 4000, got


@pytest.mark.skipif(not onednn_bf16(), reason="oneDNN runs no bf16 linear on this CPU")
def test_onednns_own_gate_up_output_comes_in_blocks_under_glibcs_line(wide: Path) -> None:
    """oneDNN's packed path (``prefill_linear=onednn``) makes its own output, which no buffer
    reaches: at 2,000 rows one 65.5 MB mapping glibc faults in afresh at every layer (~16,000
    faults a prefill). The MLP runs its gate/up in row blocks each under glibc's mapping line
    (two of 1,000 rows here), whose outputs the heap serves again in most prefills."""
    # linear=packed: a trial's linear=plain would keep no packed weight for prefill to take
    got = prefills(wide, "linear=packed,prefill_linear=onednn")
    assert got["prefill_linear"] == "onednn", got
    assert got["blocks"] == [1000, 1000] * (1 + TIMED), got
    assert got["buffers"] == {"act": 2000 * 8192}, got
    # Unblocked, every prefill took 16,000 (65.5 MB). Blocked, the heap takes a block's pages
    # afresh now and then (8,000): on the AMX Xeon once after the warm-up in the runs read
    # (8,004); on an AMD EPYC (Zen 4) in 1-3 of 8 prefills in each of 8 processes, two
    # blocks in one prefill once (16,006), and 0-700 faults in the rest. The resident size
    # there grew alike over 40 prefills of 1,400-2,000 tokens, +84 MiB blocked and +80 with
    # the gate/up buffer (prefill_linear=transposed), one process each.
    # (Where Linux backs all memory with huge pages, a mapping takes few faults: the blocks
    # above still tell.)
    faults = got["faults"]  # the sum under half of unblocked's TIMED x 16,000
    assert sum(f < 4000 for f in faults) >= 2 and sum(faults) < TIMED * 8000, got


def test_fresh_output_says_which_paths_write_into_out(wide: Path) -> None:
    """:meth:`Linear.fresh_output` repeats :meth:`Linear.forward`'s tests: for every prefill
    path this machine runs, at a count under and over the transposed paths' 512 rows, the
    output is ``out`` exactly where it says so, and the MLP's result (in blocks or not) is the
    layer's own matmuls'."""
    import torch

    from pdscope import LLM
    from pdscope.engine.kernels import OPTIONS

    seen = set()
    for choice in OPTIONS["prefill_linear"]:
        try:
            llm = LLM(
                model=str(wide),
                kv_cache_memory="64MiB",
                max_model_len=2048,
                kernels=f"prefill_linear={choice}",
                dtype="bfloat16",
            )
        except ValueError:  # a path this machine does not run (rows, pairs: no C kernels)
            continue
        mlp = llm.engine.runner.model.layers[0].mlp
        for rows in (100, 2000):
            x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
            x = x.to(mlp.gate_up_proj.weight.dtype)
            out = torch.empty(rows, 16384, dtype=x.dtype)
            with torch.inference_mode():
                fresh = mlp.gate_up_proj.fresh_output(x)
                got = mlp.gate_up_proj(x, out=out)
                assert (got.data_ptr() != out.data_ptr()) == fresh, (choice, rows)
                seen.add(fresh)
                whole = mlp.down_proj(mlp.silu_mul(got, torch.empty(rows, 8192, dtype=x.dtype)))
                # (oneDNN may sum a block's rows in another order than the whole's)
                torch.testing.assert_close(mlp(x), whole)
    assert True in seen or not onednn_bf16(), seen  # the packed path was among them
    assert False in seen, seen
