"""Prompts of an exact token count, each unique from its first token so no prefix cache helps.

With the server's ``/tokenize`` (vLLM, SGLang, pdscope) a prompt is cut to exactly N token ids
and sent as ids. Without it, prompts are text sized by a tokens-per-word estimate that is
calibrated from the prompt counts the server reports; the trace then carries the server's count,
which is what every figure uses.
"""

from __future__ import annotations

import contextlib
import random
import re
from collections.abc import Iterator
from functools import cache

import httpx


@cache
def _words() -> tuple[str, ...]:
    import pydoc_data.topics

    text = " ".join(pydoc_data.topics.topics.values())
    return tuple(w for w in re.findall(r"[A-Za-z]{3,12}", text))


# Tokens per word a real tokenizer can give for this builder's English words (BPE: ~1.3;
# one byte per token: ~6; a chat template's own tokens over a few words: tens): a server's
# count outside is not learned from. Too few is what hurts: prompts grow without bound.
MIN_TOKENS_PER_WORD, MAX_TOKENS_PER_WORD = 0.25, 100.0


class PromptTooLong(ValueError):
    """/tokenize refused the text as longer than the server's context (pdscope serve refuses
    one by its length alone; vLLM counts it)."""


class PromptBuilder:
    def __init__(
        self,
        client: httpx.AsyncClient,
        url: str,
        model: str,
        use_tokenize: bool,
        headers: dict[str, str] | None = None,
        seed: int = 0,
        tokenize_key: str = "prompt",
    ):
        self.client, self.url, self.model = client, url.rstrip("/"), model
        self.use_tokenize = use_tokenize
        self.tokenize_key = tokenize_key  # llama.cpp's /tokenize reads "content"
        self.calibrations = 0  # prompt counts from the server learned from so far
        self.implausible = 0  # prompt counts left out: tokens per word no tokenizer gives
        self._reported = self._words = 0
        self.headers = headers
        self.rng = random.Random(seed)
        self._aside_rng = random.Random()  # fresh every run, seed or not: never a repeat
        self.tokens_per_word = 1.3  # updated from the server's counts

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """Prompts drawn inside come from a stream of their own and leave the builder as it
        was, so the prompts drawn outside are the ones the seed gives whatever was drawn
        aside (a probe's resends, which one run makes and the next may not). One draw at a
        time: the builder's state is swapped, so no other prompt may be drawn meanwhile."""
        rng, per_word = self.rng, self.tokens_per_word
        self.rng = self._aside_rng
        try:
            yield
        finally:
            self.rng, self.tokens_per_word = rng, per_word

    def _text(self, words: int) -> str:
        vocab = _words()
        tag = f"{self.rng.randrange(10**9)}"  # unique first token(s)
        return tag + " " + " ".join(self.rng.choice(vocab) for _ in range(max(words, 1)))

    async def ids(self, tokens: int) -> list[int]:
        """Exactly ``tokens`` token ids (needs /tokenize)."""
        words = int(tokens / self.tokens_per_word) + 16
        for _ in range(8):
            r = await self.client.post(
                f"{self.url}/tokenize",
                headers=self.headers,
                timeout=30,
                json={
                    "model": self.model,
                    self.tokenize_key: self._text(words),
                    "add_special_tokens": False,
                },
            )
            if r.status_code == 400 and "context" in r.text:
                raise PromptTooLong(r.text[:300])
            if r.status_code != 200:  # the server's own reason, not httpx's boilerplate
                raise ValueError(f"{self.url}/tokenize answered {r.status_code}: {r.text[:300]}")
            try:
                ids = r.json()["tokens"]
                if not isinstance(ids, list):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                raise ValueError(
                    f"{self.url}/tokenize answered without a list of 'tokens': {r.text[:200]}"
                ) from None
            if len(ids) >= tokens:
                self.tokens_per_word = len(ids) / words
                return ids[:tokens]
            if not ids:
                raise ValueError(f"{self.url}/tokenize returned no tokens")
            words = int(words * tokens / len(ids)) + 16
        raise ValueError(f"{self.url}/tokenize never reached {tokens} tokens")

    def text(self, tokens: int) -> str:
        """About ``tokens`` tokens of text, by the current calibration."""
        return self._text(round(tokens / self.tokens_per_word))

    def calibrate(self, words_sent: int, reported: int | None) -> None:
        """Learn tokens per word from a prompt's word count and the server's token count."""
        if reported and words_sent:
            if not MIN_TOKENS_PER_WORD <= reported / words_sent <= MAX_TOKENS_PER_WORD:
                # A count no tokenizer gives (1 token for 25 words): learning from it grew
                # a 32-token prompt to 9 MB. Kept out, and counted for the report.
                self.implausible += 1
                return
            # Pooled over every prompt so far: one prompt's words can run ~10% above or below
            # the average in tokens, and a single sample would carry that into every prompt.
            self._reported += reported
            self._words += words_sent
            self.tokens_per_word = self._reported / self._words
            self.calibrations += 1
