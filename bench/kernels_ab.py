"""Whole engines under different kernel choices, interleaved in one process.

Each ``--kernels`` spec (as the engine's ``--kernels``; ``auto`` for the trial's own picks)
builds one engine on the same checkpoint, all loaded at once. Round after round, every engine
in turn (the order reversed every other round) decodes at batch 1 (128 tokens after a fresh
16-token prompt, tokens/s from the gap between a 1-token and a 129-token generation of it,
prefix caching off so that both prefill the same 16 tokens) and
prefills a fresh 2,000-token prompt (one output token). Prints each engine's picks, the
medians, and each engine's median per-round ratio against the first (above 1: faster).

    .venv/bin/python bench/kernels_ab.py --model /tmp/m1b \\
        --kernels linear=amx,batch_linear=c,big_batch_linear=c,prefill_linear=plain \\
        --kernels linear=pairs2,batch_linear=c,big_batch_linear=c,prefill_linear=plain

Where the engines hold different copies of the weights, their memory is not told apart here
(one process): bench/start_ab.py and bench/tight_memory_ab.py measure it per start.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from engine_bench import machine_line
from pdscope import LLM, SamplingParams
from pdscope.checkpoint.make_model import resolve_model_path

PREFILL_TOKENS = 2000
DECODE_TOKENS = 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--kernels", action="append", required=True, help="repeat: one engine")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    if len(set(args.kernels)) != len(args.kernels) or len(args.kernels) < 2:
        parser.error("give --kernels at least twice, each spec once: engines to compare")
    path = str(resolve_model_path(args.model))
    print(machine_line())
    engines: dict[str, LLM] = {}
    for spec in args.kernels:
        engines[spec] = LLM(
            model=path, dtype="bfloat16", kv_cache_memory="1GiB", max_model_len=4096,
            max_num_batched_tokens=2048, enable_prefix_caching=False, kernels=spec,
        )  # fmt: skip
        print(f"{spec}: {engines[spec].engine.kernels.summary()}", flush=True)
    rng = random.Random(0)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    more = SamplingParams(max_tokens=DECODE_TOKENS + 1, temperature=0, ignore_eos=True)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(100, 16000) for _ in range(n)]

    decode: dict[str, list[float]] = {spec: [] for spec in engines}
    prefill: dict[str, list[float]] = {spec: [] for spec in engines}
    for llm in engines.values():  # warm-up: oneDNN's primitives, the first pages
        llm.generate([fresh(PREFILL_TOKENS)], one)
    for r in range(args.rounds):
        order = list(engines.items())
        for spec, llm in order if r % 2 == 0 else reversed(order):
            prompt = fresh(16)
            start = time.perf_counter()
            llm.generate([prompt], one)
            first = time.perf_counter() - start
            start = time.perf_counter()
            llm.generate([prompt], more)
            decode[spec].append(DECODE_TOKENS / (time.perf_counter() - start - first))
            start = time.perf_counter()
            llm.generate([fresh(PREFILL_TOKENS)], one)
            prefill[spec].append(PREFILL_TOKENS / (time.perf_counter() - start))
        print(
            f"round {r + 1}: "
            + "; ".join(f"{decode[s][-1]:.1f} / {prefill[s][-1]:.0f}" for s in engines)
            + " (batch-1 tok/s / prefill tok/s)",
            flush=True,
        )
    base = args.kernels[0]
    for spec in engines:
        line = (
            f"{spec}: batch 1 {statistics.median(decode[spec]):.1f} tok/s, "
            f"prefill {statistics.median(prefill[spec]):.0f} tok/s"
        )
        if spec != base:
            d = [a / b for a, b in zip(decode[spec], decode[base], strict=True)]
            p = [a / b for a, b in zip(prefill[spec], prefill[base], strict=True)]
            line += (
                f"; against the first, batch 1 {statistics.median(d):.3f}x "
                f"({min(d):.2f}-{max(d):.2f}), prefill {statistics.median(p):.3f}x "
                f"({min(p):.2f}-{max(p):.2f})"
            )
        print(line)


if __name__ == "__main__":
    main()
