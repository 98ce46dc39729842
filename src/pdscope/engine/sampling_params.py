"""Per-request sampling parameters (vLLM's names and defaults). Pure Python."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature`` 0 means greedy. ``top_k`` 0 or -1 disables top-k; ``top_p`` 1.0 disables
    nucleus sampling. ``seed`` makes one request's sampling reproducible regardless of what else
    is in its batch. ``stop`` strings are matched on the decoded text and are not included in it.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        problems = []
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            problems.append(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            problems.append(f"seed must fit in 64 bits, got {self.seed}")
        if not 0 <= self.temperature < math.inf:  # NaN fails this too
            problems.append(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            problems.append(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            problems.append(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if any(not s for s in self.stop):
            problems.append("stop strings must be non-empty")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def greedy(self) -> bool:
        # Dividing logits by a temperature this small overflows; vLLM draws the same line.
        return self.temperature < 1e-5
