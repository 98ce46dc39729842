"""The one-call decode step, checked against a call per kernel when the engine loads.

A decodes-only step under the C kernels runs the embedding, every layer, the LM head and the
argmax in one C call (``decode_logits``), with two threads or more inside one OpenMP team whose
threads each take a share of every kernel. Its branches differ by CPU (AVX-512 BF16, AVX2, AMX
tiles), and the tests run only the ones of the CPU they run on. The one call is built to give
the per-kernel path's bits exactly (the shares split independent items only), so a few steps
through both, on the model's own weights, tell whether it does on this CPU: a check at a few
shapes, not a proof. Where it does not, the engine keeps a call per kernel: slower, never wrong.
A pass is cached per CPU, library build, thread count, model shapes and kernel choice, so that
a large model pays the check's steps once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdscope.engine.kernels import machine_key, write_cache
from pdscope.engine.model import NATIVE_MANY_MAX_ROWS, AttentionBatch, CausalLM, Linear

# (rows, keys a sequence attends to) of each step checked: batch 1 over keys enough that few
# KV heads on many threads cut its attention into context parts merged after a barrier, and
# over few (the team's serial attention: thread 0 alone); batches of 5 (the pairs tiles' short
# tails) and 17 (two groups of 16 rows, the last short) where batched matmuls take the C
# kernels, cut to the most rows those take where fewer; and 41 (five tiles of 8 and a tail of
# one in the copies, a pass of 32 and one of 9 on the tiles) where big_batch_linear takes the C
# kernels.
CHECK_STEPS = ((1, 600), (1, 32), (5, 48), (17, 48), (41, 48))
_CHECK_VERSION = 2

_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class StepCheck:
    """For each step checked ("batch R at K keys"), whether the one call gave the per-kernel
    path's logits, argmax and K/V writes bit for bit (``agrees``), and how it did not where
    not (``differences``); ``cached`` where a pass was read from the cache. Empty where no step
    takes the one call here."""

    agrees: dict[str, bool] = field(default_factory=dict)
    differences: dict[str, str] = field(default_factory=dict)
    unchecked: dict[str, str] = field(default_factory=dict)  # the per-kernel path raised
    cached: bool = False

    @property
    def passed(self) -> bool:
        return bool(self.agrees) and all(self.agrees.values())


def check_one_call(
    model: CausalLM, block_size: int = 16, cache_key: dict[str, object] | None = None,
    cache_dir: Path | None = None,
) -> StepCheck:  # fmt: skip
    """Step the model through the one C call and through a call per kernel at each of
    ``CHECK_STEPS`` the one call takes, over random caches of ``block_size``-token blocks, and
    compare; leaves the model as it found it. With ``cache_dir``, a pass is recorded there under
    ``cache_key`` (what else the outcome depends on: the kernel choice, the dtype) and read back
    instead of stepping."""
    native = model.native
    if native is None or not native.one_call:
        return StepCheck()
    cache_file = _cache_file(model, block_size, cache_key, cache_dir)
    if cache_file is not None and cache_file.is_file():
        try:
            agrees = json.loads(cache_file.read_text())["agrees"]
            return StepCheck(agrees={str(k): True for k in agrees}, cached=True)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged record is checked again and rewritten
    check = _check(model, block_size)
    if check.passed and cache_file is not None:
        write_cache(cache_file, json.dumps({"agrees": list(check.agrees)}))
    return check


def _cache_file(
    model: CausalLM, block_size: int, key: dict[str, object] | None, cache_dir: Path | None
) -> Path | None:
    native = model.native
    if cache_dir is None or native is None:
        return None
    c = model.config
    name = machine_key(
        check=_CHECK_VERSION,
        library=Path(getattr(native.lib, "_name", "")).name,  # named by source and build
        shapes=(c.hidden_size, c.intermediate_size, c.vocab_size, c.num_layers),
        heads=(c.num_heads, c.num_kv_heads, c.head_dim),
        block_size=block_size,
        **(key or {}),
    )
    return cache_dir / f"{name}.json"


def _check(model: CausalLM, block_size: int) -> StepCheck:
    check = StepCheck()
    first = next(m for m in model.modules() if isinstance(m, Linear))
    saved = (model.fuse_decode, model.fuse_logits, model._decode_layers)
    gen = torch.Generator().manual_seed(0)
    seen: set[tuple[int, int]] = set()
    try:
        for asked, keys in CHECK_STEPS:
            if asked > NATIVE_MANY_MAX_ROWS:
                if first.big_batch is None:
                    continue  # such batches take oneDNN here, outside the one call
                rows = asked
            elif asked > 1 and first.native_many is None:
                continue  # batches take oneDNN here, outside the one call
            else:
                rows = min(asked, first.many_max_rows) if asked > 1 else 1
            if (rows, keys) in seen:
                continue
            seen.add((rows, keys))
            label = f"batch {rows} at {keys} keys"
            batch, ids, caches = _step(model, rows, keys, block_size, gen)
            model.fuse_decode = model.fuse_logits = True
            try:
                if model._fused_decode(rows, caches, batch) is None:
                    continue  # this step leaves the one call (a row count on oneDNN)
            except (RuntimeError, ValueError, MemoryError) as e:
                check.agrees[label], check.differences[label] = False, f"{type(e).__name__}: {e}"
                continue
            model.fuse_decode = model.fuse_logits = False
            ref_caches = [c.clone() for c in caches]
            try:
                reference, _ = model.decode_logits(ids, ref_caches, batch)
            except (RuntimeError, ValueError, MemoryError) as e:
                check.unchecked[label] = f"{type(e).__name__}: {e}"
                continue
            model.fuse_decode = model.fuse_logits = True
            try:
                logits, greedy = model.decode_logits(ids, caches, batch)
            except (RuntimeError, ValueError, MemoryError) as e:
                check.agrees[label], check.differences[label] = False, f"{type(e).__name__}: {e}"
                continue
            differs = _differences(logits, reference, greedy, caches, ref_caches)
            check.agrees[label] = not differs
            if differs:
                check.differences[label] = differs
    finally:
        model.fuse_decode, model.fuse_logits, model._decode_layers = saved
    return check


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit: NaN where NaN, -0 apart from +0 (torch.equal is neither)."""
    bits = _BITS[a.element_size()]
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(bits), b.view(bits))


def _differences(
    logits: torch.Tensor,
    reference: torch.Tensor,
    greedy: torch.Tensor | None,
    caches: list[torch.Tensor],
    ref_caches: list[torch.Tensor],
) -> str:
    """What differs between the one call's step and the per-kernel one ('' where nothing)."""
    said = []
    if not _same_bits(logits, reference):
        if logits.shape == reference.shape and logits.dtype == reference.dtype:
            bits = _BITS[logits.element_size()]
            n = int((logits.view(bits) != reference.view(bits)).sum())
            said.append(f"{n} of {reference.numel()} logits")
        else:
            said.append(f"the logits' shape or type ({tuple(logits.shape)}, {logits.dtype})")
    if greedy is not None and not torch.equal(greedy, reference.argmax(-1)):
        wrong = int((greedy != reference.argmax(-1)).sum())
        said.append(f"the argmax in {wrong} of {greedy.numel()} rows")
    layers = sum(not _same_bits(a, b) for a, b in zip(caches, ref_caches, strict=True))
    if layers:
        said.append(f"the K/V written in {layers} of {len(caches)} layers")
    return ", ".join(said)


def _step(
    model: CausalLM, rows: int, keys: int, block_size: int, gen: torch.Generator
) -> tuple[AttentionBatch, torch.Tensor, list[torch.Tensor]]:
    """A decodes-only step of ``rows`` sequences, each on blocks of its own with random keys and
    values, decoding its last position: the batch, the token ids and the caches."""
    c, weight = model.config, model.embed_tokens.weight
    dev = weight.device
    context = max(1, min(keys, model.rope_cos.shape[0]))
    blocks = -(-context // block_size)
    shape = (2, c.num_kv_heads, rows * blocks * block_size, c.head_dim)
    caches = [torch.randn(shape, generator=gen).to(weight.dtype) for _ in model.layers]
    tables = torch.arange(rows * blocks, device=dev).view(rows, blocks)
    last = context - 1
    batch = AttentionBatch(
        tables[:, last // block_size] * block_size + last % block_size,
        block_size,
        rows,
        None,
        (0, 0),
        None,
        [],
        decode_tables=tables,
        decode_bounds=torch.tensor([[0, context]] * rows, device=dev),
        positions=torch.full((rows,), last, device=dev),
    )
    ids = torch.randint(0, c.vocab_size, (rows,), generator=gen).to(dev)
    return batch, ids, [t.to(dev) for t in caches]
