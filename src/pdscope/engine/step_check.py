"""The one-call decode step, checked against a call per kernel when the engine loads.

A decodes-only step under the C kernels runs the embedding, every layer, the LM head and the
argmax in one C call (``decode_logits``), with two threads or more inside one OpenMP team whose
threads each take a share of every kernel. Its branches differ by CPU (AVX-512 BF16, AVX2, AMX
tiles), and the tests run only the ones of the CPU they run on. The one call is built to give
the per-kernel path's bits exactly (the shares split independent items only), so a single
step through both, on the model's own weights, tells whether it does on this CPU. Where it
does not, the engine keeps a call per kernel: slower, never wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdscope.engine.model import AttentionBatch, CausalLM, Linear

# Rows the check steps: batch 1 (the one-row matmuls), and 17 (two groups of 16 rows, the last
# short) where batched decode matmuls take the many-row C kernels.
CHECK_ROWS = (1, 17)
# Keys each sequence attends to: batch 1 long enough that a few KV heads over many threads cut
# its attention into context parts merged after a barrier; a batch short.
_CONTEXT = {1: 600, 17: 48}
_BLOCK = 16


@dataclass
class StepCheck:
    """What the check found: for each row count it stepped, whether the one call gave the
    per-kernel path's logits bit for bit and their argmax (``agrees``), and what the one call
    raised where it raised (``errors``). Empty where no step takes the one call here."""

    agrees: dict[int, bool]
    errors: dict[int, str]

    @property
    def passed(self) -> bool:
        return all(self.agrees.values())


def check_one_call(model: CausalLM) -> StepCheck:
    """Step the model once through the one C call and once through a call per kernel, at each
    of ``CHECK_ROWS`` that takes the one call, over random caches, and compare. Leaves the
    model as it found it."""
    check = StepCheck({}, {})
    native = model.native
    if native is None or not native.one_call:
        return check
    first = next(m for m in model.modules() if isinstance(m, Linear))
    saved = (model.fuse_decode, model.fuse_logits, model._decode_layers)
    gen = torch.Generator().manual_seed(0)
    try:
        for rows in CHECK_ROWS:
            if rows > 1 and first.native_many is None:
                continue  # batches take oneDNN here, outside the one call
            rows = min(rows, first.many_max_rows) if rows > 1 else rows
            batch, ids, caches = _step(model, rows, gen)
            model.fuse_decode = model.fuse_logits = True
            if model._fused_decode(rows, caches, batch) is None:
                continue
            model.fuse_decode = model.fuse_logits = False
            reference, _ = model.decode_logits(ids, [c.clone() for c in caches], batch)
            model.fuse_decode = model.fuse_logits = True
            try:
                logits, greedy = model.decode_logits(ids, caches, batch)
            except (RuntimeError, ValueError, MemoryError) as e:
                check.agrees[rows], check.errors[rows] = False, f"{type(e).__name__}: {e}"
                continue
            check.agrees[rows] = torch.equal(logits, reference) and (
                greedy is None or torch.equal(greedy, reference.argmax(-1))
            )
    finally:
        model.fuse_decode, model.fuse_logits, model._decode_layers = saved
    return check


def _step(
    model: CausalLM, rows: int, gen: torch.Generator
) -> tuple[AttentionBatch, torch.Tensor, list[torch.Tensor]]:
    """A decodes-only step of ``rows`` sequences, each on blocks of its own with random keys and
    values, decoding its last position: the batch, the token ids and the caches."""
    c, weight = model.config, model.embed_tokens.weight
    dev = weight.device
    context = max(1, min(_CONTEXT.get(rows, 48), model.rope_cos.shape[0]))
    blocks = -(-context // _BLOCK)
    shape = (2, c.num_kv_heads, rows * blocks * _BLOCK, c.head_dim)
    caches = [torch.randn(shape, generator=gen).to(weight.dtype) for _ in model.layers]
    tables = torch.arange(rows * blocks, device=dev).view(rows, blocks)
    last = context - 1
    batch = AttentionBatch(
        tables[:, last // _BLOCK] * _BLOCK + last % _BLOCK,
        _BLOCK,
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
