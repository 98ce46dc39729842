"""Bench workloads: what each request asks for, and (for some workloads) when.

* ``random``: input and output lengths from a distribution, exact token counts where the server
  tokenizes, ``ignore_eos`` so outputs have the asked length.
* ``shared-prefix``: G groups of a P-token system prompt, each request adding an S-token suffix.
* ``long-prompt``: a steady population of streaming decodes, interrupted by long prompts at a set
  rate: the article's "big prompt arrives mid-stream".
* ``file:PATH``: JSONL (``prompt`` or ``messages``, optional ``output_tokens``) or ShareGPT JSON.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdscope.client.prompts import PromptBuilder, PromptTooLong


class WorkloadError(ValueError):
    """A workload that cannot be built (bad spec, unreadable file); the message names it."""


@dataclass
class RequestSpec:
    """One request to send. ``prompt`` is token ids (exact), text, or chat messages."""

    prompt: list[int] | str | list[dict[str, Any]]
    output_tokens: int
    input_tokens: int | None = None  # intended prompt length, when known
    kind: str = ""  # e.g. "decode" or "long-prompt" in the long-prompt workload; group id
    at_s: float | None = None  # scheduled send time from the run's start, if the workload sets it


@dataclass(frozen=True)
class Lengths:
    """A length distribution: ``128``, ``64-256`` (uniform), ``normal:128:32`` (clipped >= 1)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str, what: str) -> Lengths:
        text = str(text).strip()
        if re.fullmatch(r"0+(-\d+)?", text):  # no tokens asked for: not a request
            raise WorkloadError(f"{what} must be at least 1, got {text!r}")
        try:
            if m := re.fullmatch(r"(\d+)", text):
                return cls("fixed", int(m.group(1)))
            if m := re.fullmatch(r"(\d+)-(\d+)", text):
                low, high = int(m.group(1)), int(m.group(2))
                if low > high:
                    raise ValueError
                return cls("uniform", low, high)
            if m := re.fullmatch(r"normal:(\d+(?:\.\d+)?):(\d+(?:\.\d+)?)", text):
                return cls("normal", float(m.group(1)), float(m.group(2)))
        except ValueError:
            pass
        raise WorkloadError(f"{what}: cannot read {text!r}; use N, LOW-HIGH or normal:MEAN:STD")

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = rng.randint(int(self.a), int(self.b))
        else:
            value = round(rng.gauss(self.a, self.b))
        if value < 1:
            return 1
        return int(value)


async def _prompt(builder: PromptBuilder, tokens: int) -> list[int] | str:
    if not builder.use_tokenize:
        return builder.text(tokens)
    try:
        return await builder.ids(tokens)
    except PromptTooLong:
        # Past the context: sent as text of about that length, it is refused by the server
        # and counted as one failed request, as vLLM's bench counts it; the load goes on.
        return builder.text(tokens)


def _join(a: list[int] | str, b: list[int] | str) -> list[int] | str:
    if isinstance(a, list) and isinstance(b, list):
        return a + b
    return f"{a} {b}"


async def random_workload(
    builder: PromptBuilder, n: int, input_len: Lengths, output_len: Lengths, seed: int = 0
) -> list[RequestSpec]:
    rng = random.Random(seed)
    specs = []
    for _ in range(n):
        tokens = input_len.draw(rng)
        specs.append(RequestSpec(await _prompt(builder, tokens), output_len.draw(rng), tokens))
    return specs


async def shared_prefix_workload(
    builder: PromptBuilder,
    n: int,
    groups: int,
    prefix_tokens: int,
    suffix_tokens: int,
    output_len: Lengths,
    seed: int = 0,
) -> list[RequestSpec]:
    if groups < 1:
        raise WorkloadError(f"shared-prefix needs at least one group, got {groups}")
    rng = random.Random(seed)
    prefixes = [await _prompt(builder, prefix_tokens) for _ in range(groups)]
    specs = []
    for i in range(n):
        group = i % groups
        prompt = _join(prefixes[group], await _prompt(builder, suffix_tokens))
        specs.append(
            RequestSpec(
                prompt, output_len.draw(rng), prefix_tokens + suffix_tokens, kind=f"group-{group}"
            )
        )
    return specs


async def long_prompt_workload(
    builder: PromptBuilder,
    streams: int,
    stream_output: int,
    long_tokens: int,
    long_rate: float,
    duration_s: float,
    seed: int = 0,
) -> list[RequestSpec]:
    """``streams`` decodes start together and stream ``stream_output`` tokens each; meanwhile
    long prompts (``long_tokens``, one output token) arrive at ``long_rate`` per second (Poisson)
    for ``duration_s``. p99 ITL of the decodes shows what each long prefill costs them."""
    if long_rate <= 0 or duration_s <= 0:
        raise WorkloadError("long-prompt needs a positive --long-rate and --duration")
    rng = random.Random(seed)
    specs = [
        RequestSpec(await _prompt(builder, 32), stream_output, 32, kind="decode", at_s=0.0)
        for _ in range(streams)
    ]
    t = rng.expovariate(long_rate)
    while t < duration_s:
        specs.append(
            RequestSpec(
                await _prompt(builder, long_tokens), 1, long_tokens, kind="long-prompt", at_s=t
            )
        )
        t += rng.expovariate(long_rate)
    return specs


def file_workload(path: Path, n: int | None, default_output: int) -> list[RequestSpec]:
    """JSONL lines with ``prompt`` or ``messages`` (optional ``output_tokens``), or a ShareGPT
    JSON list (``conversations`` of ``{from, value}``: the first human turn is the prompt, the
    following gpt turn's length in words sets nothing: ``default_output`` is used)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"cannot read workload file {path}: {exc}") from exc
    specs: list[RequestSpec] = []
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{path} is not valid JSON: {exc}") from exc
        for number, item in enumerate(items):
            if not isinstance(item, dict):
                raise WorkloadError(
                    f"{path}: item {number} is not a ShareGPT record "
                    "({'conversations': [{'from': 'human', 'value': ...}, ...]})"
                )
            # A record without a usable first human turn is skipped, as before.
            turns = item.get("conversations")
            turns = [t for t in turns if isinstance(t, dict)] if isinstance(turns, list) else []
            human = next((t.get("value") for t in turns if t.get("from") == "human"), None)
            if isinstance(human, str) and human:
                specs.append(RequestSpec(human, default_output))
    else:
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise WorkloadError(f"{path}:{number}: not JSON: {exc}") from exc
            if not isinstance(item, dict):
                raise WorkloadError(f"{path}:{number}: a line must be a JSON object")
            prompt = item.get("messages") or item.get("prompt")
            if not prompt:
                raise WorkloadError(f"{path}:{number}: needs 'prompt' or 'messages'")
            if not isinstance(prompt, str | list):
                raise WorkloadError(f"{path}:{number}: 'prompt' must be text, got {prompt!r}")
            output = item.get("output_tokens")
            output = default_output if output is None else output
            if not isinstance(output, int) or output < 1:
                raise WorkloadError(
                    f"{path}:{number}: 'output_tokens' must be >= 1, got {output!r}"
                )
            specs.append(RequestSpec(prompt, output))
    if not specs:
        raise WorkloadError(f"{path} holds no prompts")
    if n is not None:
        specs = [specs[i % len(specs)] for i in range(n)]  # cycle when asked for more
    return specs
