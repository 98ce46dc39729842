"""The engine's timeline: what happened to each request and in each step.

These records are the data the server's metrics and the client's traces are built from. Times are
``time.perf_counter()`` seconds (monotonic, one clock for the whole engine); durations are
differences of those.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields

import numpy as np


@dataclass
class RequestTimeline:
    """One request's life in the engine.

    ``token_s[i]`` is when output token ``i`` was produced (end of the step that sampled it), so
    ``token_s[0]`` is the first-token time. ``prefill_chunks`` holds ``(step_end_s, tokens)`` for
    every prompt chunk computed, recomputation after a preemption included.
    """

    arrival_s: float
    prompt_tokens: int = 0
    first_scheduled_s: float | None = None
    prefill_chunks: list[tuple[float, int]] = field(default_factory=list)
    token_s: list[float] = field(default_factory=list)
    finished_s: float | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    # Aborted by its caller (a client that left), not by the engine: like vLLM, the server
    # counts such a request in no finished-request metric (success total, e2e, queue...).
    cancelled: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    preemptions: int = 0

    @property
    def first_token_s(self) -> float | None:
        return self.token_s[0] if self.token_s else None

    @property
    def queue_s(self) -> float | None:
        """Arrival to first scheduled: time spent waiting (vLLM's request_queue_time)."""
        if self.first_scheduled_s is None:
            return None
        return self.first_scheduled_s - self.arrival_s

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def prefill_s(self) -> float | None:
        """First scheduled to first token (vLLM's request_prefill_time)."""
        if self.first_token_s is None or self.first_scheduled_s is None:
            return None
        return self.first_token_s - self.first_scheduled_s

    @property
    def decode_s(self) -> float | None:
        """First token to last token (vLLM's request_decode_time)."""
        if not self.token_s:
            return None
        return self.token_s[-1] - self.token_s[0]

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_s is None else self.finished_s - self.arrival_s

    @property
    def itl_s(self) -> list[float]:
        """Gaps between consecutive output tokens."""
        return [b - a for a, b in zip(self.token_s, self.token_s[1:], strict=False)]


@dataclass(frozen=True)
class StepRecord:
    """One engine step: what ran and what the pool looked like afterwards."""

    start_s: float
    end_s: float
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of pool blocks in use by requests, 0-1
    prefill_tokens: int
    decode_tokens: int
    num_preempted: int
    prefix_hit_tokens: int = 0  # prompt tokens served from the prefix cache at admission

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


class StepLog:
    """The last ``maxlen`` :class:`StepRecord` s, oldest first, held as rows of one numpy array.

    A full garbage collection walks every tracked object, and every dataclass instance is one:
    100,000 records in a deque took each full collection 6.6 ms (after ``gc.freeze()``, AMX
    Xeon; exact tuples 1.0 ms), where an array's rows are no objects at all (0.0 ms). A record
    read back is made anew, equal to the one appended.
    """

    assert all(f.type in (float, "float", int, "int") for f in fields(StepRecord))
    # seconds and fractions as float64 (a perf_counter reading kept exact), counts as int64
    _DTYPE = np.dtype(
        [
            (f.name, np.float64 if f.type in (float, "float") else np.int64)
            for f in fields(StepRecord)
        ]
    )
    _FIELDS = _DTYPE.names

    def __init__(self, maxlen: int) -> None:
        assert maxlen > 0
        self._rows = np.zeros(maxlen, dtype=self._DTYPE)
        self._next = 0  # the row the next record goes to
        self._count = 0

    def append(self, record: StepRecord) -> None:
        self._rows[self._next] = tuple(getattr(record, name) for name in self._FIELDS)
        self._next = (self._next + 1) % len(self._rows)
        self._count = min(self._count + 1, len(self._rows))

    def clear(self) -> None:
        self._next = self._count = 0

    def __len__(self) -> int:
        return self._count

    def _row(self, i: int) -> StepRecord:
        first = (self._next - self._count) % len(self._rows)
        return StepRecord(*self._rows[(first + i) % len(self._rows)].item())

    def __getitem__(self, i: int) -> StepRecord:
        if not -self._count <= i < self._count:
            raise IndexError(f"step {i} of {self._count}")
        return self._row(i % self._count)

    def __iter__(self) -> Iterator[StepRecord]:
        return (self._row(i) for i in range(self._count))
