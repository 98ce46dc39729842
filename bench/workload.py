"""The engine benchmark's protocol, shared by every stack (no pdscope import: vLLM's venv runs it).

Every figure is a wall-clock difference around a blocking ``generate(prompts, max_tokens)`` call,
measured the same way for each stack:
* decode_b1_tok_s: one request, 32-token prompt; (T(1 + N tokens) - T(1 token)) / N, N = 256.
* prefill_2000_tok_s: a fresh 2,000-token prompt, one output token: 2000 / T.
* batch32_decode_tok_s: 32 requests of 128 prompt tokens submitted together; aggregate decode
  rate by the same difference: 32 x N / (T(1 + N tokens each) - T(1 token each)), N = 128.
* batch32_e2e_tok_s: the same 32 requests end to end, prefill included: 32 x (1 + N) / T.
* cached_prefix_ratio: T(prefix + suffix B) / T(prefix + suffix A), one output token, where the
  2,000-token prefix was computed by the first call (needs prefix caching).
Each timing is the median of ``repeats``; every prompt is fresh random token ids unless cached on
purpose, so no cache helps by accident.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

Generate = Callable[[list[list[int]], int], None]


def run_protocol(
    generate: Generate,
    vocab: int = 16000,
    repeats: int = 3,
    quick: bool = False,
    with_cached_prefix: bool = True,
) -> dict[str, float]:
    rng = random.Random(1234)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    def timed(prompts: list[list[int]], max_tokens: int) -> float:
        start = time.perf_counter()
        generate(prompts, max_tokens)
        return time.perf_counter() - start

    decode_tokens = 64 if quick else 256
    timed([fresh(64)], 8)  # warm-up: first calls pay allocation and kernel selection
    short = [timed([fresh(32)], 1) for _ in range(repeats)]
    long = [timed([fresh(32)], 1 + decode_tokens) for _ in range(repeats)]
    result = {
        "decode_b1_tok_s": decode_tokens / (statistics.median(long) - statistics.median(short))
    }
    prefill = [timed([fresh(2000)], 1) for _ in range(repeats)]
    result["prefill_2000_tok_s"] = 2000 / statistics.median(prefill)
    batch, out_len = (8, 32) if quick else (32, 128)
    rounds = max(1, repeats - 1)
    first = [timed([fresh(128) for _ in range(batch)], 1) for _ in range(rounds)]
    whole = [timed([fresh(128) for _ in range(batch)], 1 + out_len) for _ in range(rounds)]
    decode_s = statistics.median(whole) - statistics.median(first)
    result["batch32_decode_tok_s"] = batch * out_len / decode_s
    result["batch32_e2e_tok_s"] = batch * (1 + out_len) / statistics.median(whole)
    if with_cached_prefix:
        ratios = []
        for _ in range(repeats):
            prefix = fresh(2000)
            uncached = timed([prefix + fresh(16)], 1)
            cached = timed([prefix + fresh(16)], 1)
            ratios.append(cached / uncached)
        result["cached_prefix_ratio"] = statistics.median(ratios)
    return result
