"""A decode step's matmuls through every linear path, interleaved in one process.

Every weight of the ``small`` model's shapes (49 matmuls: qkv, o, gate_up and down of 12
layers, and the lm head) at a few rows, through torch's plain ``F.linear``, the oneDNN-packed
weights (``linear=packed``) and the C kernel (``linear=c``, engine/native.py), beside a plain
float32 sum over the same number of bytes (what streaming them costs on this machine).
``packed2048`` is the packed layout for many rows (the engine's under ``linear=c``), ``c_many``
the many-row C kernel (``batch_linear=c``: AMX tiles where the CPU and Linux allow them),
``c_many_huge`` the same over copies of the weights on transparent huge pages, as the engine
keeps the weights its C kernels stream (where Linux offers them), and ``pairs`` the
pair-interleaved copies (``linear=pairs`` at one row, ``batch_linear=pairs`` at more; with
AVX-512 BF16 or AVX2), printed against ``packed2048``; at one row also
``pairs2``, the same copies read as two streams a thread (``linear=pairs2``), printed against
``pairs``, and ``c / pairs2``. From 512 rows (a prefill chunk) also ``transposed``, torch.mm on a
transposed copy of each weight (``prefill_linear=transposed``), printed as ``plain /
transposed`` and ``packed2048 / transposed`` (over 1: the copy is faster).

    .venv/bin/python bench/linear_ab.py --rows 1 2 4 32 64

``--march x86-64-v3`` runs every C path on the engine's kernels built for that target (AVX2 and
FMA, no AVX-512) in place of this machine's build: the AVX2 kernels an AVX2-only CPU takes, on
whatever CPU is at hand.

``--ab-source FILE`` adds ``c_many_ab``: the many-row kernel built from FILE (e.g. an earlier
commit's ``decode_ops.c``, from ``git show REV:src/pdscope/engine/csrc/decode_ops.c``), so a
kernel change's before and after run interleaved in one process, and prints c_many_ab / c_many;
where both builds have the pairs kernels, ``pairs_ab`` too (``pairs2`` at one row, ``pairs``
at more, from FILE's build, over the same copies) and pairs_ab / pairs2 or pairs_ab / pairs.

At more than one row each matmul path's arithmetic rate is printed in place of its GB/s
(GFLOP/s: two per weight element a row), beside ``mm``, a float32 ``torch.mm`` of a square of
``SQUARE`` timed in the same rounds: the rate this machine's cores reach in float32 FMAs, the
bound on a batched step's matmuls where the kernels compute in float32 (no ``avx512_bf16``
or AMX).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine_bench import build_ops, machine_line
from pdscope.checkpoint.make_model import default_cache_dir
from pdscope.engine import native
from pdscope.engine.model import (
    ROWS_SPLIT_MIN_ROWS,
    linear_transposed,
    linear_widened,
    on_huge_pages,
    onednn_bf16,
    pairs_copy,
)

SHAPES = [(1536, 1024), (1024, 1024), (5632, 1024), (1024, 2816)] * 12 + [(16384, 1024)]
SQUARE = 2048  # mm's size: large enough to run at the FMA rate, small enough to time in rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, help="torch threads (default: all cores)")
    parser.add_argument("--ab-source", help="also the many-row kernel built from this C file")
    parser.add_argument("--march", help="the C kernels built for this gcc -march target instead")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.march:
        ops = build_ops(native.SOURCE, march=args.march, what="--march")
    else:
        ops = native.load(default_cache_dir() / "native")
    if ops is None:
        raise SystemExit("the C kernels did not build (a C compiler on PATH or in $CC)")
    other = build_ops(args.ab_source, march=args.march) if args.ab_source else None
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen).to(torch.bfloat16) for o, i in SHAPES]
    # oneDNN's packed layouts where it has a bf16 path: for one row, and for many as the
    # engine packs them under linear=c (PACKED_ROWS_WITH_C)
    onednn = onednn_bf16()
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights if onednn]
    packed_many = [torch.ops.mkldnn._reorder_linear_weight(w, 2048) for w in weights if onednn]
    pointwise = torch.ops.mkldnn._linear_pointwise.default
    huge = [on_huge_pages(w) for w in weights]
    # linear=pairs and batch_linear=pairs: the pair-interleaved copies, on huge pages as the
    # engine keeps them (several rows only where the build has AVX-512 BF16)
    pairs = [pairs_copy(w, ops) for w in weights] if ops.pairs else None
    prefill = any(rows >= ROWS_SPLIT_MIN_ROWS for rows in args.rows)
    transposed = [w.t().contiguous() for w in weights] if prefill else []
    nbytes = sum(w.numel() * 2 for w in weights)
    same_bytes = torch.ones(nbytes // 4)
    square = torch.randn(SQUARE, SQUARE, generator=gen)
    print(machine_line())
    built = f" (built for {args.march})" if args.march else ""
    print(
        f"C kernel: {ops.linear_isa}, many rows: {ops.linear_many_isa}, "
        f"pairs: {ops.pairs_isa or 'none'}{built}; "
        f"{nbytes / 1e6:.0f} MB of bf16 weights; ms per pass (mm: float32 GFLOP/s)"
    )
    for rows in args.rows:
        x = {i: torch.randn(rows, i, generator=gen).to(torch.bfloat16) for _, i in SHAPES}
        paths: dict[str, Callable[[], object]] = {
            "plain": lambda x=x: [F.linear(x[w.shape[1]], w) for w in weights]
        }
        if onednn:
            paths["packed"] = lambda x=x: [
                pointwise(x[w.shape[1]], p, None, "none", [], "")
                for w, p in zip(weights, packed, strict=True)
            ]
            paths["packed2048"] = lambda x=x: [
                pointwise(x[w.shape[1]], p, None, "none", [], "")
                for w, p in zip(weights, packed_many, strict=True)
            ]
        else:  # what several rows take there (matmul_math=float32)
            paths["widened"] = lambda x=x: [linear_widened(x[w.shape[1]], w, None) for w in weights]
        paths |= {
            "c": lambda x=x: [ops.linear(x[w.shape[1]], w) for w in weights],
            "c_many": lambda x=x: [ops.linear_many(x[w.shape[1]], w) for w in weights],
            "read": lambda: same_bytes.sum(),
        }
        if all(h is not None for h in huge):  # every weight here fills a huge page or more
            paths["c_many_huge"] = lambda x=x: [ops.linear_many(x[h.shape[1]], h) for h in huge]
        if pairs is not None and (rows == 1 or ops.pairs_rows):
            paths["pairs"] = lambda x=x: [
                ops.linear_pairs(x[w.shape[1]], p) for w, p in zip(weights, pairs, strict=True)
            ]
            if rows == 1:  # linear=pairs2: two streams a thread where pairs keeps eight
                paths["pairs2"] = lambda x=x: [
                    ops.linear_pairs(x[w.shape[1]], p, streams=2)
                    for w, p in zip(weights, pairs, strict=True)
                ]
        if rows >= ROWS_SPLIT_MIN_ROWS:  # prefill_linear=transposed
            paths["transposed"] = lambda x=x: [
                linear_transposed(x[w.shape[1]], t, None)
                for w, t in zip(weights, transposed, strict=True)
            ]
        if other is not None:
            paths["c_many_ab"] = lambda x=x: [other.linear_many(x[w.shape[1]], w) for w in weights]
            if "pairs" in paths and other.pairs and (rows == 1 or other.pairs_rows):
                streams = 2 if rows == 1 else 8
                paths["pairs_ab"] = lambda x=x, streams=streams: [
                    other.linear_pairs(x[w.shape[1]], p, streams=streams)
                    for w, p in zip(weights, pairs, strict=True)
                ]
        if rows > 1:  # last in each round: not between an A/B pair's two paths
            paths["mm"] = lambda: torch.mm(square, square)
        times: dict[str, list[float]] = {k: [] for k in paths}
        for fn in paths.values():
            fn()
        for _ in range(args.rounds):
            for name, fn in paths.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        flops = 2 * rows * (nbytes // 2)  # two a weight element (bf16: two bytes) a row
        cells = []
        for name, ts in times.items():
            med = statistics.median(ts)
            if name == "mm":
                cells.append(f"mm {2 * SQUARE**3 / med / 1e9:5.1f} GFLOP/s")
            elif name == "read" or rows == 1:
                cells.append(f"{name} {med * 1e3:6.2f} ({nbytes / med / 1e9:4.1f} GB/s)")
            else:
                cells.append(f"{name} {med * 1e3:6.2f} ({flops / med / 1e9:5.1f} GFLOP/s)")
        pairs_of = (
            ("packed", "c"),
            ("packed2048", "c_many"),
            ("widened", "c_many"),
            ("c_many", "c_many_huge"),
            ("c_many_ab", "c_many"),
            ("packed2048", "pairs"),
            ("pairs", "pairs2"),
            ("c", "pairs2"),
            ("pairs_ab", "pairs2" if rows == 1 else "pairs"),
            ("plain", "transposed"),
            ("packed2048", "transposed"),
        )
        ratios = [
            f"{a} / {b} "
            + f"{statistics.median(p / c for p, c in zip(times[a], times[b], strict=True)):.2f}"
            for a, b in pairs_of
            if a in times and b in times
        ]
        print(f"rows {rows:3}: " + "  ".join(cells) + "  " + ", ".join(ratios))


if __name__ == "__main__":
    main()
