"""Steps padded to a multiple of ROW_BUCKET rows (engine/model.py): the same tokens and logits
as unpadded steps, and no new oneDNN primitive for a new prompt length in a bucket met before."""

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pdscope.engine.model as model_module
from pdscope import LLM, SamplingParams
from pdscope.checkpoint.make_model import make_model
from pdscope.engine.model import PAD_MIN_ROWS, ROW_BUCKET, onednn_bf16, padded_rows, padded_to
from pdscope.engine.native import compiler
from tests.test_engine import _amx_or_skip, _count_calls, _pairs_or_skip

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def test_padded_rows_rounds_up_steps_from_the_minimum_only() -> None:
    assert PAD_MIN_ROWS == 33 and ROW_BUCKET == 16
    assert [padded_rows(n, 16) for n in (1, 32, 33, 48, 49, 1100)] == [1, 32, 48, 48, 64, 1104]
    assert [padded_rows(n, 1) for n in (33, 1100)] == [33, 1100]
    # big_batch_linear=pairs: padding from 65 rows
    assert [padded_rows(n, 16, 65) for n in (33, 40, 64, 65, 70)] == [33, 40, 64, 80, 80]


def test_padded_to_views_storage_with_room_and_copies_without() -> None:
    room = torch.full((8, 4), 7.0)[:5]  # garbage past the rows, as an empty tensor would hold
    room[:] = torch.arange(20.0).view(5, 4)
    padded = padded_to(room, 8)
    assert padded.data_ptr() == room.data_ptr() and padded.shape == (8, 4)
    assert torch.equal(padded[:5], torch.arange(20.0).view(5, 4))
    assert torch.equal(padded[5:], torch.zeros(3, 4))
    exact = torch.arange(20.0).view(5, 4)
    copied = padded_to(exact, 8)
    assert copied.data_ptr() != exact.data_ptr()
    assert torch.equal(copied, torch.cat((exact, torch.zeros(3, 4))))
    assert padded_to(exact, 5) is exact and padded_to(exact, 3) is exact
    # storage not made for exactly the padded shape (a slice of another buffer): copied, the
    # buffer left as it was
    buffer = torch.ones(10, 4)
    for part, rows in ((buffer[:5], 8), (buffer[2:5], 5)):
        assert padded_to(part, rows).data_ptr() != part.data_ptr()
    assert torch.equal(buffer, torch.ones(10, 4))


# bf16 paths whose steps of 33 rows or more run oneDNN matmuls (big_batch_linear=onednn,
# whatever a trial would pick here): PyTorch's attention and glue; the C glue with a prefill's
# matmuls split by rows; the C glue with the AMX prefill attention, whose output lies in
# storage with the padded rows' room (no copy before o_proj)
PATHS = [
    "linear=packed,batch_linear=packed,prefill_linear=transposed,prefill_attention=blocked,"
    "decode_math=float32,decode_ops=torch,big_batch_linear=onednn",
    "linear=c,batch_linear=packed,prefill_linear=rows,prefill_attention=sdpa,decode_math=native,"
    "decode_ops=c,big_batch_linear=onednn",
    "linear=amx,batch_linear=c,prefill_attention=amx,decode_math=native,decode_ops=c,"
    "big_batch_linear=onednn",
]


@pytest.mark.parametrize("budget", [2048, 72])
@pytest.mark.parametrize("kernels", PATHS)
def test_padded_steps_give_the_tokens_and_logits_of_exact_ones(
    tmp_path: Path, kernels: str, budget: int
) -> None:
    """Four prompts of 449 tokens together: one step of 449 rows (464 padded) with the whole
    budget, or steps of 72 rows (80 padded), mixed with decodes, in chunks of 72."""
    if "=c" in kernels and not compiler():
        pytest.skip("no C compiler: the C kernels cannot be built here")
    overrides = _amx_or_skip(kernels)
    # Without oneDNN's bf16 (an AVX2-only CPU) the matmuls widen to float32 and the rule runs
    # steps exact: padding is forced there, and its steps still have the exact ones' bits.
    by_rule = onednn_bf16()
    path = make_model(tmp_path / "m", "tiny", dtype="bfloat16", **overrides)
    llm = LLM(
        model=str(path),
        dtype="bfloat16",
        kv_cache_memory="16MiB",
        max_num_batched_tokens=budget,
        enable_prefix_caching=False,
        kernels=kernels + ("" if by_rule else ",step_rows=padded"),
    )
    model = llm.engine.runner.model
    # bf16 matmuls on oneDNN: padded, by the rule (elsewhere forced, above)
    assert llm.engine.kernels.step_rows == "padded"
    assert llm.engine.kernels.how["step_rows"] == ("fixed" if by_rule else "forced")
    assert model.row_bucket == ROW_BUCKET
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 1000) for _ in range(n)] for n in (101, 37, 250, 61)]
    qkv = model.layers[0].self_attn.qkv_proj
    seen: list[int] = []
    forward = qkv.forward
    qkv.forward = lambda x: (seen.append(x.shape[0]), forward(x))[1]  # type: ignore[method-assign]
    pads: list[bool] = []  # per padded attention output: a view of its own storage?

    def counted(t: torch.Tensor, rows: int) -> torch.Tensor:
        out = padded_to(t, rows)
        if rows > t.shape[0]:
            pads.append(out.data_ptr() == t.data_ptr())
        return out

    results = {}
    for bucket in (ROW_BUCKET, 1):
        model.row_bucket = bucket
        seen.clear()
        pads.clear()
        llm.engine.runner.capture_logits = True
        llm.engine.runner.captured = []
        model_module.padded_to = counted
        try:
            out = llm.generate(prompts, GREEDY)
        finally:
            model_module.padded_to = padded_to
        results[bucket] = (
            [o.token_ids for o in out],
            torch.cat(llm.engine.runner.captured),
            sorted(set(seen)),
            list(pads),
        )
    tokens, logits, rows, views = results[ROW_BUCKET]
    exact_tokens, exact_logits, exact_rows, exact_views = results[1]
    assert tokens == exact_tokens
    # each row's matmul results do not depend on the rows beside it; measured equal bit for bit
    # on the AMX Xeon, held here to a bf16 step
    torch.testing.assert_close(logits, exact_logits, atol=1.5e-2, rtol=1e-2)
    big = [n for n in exact_rows if n >= PAD_MIN_ROWS]
    assert big and any(n % ROW_BUCKET for n in big)  # the exact run had rows to pad
    assert [n for n in rows if n >= PAD_MIN_ROWS] == sorted({padded_rows(n, 16) for n in big})
    assert [n for n in rows if n < PAD_MIN_ROWS] == [n for n in exact_rows if n < PAD_MIN_ROWS]
    assert views and not exact_views
    if "prefill_attention=amx" in kernels:
        assert all(views)  # one chunk's kernel output, or several parts joined, with room
    if "decode_ops=torch" in kernels:
        assert not any(views)  # torch's attention output: copied


def test_models_whose_matmuls_are_not_onednn_bf16_are_not_padded(tmp_path: Path) -> None:
    """float32 matmuls are MKL's (no primitive per row count); bf16 widened to float32 too;
    and step_rows=exact, forced, turns the padding off (the A/B of bench/row_bucket_ab.py's
    kind, for a server)."""
    f32 = make_model(tmp_path / "f32", "tiny", dtype="float32")
    llm = LLM(model=str(f32), kv_cache_memory="8MiB")
    assert llm.engine.kernels.step_rows == "exact" and llm.engine.runner.model.row_bucket == 1
    bf16 = make_model(tmp_path / "bf16", "tiny", dtype="bfloat16")
    for kernels in ("matmul_math=float32", "step_rows=exact"):
        llm = LLM(
            model=str(bf16),
            dtype="bfloat16",
            kv_cache_memory="8MiB",
            kernels=f"linear=plain,batch_linear=packed,decode_ops=torch,{kernels}",
        )
        assert llm.engine.kernels.step_rows == "exact" and llm.engine.runner.model.row_bucket == 1
    assert "step_rows=exact (forced)" in llm.engine.kernels.summary()


def test_steps_the_pairs_copies_take_are_not_padded(tmp_path: Path) -> None:
    """Under big_batch_linear=pairs a prefill step of 40 rows runs its matmuls at 40 rows
    through the copies (which build nothing per row count: padding would only add work), and
    one of 70, past the copies' 64, at 80 rows on oneDNN."""
    # prefill_linear forced: its trial may pick the copies past 64 rows too on a tiny model
    kernels = (
        "linear=packed,batch_linear=packed,big_batch_linear=pairs,prefill_linear=onednn,"
        "decode_ops=c"
    )
    if not compiler():
        pytest.skip("no C compiler: the C kernels cannot be built here")
    _pairs_or_skip(kernels)
    path = make_model(tmp_path / "m", "tiny", dtype="bfloat16")
    llm = LLM(
        model=str(path),
        dtype="bfloat16",
        kv_cache_memory="8MiB",
        enable_prefix_caching=False,
        kernels=kernels + ("" if onednn_bf16() else ",step_rows=padded"),
    )
    model = llm.engine.runner.model
    assert (model.row_bucket, model.pad_min_rows) == (ROW_BUCKET, 65)
    qkv = model.layers[0].self_attn.qkv_proj
    seen: list[int] = []
    forward = qkv.forward
    qkv.forward = lambda x: (seen.append(x.shape[0]), forward(x))[1]  # type: ignore[method-assign]
    copied = _count_calls([qkv], "big_batch", "linear_pairs")
    rng = random.Random(0)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)  # prefill steps only
    for n in (40, 70):
        llm.generate([[rng.randrange(10, 1000) for _ in range(n)]], one)
    # one call through the copies: the 40-row step's (80 rows are past what they take)
    assert seen == [40, 80] and copied == [1]


_PRIMITIVES = """
import random, sys
from pdscope import LLM, SamplingParams
# prefill_linear forced: a trial that picks the pairs copies past 64 rows runs no oneDNN matmul
llm = LLM(model=sys.argv[1], dtype="bfloat16", kv_cache_memory="64MiB",
          enable_prefix_caching=False, max_model_len=2048, kernels="prefill_linear=onednn")
model = llm.engine.runner.model
print("ROW_BUCKET", model.row_bucket, flush=True)
model.row_bucket = int(sys.argv[2])
rng = random.Random(0)
params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
for n in (705, 711):  # one bucket of 16 (705..720)
    print("PROMPT", n, flush=True)
    llm.generate([[rng.randrange(10, 1000) for _ in range(n)]], params)
print("PROMPT end", flush=True)
"""


def _primitives_built(model: Path, bucket: int) -> dict[str, int]:
    """oneDNN matmul and inner-product primitives built (primitive cache misses, from oneDNN's
    own verbose log) while each prompt ran, in a process of its own."""
    env = dict(os.environ, ONEDNN_VERBOSE="all")
    run = subprocess.run(
        [sys.executable, "-c", _PRIMITIVES, str(model), str(bucket)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    built: dict[str, int] = {}
    current = None
    for line in run.stdout.splitlines():
        if line.startswith("ROW_BUCKET") and int(line.split()[1]) == 1:
            pytest.skip("this machine's matmuls are not oneDNN bf16: steps are not padded")
        if line.startswith("PROMPT"):
            current = line.split()[1]
            built[current] = 0
        elif current and "create:cache_miss" in line:
            # the linears' 2-D matmuls (MxK:KxN) and inner products, not an attention's bmm
            linear = re.search(r",\d+x\d+:\d+x\d+,", line) or ",inner_product," in line
            built[current] += bool(linear and (",matmul," in line or ",inner_product," in line))
    return built


def test_a_new_length_in_a_bucket_met_before_builds_no_onednn_primitive(tiny_model: Path) -> None:
    padded = _primitives_built(tiny_model, ROW_BUCKET)
    exact = _primitives_built(tiny_model, 1)
    # unpadded, each new row count builds its matmuls anew: the premise, seen here
    assert exact["705"] > 0 and exact["711"] > 0
    assert padded["705"] > 0 and padded["711"] == 0
