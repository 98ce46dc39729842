"""The one-call batch-1 decode step with the pairs copies read as 8 or 2 streams a thread.

``linear=pairs`` and ``linear=pairs2`` differ only in how many runs of its share of a weight's
blocks each thread reads side by side at one row (decode_ops.c's pairs_one_row). This loads
the ``small`` model once under ``linear=pairs``, builds the engine's own one-call step for one
live request (``--context`` tokens), and then, round after round in one process, runs that same
step (the same struct, weights, caches and token) with ``pair_streams`` 8 and 2, beside torch's
float32 sum over as many bytes as the step's weights (what streaming them costs here right
now). Both counts are checked to give the same logits first. Prints the medians every 25 rounds
(to show the host's phases) and, at the end, each one's median and the median within rounds
of the 8-stream time over its own (above 1: faster than 8 streams).

    .venv/bin/python bench/pair_streams_ab.py --rounds 200
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from engine_bench import interleaved_times, machine_line
from pdscope import LLM, SamplingParams
from pdscope.checkpoint.make_model import resolve_model_path
from pdscope.engine.model import Linear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--context", type=int, default=64)
    args = parser.parse_args()
    llm = LLM(
        str(resolve_model_path(args.model)),
        dtype="bfloat16",
        kv_cache_memory="2GiB",
        max_model_len=max(4096, args.context + 8),
        kernels="linear=pairs,decode_ops=c",
    )
    engine = llm.engine
    runner, model = engine.runner, engine.runner.model
    params = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
    engine.add_request([5 + i % 1000 for i in range(args.context - 1)], params)
    engine.step()  # the prefill; the next step is a decode at `context` tokens
    out = engine.scheduler.schedule()
    batch, ids = runner._native_decode_batch(out.scheduled)
    fused = model._fused_decode(1, runner.kv_caches, batch)
    if fused is None or model.native is None or not model.native.one_call_logits:
        raise SystemExit("the one-call C decode step does not run here")
    layers, step = fused
    native, embed = model.native, model.embed_tokens.weight

    def run(streams: int) -> torch.Tensor:
        step.pair_streams = streams
        return native.decode_logits(layers, step, ids, embed)[0]

    assert torch.equal(run(8), run(2))
    # weight_nbytes, not .weight: that would make a weight held once again
    weight_bytes = sum(m.weight_nbytes() for m in model.modules() if isinstance(m, Linear))
    same_bytes = torch.ones(weight_bytes // 4, dtype=torch.float32)
    candidates: dict[str, Callable[[], object]] = {
        "8 streams": lambda: run(8),
        "2 streams": lambda: run(2),
        "read": lambda: same_bytes.sum(),
    }
    print(machine_line())
    print(f"{weight_bytes / 1e6:.0f} MB of weights a step; {args.context} tokens of context; ms")
    times, _ = interleaved_times(candidates, args.rounds)
    for r in range(0, args.rounds, 25):  # the host's phases
        cells = [f"{k} {statistics.median(v[r : r + 25]) * 1e3:6.2f}" for k, v in times.items()]
        print(f"rounds {r + 1:3}-{min(r + 25, args.rounds):3}: " + "  ".join(cells))
    eight = times["8 streams"]
    print(
        "all rounds:     "
        + "  ".join(
            f"{k} {statistics.median(v) * 1e3:6.2f} "
            f"({statistics.median(a / b for a, b in zip(eight, v, strict=True)):.3f})"
            for k, v in times.items()
        )
    )


if __name__ == "__main__":
    main()
