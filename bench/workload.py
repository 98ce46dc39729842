"""The engine benchmark's protocol, shared by every stack (no pdscope import: vLLM's venv runs it).

Every figure is a wall-clock difference around a blocking ``generate(prompts, max_tokens)`` call,
measured the same way for each stack:
* decode_b1_tok_s: one request, 32-token prompt; N / (T(1 + N tokens) - T(1 token)), N = 256.
* prefill_2000_tok_s: a fresh 2,000-token prompt, one output token: 2000 / T.
* batch32_decode_tok_s: 32 requests of 129 prompt tokens submitted together; aggregate decode
  rate by the same difference: 32 x N / (T(1 + N tokens each) - T(1 token each)), N = 128,
  T(1 token each) read from one call before and one after, interpolated to the middle of the
  decode call's own prefill (a linear drift across the three cancels). Where the stack caches
  prefixes the 32 prompts are computed once first, so that all three calls read their first
  128 tokens from the cache and compute one token a prompt: 128 is a whole block in vLLM's CPU
  build (its default block size there) and 8 of pdscope's, and neither reuses a prompt's last
  token (it must be computed for its logits; 128 tokens reused nothing in vLLM). Fresh, the
  4,096 tokens were a large share of the call on a large model (a 3B model's took 26-36 s
  beside ~40 s of decode, and their swing a third of the difference); batch32_prefill_apart,
  how far the two prefill-only calls differed over the decode's time, a rough bound on the
  figure's error (about twice it, for noise).
* batch32_e2e_tok_s: 32 fresh requests end to end, prefill included: 32 x (1 + N) / T (the
  decode call itself where the stack has no prefix cache).
* cached_prefix_ratio: T(prefix + suffix B) / T(prefix + suffix A), one output token, where the
  2,000-token prefix was computed by the first call (needs prefix caching).
* decode_ctx64_tok_s, decode_ctx4000_tok_s (``long_context``): one request decoding N = 96
  tokens (32 when quick) after a prompt of 64 or 4,000 minus N / 2 tokens, so its mean context
  is 64 or 4,000 tokens; the rate by the same difference as decode_b1, but on one prompt per
  context, computed once first, so that both timed calls read it from the prefix cache where
  the stack has one (the difference is then N decode steps, not N decode steps plus the gap
  between two fresh 4,000-token prefills, which on a noisy host is as large as the decode
  itself), and the two contexts taken in the order 64, 4,000, 4,000, 64 and summed, so that a
  host that changes speed during the figure moves both alike.
Every prompt is fresh random token ids from ``seed`` unless cached on purpose, so no cache helps
by accident, and a new seed per round keeps rounds from hitting each other's prefixes.

A stack's worker (stack_worker.py) loads it once and runs :func:`run_round` for every round the
bench asks for, so that stacks can be interleaved round by round. A round comes in two parts,
batch-1 decode and the rest, so that the bench can measure the bandwidth ceiling just before and
just after the decode figure that it divides, while the worker sits idle.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Callable

Generate = Callable[[list[list[int]], int], None]

LONG_CONTEXT_DECODE = 96
# The batched figure's prompts: one token past vLLM's 128-token CPU block (module docstring)
BATCH_PROMPT_TOKENS = 129
CONTEXTS = {"decode_ctx64_tok_s": 64, "decode_ctx4000_tok_s": 4000}


PARTS = ("decode_b1", "rest")


def run_round(
    generate: Generate,
    seed: int,
    vocab: int = 16000,
    quick: bool = False,
    with_cached_prefix: bool = True,
    long_context: bool = False,
    part: str = "all",
) -> dict[str, float]:
    """Every figure once (the bench takes medians across rounds), or one of :data:`PARTS`:
    ``decode_b1`` (its warm-up and decode_b1_tok_s) or ``rest`` (every other figure)."""
    if part not in ("all", *PARTS):
        raise ValueError(f"part must be 'all' or one of {PARTS}, got {part!r}")
    # The rest draws from its own stream, so a round split in two prompts exactly as one whole.
    rng = random.Random(seed)
    rest_rng = random.Random(seed + 1_000_003)

    def fresh(n: int, source: random.Random = rest_rng) -> list[int]:
        return [source.randrange(100, vocab) for _ in range(n)]

    def timed(prompts: list[list[int]], max_tokens: int) -> float:
        start = time.perf_counter()
        generate(prompts, max_tokens)
        return time.perf_counter() - start

    def decode_rate(prompt_len: int, tokens: int) -> float:
        short = timed([fresh(prompt_len, rng)], 1)
        return tokens / (timed([fresh(prompt_len, rng)], 1 + tokens) - short)

    result: dict[str, float] = {}
    if part in ("all", "decode_b1"):
        timed([fresh(64, rng)], 8)  # warm-up: the first call after another stack pays misses
        result["decode_b1_tok_s"] = decode_rate(32, 64 if quick else 256)
    if part == "decode_b1":
        return result
    # In a split round the bench's bandwidth reading ran just before: as after another stack.
    timed([fresh(64)], 8)
    result["prefill_2000_tok_s"] = 2000 / timed([fresh(2000)], 1)
    batch, out_len = (8, 32) if quick else (32, 128)
    if with_cached_prefix:
        prompts = [fresh(BATCH_PROMPT_TOKENS) for _ in range(batch)]
        timed(prompts, 1)  # computed once: the three calls below read them from the cache
        calls = [prompts] * 3
    else:
        calls = [[fresh(BATCH_PROMPT_TOKENS) for _ in range(batch)] for _ in range(3)]
    first = timed(calls[0], 1)
    whole = timed(calls[1], 1 + out_len)
    again = timed(calls[2], 1)
    # The calls run [0, P], [P, 2P + D] (its prefill [P, 2P]), [2P + D, 3P + D]: the prefill's
    # middle lies P / (2P + D) of the way from the first call's middle to the last's.
    prefill_s = (first + again) / 2
    share = prefill_s / (prefill_s + whole)  # 2P + D = P + whole
    decode_s = whole - (first + (again - first) * share)
    if decode_s <= 0:
        raise RuntimeError(
            f"batch decode: the call with {out_len} tokens ({whole:.2f} s) took no longer than "
            f"its prefill alone ({first:.2f} and {again:.2f} s): the host swung; run again"
        )
    result["batch32_decode_tok_s"] = batch * out_len / decode_s
    result["batch32_prefill_apart"] = abs(first - again) / decode_s
    end_to_end = (
        timed([fresh(BATCH_PROMPT_TOKENS) for _ in range(batch)], 1 + out_len)
        if with_cached_prefix
        else whole
    )
    result["batch32_e2e_tok_s"] = batch * (1 + out_len) / end_to_end
    if with_cached_prefix:
        prefix = fresh(2000)
        uncached = timed([prefix + fresh(16)], 1)
        result["cached_prefix_ratio"] = timed([prefix + fresh(16)], 1) / uncached
    if long_context:
        tokens = LONG_CONTEXT_DECODE // 3 if quick else LONG_CONTEXT_DECODE
        result |= decode_at_contexts(generate, fresh, tokens)
    return result


def decode_at_contexts(
    generate: Generate,
    fresh: Callable[[int], list[int]],
    tokens: int = LONG_CONTEXT_DECODE,
) -> dict[str, float]:
    """decode_ctx64_tok_s and decode_ctx4000_tok_s as the module's docstring takes them: one
    prompt per context from ``fresh(n)``, computed once first, then ``tokens`` decoded after
    it in the order 64, 4,000, 4,000, 64, each by T(1 + tokens) - T(1)."""

    def timed(prompt: list[int], max_tokens: int) -> float:
        start = time.perf_counter()
        generate([prompt], max_tokens)
        return time.perf_counter() - start

    prompts = {key: fresh(context - tokens // 2) for key, context in CONTEXTS.items()}
    for prompt in prompts.values():
        timed(prompt, 1)  # computed (and cached, where the stack caches) before timing
    decode_s = dict.fromkeys(CONTEXTS, 0.0)
    for key in [*CONTEXTS, *reversed(CONTEXTS)]:
        prompt = prompts[key]
        decode_s[key] += timed(prompt, 1 + tokens) - timed(prompt, 1)
    return {key: 2 * tokens / seconds for key, seconds in decode_s.items()}


def serve_rounds(generate: Generate, with_cached_prefix: bool = True) -> None:
    """Answer the bench over stdin/stdout: one JSON request per line ({"seed", "quick",
    "long_context", "part"}), one ``RESULT {json}`` line back per request; ``READY`` once
    loaded."""
    print("READY", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        ask = json.loads(line)
        result = run_round(
            generate,
            seed=ask["seed"],
            quick=ask.get("quick", False),
            with_cached_prefix=with_cached_prefix,
            long_context=ask.get("long_context", False),
            part=ask.get("part", "all"),
        )
        print("RESULT " + json.dumps(result), flush=True)
