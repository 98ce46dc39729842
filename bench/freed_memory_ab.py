"""A step's freed memory kept for the next step (``freed_memory=kept``) against glibc as it
is (``returned``), each in a fresh process, interleaved.

``kept`` changes the process's malloc for good once a step has run (engine/malloc.py), so the
two cannot share a process: each round starts one process per setting, in alternating order.
Each process loads the model (its kernel picks from the cache, the same for both), warms up,
then times fresh 2,000-token prefills (prefix caching off) and a batch-1 decode, and reports
its resident memory after them. Prints per round, then the medians and the ratio of kept
over returned (pairwise too).

    .venv/bin/python bench/freed_memory_ab.py /tmp/m1b --rounds 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from engine_bench import machine_line

CHILD = """
import json, random, statistics, sys, time
from pdscope import LLM, SamplingParams
model, setting, prefills = sys.argv[1], sys.argv[2], int(sys.argv[3])
llm = LLM(model=model, dtype="bfloat16", kv_cache_memory="2GiB", max_model_len=4096,
          max_num_batched_tokens=2048, enable_prefix_caching=False,
          kernels=f"freed_memory={setting}")
rng = random.Random(0)
def fresh(n):
    return [rng.randrange(100, 16000) for _ in range(n)]
def timed(prompt, tokens):
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    return time.perf_counter() - start
timed(fresh(2000), 1)
prefill = [2000 / timed(fresh(2000), 1) for _ in range(prefills)]
decode = 128 / (timed(fresh(64), 129) - timed(fresh(64), 1))
with open("/proc/self/status") as f:
    rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
print(json.dumps({"prefill_tok_s": statistics.median(prefill), "decode_tok_s": decode,
                  "resident_gb": rss_kb / 1e6, "kernels": llm.engine.kernels.summary()}))
"""

SETTINGS = ("kept", "returned")


def run(model: str, setting: str, prefills: int) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, model, setting, str(prefills)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="checkpoint directory (bf16)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prefills", type=int, default=4, help="timed prefills a process")
    args = parser.parse_args()
    print(machine_line(), flush=True)
    results: dict[str, list[dict[str, object]]] = {s: [] for s in SETTINGS}
    for r in range(args.rounds):
        order = SETTINGS if r % 2 == 0 else SETTINGS[::-1]
        for setting in order:
            results[setting].append(run(args.model, setting, args.prefills))
        line = ", ".join(
            f"{s}: prefill {results[s][-1]['prefill_tok_s']:.1f} tok/s, decode "
            f"{results[s][-1]['decode_tok_s']:.1f} tok/s, {results[s][-1]['resident_gb']:.2f} GB"
            for s in order
        )
        print(f"round {r + 1}/{args.rounds} ({order[0]} first): {line}", flush=True)
    print("kernels:", results["kept"][0]["kernels"])
    for figure in ("prefill_tok_s", "decode_tok_s", "resident_gb"):
        kept = [float(x[figure]) for x in results["kept"]]  # type: ignore[arg-type]
        returned = [float(x[figure]) for x in results["returned"]]  # type: ignore[arg-type]
        pairs = sorted(k / r for k, r in zip(kept, returned, strict=True))
        print(
            f"{figure:14s} kept {statistics.median(kept):8.2f}  returned "
            f"{statistics.median(returned):8.2f}  kept/returned "
            f"{statistics.median(kept) / statistics.median(returned):.3f} "
            f"(pairs {', '.join(f'{p:.3f}' for p in pairs)})"
        )


if __name__ == "__main__":
    main()
