"""batch_linear=pairs' tile shape: the engine's build (8 rows x 3 blocks of 16 outputs)
against builds with other shapes (``-DPAIRS_TILE_ROWS``, ``-DPAIRS_TILE_BLOCKS``),
interleaved in one process.

Every weight of the ``small`` model's shapes (49 matmuls, 304 MB of bf16, as pair-interleaved
copies) at ``--rows`` (8, 16 and 32) through ``NativeOps.linear_pairs`` of each build; every
build's result is checked to be the same bits first (each output sums its pairs in one order
whatever the tile). Prints each shape's median time and, in brackets, the median within
rounds of the engine's time over its (above 1: that shape is faster).

    .venv/bin/python bench/pairs_tiles_ab.py --rounds 9

``--ab-source FILE`` adds ``ab``: the kernels compiled from FILE (e.g. a changed
``decode_ops.c``, or an earlier commit's from ``git show REV:src/pdscope/engine/csrc/decode_ops.c``)
at the engine's shape; ``--shapes`` with no shapes leaves the other shapes out. ``--model DIR``
takes one decoder layer's four matmuls (fused qkv, o, fused gate/up, down) of that checkpoint's
config.json instead of the small model's 49: a prefill's rows through a larger model's shapes,

    .venv/bin/python bench/pairs_tiles_ab.py --rows 2000 --shapes --ab-source /tmp/before.c \
        --model /tmp/m3b
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from engine_bench import build_ops, machine_line
from pdscope.checkpoint.make_model import default_cache_dir
from pdscope.engine import native
from pdscope.engine.model import pairs_copy
from pdscope.specs import architectures as registry
from pdscope.specs.models import read_config

SHAPES = [(1536, 1024), (1024, 1024), (5632, 1024), (1024, 2816)] * 12 + [(16384, 1024)]
SOURCE = Path(native.__file__).parent / "csrc" / "decode_ops.c"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument(
        "--shapes", nargs="*", default=["8x2", "6x4", "4x6", "4x4"], help="ROWSxBLOCKS"
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--ab-source", help="decode_ops.c to build as the `ab` candidate")
    parser.add_argument("--model", type=Path, help="one layer's shapes from this config.json")
    args = parser.parse_args()
    shapes = layer_shapes(read_config(args.model)) if args.model else SHAPES
    engine = native.load(default_cache_dir() / "native")
    if engine is None or engine.pairs_isa != "avx512_bf16":  # the -D shapes are AVX-512's
        raise SystemExit("needs the C kernels built with AVX-512 BF16")
    builds = {"8x3": engine}
    for shape in args.shapes:
        rows, blocks = shape.split("x")
        builds[shape] = build_ops(SOURCE, f"PAIRS_TILE_ROWS={rows}", f"PAIRS_TILE_BLOCKS={blocks}")
    if args.ab_source:
        builds["ab"] = build_ops(args.ab_source)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen).to(torch.bfloat16) for o, i in shapes]
    copies = [pairs_copy(w, engine) for w in weights]
    assert all(c is not None for c in copies)
    print(machine_line())
    for rows in args.rows:
        x = {i: torch.randn(rows, i, generator=gen).to(torch.bfloat16) for _, i in shapes}

        def run(ops: native.NativeOps, x: dict[int, torch.Tensor] = x) -> list[torch.Tensor]:
            pairs = zip(weights, copies, strict=True)
            return [ops.linear_pairs(x[w.shape[1]], c) for w, c in pairs]

        ref = run(engine)
        for name, ops in builds.items():
            assert all(torch.equal(a, b) for a, b in zip(ref, run(ops), strict=True)), name
        times: dict[str, list[float]] = {name: [] for name in builds}
        for round_no in range(args.rounds):
            order = list(builds.items())
            for name, ops in order if round_no % 2 == 0 else reversed(order):
                start = time.perf_counter()
                run(ops)
                times[name].append(time.perf_counter() - start)
        cells = []
        for name, ts in times.items():
            within = statistics.median(a / b for a, b in zip(times["8x3"], ts, strict=True))
            cells.append(f"{name} {statistics.median(ts) * 1e3:.2f} ms ({within:.3f})")
        print(f"rows {rows:2}: " + "  ".join(cells), flush=True)


def layer_shapes(config: dict[str, Any]) -> list[tuple[int, int]]:
    """(outputs, inputs) of one decoder layer's matmuls as the engine fuses them."""
    hidden, heads, inter = (
        config[k] for k in ("hidden_size", "num_attention_heads", "intermediate_size")
    )
    dim = registry.head_dim(config)
    qkv = (heads + 2 * registry.num_kv_heads(config)) * dim
    return [(qkv, hidden), (hidden, heads * dim), (2 * inter, hidden), (hidden, inter)]


if __name__ == "__main__":
    main()
