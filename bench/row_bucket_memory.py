"""A process's resident memory as it meets new prompt lengths, steps padded (ROW_BUCKET) or
exact: oneDNN keeps every matmul primitive it builds (up to its cache's ~1,024) and the memory
around them, so a server whose steps come at ever new row counts grows.

Each variant runs in a process of its own (memory is per process): the small model in bf16,
prefix caching off, ``--lengths`` distinct prompt lengths drawn from ``--range`` (one token
out each, 10 of them first as a warm-up), RSS read from /proc after every ``--every``.

    .venv/bin/python bench/row_bucket_memory.py --lengths 400 --range 40 700
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys

from pdscope.specs.local import cpu_model

CHILD = """
import random, sys
from pdscope import LLM, SamplingParams
variant, count, lo, hi, every = sys.argv[1], *map(int, sys.argv[2:6])
llm = LLM(model="small", dtype="bfloat16", kv_cache_memory="2GiB", max_model_len=4096,
          max_num_batched_tokens=2048, enable_prefix_caching=False,
          kernels="auto" if variant == "padded" else "step_rows=exact")
assert llm.engine.kernels.step_rows == variant, llm.engine.kernels.summary()
def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
rng = random.Random(0)
params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
lengths = rng.sample(range(lo, hi), count + 10)
vocab = llm.engine.runner.model.config.vocab_size
for n in lengths[:10]:
    llm.generate([[rng.randrange(1, vocab) for _ in range(n)]], params)
base = rss_mb()
marks = []
for i, n in enumerate(lengths[10:], 1):
    llm.generate([[rng.randrange(1, vocab) for _ in range(n)]], params)
    if i % every == 0:
        marks.append(f"{i}: +{rss_mb() - base:.0f}")
print(f"{variant}: RSS {base:.0f} MB after the warm-up; then (new lengths: MB more) "
      + ", ".join(marks))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, default=400)
    parser.add_argument("--range", type=int, nargs=2, default=[40, 700])
    parser.add_argument("--every", type=int, default=65)
    args = parser.parse_args()
    lo, hi = args.range
    if hi - lo < args.lengths + 10:
        parser.error(f"--range {lo} {hi} holds fewer than --lengths + 10 distinct lengths")
    print(f"CPU: {cpu_model()}")
    for variant in random.sample(["padded", "exact"], 2):
        child = [sys.executable, "-c", CHILD, variant, str(args.lengths), str(lo), str(hi)]
        done = subprocess.run(child + [str(args.every)], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{variant} failed:\n{done.stderr[-2000:]}")
        print(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
