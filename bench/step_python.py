"""Where a decode step's time goes outside the C step: the engine's Python, timed.

The ``small`` model (or ``--model``) decodes ``--tokens`` tokens for ``--batch`` prompts (1) of
``--context`` tokens each, the kernels as the engine's trial picks them. Every decode step under the
one-call C path is timed in four nested spans: the engine's ``step`` (scheduling, batch tensors,
sampling, detokenizing, stop checks, records), the model's ``decode_logits`` (the per-step check of
the weights' and caches' addresses, the step's fields), the ``NativeOps.decode_logits`` wrapper
(output and scratch tensors, argument checks) and the C call itself. Prints, per run, tokens/s and
the medians over steps of each span less the one inside it (paired within each step), in
microseconds. After the C call streams the weights, the Python objects a step touches are cold:
these spans are several times their warm cost.

    .venv/bin/python bench/step_python.py --runs 3
    .venv/bin/python bench/step_python.py --batch 32 --context 16 --tokens 128
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from engine_bench import machine_line
from pdscope import LLM, SamplingParams
from pdscope.checkpoint.make_model import resolve_model_path


def timed(fn: Callable[..., Any], into: list[int]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter_ns() - start)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1, help="prompts decoded side by side")
    args = parser.parse_args()
    llm = LLM(
        str(resolve_model_path(args.model)),
        dtype="bfloat16",
        kv_cache_memory="2GiB",
        max_model_len=max(4096, args.context + args.tokens + 1),
    )
    engine = llm.engine
    model = engine.runner.model
    native = model.native
    if native is None or not native.one_call_logits:
        raise SystemExit("the engine does not run the one-call C decode step here")
    spans: dict[str, list[int]] = {"step": [], "model": [], "wrapper": [], "c": []}
    engine.step = timed(engine.step, spans["step"])  # type: ignore[method-assign]
    model.decode_logits = timed(model.decode_logits, spans["model"])  # type: ignore[method-assign]
    wrapper = native.decode_logits
    native.decode_logits = timed(wrapper, spans["wrapper"])  # type: ignore[method-assign]
    native.lib.decode_logits = timed(native.lib.decode_logits, spans["c"])
    # distinct prompts, so no request's prefill is another's cached prefix
    prompts = [[5 + (i + 7 * b) % 1000 for i in range(args.context)] for b in range(args.batch)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts, params)  # warm-up
    print(machine_line())
    print(f"kernels: {engine.kernels.summary()}")
    print(
        f"batch {args.batch}, {args.context} tokens of context, {args.tokens} tokens a run; "
        "medians over decode steps, us (each span less the one inside it, paired per step):"
    )
    for run in range(args.runs):
        for v in spans.values():
            v.clear()
        start = time.perf_counter()
        llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        n = len(spans["c"])  # the decode steps; the prefill steps come first in `step`
        step, mdl, wrap, c = (spans[k][-n:] for k in ("step", "model", "wrapper", "c"))

        def less(outer: list[int], inner: list[int]) -> float:
            return statistics.median(a - b for a, b in zip(outer, inner, strict=True)) / 1e3

        print(
            f"run {run + 1}: {args.batch * args.tokens / elapsed:6.1f} tok/s;"
            f" C {statistics.median(c) / 1e3:7.0f}"
            f"  engine step {less(step, mdl):5.0f}  model {less(mdl, wrap):5.0f}"
            f"  wrapper {less(wrap, c):5.0f}  (Python {less(step, c):5.0f})"
        )


if __name__ == "__main__":
    main()
