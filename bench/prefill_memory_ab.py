"""A prefill's memory and speed, one engine tree against another, each in a fresh process,
interleaved (e.g. the MLP's Scratch, engine/model.py, against the commit before it).

Each arm is a checkout whose ``src`` the process imports (``.``: this one; another: a worktree,
``git worktree add /tmp/before REV``). A process's malloc state is its own, so no two arms
share one: each round starts one process per arm, in an order that turns each round. Each
process loads the model (its kernel picks from the cache, the same for every arm), warms up,
then times fresh 2,000-token prefills (prefix caching off) and a batch-1 decode, and reports
its resident memory and its minor page faults a prefill. Prints per round, then each arm's
medians and its ratio to the first arm's (pairwise too).

    git worktree add /tmp/before a53dbf4
    .venv/bin/python bench/prefill_memory_ab.py /tmp/m1b --arms /tmp/before . --rounds 3
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

CHILD = """
import json, random, resource, statistics, sys, time
from pdscope import LLM, SamplingParams
model, prefills = sys.argv[1], int(sys.argv[2])
llm = LLM(model=model, dtype="bfloat16", kv_cache_memory="2GiB", max_model_len=4096,
          max_num_batched_tokens=2048, enable_prefix_caching=False)
rng = random.Random(0)
def fresh(n):
    return [rng.randrange(100, 16000) for _ in range(n)]
def timed(prompt, tokens):
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    return time.perf_counter() - start
timed(fresh(2000), 1)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
prefill = [2000 / timed(fresh(2000), 1) for _ in range(prefills)]
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / prefills
decode = 128 / (timed(fresh(64), 129) - timed(fresh(64), 1))
with open("/proc/self/status") as f:
    rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
print(json.dumps({"prefill_tok_s": statistics.median(prefill), "decode_tok_s": decode,
                  "faults_per_prefill": faults,
                  "resident_gb": rss_kb / 1e6, "kernels": llm.engine.kernels.summary()}))
"""

FIGURES = ("prefill_tok_s", "decode_tok_s", "resident_gb", "faults_per_prefill")
HERE = Path(__file__).resolve().parent.parent


def run(model: str, arm: str, prefills: int) -> dict[str, object]:
    src = (HERE if arm == "." else Path(arm)) / "src"
    out = subprocess.run(
        [sys.executable, "-c", CHILD, model, str(prefills)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(src)},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="checkpoint directory (bf16)")
    parser.add_argument("--arms", nargs="+", required=True, help="checkouts: . or a path")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prefills", type=int, default=4, help="timed prefills a process")
    args = parser.parse_args()
    for arm in args.arms:
        if arm != "." and not (Path(arm) / "src" / "pdscope").is_dir():
            parser.error(f"arm {arm!r} is not a checkout (no src/pdscope in it)")
    print(machine_line(), flush=True)
    results: dict[str, list[dict[str, object]]] = {arm: [] for arm in args.arms}
    for r in range(args.rounds):
        turn = r % len(args.arms)
        order = args.arms[turn:] + args.arms[:turn]
        for arm in order:
            results[arm].append(run(args.model, arm, args.prefills))
        line = ", ".join(
            f"{arm}: prefill {results[arm][-1]['prefill_tok_s']:.1f} tok/s, decode "
            f"{results[arm][-1]['decode_tok_s']:.2f} tok/s, "
            f"{results[arm][-1]['resident_gb']:.2f} GB, "
            f"{results[arm][-1]['faults_per_prefill']:.0f} faults a prefill"
            for arm in order
        )
        print(f"round {r + 1}/{args.rounds}: {line}", flush=True)
    for arm in args.arms:
        print(f"kernels ({arm}):", results[arm][0]["kernels"])
    base = args.arms[0]
    for figure in FIGURES:
        first = [float(x[figure]) for x in results[base]]  # type: ignore[arg-type]
        for arm in args.arms:
            values = [float(x[figure]) for x in results[arm]]  # type: ignore[arg-type]
            line = f"{figure:18s} {arm:24s} {statistics.median(values):10.2f}"
            if arm != base and statistics.median(first):
                pairs = sorted(v / f for v, f in zip(values, first, strict=True) if f)
                line += (
                    f"  / {base}: {statistics.median(values) / statistics.median(first):.3f}"
                    f" (pairs {', '.join(f'{p:.3f}' for p in pairs)})"
                )
            print(line)


if __name__ == "__main__":
    main()
