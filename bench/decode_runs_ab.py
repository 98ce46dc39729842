"""The PyTorch decode path's single-sequence attention: gather + SDPA against in place, by runs.

One decoding sequence's attention over ``--layers`` layers' caches (the 3B's shapes by default:
24 query heads over 8 KV heads of 128, bf16, blocks of 16, a pool of 1,170 blocks), its table
cut into R runs of consecutive blocks spread over the pool, through the two paths of
``Attention._decode``: the gather (``_gather_blocks``, an ``index_select`` copy of its blocks,
then SDPA) and in place (``Attention._decode_in_place``: SDPA on one strided view, or torch's
flash kernel on each run, merged by their log-sum-exps). Interleaved, medians of ``--repeats``
per pair (the gather first in each), on the engine's settled heap; prints gather / in place
(above 1, in place is faster) beside whether ``can_decode_in_place`` takes the table, the rule
these figures set (``MAX_DECODE_RUNS``, ``MIN_KEYS_PER_RUN`` in engine/model.py). This is the
path where the C kernels are not built or the trial picks ``decode_ops=torch``; the C path
reads any table in place.

    .venv/bin/python bench/decode_runs_ab.py --contexts 256 1024 4000 --runs 1 8 16 32
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdscope.engine.malloc import settle_heap
from pdscope.engine.model import (
    Attention,
    ModelConfig,
    _gather_blocks,
    block_rows,
    can_decode_in_place,
    slot_runs,
)


def spread_table(blocks: int, runs: int, pool_blocks: int) -> list[int]:
    """``blocks`` block ids in ``runs`` runs of consecutive ids, the runs apart in the pool."""
    stride = pool_blocks // runs
    per, table = blocks // runs, []
    assert per >= 1 and stride > per, "more runs than the context's blocks, or a pool too small"
    for r in range(runs):
        n = per if r < runs - 1 else blocks - per * (runs - 1)
        table += range(r * stride, r * stride + n)
    assert table[-1] < pool_blocks, "the last run past the pool: a larger --pool-blocks"
    return table


def median_s(
    fn: Callable[[], object], repeats: int, other: Callable[[], object]
) -> tuple[float, float]:
    """Medians of ``fn`` and ``other`` timed in turn, ``repeats`` times each."""
    a, b = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        a.append(time.perf_counter() - start)
        start = time.perf_counter()
        other()
        b.append(time.perf_counter() - start)
    return statistics.median(a), statistics.median(b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4000])
    parser.add_argument("--runs", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--pool-blocks", type=int, default=1170)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # the engine's heap (heap=settled): the gather's output then comes from the heap, not a
    # fresh mapping faulted in page by page, which doubled the gather's time here
    settled = settle_heap()
    block = 16
    cfg = ModelConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 256,
            "hidden_size": args.heads * args.head_dim,
            "intermediate_size": 256,
            "num_hidden_layers": 1,
            "num_attention_heads": args.heads,
            "num_key_value_heads": args.kv_heads,
            "head_dim": args.head_dim,
        }
    )
    attn = Attention(cfg).to(torch.bfloat16)
    kvh, group, dim = args.kv_heads, args.heads // args.kv_heads, args.head_dim
    slots = args.pool_blocks * block
    caches = [torch.randn(2, kvh, slots, dim, dtype=torch.bfloat16) for _ in range(args.layers)]
    q = torch.randn(1, args.heads, dim, dtype=torch.bfloat16)
    print(
        f"{args.layers} layers, {args.heads} query heads over {kvh} KV heads of {dim}, bf16, "
        f"{args.threads} threads; medians of {args.repeats}, interleaved; heap settled: {settled}"
    )
    print(f"{'keys':>6} {'runs':>5} {'gather ms':>10} {'in place ms':>12} {'gather/in place':>16}"
          f" {'rule':>9}")  # fmt: skip
    with torch.inference_mode():
        for keys in args.contexts:
            for runs in args.runs:
                if runs > -(-keys // block):
                    print(f"{keys:>6} {runs:>5}   (more runs than the context's blocks)")
                    continue
                table = spread_table(-(-keys // block), runs, args.pool_blocks)
                spans = slot_runs(table, 0, keys, block)
                assert len(spans) == runs
                rows = block_rows(torch.tensor(table), kvh, args.pool_blocks)

                def gather(rows: torch.Tensor = rows, keys: int = keys) -> None:
                    for cache in caches:
                        kv = _gather_blocks(cache, rows, block)[:, :, :keys].unsqueeze(1)
                        query = q.view(1, kvh, group, dim)
                        F.scaled_dot_product_attention(query, kv[0], kv[1], scale=attn.scale)

                def in_place(spans: list[tuple[int, int]] = spans) -> None:
                    for cache in caches:
                        attn._decode_in_place(q, cache, spans)

                got = attn._decode_in_place(q, caches[0], spans).float()
                kv = _gather_blocks(caches[0], rows, block)[:, :, :keys].unsqueeze(1)
                ref = F.scaled_dot_product_attention(
                    q.view(1, kvh, group, dim).float(), kv[0].float(), kv[1].float(),
                    scale=attn.scale,
                )  # fmt: skip
                torch.testing.assert_close(got.view(-1), ref.reshape(-1), atol=2e-2, rtol=2e-2)
                gather(), in_place()  # warm-up
                g, p = median_s(gather, args.repeats, in_place)
                rule = "in place" if can_decode_in_place(spans, q.device) else "gather"
                print(f"{keys:>6} {runs:>5} {g * 1e3:>10.1f} {p * 1e3:>12.1f} {g / p:>16.2f}"
                      f" {rule:>9}")  # fmt: skip


if __name__ == "__main__":
    main()
