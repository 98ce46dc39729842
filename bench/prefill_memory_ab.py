"""A prefill's memory and speed, one engine tree against another, each in a fresh process,
interleaved (e.g. the MLP's Scratch, engine/model.py, against the commit before it).

Each arm is a checkout whose ``src`` the process imports (``.``: this one; another: a worktree,
``git worktree add /tmp/before REV``), optionally with environment settings after an ``@``
(``.@MALLOC_MMAP_MAX_=0``, comma-separated). A process's malloc state is its own, so no two
arms share one: each round starts one process per arm, in an order that turns each round.
Each process loads the model (its kernel picks from the cache, the same for every arm), warms
up, then runs its workload and reports its resident memory and its minor page faults:

- ``--workload prefill``: fresh 2,000-token prefills (prefix caching off) and a batch-1
  decode; faults a prefill.
- ``--workload mixed``: what a server at concurrency 16 runs, offline: 48 fresh prompts of
  16-2,000 tokens (the same in every process), 64 tokens out each, 16 at a time, a new one
  admitted as one ends, so chunked prefills share steps with decodes. Output tok/s over the
  whole run, the steps with prefill chunks (mixed or not) as tokens a second of their own
  time, and faults a step with a prefill chunk.

Prints per round, then each arm's medians and its ratio to the first arm's (pairwise too).
``--kernels`` forces paths in every arm (a trial in one arm's process may otherwise pick
differently from the others'), or, given once an arm, sets each arm's own.

    git worktree add /tmp/before a53dbf4
    .venv/bin/python bench/prefill_memory_ab.py /tmp/m1b --arms /tmp/before . --rounds 3
    .venv/bin/python bench/prefill_memory_ab.py /tmp/m1b --workload mixed \
        --arms /tmp/before . .@MALLOC_MMAP_MAX_=0
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
model, prefills, kernels = sys.argv[1], int(sys.argv[2]), sys.argv[3]
llm = LLM(model=model, dtype="bfloat16", kv_cache_memory="2GiB", max_model_len=4096,
          max_num_batched_tokens=2048, enable_prefix_caching=False, kernels=kernels)
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

MIXED = """
import json, random, resource, sys, time
from pdscope import LLM, SamplingParams
model, kernels = sys.argv[1], sys.argv[3]
llm = LLM(model=model, dtype="bfloat16", kv_cache_memory="2GiB", max_model_len=4096,
          max_num_batched_tokens=2048, enable_prefix_caching=False, kernels=kernels)
engine = llm.engine
execute = engine.runner.execute
steps = []  # (prefill tokens, all tokens, seconds, faults) of each step with a prefill chunk
def timed(out):
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    sampled = execute(out)
    if out.num_prefill_tokens:
        steps.append((out.num_prefill_tokens, out.num_tokens, time.perf_counter() - start,
                      resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults))
    return sampled
engine.runner.execute = timed
params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
def run(prompts, together):
    rng = random.Random(prompts)
    def fresh():
        return [rng.randrange(100, 16000) for _ in range(rng.randrange(16, 2000))]
    for _ in range(together):
        engine.add_request(fresh(), params)
    added = together
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished and added < prompts:
                engine.add_request(fresh(), params)
                added += 1
run(16, 16)
steps.clear()
start = time.perf_counter()
run(48, 16)
wall_s = time.perf_counter() - start
with open("/proc/self/status") as f:
    rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
print(json.dumps({"output_tok_s": 48 * 64 / wall_s,
                  "prefill_step_tok_s": sum(s[1] for s in steps) / sum(s[2] for s in steps),
                  "faults_per_prefill_step": sum(s[3] for s in steps) / len(steps),
                  "resident_gb": rss_kb / 1e6, "kernels": engine.kernels.summary()}))
"""

WORKLOADS = {
    "prefill": (CHILD, ("prefill_tok_s", "decode_tok_s", "resident_gb", "faults_per_prefill")),
    "mixed": (
        MIXED,
        ("output_tok_s", "prefill_step_tok_s", "resident_gb", "faults_per_prefill_step"),
    ),
}
HERE = Path(__file__).resolve().parent.parent


def run(model: str, arm: str, workload: str, prefills: int, kernels: str) -> dict[str, object]:
    tree, _, settings = arm.partition("@")
    src = (HERE if tree == "." else Path(tree)) / "src"
    extra = dict(item.split("=", 1) for item in settings.split(",") if item)
    out = subprocess.run(
        [sys.executable, "-c", WORKLOADS[workload][0], model, str(prefills), kernels],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **extra, "PYTHONPATH": str(src)},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="checkpoint directory (bf16)")
    parser.add_argument("--arms", nargs="+", required=True, help="checkouts: . or a path")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prefills", type=int, default=4, help="timed prefills a process")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="prefill")
    parser.add_argument(
        "--kernels",
        nargs="+",
        default=["auto"],
        help="the engine's kernels: one for every arm, or one an arm",
    )
    args = parser.parse_args()
    if len(args.kernels) not in (1, len(args.arms)):
        parser.error(f"--kernels: one for every arm or one an arm ({len(args.arms)})")
    if len(set(args.arms)) < len(args.arms):
        parser.error("--arms: each arm once (the same tree twice: add @X=1 to one)")
    each = args.kernels * len(args.arms) if len(args.kernels) == 1 else args.kernels
    kernels = dict(zip(args.arms, each, strict=True))
    for arm in args.arms:
        tree, _, settings = arm.partition("@")
        if tree != "." and not (Path(tree) / "src" / "pdscope").is_dir():
            parser.error(f"arm {arm!r} is not a checkout (no src/pdscope in it)")
        if any("=" not in item for item in settings.split(",") if item):
            parser.error(f"arm {arm!r}: settings after @ are KEY=VALUE, comma-separated")
    print(machine_line(), flush=True)
    figures = WORKLOADS[args.workload][1]
    results: dict[str, list[dict[str, object]]] = {arm: [] for arm in args.arms}
    for r in range(args.rounds):
        turn = r % len(args.arms)
        order = args.arms[turn:] + args.arms[:turn]
        for arm in order:
            results[arm].append(run(args.model, arm, args.workload, args.prefills, kernels[arm]))
        line = "; ".join(
            f"{arm}: " + ", ".join(f"{f} {float(results[arm][-1][f]):,.2f}" for f in figures)  # type: ignore[arg-type]
            for arm in order
        )
        print(f"round {r + 1}/{args.rounds}: {line}", flush=True)
    for arm in args.arms:
        print(f"kernels ({arm}):", results[arm][0]["kernels"])
    base = args.arms[0]
    for figure in figures:
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
