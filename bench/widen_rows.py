"""Where widening a bf16 matmul to float32 pays: one layer of the small model, by rows.

The four weights of one layer of the ``small`` model (qkv, o, gate_up, down), each matmul at
``--rows`` rows three ways, interleaved: ``F.linear`` in bf16, in float32 on float32 weights,
and bf16 widened to float32 for the call (what ``matmul_math=float32`` runs:
engine/model.py's ``linear_widened``). On a CPU where oneDNN has no bf16 path torch's bf16
matmul is a slow fallback, and this table sets ``WIDEN_MIN_ROWS``.

    .venv/bin/python bench/widen_rows.py --rows 1 8 12 16 24 32 512
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from engine_bench import machine_line
from pdscope.engine.kernels import median_times_s
from pdscope.engine.model import linear_widened

SHAPES = [(1536, 1024), (1024, 1024), (5632, 1024), (1024, 2816)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 12, 16, 24, 32, 512])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen).to(torch.bfloat16) for o, i in SHAPES]
    wide = [w.float() for w in weights]
    print(machine_line())
    print("one layer of the small model, ms per pass: medians of interleaved rounds")
    for rows in args.rows:
        x = {i: torch.randn(rows, i, generator=gen).to(torch.bfloat16) for _, i in SHAPES}
        xf = {i: t.float() for i, t in x.items()}
        paths = {
            "bf16": lambda x=x: [F.linear(x[w.shape[1]], w) for w in weights],
            "float32": lambda xf=xf: [F.linear(xf[w.shape[1]], w) for w in wide],
            "widened": lambda x=x: [linear_widened(x[w.shape[1]], w, None) for w in weights],
        }
        # the engine's own trial timing: a warm-up each, then rounds interleaved
        medians = median_times_s(paths, rounds=args.rounds, budget_s=math.inf)
        flop = sum(2 * rows * o * i for o, i in SHAPES)
        cells = [f"{k} {t * 1e3:8.2f} ({flop / t / 1e9:5.1f} GFLOP/s)" for k, t in medians.items()]
        print(f"rows {rows:4}: " + "  ".join(cells))


if __name__ == "__main__":
    main()
