"""A kernel trial in a slow stretch of the host, and the start after it.

Round after round, on a kernel cache of its own (the machine's C kernels and step checks
shared): an engine starts while a memory hog runs beside it (one thread streaming copies
through two arrays of ``--hog-mib`` MiB each), so its trials time the candidates on a slowed
host and cache the picks; the hog stops; a second engine starts on that cache, and a third
after it. Prints, per start, the host's memory reading the cache records or is held against
(the trial's slower one), how each matmul path was decided, its pick, and its trial's median
times: whether a trial on a slowed host picks otherwise, and whether the quiet start
measures again (the rule in ``kernels.choose``: FASTER_BY).

    .venv/bin/python bench/noisy_trial.py --rounds 3

The hog runs in this VM, so it raises the load average too; a neighbour on the physical host
does not, and only the memory reading sees it (the load rule needs 0.5 per core of a 1-minute
average, which a start a few seconds after the hog stops has not shed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engine_bench import machine_line
from pdscope import LLM
from pdscope.checkpoint.make_model import default_cache_dir, resolve_model_path
from pdscope.engine.kernels import load_per_core

PATHS = ("linear", "batch_linear", "big_batch_linear", "prefill_linear")
HOG = """
import sys, numpy as np
a = np.ones(int(sys.argv[1]) << 17); b = np.empty_like(a)
print("ready", flush=True)
while True:
    np.copyto(b, a)
"""


def start(path: str, cache: Path, label: str) -> None:
    began = time.perf_counter()
    llm = LLM(model=path, dtype="bfloat16", kv_cache_memory="256MiB", max_model_len=2048)
    took_s = time.perf_counter() - began
    choice = llm.engine.kernels
    (entry,) = (cache / "kernels").glob("*.json")
    read = json.loads(entry.read_text()).get("read_gb_s")
    print(
        f"  {label:<12} start {took_s:5.1f} s, load {load_per_core():.2f}/core, cache's "
        f"reading {read} GB/s",
        flush=True,
    )
    for matmul in PATHS:
        trial_ms = {
            k.split("=")[1]: round(v * 1e3, 2)
            for k, v in choice.trial_s.items()
            if k.split("=")[0] == matmul
        }
        print(f"    {matmul}={getattr(choice, matmul)} ({choice.how.get(matmul)}): {trial_ms} ms")
    del llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hog-mib", type=int, default=512)
    args = parser.parse_args()
    path = str(resolve_model_path(args.model))
    print(machine_line())
    shared = default_cache_dir()
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="pdscope-noisy-") as tmp:
            cache = Path(tmp)
            for part in ("native", "step_check"):
                if (shared / part).is_dir():
                    (cache / part).symlink_to(shared / part)
            os.environ["PDSCOPE_CACHE"] = str(cache)
            print(f"round {i + 1}:", flush=True)
            hog = subprocess.Popen(
                [sys.executable, "-c", HOG, str(args.hog_mib)], stdout=subprocess.PIPE, text=True
            )
            try:
                assert hog.stdout is not None and hog.stdout.readline().strip() == "ready"
                start(path, cache, "hog beside")
            finally:
                hog.kill()
                hog.wait()
            time.sleep(2)
            start(path, cache, "quiet")
            start(path, cache, "quiet again")


if __name__ == "__main__":
    main()
