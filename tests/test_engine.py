"""The engine against Hugging Face transformers, and against itself under every scheduling mode.

Tiny random checkpoints in float32 so that batching changes nothing but rounding far below the
gaps between the top logits.
"""

import copy
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from prometheus_client import generate_latest

from pdscope import LLM, SamplingParams
from pdscope.checkpoint.make_model import make_model
from pdscope.engine import native
from pdscope.engine.kernels import (
    packed_unread,
    pairs_preferred,
    parse_kernels,
    stored_past_one,
)
from pdscope.engine.model import Linear
from tests.conftest import OTHER_BUILDS, build_for, seed_native

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# Every path the kernel trial may choose on a CPU (engine/kernels.py), each candidate in at
# least one row. In float32 the linear (plain or the C kernel for single rows), the prefill
# attention and the decode ops have two candidates each (the prefill one runs in prefill steps,
# the decode ops in decode-only steps, the C linear wherever a matmul has one row: batch-1
# decode steps and a prefill's sampled row); the bf16 tests below cover packed linears and the
# decode math too. threads=bound changes where the threads run, not what they compute; it is
# in one row of each so that pinning is exercised under every scheduling mode. batch_linear=c
# and pairs (bf16 matmuls of 2-32 rows through the many-row C kernel or the pairs copies) run
# their prefill in chunks of 24 tokens, so that the logits pass through them (counted below);
# big_batch_linear=pairs (33-64 rows through the copies) in chunks of 40.
FLOAT32_PATHS = [
    "linear=plain,prefill_attention=blocked,decode_ops=torch",
    "linear=c,prefill_attention=sdpa,decode_ops=c,threads=bound",
]
BF16_PATHS = [
    "linear=packed,batch_linear=packed,prefill_linear=transposed,prefill_attention=blocked,"
    "decode_math=float32,decode_ops=torch",
    "linear=plain,batch_linear=c,prefill_attention=sdpa,decode_math=native,decode_ops=c",
    "linear=c,batch_linear=c,prefill_attention=sdpa,decode_math=float32,decode_ops=c,threads=bound",
    # AMX tiles: the prefill attention (a head size that is a multiple of 32: the model below
    # gets 64) and single-row matmuls (linear=amx); the decode attention's prefetch at every
    # tile (decode_prefetch=every, as the pairs2 row below)
    "linear=amx,batch_linear=c,prefill_attention=amx,decode_math=native,decode_ops=c,"
    "decode_prefetch=every",
    # single rows through the pair-interleaved weight copies (linear=pairs), the prefill
    # attention in AVX-512 BF16 (head size 64, as the AMX row: decode attention then takes
    # the bf16 head-64 kernel too)
    "linear=pairs,batch_linear=c,prefill_attention=c,decode_math=native,decode_ops=c",
    # batched rows (the 24-row chunks below) through the pairs copies, single rows packed
    "linear=packed,batch_linear=pairs,prefill_attention=c,decode_math=float32,decode_ops=c",
    # single rows through the copies as two streams a thread, batched rows too
    "linear=pairs2,batch_linear=pairs,prefill_attention=c,decode_math=native,decode_ops=c,"
    "decode_prefetch=every",
    # rows of 33-64 (the 40-row chunks below, unpadded there) through the copies, 2-32 (the
    # last chunk's 20) through the many-row kernel
    "linear=pairs2,batch_linear=c,big_batch_linear=pairs,prefill_attention=sdpa,"
    "decode_math=native,decode_ops=c",
    # every matmul of 12 rows or more widened to float32 (what an AVX2-only CPU runs), single
    # rows through the C kernel
    "linear=c,batch_linear=packed,matmul_math=float32,prefill_attention=sdpa,"
    "decode_math=float32,decode_ops=c",
    # a prefill's matmuls split by rows over the threads (the 1,100-token chunk below)
    "linear=c,batch_linear=packed,prefill_linear=rows,prefill_attention=sdpa,"
    "decode_math=native,decode_ops=c",
    # every matmul past 64 rows (the 1,100-token chunk) through the copies too, so that no
    # weight keeps a packed copy
    "linear=pairs2,batch_linear=pairs,big_batch_linear=pairs,prefill_linear=pairs,"
    "prefill_attention=c,decode_math=native,decode_ops=c",
    # every matmul on the weight as stored, no copy kept (the memory rule's pick where the
    # tiles are granted): single rows on the tiles, the 1,100-token chunk through F.linear
    "linear=amx,batch_linear=c,big_batch_linear=c,prefill_linear=plain,prefill_attention=amx,"
    "decode_math=native,decode_ops=c",
]


def _amx_or_skip(kernels: str) -> dict[str, int]:
    """For the prefill_attention=amx and =c rows: skip where the tiles are not granted (amx) or
    the C kernels lack AVX-512 BF16 (c); the checkpoint overrides that give the kernel a head
    size it takes (tiny's is 16). Head size 64 also sends the decode steps through the bf16
    head-64 decode attention, its scores on the tiles where they are granted."""
    tiles = "prefill_attention=amx" in kernels
    if not tiles and "prefill_attention=c" not in kernels:
        return {}
    from pdscope.checkpoint.make_model import default_cache_dir
    from pdscope.engine import native

    ops = native.load(default_cache_dir() / "native")
    if tiles and (ops is None or not ops.prefill_amx):
        pytest.skip("no AMX tiles on this CPU, compiler or kernel")
    if not tiles and (ops is None or not ops.prefill_vec):
        pytest.skip("the C kernels built without AVX-512 BF16 here")
    return {"head_dim": 64}


def _pairs_or_skip(kernels: str) -> None:
    """For the linear=pairs, batch_linear=pairs and big_batch_linear=pairs rows (all hold the
    text "linear=pairs"):
    skip where the C kernels lack the pairs kernels (AVX-512 BF16 or AVX2, one row or
    several)."""
    if "linear=pairs" not in kernels:
        return
    from pdscope.checkpoint.make_model import default_cache_dir
    from pdscope.engine import native

    ops = native.load(default_cache_dir() / "native")
    if ops is None or not ops.pairs:
        pytest.skip("no AVX-512 BF16 or AVX2 in this build of the C kernels")
    if "batch_linear=pairs" in kernels and not ops.pairs_rows:  # big_batch_linear's too
        pytest.skip("no kernel for several rows in this build of the C kernels")


def _use_build(
    build: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> native.NativeOps | None:
    """Make the engines this test loads run ``build``'s C kernels (conftest's OTHER_BUILDS),
    with trial outcomes of their own; None for the engine's own build."""
    if build == "engine":
        return None
    ops = build_for(build, request.getfixturevalue("tmp_path_factory"))
    monkeypatch.setattr(native, "load", lambda cache_dir: ops)
    monkeypatch.setenv("PDSCOPE_CACHE", str(tmp_path / "cache"))
    return ops


@pytest.fixture(autouse=True)
def _needs_a_compiler_for_c(request: pytest.FixtureRequest) -> None:
    """The C kernels build with any C compiler; a machine without one runs the rest."""
    from pdscope.engine.model import thread_cpus
    from pdscope.engine.native import compiler

    callspec = getattr(request.node, "callspec", None)
    kernels = str(callspec.params.get("kernels", "")) if callspec else ""
    if "=c" in kernels and not compiler():
        pytest.skip("no C compiler: the C kernels cannot be built here")
    if "threads=bound" in kernels and not thread_cpus():
        pytest.skip("one thread or one CPU: nothing to pin")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    paths = {arch: make_model(root / arch, "tiny", arch=arch, dtype="float32") for arch in ARCHS}
    paths["llama-tied-rope3"] = make_model(
        root / "llama3",
        "tiny",
        arch="llama",
        dtype="float32",
        tie_word_embeddings=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    return paths


def prompts(llm: LLM) -> list[list[int]]:
    texts = [
        "The quick brown fox jumps over the lazy dog. " * 3,
        "Hello",
        "def main():\n    return",
        "Prefill reads the prompt; decode writes one token per step. " * 6,
    ]
    return [llm.tokenizer.encode(t) for t in texts]


# the C path in the builds of CPUs without AVX-512 too (conftest's OTHER_BUILDS)
C_FLOAT32 = [(k, "engine") for k in FLOAT32_PATHS] + [(FLOAT32_PATHS[1], b) for b in OTHER_BUILDS]


@pytest.mark.parametrize(("kernels", "build"), C_FLOAT32)
@pytest.mark.parametrize("arch", [*ARCHS, "llama-tied-rope3"])
def test_logits_match_transformers(
    checkpoints: dict[str, Path],
    arch: str,
    kernels: str,
    build: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    transformers = pytest.importorskip("transformers")
    other = _use_build(build, request, monkeypatch, tmp_path)
    path = checkpoints[arch]
    llm = LLM(
        model=str(path),
        kv_cache_memory="8MiB",
        block_size=4,
        max_num_batched_tokens=32,
        kernels=kernels,
    )
    assert other is None or llm.engine.runner.model.native is other
    llm.engine.runner.capture_logits = True
    prompt = prompts(llm)[0]
    out = llm.generate(prompt, GREEDY)[0]
    ours = torch.cat(llm.engine.runner.captured)  # one row per generated token
    assert ours.shape[0] == len(out.token_ids) == 12

    ref_model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    ids = torch.tensor([prompt + out.token_ids[:-1]])
    with torch.no_grad():
        ref = ref_model(ids).logits[0, len(prompt) - 1 :]
    # Tolerance: float32 with different op order (fused projections, paged gathers).
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-3)
    assert ref.argmax(-1).tolist() == out.token_ids


def _count_calls(modules: list, attr: str, method: str) -> list[int]:
    """Point every module's ``attr`` (the loaded C kernels) at a copy whose ``method`` counts
    its calls; returns the one-element counter."""
    calls = [0]
    ops = getattr(modules[0], attr)
    run = getattr(ops, method)

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls[0] += 1
        return run(*args, **kwargs)

    for m in modules:
        setattr(m, attr, copy.copy(ops))
        setattr(getattr(m, attr), method, counted)
    return calls


# The C rows in the builds of CPUs without AVX-512 too: many rows through the C kernel with
# bf16 decode math or float32, and rows through the AVX2 pairs (x86-64-v3 alone): single
# rows beside the C kernel, and single and many rows through the copies.
C_BF16 = [(k, "engine") for k in BF16_PATHS] + [
    *((k, b) for k in BF16_PATHS[1:3] for b in OTHER_BUILDS),
    (
        "linear=pairs2,batch_linear=c,prefill_attention=sdpa,decode_math=native,decode_ops=c",
        "x86-64-v3",
    ),
    (
        "linear=pairs2,batch_linear=pairs,prefill_attention=sdpa,decode_math=native,decode_ops=c",
        "x86-64-v3",
    ),
    (  # eight streams a thread, the AVX2 Zen 2's pick
        "linear=pairs,batch_linear=pairs,prefill_attention=sdpa,decode_math=float32,decode_ops=c",
        "x86-64-v3",
    ),
]


@pytest.mark.parametrize(("kernels", "build"), C_BF16)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bfloat16_logits_match_transformers(
    tmp_path: Path,
    arch: str,
    kernels: str,
    build: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bf16 CPU paths: oneDNN-packed or plain linears, both RMSNorm forms (a 1,100-token
    prefill is over the small-input limit, a decode step under it), blocked or SDPA prefill
    attention over many blocks, and single-sequence SDPA decode."""
    import random

    from pdscope.engine.model import can_pack

    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    overrides = _amx_or_skip(kernels)
    other = _use_build(build, request, monkeypatch, tmp_path)
    if other is not None:  # head size 64: the decode steps take the build's own attention
        overrides = {"head_dim": 64}
    _pairs_or_skip(kernels)
    path = make_model(tmp_path / arch, "tiny", arch=arch, dtype="bfloat16", **overrides)
    # Generated norm weights are all ones; random ones make a dropped or misplaced weight show.
    weights_file = path / "model.safetensors"
    tensors = load_file(weights_file)
    gen = torch.Generator().manual_seed(0)
    for name, t in tensors.items():
        if "norm" in name:
            tensors[name] = (1 + 0.5 * torch.randn(t.shape, generator=gen)).to(t.dtype)
    save_file(tensors, weights_file, metadata={"format": "pt"})
    import pdscope.engine.model as model_module

    paths = parse_kernels(kernels)
    many = paths["batch_linear"] in ("c", "pairs")
    big_forced = paths.get("big_batch_linear") == "pairs"
    # prefill_linear=pairs or plain forced: one chunk past 64 rows, not a C batch path's short
    # ones
    past_64_forced = paths.get("prefill_linear") in ("pairs", "plain")
    c_linear = paths["linear"] in ("c", "amx", "pairs", "pairs2")
    llm = LLM(
        model=str(path),
        dtype="bfloat16",
        kv_cache_memory="8MiB",
        block_size=4,
        kernels=kernels,
        max_num_batched_tokens=(
            2048 if past_64_forced else 40 if big_forced else 24 if many else 2048
        ),
    )
    model = llm.engine.runner.model
    # a row that leaves prefill_linear to the trial (a 2,048-token budget): what it chose
    past_64 = llm.engine.kernels.prefill_linear == "pairs"
    # rows that leave big_batch_linear to the trial: what it chose here (no step has 33-64
    # rows in them, but its copies are made)
    big = llm.engine.kernels.big_batch_linear == "pairs"
    big_on_c = llm.engine.kernels.big_batch_linear in ("pairs", "c")
    assert big or not big_forced
    assert other is None or model.native is other
    if can_pack(torch.bfloat16, torch.device("cpu")):
        # linear=c packs for matmuls over one row; with every matmul past one row on the
        # copies none is kept
        picks = asdict(llm.engine.kernels)
        unread = packed_unread(picks) or stored_past_one(picks)
        packed = "linear=plain" not in kernels and not unread
        assert all(
            (m.packed is not None) == packed for m in model.modules() if hasattr(m, "packed")
        )
    linears = [m for m in model.modules() if hasattr(m, "packed")]
    assert all((m.native is not None) == c_linear for m in linears)
    assert all(m.one_row_amx == (paths["linear"] == "amx") for m in linears)
    pair_rows = paths["linear"] in ("pairs", "pairs2")
    many_pairs = paths["batch_linear"] == "pairs"
    # every weight here has a shape the copy takes
    copies = pair_rows or many_pairs or big or past_64
    assert all((m.pairs is not None) == copies for m in linears)
    assert all((m.many_rows is not None) == past_64 for m in linears)
    assert all((m.big_batch is not None) == big_on_c for m in linears)
    assert all(m.big_batch_pairs == big for m in linears)
    assert all(m.pair_streams == (2 if paths["linear"] == "pairs2" else 8) for m in linears)
    assert all(m.many_pairs == many_pairs for m in linears)
    # matmul_math=float32 with batch_linear=packed: rows below WIDEN_MIN_ROWS still take C
    # (the C kernels load for every row here: each has a path on them)
    cpu_rule = model_module.widen_bf16(torch.bfloat16, torch.device("cpu"))
    widen = paths.get("matmul_math", "float32" if cpu_rule else "native") == "float32"
    assert all((m.native_many is not None) == (many or widen) for m in linears)
    below = model_module.WIDEN_MIN_ROWS - 1
    assert all(m.many_max_rows == (32 if many or not widen else below) for m in linears)
    rows = 2048 if c_linear else 1  # packed for many rows where C takes one
    assert all(m.packed_rows == rows for m in linears if m.packed is not None)
    # amx or c: every layer's prefill takes the C kernel
    amx = paths.get("prefill_attention") in ("amx", "c")
    attns = [m for m in model.modules() if hasattr(m, "prefill_native")]
    assert attns and all((m.prefill_native is not None) == amx for m in attns)
    assert all(m.prefill_tiles == (paths["prefill_attention"] == "amx") for m in attns if amx)
    # The many-row kernel's calls: from batched chunks (batch_linear=c) and from single rows
    # (linear=amx, which hands them to the same kernel through the modules' `native`).
    many_kernel = "linear_pairs" if many_pairs else "linear_many"
    many_calls = _count_calls(linears, "native_many", many_kernel) if many else [0]
    big_calls = _count_calls(linears, "big_batch", "linear_pairs") if big else [0]
    past_64_calls = _count_calls(linears, "many_rows", "linear_pairs") if past_64 else [0]
    amx_rows = paths["linear"] == "amx"
    one_row_calls = _count_calls(linears, "native", "linear_many") if amx_rows else [0]
    # linear=pairs: the prefill's last row through the LM head (decode steps run in one call)
    pair_calls = _count_calls(linears, "native", "linear_pairs") if pair_rows else [0]
    # prefill_attention=amx or c reads each chunk's K/V through its block table (no gather)
    paged_calls = _count_calls(attns, "prefill_native", "prefill_attention_paged") if amx else [0]
    # where a row leaves prefill_linear to the trial, what it chose on this host
    prefill_linear = llm.engine.kernels.prefill_linear
    assert prefill_linear == paths.get("prefill_linear", prefill_linear)
    by_rows = prefill_linear == "rows"
    copied = prefill_linear in ("rows", "transposed")
    in_layers = [m for m in linears if m is not model.lm_head]
    assert all((m.team is not None) == by_rows for m in in_layers)
    assert all((m.weight_t is not None) == copied for m in in_layers)
    assert model.lm_head.team is None and model.lm_head.weight_t is None
    # prefill_linear=plain: past 64 rows F.linear on the weight as stored, whatever copies exist
    assert all(m.plain_rows == (prefill_linear == "plain") for m in linears)

    plain_calls = [0]
    transposed = model_module.linear_transposed

    def counted(*args: object) -> torch.Tensor:
        plain_calls[0] += 1
        return transposed(*args)  # type: ignore[arg-type]

    model_module.linear_transposed = counted  # restored below
    assert all(m.widen == widen for m in linears)
    widened_calls = [0]
    widened = model_module.linear_widened

    def counted_widened(*args: object) -> torch.Tensor:
        widened_calls[0] += 1
        return widened(*args)  # type: ignore[arg-type]

    model_module.linear_widened = counted_widened
    team_calls = _count_calls(in_layers, "team", "run_on_team") if by_rows else [0]
    llm.engine.runner.capture_logits = True
    rng = random.Random(0)
    prompt = [rng.randrange(10, 1000) for _ in range(1100)]
    try:
        out = llm.generate(prompt, GREEDY)[0]
    finally:
        model_module.linear_transposed = transposed
        model_module.linear_widened = widened
    # the prefill's matmuls where no other path takes them: not the 24-row chunks of a C
    # batch path, nor the one 1,100-row chunk under the copies of prefill_linear
    assert (widened_calls[0] > 0) == (widen and not many and not copied and not past_64)
    # every matmul of the layers in the 1,100-row prefill, none in the decode steps
    assert team_calls[0] == (4 * len(model.layers) if by_rows else 0)
    unsplit = prefill_linear == "transposed"
    assert plain_calls[0] == (4 * len(model.layers) if unsplit else 0)
    # the chunks' matmuls went through the many-row kernel (or the copies)
    assert (many_calls[0] > 0) == (many and not past_64 and not past_64_forced)
    assert past_64_calls[0] == (4 * len(model.layers) if past_64 else 0)
    assert (big_calls[0] > 0) == (big_forced and not past_64)  # the 40-row chunks
    assert (one_row_calls[0] > 0) == amx_rows  # decode rows on the tiles
    assert (pair_calls[0] > 0) == pair_rows
    assert (paged_calls[0] > 0) == amx
    ours = torch.cat(llm.engine.runner.captured)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation="eager"
    )
    with torch.no_grad():
        ref = ref_model(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1 :]
    # Measured: at most one bf16 step (0.004 at logits of ~0.7) apart.
    torch.testing.assert_close(ours, ref.float(), atol=1.5e-2, rtol=1e-2)


# llama's hidden size must divide by its heads (tiny's is 64): 4 query heads a KV head there,
# 3 in qwen3
@pytest.mark.parametrize(("arch", "heads"), [("llama", 8), ("qwen3", 6)])
def test_head_size_128_decode_logits_match_transformers(
    tmp_path: Path, arch: str, heads: int
) -> None:
    """Head size 128 (Llama 3's 3B and 8B, Qwen2.5's 7B): decode steps on the C kernels, whose
    bf16 attention at that size has its own kernel in AVX-512 BF16 (the AVX2 build's is its
    own), over a 1,100-token context in blocks of 4; every logit against transformers'."""
    import random

    from pdscope.engine.native import compiler

    transformers = pytest.importorskip("transformers")
    if not compiler():
        pytest.skip("no C compiler: the C kernels cannot be built here")
    path = make_model(
        tmp_path / arch,
        "tiny",
        arch=arch,
        dtype="bfloat16",
        head_dim=128,
        num_attention_heads=heads,
        num_key_value_heads=2,
    )
    llm = LLM(
        model=str(path),
        dtype="bfloat16",
        kv_cache_memory="16MiB",
        block_size=4,
        kernels="decode_math=native,decode_ops=c",
    )
    llm.engine.runner.capture_logits = True
    rng = random.Random(1)
    prompt = [rng.randrange(10, 1000) for _ in range(1100)]
    out = llm.generate(prompt, GREEDY)[0]
    ours = torch.cat(llm.engine.runner.captured)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation="eager"
    )
    with torch.no_grad():
        ref = ref_model(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1 :]
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref.float(), atol=1.5e-2, rtol=1e-2)


@pytest.mark.parametrize(
    "engine_args",
    [
        {"max_num_batched_tokens": 24, "block_size": 4},  # chunks after a cached prefix
        {"max_num_batched_tokens": 2048, "enable_prefix_caching": True, "block_size": 8},
    ],
)
@pytest.mark.parametrize(
    "kernels",
    [
        "linear=amx,batch_linear=c,prefill_attention=amx,decode_math=native,decode_ops=c",
        "linear=pairs,batch_linear=c,prefill_attention=c,decode_math=native,decode_ops=c",
    ],
    ids=["amx", "c"],
)
def test_c_prefill_reads_the_cache_in_place_as_the_gather_does(
    tmp_path: Path, engine_args: dict[str, int], kernels: str
) -> None:
    """prefill_attention=amx or c reads each chunk's keys and values through its block table;
    with the gather copy instead (the path before) every logit and token is the same, bit for
    bit, across chunking and prefix caching (bf16: the kernel takes bf16 only)."""
    _pairs_or_skip(kernels)
    path = make_model(
        tmp_path / "m", "tiny", arch="qwen3", dtype="bfloat16", **_amx_or_skip(kernels)
    )
    runs, first = [], None
    for paged in (True, False):
        llm = LLM(
            model=str(path),
            dtype="bfloat16",
            kv_cache_memory="8MiB",
            # the second engine on the first's every path: a trial may measure again between
            # the two starts and pick another prefill matmul, whose bits differ
            kernels=kernels if first is None else _every_path(first),
            **engine_args,
        )
        first = first or llm
        attns = [m for m in llm.engine.runner.model.modules() if hasattr(m, "prefill_paged")]
        for m in attns:
            m.prefill_paged = paged
        calls = _count_calls(attns, "prefill_native", "prefill_attention_paged")
        llm.engine.runner.capture_logits = True
        ps = prompts(llm)
        shared = ps[3] + ps[0]  # a second prompt on the first's blocks: a cached prefix
        outs = llm.generate([ps[3], ps[1], shared], GREEDY)
        outs += llm.generate([shared], GREEDY)
        assert (calls[0] > 0) == paged
        runs.append(([o.token_ids for o in outs], torch.cat(llm.engine.runner.captured)))
        llm.engine.pool.check_invariants()
    assert runs[0][0] == runs[1][0]
    assert torch.equal(runs[0][1], runs[1][1])


def baseline(path: Path, ps: list[list[int]]) -> list[list[int]]:
    """Each prompt alone, whole-prompt prefill, no prefix cache."""
    results = []
    for p in ps:
        llm = LLM(
            model=str(path),
            kv_cache_memory="8MiB",
            enable_prefix_caching=False,
            max_num_batched_tokens=2048,
            kernels="decode_ops=torch",  # the PyTorch path is the reference
        )
        results.append(llm.generate(p, GREEDY)[0].token_ids)
    return results


@pytest.fixture(scope="module")
def reference(checkpoints: dict[str, Path]) -> tuple[list[list[int]], list[list[int]]]:
    llm = LLM(model=str(checkpoints["qwen3"]), kv_cache_memory="8MiB")
    ps = prompts(llm)
    return ps, baseline(checkpoints["qwen3"], ps)


@pytest.mark.parametrize(
    "engine_args",
    [
        {"enable_prefix_caching": True},
        {"max_num_batched_tokens": 7},
        {"max_num_batched_tokens": 16, "block_size": 4},
        {"max_num_batched_tokens": 64, "enable_prefix_caching": True, "block_size": 8},
        {"max_num_seqs": 2},
    ],
)
@pytest.mark.parametrize("kernels", FLOAT32_PATHS)
def test_batched_outputs_match_single_runs(checkpoints, reference, engine_args, kernels) -> None:
    ps, expected = reference
    llm = LLM(
        model=str(checkpoints["qwen3"]), kv_cache_memory="8MiB", kernels=kernels, **engine_args
    )
    # Twice through, so the second round hits the prefix cache when it is on.
    for _ in range(2):
        outs = llm.generate(ps, GREEDY)
        assert [o.token_ids for o in outs] == expected
    llm.engine.pool.check_invariants()


def kv_budget_bytes(path: Path, blocks: int, block_size: int) -> int:
    """Bytes of a float32 KV pool holding ``blocks`` blocks for this checkpoint."""
    import json

    c = json.loads((path / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    per_token = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 4
    return blocks * block_size * per_token


@pytest.mark.parametrize("kernels", FLOAT32_PATHS)
@pytest.mark.parametrize("caching", [False, True])
def test_forced_preemption_recomputes_identically(checkpoints, reference, caching, kernels) -> None:
    ps, expected = reference
    # A pool far smaller than the eight requests' total forces preemption and recomputation.
    llm = LLM(
        model=str(checkpoints["qwen3"]),
        kernels=kernels,
        block_size=4,
        max_model_len=256,
        enable_prefix_caching=caching,
        kv_cache_memory=kv_budget_bytes(checkpoints["qwen3"], 70, 4),
    )
    outs = llm.generate(ps + ps, GREEDY)
    assert llm.engine.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected + expected
    assert sum(o.timeline.preemptions for o in outs) == llm.engine.num_preemptions
    pool = llm.engine.pool
    pool.check_invariants()
    assert pool.num_used_blocks == 0
    # Re-admissions after preemption are not counted as prefix-cache demand.
    assert pool.prefix_cache_hits <= pool.prefix_cache_queries <= sum(len(p) for p in ps + ps)


@pytest.mark.parametrize("kernels", FLOAT32_PATHS)
@pytest.mark.parametrize("window", [8, 20])
def test_mistral_sliding_window_matches_transformers(
    tmp_path: Path, window: int, kernels: str
) -> None:
    transformers = pytest.importorskip("transformers")
    path = make_model(
        tmp_path / "m", "tiny", arch="mistral", dtype="float32", sliding_window=window
    )
    llm = LLM(
        model=str(path),
        kv_cache_memory="8MiB",
        block_size=4,
        max_num_batched_tokens=16,
        kernels=kernels,
    )
    llm.engine.runner.capture_logits = True
    prompt = prompts(llm)[0][:40]
    out = llm.generate(prompt, GREEDY)[0]
    ours = torch.cat(llm.engine.runner.captured)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        ref = ref_model(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1 :]
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-3)


def test_a_one_token_last_chunk_is_prefill_everywhere(checkpoints) -> None:
    """17 prompt tokens, budget 16: step 2 computes the last prompt token alone. The scheduler
    calls it prefill, the runner runs it as prefill and the timeline counts it as prefill, and
    the tokens match an unchunked run."""
    path = checkpoints["qwen3"]
    whole = LLM(model=str(path), kv_cache_memory="8MiB")
    prompt = (whole.tokenizer.encode("Prefill reads the prompt; decode writes one. " * 4))[:17]
    assert len(prompt) == 17
    expected = whole.generate(prompt, GREEDY)[0].token_ids

    llm = LLM(model=str(path), kv_cache_memory="8MiB", max_num_batched_tokens=16)
    out = llm.generate(prompt, GREEDY)[0]
    assert out.token_ids == expected
    steps = list(llm.engine.steps)
    assert [(s.prefill_tokens, s.decode_tokens) for s in steps[:3]] == [(16, 0), (1, 0), (0, 1)]
    assert out.timeline.prefill_chunks[1][1] == 1
    assert sum(n for _, n in out.timeline.prefill_chunks) == 17


@pytest.mark.parametrize("kernels", [FLOAT32_PATHS[1]])  # the C decode path
def test_c_path_hands_long_contexts_to_sdpa_in_place(
    checkpoints, reference, monkeypatch: pytest.MonkeyPatch, kernels: str
) -> None:
    """With the long-context threshold at one key, every single-sequence decode of the C path
    attends through torch's SDPA over its cache in place: same tokens as the reference."""
    from pdscope.engine import runner

    monkeypatch.setattr(runner, "NATIVE_SDPA_FROM_KEYS", 1)
    ps, expected = reference
    llm = LLM(model=str(checkpoints["qwen3"]), kv_cache_memory="8MiB", kernels=kernels)
    seen: list[bool] = []
    build = runner.ModelRunner._native_decode_batch

    def spy(self, *args):
        batch, ids = build(self, *args)
        seen.append(batch.decode_runs is not None)
        return batch, ids

    monkeypatch.setattr(runner.ModelRunner, "_native_decode_batch", spy)
    assert [llm.generate(p, GREEDY)[0].token_ids for p in ps] == expected
    assert seen and all(seen)


@pytest.mark.parametrize("window", [None, 8])
def test_c_path_decodes_beside_prefill_chunks_read_their_block_tables(
    checkpoints, reference, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, window: int | None
) -> None:
    """In a step that mixes prefill chunks with decodes, the C path's decodes read the cache
    through their block tables, as in a decodes-only step: never a gather copy of their padded
    contexts (15 decodes of up to 2,000 tokens gathered 61 MB a layer of a 1.1B model, in
    memory glibc mapped afresh every layer). The tokens are the reference's, a sliding
    window's (Mistral, 8 tokens) included."""
    from pdscope.engine.model import Attention

    ps, expected = reference
    path = checkpoints["qwen3"]
    if window is not None:
        path = make_model(
            tmp_path / "m", "tiny", arch="mistral", dtype="float32", sliding_window=window
        )
        expected = baseline(path, ps)
    llm = LLM(
        model=str(path),
        kv_cache_memory="8MiB",
        kernels="linear=c,prefill_attention=sdpa,decode_ops=c",
        max_num_batched_tokens=7,  # chunks of 7 tokens beside the decodes of shorter prompts
    )
    attns = [m for m in llm.engine.runner.model.modules() if isinstance(m, Attention)]
    calls = _count_calls(attns, "native", "decode_attention")
    forward = llm.engine.runner._forward  # every step with a prefill chunk
    mixed, in_mixed = [0], [0]  # mixed steps, and the paged attention's calls in them

    def counted(decodes: list, prefills: list) -> dict:
        before = calls[0]
        out = forward(decodes, prefills)
        if decodes and prefills:
            mixed[0] += 1
            in_mixed[0] += calls[0] - before
        return out

    def gathered(*args: object) -> None:
        raise AssertionError("a decode beside a prefill chunk took the gather")

    monkeypatch.setattr(llm.engine.runner, "_forward", counted)
    monkeypatch.setattr(Attention, "_decode", gathered)
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == expected
    assert mixed[0] > 0 and in_mixed[0] == mixed[0] * len(attns)


def test_decode_step_indices_are_views_of_one_buffer_that_grows(tiny_model: Path) -> None:
    """A decodes-only step under the C kernels writes its ids, positions, slots, key bounds and
    block tables into one buffer the runner keeps, and hands out views of it: the right values
    for each sequence; the views of the last shape kept; a step too big for the buffer grows
    it, and later views (of any shape) point into the new buffer, not the old one."""
    llm = LLM(model=str(tiny_model), kv_cache_memory="8MiB", block_size=4, max_model_len=256)
    engine, runner = llm.engine, llm.engine.runner
    small = runner._index_views(2, 3)
    assert runner._index_views(2, 3) is small
    start = runner._index_buf.numel()
    big = runner._index_views(32, start // 32)  # 32 x (5 + width) > the buffer
    buf = runner._index_buf
    assert buf.numel() >= 32 * (5 + start // 32) > start
    again = runner._index_views(2, 3)
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()
    assert all(lo <= v.data_ptr() < hi for v in (*big, *again))
    assert [tuple(v.shape) for v in again] == [(2,), (2,), (2,), (2, 2), (2, 3)]
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    for prompt in ([5] * 9, [7] * 3):
        engine.add_request(prompt, params)
    engine.step()  # both prefills
    engine.step()  # their first decodes
    out = engine.scheduler.schedule()
    assert [e.is_prefill for e in out.scheduled] == [False, False]
    batch, ids = runner._native_decode_batch(out.scheduled)
    requests = [e.request for e in out.scheduled]
    lengths = [r.num_tokens for r in requests]  # 11 and 5: each decodes its last token
    assert ids.tolist() == [r.token_ids[-1] for r in requests]
    assert batch.positions is not None and batch.positions.tolist() == [n - 1 for n in lengths]
    pairs = zip(requests, lengths, strict=True)
    slots = [r.block_table[(n - 1) // 4] * 4 + (n - 1) % 4 for r, n in pairs]
    assert batch.slot_mapping.tolist() == slots
    assert batch.decode_bounds is not None and batch.decode_tables is not None
    assert batch.decode_bounds.tolist() == [[0, n] for n in lengths]
    width = -(-max(lengths) // 4)
    tables = [(r.block_table + [0] * width)[:width] for r in requests]
    assert batch.decode_tables.tolist() == tables
    lo, hi = runner._index_buf.data_ptr(), runner._index_buf.data_ptr() + 8 * 2 * (5 + width)
    assert all(lo <= t.data_ptr() < hi for t in (ids, batch.positions, batch.decode_tables))


def test_the_mlps_scratch_hands_out_views_of_one_buffer_that_grows() -> None:
    from pdscope.engine.model import Scratch

    scratch = Scratch()
    bf16, f32 = torch.empty(0, dtype=torch.bfloat16), torch.empty(0)  # the dtype to take
    with torch.inference_mode():
        a = scratch.take("gate_up", 100, 64, bf16)
        b = scratch.take("gate_up", 80, 64, bf16)  # fewer rows: the same memory
        assert a.data_ptr() == b.data_ptr() and b.shape == (80, 64)
        c = scratch.take("gate_up", 200, 64, bf16)  # more: grown
        assert c.shape == (200, 64) and scratch.buffers["gate_up"].numel() == 200 * 64
        assert not c.is_inference()  # made outside inference mode: writable outside it too
        d = scratch.take("act", 200, 32, f32)
        assert d.dtype == torch.float32 and d.data_ptr() != c.data_ptr()
    out = scratch.take("x", 200, 64, f32)  # outside inference mode, as a test's
    torch.mm(torch.ones(200, 8), torch.ones(8, 64), out=out)
    assert out[0, 0].item() == 8.0


@pytest.mark.parametrize(
    ("dtype", "kernels"),
    [
        ("float32", "linear=c,prefill_attention=sdpa,decode_ops=c"),
        ("bfloat16", "linear=c,batch_linear=c,prefill_attention=sdpa,decode_ops=c"),
        # batch-1 rows stay on oneDNN here (not one-call); batches of 2-4 take the C kernel
        ("bfloat16", "linear=packed,batch_linear=c,prefill_attention=sdpa,decode_ops=c"),
        ("bfloat16", "linear=amx,batch_linear=c,prefill_attention=sdpa,decode_ops=c"),
        ("bfloat16", "linear=pairs,batch_linear=c,prefill_attention=sdpa,decode_ops=c"),
        ("bfloat16", "linear=pairs,batch_linear=pairs,prefill_attention=sdpa,decode_ops=c"),
        ("bfloat16", "linear=pairs2,batch_linear=pairs,prefill_attention=sdpa,decode_ops=c"),
        # batched rows through the copies, single rows not: made for batch_linear alone
        ("bfloat16", "linear=packed,batch_linear=pairs,prefill_attention=sdpa,decode_ops=c"),
        ("bfloat16", "linear=c,batch_linear=pairs,prefill_attention=sdpa,decode_ops=c"),
        # float32 weights take no copy: every matmul the many-row kernel, in both paths
        ("float32", "linear=c,batch_linear=pairs,prefill_attention=sdpa,decode_ops=c"),
    ],
)
# a qkv bias; q/k norms; q/k norms with the LM head tied to the embedding and a vocabulary
# that is not a multiple of 16 (the one-row AMX kernel then leaves it to the other matmul)
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3-tied"])
def test_one_call_decode_step_is_the_per_kernel_path_bit_for_bit(
    tmp_path: Path, arch: str, dtype: str, kernels: str
) -> None:
    """NativeOps.decode_layers runs the per-kernel path's kernels in its order on its buffers,
    and NativeOps.decode_logits the LM head after them in the same call, so their logits are
    the same bits, at one row and at a batch of several (batch_linear=c or pairs)."""
    from safetensors.torch import load_file, save_file

    from pdscope.checkpoint.make_model import default_cache_dir
    from pdscope.engine import native

    if "linear=amx" in kernels:
        ops = native.load(default_cache_dir() / "native")
        if ops is None or ops.linear_many_isa != "amx":
            pytest.skip("no AMX tiles on this CPU, compiler or kernel")
    _pairs_or_skip(kernels)
    tied = arch.endswith("-tied")
    overrides = {"tie_word_embeddings": True, "vocab_size": 1000} if tied else {}
    path = make_model(
        tmp_path / arch, "tiny", arch=arch.removesuffix("-tied"), dtype=dtype, **overrides
    )
    # Generated norms are all ones: random ones make a swapped or dropped norm weight show.
    weights_file = path / "model.safetensors"
    tensors = load_file(weights_file)
    gen = torch.Generator().manual_seed(0)
    for name, t in tensors.items():
        if "norm" in name or "bias" in name:
            tensors[name] = (1 + 0.5 * torch.randn(t.shape, generator=gen)).to(t.dtype)
    save_file(tensors, weights_file, metadata={"format": "pt"})
    llm = LLM(
        model=str(path),
        dtype=dtype,
        kv_cache_memory="8MiB",
        block_size=4,
        kernels=kernels,
        enable_prefix_caching=False,  # the second pass must prefill as the first did
    )
    model = llm.engine.runner.model
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    ps = prompts(llm)
    batched = "batch_linear=c" in kernels or "batch_linear=pairs" in kernels
    one_row_c = "linear=packed" not in kernels
    llm.engine.runner.capture_logits = True
    # per-kernel; the layers in one call, the LM head after it; both in one call
    modes = {"per-kernel": (False, False), "layers": (True, False), "logits": (True, True)}
    captured: dict[str, list[torch.Tensor]] = {}
    for mode, (fuse, fuse_logits) in modes.items():
        model.fuse_decode, model.fuse_logits = fuse, fuse_logits
        layer_calls = _count_calls([model], "native", "decode_layers")
        logit_calls = _count_calls([model], "native", "decode_logits")
        llm.engine.runner.captured = []
        llm.generate(ps[0], GREEDY)  # batch-1 decode steps
        single = (layer_calls[0], logit_calls[0])
        llm.generate(ps, GREEDY)  # decode steps of 1-4 rows
        captured[mode] = llm.engine.runner.captured
        one_calls = GREEDY.max_tokens - 1 if fuse and one_row_c else 0
        assert single == ((0, one_calls) if fuse_logits else (one_calls, 0))
        calls = logit_calls if fuse_logits else layer_calls
        assert (calls[0] > sum(single)) == (fuse and batched)
    # A weight whose storage is replaced after the one-call path cached its pointers: read
    # anew; the LM head's too (under tying, the embedding's with it).
    for proj in (model.layers[0].mlp.down_proj, model.lm_head):
        proj.weight.data = proj.weight.data * 1.5
    for mode, (fuse, fuse_logits) in modes.items():
        model.fuse_decode, model.fuse_logits = fuse, fuse_logits
        llm.engine.runner.captured = []
        llm.generate(ps[0], GREEDY)
        captured[mode] += llm.engine.runner.captured
    # the one call's step (the last one ran a single row) reads it as linear's streams a
    # thread: the same bits either way, so only the field says which ran
    if one_row_c:
        assert model._decode_layers is not None
        step = model._decode_layers[-1][1]
        assert step.pair_streams == (2 if "linear=pairs2" in kernels else 8)
    for mode in ("layers", "logits"):
        assert len(captured[mode]) == len(captured["per-kernel"])
        for fused, per_kernel in zip(captured[mode], captured["per-kernel"], strict=True):
            assert fused.dtype == per_kernel.dtype == torch.float32
            assert torch.equal(fused, per_kernel)


def _team_model(tmp_path: Path, dtype: str) -> Path:
    """A checkpoint sized to take the one-call step's team at 2 threads or more (2.75 M matmul
    weights a layer; under 2 M a step keeps a region per kernel) with shares that are real:
    every matmul splits (out x in >= 65,536), one KV head, a 16,384 vocabulary."""
    return make_model(
        tmp_path / "wide", "tiny", dtype=dtype, hidden_size=512, intermediate_size=1408,
        num_attention_heads=8, num_key_value_heads=1, vocab_size=16384,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("dtype", "kernels"),
    [
        ("float32", "linear=c,prefill_attention=sdpa,decode_ops=c"),
        ("bfloat16", "linear=c,batch_linear=c,prefill_attention=sdpa,decode_ops=c"),
        ("bfloat16", "linear=pairs2,batch_linear=pairs,prefill_attention=sdpa,decode_ops=c"),
        # one-row copies beside the many-row C kernel (the trial may pick it either way)
        ("bfloat16", "linear=pairs2,batch_linear=c,prefill_attention=sdpa,decode_ops=c"),
    ],
)
# 4 threads on a 2-CPU host: the team outnumbers its CPUs, so its barriers sleep soon
@pytest.mark.parametrize("threads", [2, 4])
# x86-64-v3: the kernels an AVX2-only CPU builds (each thread that takes a share of a bf16
# matmul widens x itself; pairs2 and the pairs tiles in AVX2), run here on the AVX-512
# machine's cores; x86-64: the portable loops (no pairs there)
@pytest.mark.parametrize("build", ["engine", *OTHER_BUILDS])
def test_the_one_call_step_shares_every_kernel_over_its_team_bit_for_bit(
    tmp_path: Path,
    dtype: str,
    kernels: str,
    threads: int,
    build: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With 2 threads or more the one-call step runs inside one OpenMP region, each thread
    taking its share of every kernel between barriers of its own. The model is sized to take
    a team (2.75 M matmul weights a layer; under 2 M a step keeps a region per kernel) and so
    that the shares are real: every matmul splits (out x in >= 65,536), one KV head and a
    1,100-token prompt cut batch-1 attention into context parts merged after a barrier, and
    17 rows of a 16,384 vocabulary widen the bf16 logits and take each row's argmax in
    parallel. The logits, and the greedy tokens the fused argmax picks, are the per-kernel
    path's bits, in the engine's build and in the one an AVX2-only CPU makes."""
    from pdscope.engine import native

    other = _use_build(build, request, monkeypatch, tmp_path)
    _pairs_or_skip(kernels)
    path = _team_model(tmp_path, dtype)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        llm = LLM(
            model=str(path), dtype=dtype, kv_cache_memory="32MiB", block_size=16,
            kernels=kernels, enable_prefix_caching=False,
        )  # fmt: skip
        model = llm.engine.runner.model
        ops = model.native
        assert isinstance(ops, native.NativeOps)
        assert other is None or ops is other
        rng = torch.Generator().manual_seed(0)
        long = torch.randint(10, 16000, (1100,), generator=rng).tolist()
        batch = [torch.randint(10, 16000, (5 + i,), generator=rng).tolist() for i in range(17)]
        runs: dict[bool, tuple[list[torch.Tensor], list[list[int]]]] = {}
        for fused in (False, True):
            model.fuse_decode = model.fuse_logits = fused
            before = ops.team_steps
            llm.engine.runner.capture_logits = True
            llm.engine.runner.captured = []
            llm.generate([long], GREEDY)
            llm.generate(batch, GREEDY)
            captured = llm.engine.runner.captured
            llm.engine.runner.capture_logits = False
            tokens = [o.token_ids for o in llm.generate([long, *batch], GREEDY)]
            steps = ops.team_steps - before
            # the long prompt's decode steps and the batch's (a few rows take the one call
            # where batch_linear is C or pairs), and the mixed call's decode-only steps; or none
            one = GREEDY.max_tokens - 1
            least = one * (2 if "batch_linear" in kernels else 1)
            assert (least <= steps <= 3 * one) if fused else steps == 0
            runs[fused] = (captured, tokens)
    finally:
        torch.set_num_threads(saved)
    (per_kernel, tokens), (one_call, fused_tokens) = runs[False], runs[True]
    assert len(one_call) == len(per_kernel) == 2 * GREEDY.max_tokens  # prefill rows too
    assert all(torch.equal(a, b) for a, b in zip(one_call, per_kernel, strict=True))
    assert fused_tokens == tokens


@pytest.mark.parametrize(
    "kernels",
    [
        "linear=pairs2,batch_linear=pairs,big_batch_linear=pairs",
        # the copies made for this path alone: the rows around it on oneDNN and the C kernel
        "linear=c,batch_linear=c,big_batch_linear=pairs",
        "linear=packed,batch_linear=packed,big_batch_linear=pairs",
        # the weight as stored, through the many-row kernel (the memory rule's pick where it
        # has AMX tiles)
        "linear=c,batch_linear=c,big_batch_linear=c",
    ],
)
@pytest.mark.parametrize("build", ["engine", "x86-64-v3"])
def test_decode_batches_of_33_to_64_rows_take_the_copies_in_one_call_bit_for_bit(
    tmp_path: Path,
    kernels: str,
    build: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """big_batch_linear=pairs: a decodes-only step of 40 sequences (five row tiles of 8 in
    AVX-512 BF16, eight of 5 in AVX2) runs in one C call on a team of 2 threads, with the per-
    kernel path's logits and greedy tokens bit for bit; both read the copies (counted, and the
    one call's step fields); the logits stay within a bf16 rounding of big_batch_linear=onednn,
    whose 40-row steps leave the one call. big_batch_linear=c alike, on the weight as stored
    through the many-row kernel (with AMX tiles, rows in passes of 32; else row by row)."""
    other = _use_build(build, request, monkeypatch, tmp_path)
    _pairs_or_skip(kernels)
    under = parse_kernels(kernels)["big_batch_linear"]
    path = _team_model(tmp_path, "bfloat16")
    rng = torch.Generator().manual_seed(0)
    batch = [torch.randint(10, 16000, (5 + i % 7,), generator=rng).tolist() for i in range(40)]
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    runs: dict[str, tuple[list[torch.Tensor], list[list[int]]]] = {}
    try:
        for big in (under, "onednn"):
            llm = LLM(
                model=str(path), dtype="bfloat16", kv_cache_memory="32MiB", block_size=16,
                kernels=kernels.replace(f"big_batch_linear={under}", f"big_batch_linear={big}")
                + ",prefill_attention=sdpa,decode_ops=c",
                enable_prefix_caching=False, max_num_seqs=64,
            )  # fmt: skip
            model = llm.engine.runner.model
            ops = model.native
            assert ops is not None and (other is None or ops is other)
            linears = [m for m in model.modules() if isinstance(m, Linear)]
            assert all((m.big_batch is not None) == (big == under) for m in linears)
            # oneDNN's run fused as served: its 40-row steps must leave the one call
            modes = (False, True) if big == under else (True,)
            copies = big == "pairs"
            for fused in modes:
                model.fuse_decode = model.fuse_logits = fused
                one_calls = _count_calls([model], "native", "decode_logits")
                kernel = "linear_pairs" if copies else "linear_many"
                copy_calls = _count_calls(linears, "big_batch", kernel) if big == under else [0]
                llm.engine.runner.capture_logits = True
                llm.engine.runner.captured = []
                team_steps = ops.team_steps
                tokens = [o.token_ids for o in llm.generate(batch, GREEDY)]
                decodes = GREEDY.max_tokens - 1  # steps of 40 rows after the prefill
                if big == "onednn":
                    assert one_calls[0] == 0
                elif fused:
                    assert one_calls[0] == ops.team_steps - team_steps == decodes
                    # the one call read the copies (the AVX2 build's many-row kernel would
                    # round alike too rarely for the logits to tell)
                    assert model._decode_layers is not None
                    step = model._decode_layers[-1][1]
                    assert step.rows == 40 and step.pairs == copies
                else:
                    assert copy_calls[0] >= decodes * 4 * len(model.layers)
                runs[big + (" fused" if fused and big == under else "")] = (
                    llm.engine.runner.captured,
                    tokens,
                )
    finally:
        torch.set_num_threads(saved)
    (per_kernel, tokens), (one_call, fused_tokens) = runs[under], runs[f"{under} fused"]
    assert len(one_call) == len(per_kernel) == GREEDY.max_tokens
    assert all(torch.equal(a, b) for a, b in zip(one_call, per_kernel, strict=True))
    assert fused_tokens == tokens
    # one bf16 rounding apart at most: the prefill's 40 sampled rows through the LM head (the
    # copies, or oneDNN), and the first decode step where the prefill picked the same tokens
    # in both (it may not at a near tie, which the first comparison bounds)
    onednn, onednn_tokens = runs["onednn"]
    torch.testing.assert_close(per_kernel[0], onednn[0], atol=1.5e-2, rtol=1e-2)
    if [t[0] for t in tokens] == [t[0] for t in onednn_tokens]:
        torch.testing.assert_close(per_kernel[1], onednn[1], atol=1.5e-2, rtol=1e-2)


def test_a_tiny_models_step_keeps_a_region_per_kernel(tmp_path: Path) -> None:
    """Under 2 M matmul weights a layer (the tiny preset: 46 K) the one-call step runs no team:
    its kernels take microseconds, and a step would wait at its barriers more than it works."""
    from pdscope.engine import native

    path = make_model(tmp_path / "tiny", "tiny", dtype="float32")
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(
            model=str(path), dtype="float32", kv_cache_memory="8MiB",
            kernels="linear=c,prefill_attention=sdpa,decode_ops=c",
        )  # fmt: skip
        model = llm.engine.runner.model
        assert isinstance(model.native, native.NativeOps)
        calls = _count_calls([model], "native", "decode_logits")
        before = model.native.team_steps
        llm.generate([[5, 6, 7]], GREEDY)
        assert calls[0] == GREEDY.max_tokens - 1  # the one call ran, on no team
        assert model.native.team_steps == before
    finally:
        torch.set_num_threads(saved)


# batches of 33-64 on oneDNN (out of the one call), whatever a trial would pick here
ONE_CALL_KERNELS = (
    "linear=c,batch_linear=c,big_batch_linear=onednn,prefill_attention=sdpa,decode_ops=c"
)
CHECKED = "batch 1 at 600 keys, batch 1 at 32 keys, batch 5 at 48 keys, batch 17 at 48 keys"
# ... and through the pairs copies (in the one call): a fifth step checked
BIG_ONE_CALL_KERNELS = ONE_CALL_KERNELS.replace("big_batch_linear=onednn", "big_batch_linear=pairs")
# ... and through the many-row kernel on the weight as stored (in the one call too)
STORED_ONE_CALL_KERNELS = ONE_CALL_KERNELS.replace("big_batch_linear=onednn", "big_batch_linear=c")


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache of the test's own (no pass of the one-call check recorded), over the C kernels
    this process already built."""
    from pdscope.checkpoint.make_model import default_cache_dir
    from pdscope.engine import native

    ops = native.load(default_cache_dir() / "native")
    assert ops is not None
    monkeypatch.setattr(native, "load", lambda cache_dir: ops)
    monkeypatch.setenv("PDSCOPE_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize(
    "kernels", [ONE_CALL_KERNELS, BIG_ONE_CALL_KERNELS, STORED_ONE_CALL_KERNELS]
)
@pytest.mark.parametrize("threads", [1, 2])
def test_the_engine_checks_its_one_call_step_at_load(
    tmp_path: Path, kernels: str, threads: int, own_cache: None, steady_gauge: None,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """At load the engine steps its model through the one C call and through a call per
    kernel, at batch 1 (600 keys and 32), 5 and 17 (and 41 where big_batch_linear takes the
    copies or the many-row kernel into the one call), and keeps the one call where the logits,
    argmax and K/V writes agree bit for bit. On a model sized to take a team (2.75 M matmul
    weights a layer) at 2 threads the check's one-call steps run on the team, so a CPU whose
    team branches no test here runs (AMX tiles) is checked before it serves. A pass is cached:
    the next load of the same shapes steps nothing."""
    from pdscope.engine import native
    from pdscope.server.metrics import EngineMetrics

    path = _team_model(tmp_path, "bfloat16")
    ops = native.load(tmp_path)
    assert ops is not None
    big = kernels in (BIG_ONE_CALL_KERNELS, STORED_ONE_CALL_KERNELS)
    if kernels == BIG_ONE_CALL_KERNELS and not ops.pairs_rows:
        pytest.skip("no pairs kernels for several rows in this build of the C kernels")
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    teamed = []
    try:
        for _ in range(2):
            before = ops.team_steps
            with caplog.at_level("INFO", logger="pdscope.engine"):
                llm = LLM(model=str(path), kv_cache_memory="32MiB", kernels=kernels)
            teamed.append(ops.team_steps - before)
            assert llm.engine.decode_step == "one_call" and llm.engine.runner.model.fuse_decode
    finally:
        torch.set_num_threads(saved)
    said = [r.getMessage() for r in caplog.records if "one-call decode step" in r.getMessage()]
    on = f"{threads} thread{'s' if threads > 1 else ''}"
    checked = CHECKED + (", batch 41 at 48 keys" if big else "")
    assert said[0].endswith(f"bits at {checked}, {on}" + said[0][said[0].rindex(" (") :])
    assert "checked in" in said[0] and said[1].endswith("(a pass cached)")
    steps = 5 if big else 4
    assert teamed == [steps if threads > 1 else 0, 0]  # one step a shape, then none
    text = generate_latest(EngineMetrics(llm.engine, "wide").registry).decode()
    assert 'decode_step="one_call"' in text


@pytest.mark.parametrize("kernels", [ONE_CALL_KERNELS])
def test_a_per_kernel_path_that_raises_leaves_the_one_call_unchecked_not_the_load_failed(
    tmp_path: Path, kernels: str, own_cache: None,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """The check's reference is the per-kernel path, which these shapes never ran at load
    before the check: a fault there (put in by wrapping its norm, which the one call does not
    go through) warns and keeps the one call, as served before, rather than failing to load."""
    from pdscope.engine import native

    def broken(self: native.NativeOps, *args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("a fault put in")

    path = make_model(tmp_path / "m", "tiny", dtype="bfloat16")
    with monkeypatch.context() as patch, caplog.at_level("INFO", logger="pdscope.engine"):
        patch.setattr(native.NativeOps, "rms_norm", broken)
        llm = LLM(model=str(path), kv_cache_memory="8MiB", kernels=kernels)
    assert llm.engine.decode_step == "one_call" and llm.engine.runner.model.fuse_decode
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("not checked at batch 1 at 600 keys (RuntimeError: a fault put in)" in m
               for m in said)  # fmt: skip
    assert [o.token_ids for o in llm.generate([[5, 6, 7]], GREEDY)]  # it serves


def test_the_one_call_check_compares_bits_not_values() -> None:
    """NaN matches NaN and -0 differs from +0, as bits do (torch.equal says the opposite of
    both), in the logits and in the K/V a step writes; the argmax is the logits'."""
    from pdscope.engine.step_check import _differences

    logits = torch.tensor([[0.0, float("nan"), 1.0], [2.0, 3.0, 1.0]])
    kv = [torch.randn(2, 1, 4, 8).to(torch.bfloat16) for _ in range(2)]
    greedy = torch.tensor([1, 1])  # torch.argmax takes a NaN as the largest
    assert _differences(logits, logits.clone(), greedy, kv, [t.clone() for t in kv]) == ""
    signed, flipped = logits.clone(), [t.clone() for t in kv]
    signed[1, 2] = -1.0
    signed[0, 0] = -0.0
    flipped[1][0, 0, 2, 3] = -flipped[1][0, 0, 2, 3]
    said = _differences(signed, logits, torch.tensor([1, 0]), flipped, kv)
    assert said == "2 of 6 logits, the argmax in 1 of 2 rows, the K/V written in 1 of 2 layers"


@pytest.mark.parametrize("kernels", [ONE_CALL_KERNELS])
@pytest.mark.parametrize("fault", ["one ulp", "raises"])
def test_a_one_call_step_that_disagrees_is_switched_off(
    tmp_path: Path, kernels: str, fault: str, own_cache: None,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """Where the one call's logits differ from the per-kernel path's (here by one ulp in one
    logit at batch 17) or the call raises (here at batch 1), the engine warns, naming the step
    and the difference, keeps a call per kernel, and says so in /metrics; it then decodes the
    same tokens as an engine whose one call agrees. No CPU here has such a fault, so it is put
    in by wrapping the one call while the engine loads. A failed check is not cached: the
    next load checks again."""
    from pdscope.engine import native
    from pdscope.server.metrics import EngineMetrics

    path = make_model(tmp_path / "m", "tiny", dtype="bfloat16")
    prompts = [[5, 6, 7], [8, 9, 10, 11], *([[12, 13]] * 15)]
    one_call = native.NativeOps.decode_logits

    def faulty(self: native.NativeOps, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        logits, greedy = one_call(self, *args)
        if fault == "raises" and logits.shape[0] == 1:
            raise RuntimeError("a fault put in")
        if fault == "one ulp" and logits.shape[0] == 17:
            logits[3, 7] = torch.nextafter(logits[3, 7], torch.tensor(float("inf")))
        return logits, greedy

    with monkeypatch.context() as patch, caplog.at_level("INFO", logger="pdscope.engine"):
        patch.setattr(native.NativeOps, "decode_logits", faulty)
        llm = LLM(model=str(path), kv_cache_memory="8MiB", kernels=kernels)
    assert llm.engine.decode_step == "per_kernel_mismatch"
    assert not llm.engine.runner.model.fuse_decode
    said = (
        "batch 1 at 600 keys: RuntimeError: a fault put in; batch 1 at 32 keys: RuntimeError"
        if fault == "raises"
        else "batch 17 at 48 keys: 1 of 17408 logits; decode keeps a call per kernel"
    )
    assert any(said in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    caplog.clear()
    with caplog.at_level("INFO", logger="pdscope.engine"):
        good = LLM(model=str(path), kv_cache_memory="8MiB", kernels=kernels)
    assert good.engine.decode_step == "one_call"
    assert any("checked in" in r.getMessage() for r in caplog.records)
    expected = [o.token_ids for o in good.generate(prompts, GREEDY)]
    calls = _count_calls([llm.engine.runner.model], "native", "decode_logits")
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert calls[0] == 0  # every decode step ran a call per kernel
    text = generate_latest(EngineMetrics(llm.engine, "m").registry).decode()
    assert 'decode_step="per_kernel_mismatch"' in text


@pytest.mark.parametrize(
    ("kernels", "rows"),
    [
        ("linear=pairs", 1),
        ("linear=packed,batch_linear=pairs", 3),
        ("linear=packed,batch_linear=packed,big_batch_linear=pairs", 40),
        ("linear=c,batch_linear=c,big_batch_linear=onednn,prefill_linear=pairs", 100),
    ],
)
def test_pairs_copies_follow_a_replaced_weight_and_are_dropped_with_the_path(
    tmp_path: Path, kernels: str, rows: int
) -> None:
    """Under linear=pairs (or batch_linear=pairs, big_batch_linear=pairs: 33-64 rows, or
    prefill_linear=pairs: past 64, here 100 rows and prefill steps of 64 prompts) every
    weight the copy takes holds one (the tied-away vocabulary of 1,000 is not a multiple of
    16: that LM head keeps the C kernel); a weight whose storage is replaced is copied anew
    before a single row (or a few, or 40) reads it, so a row sees the new weight; and other
    linear choices free every copy."""
    from pdscope.engine.model import apply_kernels

    _pairs_or_skip(kernels)
    path = make_model(tmp_path / "m", "tiny", dtype="bfloat16", vocab_size=1000)
    llm = LLM(model=str(path), dtype="bfloat16", kv_cache_memory="8MiB", kernels=kernels)
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert model.lm_head.pairs is None
    assert all(m.pairs is not None for m in linears if m is not model.lm_head)
    prompts = (
        [[5, 6, 7], [8, 9], [10, 11, 12, 13]][:rows]
        if rows <= 3
        else [[5 + i, 6, 7] for i in range(rows)]
    )
    before = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    proj = model.layers[0].mlp.down_proj
    x = torch.randn(rows, proj.in_features, generator=torch.Generator().manual_seed(0))
    x = x.to(torch.bfloat16)
    old = proj(x)
    proj.weight.data = proj.weight.data * -2.0
    new = proj(x)
    torch.testing.assert_close(
        new, torch.nn.functional.linear(x, proj.weight), atol=4e-2, rtol=2e-2
    )
    assert not torch.allclose(new, old, atol=4e-2, rtol=2e-2)
    assert proj.pairs_source == proj.weight_key()
    after = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert all(a != b for a, b in zip(after, before, strict=True))  # the steps read it too
    other = replace(
        llm.engine.kernels,
        linear="c", batch_linear="packed", big_batch_linear="onednn", prefill_linear="onednn",
    )  # fmt: skip
    apply_kernels(model, other, llm.engine._native)
    assert all(m.pairs is None for m in linears)


PAIRS_PAST_ONE = "batch_linear=pairs,big_batch_linear=pairs,prefill_linear=pairs"


def _every_path(llm: LLM) -> str:
    """``--kernels`` forcing every path to what ``llm``'s engine runs."""
    from pdscope.engine.kernels import OPTIONS

    return ",".join(f"{p}={getattr(llm.engine.kernels, p)}" for p in OPTIONS)


ALL_PAIRS = f"linear=pairs2,{PAIRS_PAST_ONE}"


def test_a_weight_that_every_matmul_reads_a_copy_of_is_held_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where one row, 2-32, 33-64 and more rows all read the pairs copy, apply_kernels lets
    the weight go (its storage freed: no reference to it lives on) and the copy holds its
    values once; the one-call step and every step size run without making it again, and
    generate what an engine that keeps its weights generates; the weight made again on
    access is the checkpoint's, bit for bit, and the layer then computes the same bits; the
    parameter count counts it all along."""
    import gc
    import weakref

    from pdscope.engine.kernels import KernelChoice
    from pdscope.engine.loader import load_model
    from pdscope.engine.model import apply_kernels

    _pairs_or_skip(ALL_PAIRS)
    path = make_model(tmp_path / "m", "tiny", dtype="bfloat16")
    checkpoint = load_model(path, torch.bfloat16, torch.device("cpu"))
    model = load_model(path, torch.bfloat16, torch.device("cpu"))
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    weights = [weakref.ref(m.weight) for m in linears]
    count = sum(p.numel() for p in model.parameters())
    choice = KernelChoice(**parse_kernels(ALL_PAIRS + ",decode_ops=c"))
    ops = native.load(seed_native(tmp_path / "native"))
    apply_kernels(model, choice, ops)
    gc.collect()
    assert all(m.held_once and m.stored_weight() is None for m in linears)
    assert all(ref() is None for ref in weights)  # freed: the copy is all that holds them
    assert model.parameter_count() == count
    gen = torch.Generator().manual_seed(0)
    proj = model.layers[0].mlp.down_proj
    xs = [
        torch.randn(r, proj.in_features, generator=gen).to(torch.bfloat16) for r in (1, 8, 40, 100)
    ]
    held = [proj(x) for x in xs]
    assert proj.held_once  # no row count read the weight
    restored = proj.weight  # made again from the copy
    assert not proj.held_once and proj.pairs is not None
    assert torch.equal(restored, checkpoint.layers[0].mlp.down_proj.weight)
    assert all(torch.equal(proj(x), y) for x, y in zip(xs, held, strict=True))
    assert model.parameter_count() == count

    on_copies = ALL_PAIRS + ",decode_ops=c"  # the one call: a trial could pick decode_ops=torch
    llm = LLM(model=str(path), dtype="bfloat16", kv_cache_memory="8MiB", kernels=on_copies)
    assert llm.engine.decode_step == "one_call"
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.held_once for m in linears)
    # steps of 1, 3, 40 and 100 rows, prefill chunks of 64 and more
    prompts = [[5, 6, 7], [8, 9] * 40, [10, 11, 12, 13] * 30] + [[3 + i, 4] for i in range(40)]
    calls = _count_calls([model], "native", "decode_logits")
    held = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert calls[0] > 0  # decode ran in the one call, on the copies alone
    assert all(m.held_once for m in linears)
    with monkeypatch.context() as patch:
        patch.setattr(Linear, "hold_once", lambda self: None)
        every = _every_path(llm)  # the same paths, none left to a trial
        kept = LLM(model=str(path), dtype="bfloat16", kv_cache_memory="8MiB", kernels=every)
    model = kept.engine.runner.model
    assert not any(m.held_once for m in model.modules() if isinstance(m, Linear))
    assert [o.token_ids for o in kept.generate(prompts, GREEDY)] == held


def test_a_conversion_reaches_a_weight_held_once(tmp_path: Path) -> None:
    """``.to(float32)`` on a model whose weights are held once converts them as it converts
    stored ones (the values the checkpoint's, widened, and a matmul on them), where it once
    skipped them and left the bf16 copy to be made again later; ``.to()`` the dtype they have
    leaves them held once, nothing made again."""
    from pdscope.engine.kernels import KernelChoice
    from pdscope.engine.loader import load_model
    from pdscope.engine.model import apply_kernels

    _pairs_or_skip(ALL_PAIRS)
    path = make_model(tmp_path / "m", "tiny", dtype="bfloat16")
    checkpoint = load_model(path, torch.bfloat16, torch.device("cpu"))
    model = load_model(path, torch.bfloat16, torch.device("cpu"))
    apply_kernels(
        model, KernelChoice(**parse_kernels(ALL_PAIRS)), native.load(seed_native(tmp_path / "n"))
    )
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.held_once for m in linears)
    model.to(torch.bfloat16)
    assert all(m.held_once for m in linears)
    model.to(torch.float32)
    proj, kept = model.layers[0].mlp.down_proj, checkpoint.layers[0].mlp.down_proj
    assert not any(m.held_once for m in linears)
    assert all(m.stored_weight().dtype == torch.float32 for m in linears)
    assert torch.equal(proj.weight, kept.weight.float())
    x = torch.randn(3, proj.in_features, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(proj(x), torch.nn.functional.linear(x, kept.weight.float()))


@pytest.mark.parametrize(
    ("kernels", "once"),
    [
        ("linear=pairs,batch_linear=c,big_batch_linear=pairs,prefill_linear=pairs", False),
        ("linear=c,batch_linear=pairs,big_batch_linear=pairs,prefill_linear=pairs", False),
        ("linear=pairs,batch_linear=pairs,big_batch_linear=onednn,prefill_linear=onednn", True),
        ("linear=pairs,batch_linear=packed,big_batch_linear=onednn,prefill_linear=onednn", True),
    ],
)
def test_a_weight_is_held_once_only_where_no_path_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernels: str, once: bool
) -> None:
    """batch_linear=c's many-row kernel and linear=c read the weight as stored: it stays.
    Where the packed weights take the larger matmuls in place of the copy, the weight goes
    and the two copies stay, and a prefill and a batched decode there give what the same
    paths give with the weights kept. A tied LM head is the embedding, which reads its
    weight: kept."""
    from pdscope.engine.model import can_pack

    _pairs_or_skip(kernels)
    packs = can_pack(torch.bfloat16, torch.device("cpu"))
    if not packs and ("packed" in kernels or "onednn" in kernels):
        pytest.skip("oneDNN has no bf16 packing on this CPU")
    path = make_model(tmp_path / "m", "tiny", dtype="bfloat16", tie_word_embeddings=True)
    llm = LLM(model=str(path), dtype="bfloat16", kv_cache_memory="8MiB", kernels=kernels)
    model = llm.engine.runner.model
    assert model.lm_head.stored_weight() is model.embed_tokens.weight  # tied: kept
    layers = [m for m in model.layers.modules() if isinstance(m, Linear)]
    assert all(m.held_once == once for m in layers)
    if not once:
        return
    assert all(m.pairs is not None and m.packed is not None for m in layers)
    prompts = [[5, 6, 7] * 30] + [[3 + i, 4] for i in range(12)]
    held = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert all(m.held_once for m in layers)
    monkeypatch.setattr(Linear, "hold_once", lambda self: None)
    kept = LLM(model=str(path), dtype="bfloat16", kv_cache_memory="8MiB", kernels=_every_path(llm))
    assert [o.token_ids for o in kept.generate(prompts, GREEDY)] == held


def test_widened_matmuls_keep_a_weight_only_where_one_reads_it() -> None:
    """Under matmul_math=float32 (a CPU without oneDNN's bf16 path) a matmul no copy takes
    widens the weight as stored: held once only where every row count reads the copy."""
    lin = Linear(64, 32, bias=False, dtype=torch.bfloat16)
    ops = object()  # the C kernels' stand-in: weight_unread only asks whether a path is set
    lin.pairs = torch.empty(2, 32, 16, 2, dtype=torch.bfloat16)
    lin.one_row_pairs, lin.native, lin.widen = True, ops, True
    lin.native_many, lin.many_pairs = ops, True
    assert not lin.weight_unread()  # 33 rows and more widen the weight
    lin.big_batch, lin.big_batch_pairs, lin.many_rows = ops, True, ops
    assert lin.weight_unread()
    lin.big_batch_pairs = False  # big_batch_linear=c: the many-row kernel on the weight
    assert not lin.weight_unread()
    lin.big_batch_pairs = True
    lin.many_pairs = False  # the many-row kernel on the weight
    assert not lin.weight_unread()


def test_a_weight_held_once_is_read_written_and_replaced_as_one_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state dict gives a held weight's values and leaves it held once; a write through
    ``.weight`` (made again first) reaches the copy; a new Parameter set in its place is
    copied anew without the old one being made again; load_state_dict loads into it; and
    apply_kernels with paths that read no copy keeps the values, not the freed weight's
    bytes."""
    from pdscope.engine.model import apply_kernels

    _pairs_or_skip(ALL_PAIRS)
    path = make_model(tmp_path / "m", "tiny", dtype="bfloat16")
    llm = LLM(model=str(path), dtype="bfloat16", kv_cache_memory="8MiB", kernels=ALL_PAIRS)
    model = llm.engine.runner.model
    proj = model.layers[0].self_attn.o_proj
    assert proj.held_once
    state = model.state_dict()
    assert proj.held_once
    values = state["layers.0.self_attn.o_proj.weight"]
    assert values.shape == (proj.out_features, proj.in_features)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, proj.in_features, generator=gen).to(torch.bfloat16)
    torch.testing.assert_close(proj(x), torch.nn.functional.linear(x, values), atol=4e-2, rtol=2e-2)
    with torch.no_grad():
        proj.weight.mul_(-2.0)  # in place, through the weight made again
    torch.testing.assert_close(
        proj(x), torch.nn.functional.linear(x, values * -2.0), atol=8e-2, rtol=2e-2
    )
    apply_kernels(model, llm.engine.kernels, llm.engine._native)  # held once again
    assert proj.held_once
    new = torch.randn(proj.out_features, proj.in_features, generator=gen).to(torch.bfloat16)

    def refused(self: Linear) -> torch.nn.Parameter:
        raise AssertionError("the weight replaced was made again")

    monkeypatch.setattr(Linear, "restore_weight", refused)
    proj.weight = torch.nn.Parameter(new, requires_grad=False)
    monkeypatch.undo()
    torch.testing.assert_close(proj(x), torch.nn.functional.linear(x, new), atol=4e-2, rtol=2e-2)
    apply_kernels(model, llm.engine.kernels, llm.engine._native)
    assert proj.held_once
    model.load_state_dict(state)
    assert torch.equal(proj.weight, values)
    apply_kernels(model, llm.engine.kernels, llm.engine._native)
    plain = replace(
        llm.engine.kernels,
        linear="plain", batch_linear="packed", big_batch_linear="onednn", prefill_linear="onednn",
    )  # fmt: skip
    apply_kernels(model, plain, llm.engine._native)
    assert not proj.held_once and proj.pairs is None
    assert torch.equal(proj.weight, values)


def test_where_another_copy_does_not_fit_each_weight_is_held_once_without_a_trial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With memory for a quarter of the weights' copy, the four matmul paths take the pairs
    copies without a trial (how: "memory"), every weight is held once, the start says so, and
    the engine generates what it generates forced to the same paths with room to spare; one
    of them forced to a path that keeps oneDNN's packed copy leaves them to the trial; with
    room, those paths are measured as before. Where the C kernels have AMX tiles, the paths
    taken are those that read the weight as stored (tiles up to 64 rows, F.linear past them:
    the prompt of 90 tokens), and no weight keeps a copy."""
    import logging

    from pdscope.checkpoint.make_model import default_cache_dir
    from pdscope.engine import llm_engine
    from pdscope.engine import model as engine_model
    from pdscope.engine.loader import load_model

    _pairs_or_skip(ALL_PAIRS)
    ops = native.load(default_cache_dir() / "native")
    stored = ops is not None and ops.linear_many_isa == "amx"
    past_one = (
        "batch_linear=c,big_batch_linear=c,prefill_linear=plain" if stored else PAIRS_PAST_ONE
    )
    path = make_model(tmp_path / "m", "tiny", dtype="bfloat16")
    loaded = load_model(path, torch.bfloat16, torch.device("cpu"))
    weights = sum(m.weight_nbytes() for m in loaded.modules() if isinstance(m, Linear))
    paths = ("linear", "batch_linear", "big_batch_linear", "prefill_linear")
    args = {"dtype": "bfloat16", "kv_cache_memory": "256KiB", "max_model_len": 128}
    prompts = [[5, 6, 7] * 30] + [[3 + i, 4] for i in range(40)]
    for room, how in ((3 * weights, "memory"), (100 * weights, "timed")):
        for module in (engine_model, llm_engine):
            monkeypatch.setattr(module, "available_memory_bytes", lambda room=room: room)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pdscope.engine"):
            llm = LLM(model=str(path), **args)
        kernels = llm.engine.kernels
        hows = {kernels.how[p] for p in paths}
        assert hows == {"memory"} if how == "memory" else "memory" not in hows, kernels.summary()
        warned = [r.getMessage() for r in caplog.records if "held once" in r.getMessage()]
        if how == "timed":
            assert not warned
            continue
        assert len(warned) == 1 and "does not fit" in warned[0]
        assert "as stored" in warned[0] if stored else "pairs copy" in warned[0]
        picked = f"batch_linear={kernels.batch_linear},big_batch_linear="
        picked += f"{kernels.big_batch_linear},prefill_linear={kernels.prefill_linear}"
        assert picked == past_one and (kernels.linear == "amx") == stored
        model = llm.engine.runner.model
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        if stored:
            assert not any(m.held_once or m.packed is not None for m in linears)
            assert not any(m.pairs is not None or m.weight_t is not None for m in linears)
        else:
            assert all(m.held_once for m in linears)
        held = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        # the packed weights kept; prefill_linear=plain reads the weight as stored, so that
        # no trial pick leaves it unread (held once in its pairs copy, as a CI run's trial did)
        for spec in ("linear=packed", "batch_linear=packed"):
            partly = LLM(model=str(path), kernels=f"{spec},prefill_linear=plain", **args)
            assert "memory" not in {partly.engine.kernels.how[p] for p in paths}, spec
            model = partly.engine.runner.model
            assert not any(m.held_once for m in model.modules() if isinstance(m, Linear))
        # single rows forced onto the copies take the rest there too, AMX tiles or not
        assert ops is not None
        copies = LLM(model=str(path), kernels=f"linear={pairs_preferred(ops.pairs_isa)}", **args)
        on_copies = copies.engine.kernels
        assert {on_copies.how[p] for p in paths[1:]} == {"memory"}
        assert on_copies.prefill_linear == on_copies.big_batch_linear == "pairs"
        model = copies.engine.runner.model
        assert all(m.held_once for m in model.modules() if isinstance(m, Linear))
        for module in (engine_model, llm_engine):
            monkeypatch.setattr(module, "available_memory_bytes", lambda: 100 * weights)
        # every path as the memory rule's engine ran it: none left to a trial, whose other
        # prefill attention or decode ops would round differently
        forced = LLM(model=str(path), kernels=_every_path(llm), **args)
        assert {forced.engine.kernels.how[p] for p in paths} == {"forced"}
        assert [o.token_ids for o in forced.generate(prompts, GREEDY)] == held


def test_the_loaded_weights_keep_no_mapping_of_the_checkpoint(tmp_path: Path) -> None:
    """safetensors reads each file through one mapping that any tensor read from it keeps
    whole: once loaded, no tensor of the model lies in it (the file is not mapped at all),
    whatever the dtype asked."""
    import gc

    from pdscope.engine.loader import load_model

    if not Path("/proc/self/maps").is_file():
        pytest.skip("no /proc/self/maps (not Linux)")
    path = make_model(tmp_path / "m", "tiny", dtype="bfloat16")
    for dtype in (torch.bfloat16, torch.float32):
        model = load_model(path, dtype, torch.device("cpu"))
        gc.collect()
        maps = Path("/proc/self/maps").read_text()
        assert str(path / "model.safetensors") not in maps
        assert all(p.dtype == dtype for p in model.parameters())


def test_only_a_weight_a_c_kernel_reads_as_stored_is_moved_onto_huge_pages(
    tmp_path: Path,
) -> None:
    """The C kernels stream a weight from huge pages where they read it as stored
    (linear=c); where its pairs copy stands in for it every time, the weight is not moved
    (a copy of it made for nothing: it is let go)."""
    from pdscope.engine.model import huge_pages_offered

    _pairs_or_skip(ALL_PAIRS)
    if not huge_pages_offered():
        pytest.skip("Linux offers no transparent huge pages here")
    shape = {"hidden_size": 1024, "intermediate_size": 2048}  # weights of 2 MiB or more
    path = make_model(tmp_path / "m", "tiny", dtype="bfloat16", **shape)
    args = {"dtype": "bfloat16", "kv_cache_memory": "8MiB"}
    for kernels, moved in ((ALL_PAIRS, False), ("linear=c,batch_linear=c", True)):
        model = LLM(model=str(path), kernels=kernels, **args).engine.runner.model
        layers = [m for m in model.layers.modules() if isinstance(m, Linear)]
        assert all(m.weight_nbytes() >= 1 << 21 for m in layers)
        assert all(m.huge_pages == moved for m in layers), kernels


@pytest.mark.parametrize("assign", [False, True], ids=["in-place", "assign"])
def test_weights_loaded_in_place_reach_every_copy(tmp_path: Path, assign: bool) -> None:
    """``load_state_dict`` writes the weights in place, their storage where it was (or, with
    ``assign=True``, puts new Parameters in the modules): the packed, transposed and pairs
    copies made from the old weights, and the one-call step's pointers, are made anew before
    anything reads them. After the load the engine generates what an engine whose copies were
    made from the new weights generates (its copies dropped, the weights loaded, the copies
    made again), and not what it generated before, once its prefix cache is reset (its KV
    came from the old weights). Steps that write no weight remake nothing."""
    from pdscope.engine.model import apply_kernels, can_pack

    # one row: pairs in the one-call step; 8 rows: packed (where oneDNN packs bf16: an
    # AVX2-only CPU has no packed copy to remake); a 600-token prefill: transposed
    kernels = "linear=pairs,batch_linear=packed,prefill_linear=transposed,decode_ops=c"
    packs = can_pack(torch.bfloat16, torch.device("cpu"))
    _pairs_or_skip(kernels)
    path = make_model(tmp_path / "m", "tiny", dtype="bfloat16")
    a = LLM(model=str(path), dtype="bfloat16", kv_cache_memory="8MiB", kernels=kernels)
    # b on a's every path: a trial between the starts could pick another prefill attention
    b = LLM(model=str(path), dtype="bfloat16", kv_cache_memory="8MiB", kernels=_every_path(a))
    ma, mb = a.engine.runner.model, b.engine.runner.model
    linears = {n: m for n, m in ma.named_modules() if isinstance(m, Linear)}
    assert all(m.pairs is not None and (m.packed is not None) == packs for m in linears.values())
    assert ma.layers[0].mlp.down_proj.weight_t is not None
    batch = [[5 + i % 50 for i in range(600)]] + [[9 + j, 10, 11, 12] for j in range(7)]

    def generated(llm: LLM) -> list[list[int]]:
        outs = [o.token_ids for o in llm.generate(batch, GREEDY)]
        return outs + [llm.generate([5, 6, 7], GREEDY)[0].token_ids]

    before = generated(a)
    copies = {n: (m.pairs, m.packed, m.weight_t) for n, m in linears.items()}
    step = ma._decode_layers
    assert generated(a) == before
    assert ma._decode_layers is step  # the version check does not fire on reads
    for n, m in linears.items():
        assert all(x is y for x, y in zip((m.pairs, m.packed, m.weight_t), copies[n], strict=True))
    gen = torch.Generator().manual_seed(3)
    new = {
        k: (v.float() * (1 + 0.5 * torch.randn(v.shape, generator=gen))).to(v.dtype)
        if k.removesuffix(".weight") in linears
        else v.clone()
        for k, v in ma.state_dict().items()
    }
    ma.load_state_dict(new, assign=assign)
    assert a.reset_prefix_cache()  # its cached KV was computed with the old weights
    plain = replace(
        b.engine.kernels, linear="plain", big_batch_linear="onednn", prefill_linear="onednn"
    )
    apply_kernels(mb, plain, mb.native)
    assert all(
        m.pairs is None and m.packed is None and m.weight_t is None
        for m in mb.modules()
        if isinstance(m, Linear)
    )
    mb.load_state_dict(new)
    apply_kernels(mb, b.engine.kernels, mb.native)
    after = generated(a)
    assert after == generated(b)
    assert after != before


def test_pairs_step_reads_each_weight_as_the_per_kernel_path_does(tmp_path: Path) -> None:
    """Under linear=pairs a weight whose shape the copy does not take (here layer 0's qkv,
    (4 + 2) x 12 = 72 rows) keeps the C kernel on the weight as stored while the others read
    their copies: the one-call step does the same per weight, so its logits are the per-kernel
    path's bits, and it does take the copies (the step says so; with AVX-512 BF16 the logits
    are not linear=c's)."""
    from pdscope.engine.model import apply_kernels

    _pairs_or_skip("linear=pairs")
    odd = {"num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 12}
    path = make_model(tmp_path / "m", "tiny", dtype="bfloat16", **odd)
    llm = LLM(
        model=str(path),
        dtype="bfloat16",
        kv_cache_memory="8MiB",
        kernels="linear=pairs,decode_ops=c",
        enable_prefix_caching=False,
    )
    model = llm.engine.runner.model
    assert model.layers[0].self_attn.qkv_proj.pairs is None
    assert model.layers[0].self_attn.o_proj.pairs is not None
    runner = llm.engine.runner
    runner.capture_logits = True
    captured: dict[str, list[torch.Tensor]] = {}
    for mode, fused in (("per-kernel", False), ("one call", True)):
        model.fuse_decode = model.fuse_logits = fused
        runner.captured = []
        llm.generate([5, 6, 7], GREEDY)
        captured[mode] = runner.captured
    assert model._decode_layers is not None and model._decode_layers[-1][1].pairs
    assert len(captured["one call"]) == len(captured["per-kernel"])
    for a, b in zip(captured["one call"], captured["per-kernel"], strict=True):
        assert torch.equal(a, b)
    if model.native.pairs_isa != "avx512_bf16":
        return  # in AVX2 the two sums' orders differ too rarely to show in a model this small
    apply_kernels(model, replace(llm.engine.kernels, linear="c"), model.native)
    runner.captured = []
    llm.generate([5, 6, 7], GREEDY)
    assert not all(
        torch.equal(a, b) for a, b in zip(runner.captured, captured["one call"], strict=True)
    )


def test_huge_pages_setting_reads_the_bracketed_choice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pdscope.engine.model as model_module

    setting = tmp_path / "enabled"
    monkeypatch.setattr(model_module, "_THP_SETTING", str(setting))
    assert model_module.huge_pages_setting() is None  # absent
    cases = (("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"))
    for text, word in cases:
        setting.write_text(text)
        assert model_module.huge_pages_setting() == word
    setting.write_text("always madvise [never]")
    assert model_module.huge_pages_setting() == "never" and not model_module.huge_pages_offered()


def test_kv_caches_are_zeroed_on_huge_pages_where_linux_offers_them(tmp_path: Path) -> None:
    """The runner's KV caches: zeroed, the model's shape and dtype, each on huge-page-aligned
    memory of its own where Linux offers transparent huge pages and a cache fills one (else
    torch's), and generation writes and reads them."""
    from pdscope.engine.model import huge_pages_offered
    from pdscope.engine.runner import kv_cache

    small = kv_cache((2, 2, 16, 8), torch.bfloat16, torch.device("cpu"))  # under a huge page
    assert small.shape == (2, 2, 16, 8) and not small.any()
    path = make_model(tmp_path / "m", "tiny", dtype="bfloat16")
    llm = LLM(model=str(path), dtype="bfloat16", kv_cache_memory="64MiB")
    caches = llm.engine.runner.kv_caches
    c = llm.engine.runner.model.config
    assert all(
        t.shape == (2, c.num_kv_heads, t.shape[2], c.head_dim) and t.dtype == torch.bfloat16
        for t in caches
    )
    assert not any(t.any() for t in caches)
    if huge_pages_offered() and caches[0].numel() * 2 >= 1 << 21:
        assert all(t.data_ptr() % (1 << 21) == 0 for t in caches)
    assert len(llm.generate([5, 6, 7], GREEDY)[0].token_ids) == 12
    assert all(t.any() for t in caches)  # generation wrote K/V into every layer's


def test_streamed_weights_move_to_huge_pages_and_stay_tied(tmp_path: Path) -> None:
    """Under linear=c the weights the C kernels stream (here the 4 MiB tied lm head; the tiny
    model's others are under one huge page) move onto huge-page-aligned memory of their own:
    the same values, still the embedding's parameter, and generation reads them."""
    from safetensors.torch import load_file

    from pdscope.engine.model import huge_pages_offered, on_huge_pages
    from pdscope.engine.native import compiler

    if not huge_pages_offered() or compiler() is None:
        pytest.skip("Linux offers no transparent huge pages here, or no C compiler")
    small = torch.randn(8, 8)
    assert on_huge_pages(small) is None  # under one huge page: left where it is
    path = make_model(
        tmp_path / "tied", "tiny", dtype="bfloat16", tie_word_embeddings=True, vocab_size=32768
    )
    embed = load_file(path / "model.safetensors")["model.embed_tokens.weight"]
    llm = LLM(model=str(path), dtype="bfloat16", kv_cache_memory="8MiB", kernels="linear=c")
    model = llm.engine.runner.model
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.lm_head.huge_pages and model.lm_head.weight.data_ptr() % (1 << 21) == 0
    assert torch.equal(model.lm_head.weight, embed)
    assert not any(
        m.huge_pages for m in model.modules() if m is not model.lm_head and hasattr(m, "huge_pages")
    )
    out = llm.generate([5, 6, 7], GREEDY)[0]
    assert len(out.token_ids) == 12 and all(0 <= t < 32768 for t in out.token_ids)
