"""An engine's start, uncached and cached, against another tree's, interleaved.

Each round builds the engine in a fresh process from this tree and from ``--ab-tree`` (e.g. a
worktree of an earlier commit: ``git worktree add /tmp/before REV``), in alternating order,
twice each: first with an empty kernel-choice and step-check cache (a start on a new machine or
model: the kernel trials and the one-call check run), then with the cache that start wrote.
The checkpoint and the C kernels' build are shared by every start (made once, beforehand), so
neither is timed. Prints per tree and kind of start: the seconds until the engine is built, the
peak resident memory, the memory resident once it is built (VmRSS: the weights and their
copies, the KV cache of 256 MiB, torch), and the ratio of the two trees' medians.

    git worktree add /tmp/before e28a7c5
    .venv/bin/python bench/start_ab.py /tmp/m1b --ab-tree /tmp/before --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from engine_bench import machine_line

HERE = Path(__file__).resolve().parent.parent
# Run in the child: builds the engine, prints its seconds and the process's peak and resident
# memory.
CHILD = """
import gc, json, resource, sys, time
start = time.perf_counter()
from pdscope.engine.llm_engine import LLMEngine
engine = LLMEngine(model=sys.argv[1], kv_cache_memory="256MiB", max_model_len=2048)
seconds = time.perf_counter() - start
gc.collect()
with open("/proc/self/status") as f:
    rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
print(json.dumps({
    "s": seconds,
    "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
    "resident_gb": rss_kb / 1e6,
    "kernels": engine.kernels.summary(),
}))
"""


def start(tree: Path, model: str, cache: Path) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "PDSCOPE_CACHE": str(cache)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, model], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a checkpoint directory, or small")
    parser.add_argument("--ab-tree", type=Path, required=True, help="the other source tree")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    trees = {"this": HERE, "ab": args.ab_tree.resolve()}
    base = Path(tempfile.mkdtemp(prefix="start_ab-"))
    shared = base / "shared"
    for tree in trees.values():  # a built-in model and each tree's C kernels, made once
        start(tree, args.model, shared)
    print(machine_line())
    seconds: dict[tuple[str, str], list[float]] = {}
    peaks: dict[tuple[str, str], list[float]] = {}
    resident: dict[tuple[str, str], list[float]] = {}
    try:
        for r in range(args.rounds):
            for name in trees if r % 2 == 0 else reversed(trees):
                cache = base / f"{name}-{r}"
                cache.mkdir()
                for part in ("models", "native"):
                    if (shared / part).exists():
                        (cache / part).symlink_to(shared / part)
                for kind in ("uncached", "cached"):
                    got = start(trees[name], args.model, cache)
                    seconds.setdefault((name, kind), []).append(float(got["s"]))
                    peaks.setdefault((name, kind), []).append(float(got["peak_gb"]))
                    resident.setdefault((name, kind), []).append(float(got["resident_gb"]))
                    line = f"round {r + 1} {name} {kind}: {got['s']:.2f} s"
                    line += f", {got['peak_gb']:.2f} GB peak, {got['resident_gb']:.2f} resident"
                    print(f"{line}; {got['kernels']}", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    for kind in ("uncached", "cached"):
        this, ab = (statistics.median(seconds[n, kind]) for n in trees)
        peak_this, peak_ab = (statistics.median(peaks[n, kind]) for n in trees)
        held_this, held_ab = (statistics.median(resident[n, kind]) for n in trees)
        print(
            f"{kind:9} this {this:.2f} s, ab {ab:.2f} s: ab / this {ab / this:.2f}x; "
            f"peak memory this {peak_this:.2f} GB, ab {peak_ab:.2f} GB; "
            f"resident once built this {held_this:.2f} GB, ab {held_ab:.2f} GB"
        )


if __name__ == "__main__":
    main()
