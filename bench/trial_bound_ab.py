"""The kernel trials of a large model on every weight against their bounded set, interleaved.

The decode-linear trials (linear, batch_linear, big_batch_linear) time whole layers up to
``_TRIAL_STREAM_BYTES`` and the LM head's rows in their share; prefill_linear's, the first rows
of layer 0's weights up to ``_PREFILL_TRIAL_BYTES`` (engine/model.py). This runs each of those
paths' trials both ways on one checkpoint, in alternating order each round, and prints per path
and way: the seconds the trial took (its candidates' copies made, then the runs), each
candidate's median time over the path's fastest (what the choice rests on) and the picks.

    .venv/bin/pdscope make-model /tmp/m1b --preset small --layers 16 --hidden 2048 \\
        --intermediate 8192 --heads 32 --kv-heads 8 --vocab 32768
    .venv/bin/python bench/trial_bound_ab.py /tmp/m1b --rounds 5

Each trial runs every candidate ``--runs`` times (after one warm-up), more than a start-up's
trial does (it stops at its share of a second), so that the ratios are steadier than one
start's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

from engine_bench import machine_line
from pdscope import LLM
from pdscope.checkpoint.make_model import default_cache_dir
from pdscope.engine import model as model_module
from pdscope.engine import native
from pdscope.engine.kernels import median_times_s

PATHS = ("linear", "batch_linear", "big_batch_linear", "prefill_linear")
# every path kept off the copies, so the model holds what it holds when a start's trials run
NO_COPIES = "linear=packed,batch_linear=packed,big_batch_linear=onednn,prefill_linear=onednn"
WAYS = {
    "every weight": (1 << 62, 1 << 62),
    "bounded": (model_module._TRIAL_STREAM_BYTES, model_module._PREFILL_TRIAL_BYTES),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a checkpoint directory, or small")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=7, help="timed runs a candidate, a trial")
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    args = parser.parse_args()

    llm = LLM(model=args.model, kv_cache_memory="64MiB", max_model_len=2048, kernels=NO_COPIES)
    model = llm.engine.runner.model
    ops = native.load(default_cache_dir() / "native")
    print(machine_line())
    print(f"model {args.model}: {sum(p.numel() for p in model.parameters()) / 1e6:,.1f}M params")
    took: dict[tuple[str, str], list[float]] = {}
    ratios: dict[tuple[str, str, str], list[float]] = {}
    picks: dict[tuple[str, str], Counter[str]] = {}
    for r in range(args.rounds):
        ways = list(WAYS) if r % 2 == 0 else list(reversed(WAYS))
        for way in ways:
            model_module._TRIAL_STREAM_BYTES, model_module._PREFILL_TRIAL_BYTES = WAYS[way]
            trials = model_module.kernel_trials(model, args.prefill_tokens, ops)
            for path in PATHS:
                if path not in trials:
                    continue
                start = time.perf_counter()
                medians = median_times_s(trials[path](), rounds=args.runs, budget_s=1e9)
                took.setdefault((path, way), []).append(time.perf_counter() - start)
                best = min(medians.values())
                for name, t in medians.items():
                    ratios.setdefault((path, way, name), []).append(t / best)
                pick = min(medians, key=medians.__getitem__)
                picks.setdefault((path, way), Counter())[pick] += 1
            del trials  # its copies go before the other way's are made
    for path in PATHS:
        for way in WAYS:
            if (path, way) not in took:
                continue
            names = [n for (p, w, n) in ratios if (p, w) == (path, way)]
            cells = ", ".join(
                f"{n} {statistics.median(ratios[path, way, n]):.3f}"
                f" ({min(ratios[path, way, n]):.2f}-{max(ratios[path, way, n]):.2f})"
                for n in names
            )
            won = ", ".join(f"{n} x{c}" for n, c in picks[path, way].most_common())
            print(
                f"{path:16} {way:12} {statistics.median(took[path, way]):6.2f} s a trial; "
                f"over the fastest: {cells}; picked {won}"
            )


if __name__ == "__main__":
    main()
