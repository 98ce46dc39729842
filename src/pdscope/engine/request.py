"""Request state inside the engine. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from pdscope.engine.sampling_params import SamplingParams
from pdscope.engine.timeline import RequestTimeline


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation request.

    Invariant: ``num_computed_tokens <= num_tokens``. A step that brings ``num_computed_tokens`` up
    to ``num_tokens`` samples one new token, which makes them differ by one again (a decode).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    timeline: RequestTimeline
    stop_token_ids: frozenset[int] = frozenset()  # ends the request: EOS ids + params' ids
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of full, computed blocks
    status: Status = Status.WAITING
    output_text: str = ""
    finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def is_prefill(self) -> bool:
        """Still computing tokens it already has (prompt, or all tokens after a preemption)."""
        return self.num_tokens - self.num_computed_tokens > 1 or not self.output_token_ids
