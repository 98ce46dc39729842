"""An engine on a host with little memory to spare, against another tree's, interleaved.

This process first takes memory until the host has only ``--leave-gb`` available (anonymous
pages, written, held until the end): a smaller host, as the engine sees it (MemAvailable).
Then each round builds the engine in a fresh process from this tree and from ``--ab-tree``
(e.g. a worktree of an earlier commit: ``git worktree add /tmp/before REV``), alternating the
order, each with an empty kernel-choice cache (what each tree's start decides with that much
memory; the C kernels' build is shared and not timed), and prints per tree: the paths chosen,
the memory resident once built (VmRSS), and batch-1 decode tokens/s (256 tokens after a
16-token prompt, the median of 3 runs, each run's tokens/s from the gap between a 1-token and
a 257-token generation) and prefill tokens/s (a fresh 2,000-token prompt and one output token,
the median of 3), then the medians and their ratios.

    git worktree add /tmp/before f0acacd
    .venv/bin/python bench/tight_memory_ab.py /tmp/m1b --ab-tree /tmp/before --leave-gb 7
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

import numpy as np

from engine_bench import machine_line

HERE = Path(__file__).resolve().parent.parent
# Run in the child: builds the engine, prints its kernels, resident memory and decode rate.
CHILD = """
import gc, json, statistics, sys, time
from pdscope import LLM, SamplingParams
llm = LLM(model=sys.argv[1], kv_cache_memory="256MiB", max_model_len=2048)
gc.collect()
with open("/proc/self/status") as f:
    rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
prompt = [[100 + i for i in range(16)]]
rates = []
for _ in range(3):
    took = {}
    for n in (1, 257):
        start = time.perf_counter()
        llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        took[n] = time.perf_counter() - start
    rates.append(256 / (took[257] - took[1]))
prefill = []
for i in range(3):
    fresh = [[100 + (7919 * (i * 2000 + j)) % 30000 for j in range(2000)]]
    start = time.perf_counter()
    llm.generate(fresh, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    prefill.append(2000 / (time.perf_counter() - start))
print(json.dumps({
    "kernels": llm.engine.kernels.summary(),
    "resident_gb": rss_kb / 1e6,
    "tok_s": statistics.median(rates),
    "prefill_tok_s": statistics.median(prefill),
}))
"""


def available_gb() -> float:
    with open("/proc/meminfo") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    return kb / 1e6


def run(tree: Path, model: str, cache: Path) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "PDSCOPE_CACHE": str(cache)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, model], env=env, capture_output=True, text=True
    )
    if out.returncode != 0:  # e.g. killed for memory: said, not averaged in
        return {"failed": f"exit {out.returncode}: {out.stderr.strip()[-300:]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a checkpoint directory, or small")
    parser.add_argument("--ab-tree", type=Path, required=True, help="the other source tree")
    parser.add_argument("--leave-gb", type=float, required=True, help="memory left available")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    trees = {"this": HERE, "ab": args.ab_tree.resolve()}
    base = Path(tempfile.mkdtemp(prefix="tight_ab-"))
    shared = base / "shared"
    for tree in trees.values():  # the C kernels (and a built-in model), made once
        subprocess.run(
            [sys.executable, "-c", "from pdscope.engine import native; from pdscope.checkpoint"
             ".make_model import default_cache_dir as d; native.load(d() / 'native')"],
            env={**os.environ, "PYTHONPATH": str(tree / "src"), "PDSCOPE_CACHE": str(shared)},
            check=True,
        )  # fmt: skip
    take_gb = available_gb() - args.leave_gb
    held = np.ones(max(0, int(take_gb * 1e9)), dtype=np.uint8)  # written: resident
    print(machine_line())
    print(f"held {held.nbytes / 1e9:.2f} GB here: {available_gb():.2f} GB left available")
    rates: dict[str, list[float]] = {}
    prefills: dict[str, list[float]] = {}
    resident: dict[str, list[float]] = {}
    try:
        for r in range(args.rounds):
            for name in trees if r % 2 == 0 else reversed(trees):
                cache = base / f"{name}-{r}"
                cache.mkdir()
                (cache / "native").symlink_to(shared / "native")
                got = run(trees[name], args.model, cache)
                if "failed" in got:
                    print(f"round {r + 1} {name}: failed, {got['failed']}", flush=True)
                    continue
                rates.setdefault(name, []).append(float(got["tok_s"]))
                prefills.setdefault(name, []).append(float(got["prefill_tok_s"]))
                resident.setdefault(name, []).append(float(got["resident_gb"]))
                print(
                    f"round {r + 1} {name}: {got['tok_s']:.1f} tok/s at batch 1, "
                    f"prefill {got['prefill_tok_s']:.0f} tok/s, "
                    f"{got['resident_gb']:.2f} GB resident; {got['kernels']}",
                    flush=True,
                )
    finally:
        shutil.rmtree(base, ignore_errors=True)
        del held
    for name in trees:
        if name in rates:
            print(
                f"{name}: {statistics.median(rates[name]):.1f} tok/s, "
                f"prefill {statistics.median(prefills[name]):.0f} tok/s, "
                f"{statistics.median(resident[name]):.2f} GB resident ({len(rates[name])} runs)"
            )
    if all(name in rates for name in trees):
        ratio = statistics.median(rates["this"]) / statistics.median(rates["ab"])
        print(f"this / ab batch-1 tok/s: {ratio:.2f}x")
        ratio = statistics.median(prefills["this"]) / statistics.median(prefills["ab"])
        print(f"this / ab prefill tok/s: {ratio:.2f}x")


if __name__ == "__main__":
    main()
