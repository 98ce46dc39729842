"""Batch-1 decode in process and behind the server's AsyncEngine (the layer between the HTTP
routes and the engine): does it keep the engine's speed?

GNU OpenMP gives each thread that starts a parallel region its own team of workers. Once a
process's teams hold more threads than it has CPUs, every worker stops spinning at a barrier
after ~1,000 spins and sleeps in the kernel, so each of a decode step's barriers pays a
wake-up. The server steps its engine on its own thread; built (loaded, warmed) on the main
thread, the process had two teams. Three variants, each in a fresh process (a team lives as
long as its thread), rounds alternating them:

* ``in process``: the engine built and stepped on the main thread (one team);
* ``served, built on main``: built on the main thread, stepped by AsyncEngine's thread (two);
* ``served``: what ``pdscope serve`` does now, built and stepped on AsyncEngine's thread
  (``server.run.start_engine``; one team).

Each worker decodes ``--requests`` fresh prompts of 200 tokens for 128 tokens, greedy, and
reports each request's TPOT from the engine's own timeline (decode time / (tokens - 1)); a
round's ratios divide each variant's median by the in-process one's.

    .venv/bin/python bench/one_team.py --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

VARIANTS = ("in process", "served, built on main", "served")
PROMPT_TOKENS, OUTPUT_TOKENS = 200, 128


def worker(variant: str, model: str, requests: int) -> None:
    from pdscope.engine.async_engine import AsyncEngine
    from pdscope.engine.llm_engine import EngineArgs, LLMEngine
    from pdscope.engine.sampling_params import SamplingParams
    from pdscope.server.run import start_engine

    args = EngineArgs(model=model)
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True, temperature=0)
    rng = random.Random(0)
    tpot_ms: list[float] = []

    def prompt() -> list[int]:
        return [rng.randrange(100, 16000) for _ in range(PROMPT_TOKENS)]

    def record(timeline: object) -> None:
        decode_s, tokens = timeline.decode_s, len(timeline.token_s)  # type: ignore[attr-defined]
        tpot_ms.append(decode_s / (tokens - 1) * 1e3)

    if variant == "in process":
        engine = LLMEngine(args)

        def run() -> None:
            request = engine.add_request(prompt(), params)
            while engine.has_unfinished():
                engine.step()
            record(request.timeline)

    else:
        served = (
            AsyncEngine(LLMEngine(args)) if variant.endswith("main") else start_engine(args, None)
        )

        async def consume() -> None:
            last = None
            async for out in served.generate(prompt(), params):
                last = out
            assert last is not None
            record(last.request.timeline)

        def run() -> None:
            asyncio.run(consume())

    run()  # a first request pays one-off work
    tpot_ms.clear()
    for _ in range(requests):
        run()
    print(json.dumps({"variant": variant, "tpot_ms": tpot_ms}))
    if variant != "in process":
        served.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--model", default="small")
    parser.add_argument("--worker", choices=VARIANTS)
    a = parser.parse_args()
    if a.worker:
        worker(a.worker, a.model, a.requests)
        return
    from engine_bench import machine_line

    print(machine_line())
    rng = random.Random(1)
    medians: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(a.rounds):
        order = list(VARIANTS)
        rng.shuffle(order)  # no variant always first or last in a round
        for variant in order:
            done = subprocess.run(
                [sys.executable, str(Path(__file__)), "--worker", variant, "--model", a.model,
                 "--requests", str(a.requests)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            line = done.stdout.strip().splitlines()[-1]
            medians[variant].append(statistics.median(json.loads(line)["tpot_ms"]))
        base = medians["in process"][-1]
        print(
            f"round {r + 1}: "
            + ", ".join(
                f"{v} {medians[v][-1]:.2f} ms ({medians[v][-1] / base:.2f}x)" for v in VARIANTS
            ),
            flush=True,
        )
    print("median TPOT over rounds, and of the within-round ratios to in process (min-max):")
    for v in VARIANTS:
        ratios = [m / b for m, b in zip(medians[v], medians["in process"], strict=True)]
        print(
            f"  {v:22s} {statistics.median(medians[v]):6.2f} ms  {statistics.median(ratios):.3f}x "
            f"({min(ratios):.3f}-{max(ratios):.3f})"
        )


if __name__ == "__main__":
    main()
