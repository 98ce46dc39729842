"""Prefills of new and of repeated lengths, with steps padded to ROW_BUCKET rows and without,
interleaved in one process.

oneDNN builds a matmul primitive for every new row count, so the first prefill of each new
prompt length pays for four of them (one per weight shape of a layer). ``CausalLM.row_bucket``
pads steps to a multiple of ROW_BUCKET rows (engine/model.py); this bench measures both what it
saves and what it costs, on one engine whose ``row_bucket`` is switched between rounds:

* ``fresh``: a prompt length neither variant has run before (drawn at random from
  ``--fresh-range``, each used once: the two of a pair differ), so the exact variant always
  builds new primitives and the padded one only where the length opens a bucket it has not met
  (a range of 400 lengths is 25 buckets: as a server's traffic, most fresh lengths soon fall
  in one it met; an exact length that is a multiple of ROW_BUCKET builds a bucket the padded
  variant may meet later, a small bias its way);
* ``repeat``: lengths both variants ran before (warmed up first), so neither builds anything
  and the difference is the padding's price (up to ROW_BUCKET - 1 more rows through the
  matmuls and norms; on the PyTorch attention paths a copy of its output a layer, where the
  C kernels' output has the rows' room).

A prefill is ``LLM.generate`` of one prompt for one token, prefix caching off, random ids.
Each kind runs as pairs back to back (padded and exact, the order alternating); the ratio is
padded over exact per pair, then the median; below 1 the padding is faster.

    .venv/bin/python bench/row_bucket_ab.py --rounds 9
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from pdscope.specs.local import cpu_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--repeat-lengths", type=int, nargs="+", default=[300, 777, 1300, 1900])
    parser.add_argument("--fresh-range", type=int, nargs=2, default=[600, 1000])
    args = parser.parse_args()

    from pdscope import LLM, SamplingParams
    from pdscope.engine.model import ROW_BUCKET

    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        kv_cache_memory="2GiB",
        max_model_len=4096,
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
    )
    model = llm.engine.runner.model
    chosen = model.row_bucket
    print(f"CPU: {cpu_model()}; kernels: {llm.engine.kernels.summary()}")
    print(f"row_bucket as loaded: {chosen} (ROW_BUCKET {ROW_BUCKET})")
    vocab = model.config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def prefill_ms(length: int, bucket: int) -> float:
        model.row_bucket = bucket
        prompt = [rng.randrange(1, vocab) for _ in range(length)]
        start = time.perf_counter()
        llm.generate([prompt], params)
        return (time.perf_counter() - start) * 1e3

    for bucket in (ROW_BUCKET, 1):
        for length in args.repeat_lengths:
            prefill_ms(length, bucket)
    lo, hi = args.fresh_range
    unused = [n for n in range(lo, hi + 1) if n not in args.repeat_lengths]
    rng.shuffle(unused)
    ratios: dict[str, list[float]] = {"fresh": [], "repeat": []}
    sums: dict[tuple[str, str], float] = {}
    for r in range(args.rounds):
        for i, length in enumerate(args.repeat_lengths):
            for kind in ("fresh", "repeat"):
                # each pair back to back, its order alternating; a fresh length once ever
                order = (ROW_BUCKET, 1) if (r + i) % 2 == 0 else (1, ROW_BUCKET)
                ms = {b: prefill_ms(length if kind == "repeat" else unused.pop(), b) for b in order}
                ratios[kind].append(ms[ROW_BUCKET] / ms[1])
                for b, name in ((ROW_BUCKET, "padded"), (1, "exact")):
                    sums[(name, kind)] = sums.get((name, kind), 0.0) + ms[b]
    model.row_bucket = chosen
    pairs = args.rounds * len(args.repeat_lengths)
    print(f"{pairs} pairs a kind (fresh from {lo}-{hi}, repeats {args.repeat_lengths})")
    print("kind    padded ms  exact ms  padded/exact (median of pairs, quartiles)")
    for kind in ("fresh", "repeat"):
        q = statistics.quantiles(ratios[kind], n=4)
        print(
            f"{kind:7s} {sums[('padded', kind)] / pairs:9.1f} {sums[('exact', kind)] / pairs:9.1f}"
            f"  {statistics.median(ratios[kind]):.3f} ({q[0]:.3f}-{q[2]:.3f})"
        )


if __name__ == "__main__":
    main()
