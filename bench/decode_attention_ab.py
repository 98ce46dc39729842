"""The C decode attention alone: its generic loop against the engine's build, interleaved.

One decode step's attention for the ``small`` model's shapes (12 layers, 16 query heads over 4
KV heads of 64, bf16, blocks of 16; ``--head-dim``, ``--heads``, ``--kv-heads`` and ``--layers``
set others, e.g. a 3B's 128, 24, 8 and 28) at ``--batch`` sequences (1) of each given context,
each sequence its own ascending run of blocks, through the library built with
``-DNEW_DECODE_ATTENTION=0`` (the generic per-key loop, ``generic``), with ``=1`` (16 keys at
a time for head size 64 or 128 in AVX-512, ``avx512``) and the engine's build (``c``: the same
with the scores on AMX tiles where the CPU and Linux grant them), beside a float32 sum over the same
bytes of K and V. Wall time and this process's CPU time (robust to a busy host
at ``--threads 1``), medians.

    .venv/bin/python bench/decode_attention_ab.py --contexts 64 1000 4000 --threads 1
    .venv/bin/python bench/decode_attention_ab.py --batch 32 --contexts 144
    .venv/bin/python bench/decode_attention_ab.py --march x86-64-v3   # an AVX2-only CPU's

``--march TARGET`` builds ``generic`` and ``c`` for that gcc target instead of this CPU (for
x86-64-v3, ``c`` is the AVX2 kernel of 16 keys a tile; ``avx512`` is left out).

``--prefetch jumps|every|both`` sets the kernel choice's ``decode_prefetch`` in every build
that has it (default jumps, the library's own default); ``both`` runs them at jumps and
``c_every`` beside them (the engine's build at every), and prints c_every / c.

``--cold MB`` reads MB of other memory before each layer's attention, as a decode step reads a
layer's weights before it (the small model's are ~25 MB), so the KV comes from memory rather
than a cache left warm by the last round; only the attention calls are timed, so the CPU
column (which would hold the other reads) prints as ``-`` and the float32 read is left out.

``--huge-cache`` adds ``c_huge``: the engine's build over the same caches copied onto
transparent huge pages (as the engine's runner allocates them where Linux offers them; the
others' caches are on torch's ordinary pages), and prints c_huge / c; with ``--ab-source`` also
``ab_huge``, that build over the same huge caches, and ab_huge / c_huge.

``--ab-source FILE`` adds ``ab``: the engine's build compiled from FILE (e.g. an earlier
commit's ``decode_ops.c``, from ``git show REV:src/pdscope/engine/csrc/decode_ops.c``), so a
change to the attention runs before and after, interleaved, and prints ab / c (the time the
other build takes over this one's: above 1, this build is faster).

``--scattered`` adds the engine's build over one sequence's table in a pool of 1,170 blocks
(engine_bench's 2 GiB on the 3B; ``--pool-blocks``), its caches on huge pages as the runner's:
``one_run`` (consecutive blocks), and the table the pool hands a prompt of that context after
five rounds of engine_bench's allocations (two batches of 32 prompts of 9 blocks growing 8
blocks each, side by side, then the prompt itself) under ``BlockPool(grow_runs=False)``
(``lru``, the allocation before the 58th session) and as the engine allocates now (``runs``);
it prints each table's runs of consecutive blocks and the times over one_run's:

    .venv/bin/python bench/decode_attention_ab.py --scattered --head-dim 128 --heads 24 \
        --kv-heads 8 --layers 28 --contexts 3950
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time

import torch

from decode_ops_ab import generic_attention_ops
from engine_bench import build_ops, interleaved_times, machine_line
from pdscope.checkpoint.make_model import default_cache_dir
from pdscope.engine import native
from pdscope.engine.block_pool import BlockPool
from pdscope.engine.model import huge_pages_setting
from pdscope.engine.runner import kv_cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4000])
    parser.add_argument(
        "--batch", type=int, default=1, help="sequences a step, each of every context"
    )
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--threads", type=int, help="torch threads (default: all cores)")
    parser.add_argument("--ab-source", help="decode_ops.c to build as the `ab` candidate")
    parser.add_argument(
        "--huge-cache", action="store_true", help="also the engine's build over huge pages"
    )
    parser.add_argument("--march", help="build generic and c for this gcc -march target")
    parser.add_argument(
        "--cold",
        type=int,
        metavar="MB",
        help="read MB of other memory before each layer's attention (timed: the calls alone)",
    )
    parser.add_argument("--head-dim", type=int, default=64, help="head size (the small's 64)")
    parser.add_argument("--heads", type=int, default=16, help="query heads (the small's 16)")
    parser.add_argument("--kv-heads", type=int, default=4, help="KV heads (the small's 4)")
    parser.add_argument("--layers", type=int, default=12, help="layers (the small's 12)")
    parser.add_argument(
        "--prefetch",
        choices=("jumps", "every", "both"),
        default="jumps",
        help="decode_prefetch for every build that has it (both: at jumps, and c_every)",
    )
    parser.add_argument(
        "--scattered",
        action="store_true",
        help="also one sequence's tables from a wrapped pool: one run, LRU order, grown runs",
    )
    parser.add_argument("--pool-blocks", type=int, default=1170, help="the pool for --scattered")
    args = parser.parse_args()
    if args.scattered and (args.batch != 1 or args.cold):
        raise SystemExit("--scattered: one sequence (--batch 1), no --cold")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.march:
        engine_ops = build_ops(native.SOURCE, what="--march", march=args.march)
        ops = {"generic": generic_attention_ops(0, args.march), "c": engine_ops}
    else:
        built = native.load(default_cache_dir() / "native")
        if built is None:
            raise SystemExit("the C kernels did not build (a C compiler on PATH or in $CC)")
        engine_ops = built
        ops = {"generic": generic_attention_ops(), "avx512": generic_attention_ops(1), "c": built}
    if args.ab_source:
        ops["ab"] = build_ops(args.ab_source, march=args.march)
    if args.prefetch != "jumps" and not engine_ops.has_decode_prefetch:
        raise SystemExit(f"--prefetch {args.prefetch}: this build of c has no decode_prefetch")
    for o in ops.values():  # every build that has it, avx512 too, so their ratios compare alike
        if o.has_decode_prefetch:
            o.set_decode_prefetch("jumps" if args.prefetch == "both" else args.prefetch)
    block, kv_heads, heads, dim, layers = 16, args.kv_heads, args.heads, args.head_dim, args.layers
    if min(kv_heads, heads, dim, layers) < 1 or heads % kv_heads:
        raise SystemExit("--heads must be a positive multiple of --kv-heads; all sizes positive")
    if args.cold is not None and args.cold <= 0:
        raise SystemExit(f"--cold must be a positive number of MB, not {args.cold}")
    other = torch.ones(args.cold << 18) if args.cold else None
    gen = torch.Generator().manual_seed(0)
    print(machine_line())
    print(
        f"ms per step's attention ({layers} layers, {heads} heads over {kv_heads} KV heads of"
        f" {dim}), wall / CPU; GB/s of K and V by wall time"
    )
    for context in args.contexts:
        # each sequence its own ascending run of blocks, as a fresh pool hands them out
        per_seq = (context + block - 1) // block
        blocks = per_seq * args.batch
        caches = [
            torch.randn(2, kv_heads, blocks * block, dim, generator=gen).to(torch.bfloat16)
            for _ in range(layers)
        ]
        tables = torch.arange(blocks).view(args.batch, per_seq).contiguous()
        bounds = torch.tensor([[0, context]] * args.batch)
        q = torch.randn(args.batch, heads, dim, generator=gen).to(torch.bfloat16)
        nbytes = layers * 2 * kv_heads * context * dim * 2 * args.batch
        same_bytes = torch.ones(nbytes // 4 if other is None else 1)  # read only when warm

        def step(
            o: native.NativeOps,
            over: list[torch.Tensor] | None = None,
            caches=caches,
            q=q,
            tables=tables,
            bounds=bounds,
        ) -> float:
            """The attention of every layer; with --cold, after the other reads, and the
            seconds its calls alone took."""
            took = 0.0
            for c in caches if over is None else over:
                if other is not None:
                    other.sum()
                t0 = time.perf_counter()
                o.decode_attention(q, c, tables, bounds, block, dim**-0.5)
                took += time.perf_counter() - t0
            return took

        paths = {name: (lambda o=o: step(o)) for name, o in ops.items()}
        if args.prefetch == "both":

            def every(step=step) -> float:
                engine_ops.set_decode_prefetch("every")
                took = step(engine_ops)
                engine_ops.set_decode_prefetch("jumps")
                return took

            paths["c_every"] = every
        if args.huge_cache:
            if huge_pages_setting() != "madvise":  # under always, the others' are huge too
                raise SystemExit("--huge-cache: needs transparent huge pages set to madvise")
            huge = [kv_cache(c.shape, c.dtype, c.device).copy_(c) for c in caches]
            # a cache under one huge page, or no huge pages offered: ordinary pages, left out
            if all(c.data_ptr() % (2 << 20) == 0 for c in huge):
                paths["c_huge"] = lambda huge=huge: step(engine_ops, huge)
                if "ab" in ops:
                    paths["ab_huge"] = lambda huge=huge: step(ops["ab"], huge)
        if args.scattered:
            need = -(-context // block)
            if need + 128 > args.pool_blocks or need <= 128:
                raise SystemExit(f"--scattered: {context} keys in a pool of {args.pool_blocks}")
            shape = (2, kv_heads, args.pool_blocks * block, dim)
            pooled = [kv_cache(shape, torch.bfloat16, torch.device("cpu")) for _ in caches]
            for c in pooled:
                c.normal_(generator=gen)
            tables_of = {
                "one_run": list(range(need)),
                "lru": scattered_table(args.pool_blocks, need, grow_runs=False),
                "runs": scattered_table(args.pool_blocks, need, grow_runs=True),
            }
            as_tensors = {name: torch.tensor([table]) for name, table in tables_of.items()}
            for name in tables_of:
                paths[name] = lambda t=as_tensors[name], over=pooled: step(
                    engine_ops, over, tables=t
                )
        paths["read"] = lambda same_bytes=same_bytes: same_bytes.sum()
        if other is not None:  # each call's own seconds, the other reads left out
            calls: dict[str, list[float]] = {name: [] for name in paths}
            paths = {
                name: (lambda fn=fn, took=calls[name]: took.append(fn()))
                for name, fn in paths.items()
                if name != "read"
            }
        wall, cpu = interleaved_times(paths, args.rounds)
        if other is not None:
            wall = {name: took[1:] for name, took in calls.items() if took}  # less the warm-up
        cells = []
        for name in paths:
            w, c = statistics.median(wall[name]), statistics.median(cpu[name])
            cpu_ms = "     -" if other is not None else f"{c * 1e3:6.2f}"  # cold: the reads in it
            cells.append(f"{name} {w * 1e3:6.2f} / {cpu_ms} ({nbytes / w / 1e9:4.1f} GB/s)")
        ratios = [
            f"  {name} / c {_over(wall[name], wall['c']):.2f}"
            for name in ("generic", "avx512")
            if name in paths
        ]
        # the time ab (c_huge) takes over c's: above 1, c is faster
        extra = [(name, "c") for name in ("ab", "c_every", "c_huge") if name in paths]
        if "ab_huge" in paths:
            extra.append(("ab_huge", "c_huge"))
        if args.scattered:
            extra += [("lru", "one_run"), ("runs", "one_run"), ("lru", "runs")]
            print(
                "runs of consecutive blocks: "
                + ", ".join(f"{name} {runs_of(t)}" for name, t in tables_of.items())
            )
        print(
            f"context {context:5}: "
            + "  ".join(cells)
            + "".join(ratios)
            + "".join(
                f"  {name} / {base} {_over(wall[name], wall[base]):.2f}" for name, base in extra
            )
        )


def scattered_table(pool_blocks: int, need: int, grow_runs: bool) -> list[int]:
    """The table a prompt of ``need`` blocks (16 keys) gets in a pool of ``pool_blocks`` after
    five rounds of engine_bench's allocations, each: two batches of 32 prompts of 9 blocks that
    grow 8 blocks each a block at a time, side by side, then the prompt, in chunks of 128
    blocks (2,048 tokens); every table published under fresh hashes and freed when done."""
    pool = BlockPool(pool_blocks, 16, grow_runs=grow_runs)
    rng = random.Random(0)

    def done(table: list[int]) -> None:
        pool.register_full_blocks(table, [rng.randbytes(16) for _ in table])
        pool.free(table)

    for _ in range(5):
        for _ in range(2):
            batch = [pool.allocate(9) for _ in range(32)]
            for _ in range(8):
                for table in batch:
                    table += pool.allocate(1, table[-1])
            for table in batch:
                done(table)
        prompt = pool.allocate(128)
        prompt += pool.allocate(need - 128, prompt[-1])
        done(list(prompt))
    return prompt


def runs_of(table: list[int]) -> int:
    """How many runs of consecutive block ids ``table`` is made of."""
    return 1 + sum(1 for a, b in itertools.pairwise(table) if b != a + 1)


def _over(a: list[float], b: list[float]) -> float:
    """The median within rounds of a's time over b's."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


if __name__ == "__main__":
    main()
