"""engine_bench's protocol (bench/workload.py): which prompts its batch-32 figure sends, to a
stack that caches prefixes and to one that does not. The stand-in ``generate`` records the
calls and sleeps in proportion to the tokens asked; the stacks themselves run in
bench/engine_bench.py."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))

from workload import BATCH_PROMPT_TOKENS, run_round

Call = tuple[tuple[tuple[int, ...], ...], int]


def recorded(with_cached_prefix: bool) -> tuple[dict[str, float], list[Call]]:
    calls: list[Call] = []

    def generate(prompts: list[list[int]], max_tokens: int) -> None:
        calls.append((tuple(map(tuple, prompts)), max_tokens))
        time.sleep(0.0005 * max_tokens)

    result = run_round(generate, seed=7, with_cached_prefix=with_cached_prefix, part="rest")
    return result, [c for c in calls if len(c[0]) == 32]


def test_batch_decode_reads_prompts_computed_once_where_the_stack_caches() -> None:
    """With a prefix cache: the 32 prompts (129 tokens: one past vLLM's 128-token CPU block)
    are computed once, then the 1-token, (1 + 128)-token and 1-token calls send the same ones;
    the end-to-end figure sends 32 fresh ones of its own."""
    result, calls = recorded(with_cached_prefix=True)
    assert [n for _, n in calls] == [1, 1, 129, 1, 129]
    computed, first, whole, again, end_to_end = (prompts for prompts, _ in calls)
    assert computed == first == whole == again
    assert all(len(p) == BATCH_PROMPT_TOKENS == 129 for p in computed)
    assert not set(end_to_end) & set(computed) and len(set(end_to_end)) == 32
    assert result["batch32_decode_tok_s"] > 0 and result["batch32_e2e_tok_s"] > 0


def test_batch_decode_sends_fresh_prompts_to_a_stack_without_a_cache() -> None:
    """Without one (transformers): three calls, each of 32 fresh prompts; the decode call is
    the end-to-end figure's too."""
    result, calls = recorded(with_cached_prefix=False)
    assert [n for _, n in calls] == [1, 129, 1]
    sets = [set(prompts) for prompts, _ in calls]
    assert all(len(s) == 32 for s in sets) and not (sets[0] & sets[1] or sets[1] & sets[2])
    assert "cached_prefix_ratio" not in result and result["batch32_e2e_tok_s"] > 0
