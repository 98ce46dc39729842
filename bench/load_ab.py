"""A checkpoint's load (engine/loader.py's load_model alone), this tree against another's,
interleaved.

Each round loads the checkpoint in a fresh process from this tree and from ``--ab-tree`` (a
worktree of an earlier commit: ``git worktree add /tmp/before REV``), in alternating order.
Prints per load the seconds load_model took and the growth of the process's peak resident
memory over it (``ru_maxrss``: the weights, and whatever the load keeps beside them at its
peak, file pages it maps included), then each tree's median and the ratio of the medians.
The file's pages are in the page cache after the first load of a round, so the two trees
read it alike; the first round's first load may read from disk.

    git worktree add /tmp/before c032200
    .venv/bin/python bench/load_ab.py /tmp/m1b --ab-tree /tmp/before --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from engine_bench import machine_line

HERE = Path(__file__).resolve().parent.parent
CHILD = """
import json, resource, sys, time, torch
from pathlib import Path
from pdscope.engine.loader import load_model
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
model = load_model(Path(sys.argv[1]), torch.bfloat16, torch.device("cpu"))
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
weights = sum(p.numel() * p.element_size() for p in model.parameters())
grown = (peak - before) * 1024 / 1e9
print(json.dumps({"s": seconds, "grown_gb": grown, "weights_gb": weights / 1e9}))
"""


def load(tree: Path, model: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    run = subprocess.run(
        [sys.executable, "-c", CHILD, model], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(run.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a checkpoint directory")
    parser.add_argument("--ab-tree", type=Path, required=True, help="the other source tree")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    trees = {"this": HERE, "ab": args.ab_tree.resolve()}
    print(machine_line())
    got: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name in trees if r % 2 == 0 else reversed(trees):
            one = load(trees[name], args.model)
            got[name].append(one)
            print(
                f"round {r + 1} {name}: {one['s']:.2f} s, peak grew {one['grown_gb']:.2f} GB "
                f"({one['weights_gb']:.2f} GB of weights)",
                flush=True,
            )
    medians = {
        name: {k: statistics.median(run[k] for run in runs) for k in ("s", "grown_gb")}
        for name, runs in got.items()
    }
    for name, m in medians.items():
        print(f"{name}: {m['s']:.2f} s, peak grew {m['grown_gb']:.2f} GB (median of {args.rounds})")
    this, ab = medians["this"], medians["ab"]
    print(
        f"ab / this: load time {ab['s'] / this['s']:.2f}x, "
        f"peak growth {ab['grown_gb'] / this['grown_gb']:.2f}x"
    )


if __name__ == "__main__":
    main()
