"""Batch-1 decode with the one-call step in one OpenMP region (this tree) against an earlier
revision whose kernels each opened their own region, at libgomp spin counts side by side.

Each kernel's own region cost a step ~110 fork-joins, and once libgomp's workers sleep at a
barrier (``GOMP_SPINCOUNT=0``, ``OMP_WAIT_POLICY=PASSIVE``, or more OpenMP threads than CPUs,
where libgomp itself counts 1,000 spins) each one is a kernel wake-up. The step's team spins
at barriers of its own inside a step, whatever the spin count. Every (tree, spin) pair runs in
a fresh process (a spin count is read once, when libgomp loads), rounds alternating them; a
worker is ``bench/one_team.py --worker 'in process'`` (TPOT from the engine's own timeline,
200-token prompts, 128 tokens), run against the revision's sources through ``PYTHONPATH``.

    .venv/bin/python bench/step_team.py --base ffca487 --spins 0 1000 default --rounds 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from engine_bench import machine_line

ROOT = Path(__file__).resolve().parent.parent


def tpot_ms(src: Path, spin: str, requests: int, model: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(src), "GOMP_SPINCOUNT": spin}
    env.pop("OMP_WAIT_POLICY", None)
    if spin == "default":  # libgomp's own (~300,000 spins with no more threads than CPUs)
        env.pop("GOMP_SPINCOUNT")
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "one_team.py"), "--worker", "in process",
         "--requests", str(requests), "--model", model],
        capture_output=True, text=True, check=True, env=env,
    )  # fmt: skip
    return statistics.median(json.loads(done.stdout.strip().splitlines()[-1])["tpot_ms"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the git revision to compare against")
    parser.add_argument("--spins", nargs="+", default=["0", "1000", "default"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--model", default="small")
    a = parser.parse_args()
    print(machine_line())
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(base), a.base],
            check=True,
        )
        try:
            trees = {"base": base / "src", "this": ROOT / "src"}
            got: dict[tuple[str, str], list[float]] = {}
            for r in range(a.rounds):
                for spin in a.spins:
                    # the order flips each round: neither tree always runs first
                    for tree in list(trees) if r % 2 == 0 else list(trees)[::-1]:
                        t = tpot_ms(trees[tree], spin, a.requests, a.model)
                        got.setdefault((tree, spin), []).append(t)
                line = ", ".join(
                    f"spin {s}: {got[('this', s)][-1]:.2f} / {got[('base', s)][-1]:.2f} ms"
                    for s in a.spins
                )
                print(f"round {r + 1} (this / base): {line}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)])
    print("median TPOT this / base, and the within-round ratio this / base (min-max):")
    for s in a.spins:
        this, was = got[("this", s)], got[("base", s)]
        ratios = [t / b for t, b in zip(this, was, strict=True)]
        print(
            f"  GOMP_SPINCOUNT={s:>7s}: {statistics.median(this):6.2f} / "
            f"{statistics.median(was):6.2f} ms  {statistics.median(ratios):.3f}x "
            f"({min(ratios):.3f}-{max(ratios):.3f})"
        )


if __name__ == "__main__":
    main()
