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

    Invariants: ``num_computed_tokens <= num_tokens``; ``token_ids`` is the prompt followed by the
    outputs and only grows (:meth:`append_output`), so slices taken from it and the hashes of its
    full blocks stay valid for the request's whole life, preemptions included. A step that brings
    ``num_computed_tokens`` up to ``num_tokens`` samples one new token, which makes them differ by
    one again (a decode).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    timeline: RequestTimeline
    stop_token_ids: frozenset[int] = frozenset()  # ends the request: EOS ids + params' ids
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Chained hashes of the full blocks of ``token_ids`` seen so far (computed or not). Extended
    # by the block pool as tokens arrive, never recomputed: the tokens they cover never change.
    block_hashes: list[bytes] = field(default_factory=list)
    # Leading blocks of ``block_table`` the prefix cache already holds under this request's
    # hashes: publishing after a step starts past them (a held block is never evicted).
    num_published_blocks: int = 0
    status: Status = Status.WAITING
    output_text: str = ""
    finish_reason: str | None = None
    token_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.token_ids = self.prompt_token_ids + self.output_token_ids

    def append_output(self, token: int) -> None:
        self.output_token_ids.append(token)
        self.token_ids.append(token)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def is_decode_next(self) -> bool:
        """The only token left to compute is the last sampled one: the next step is a decode.

        This is the one rule for a token's phase. Anything else still computing tokens the
        request already had (a prompt chunk, the recomputation after a preemption up to its
        last sampled token) is prefill.
        """
        return self.num_tokens - self.num_computed_tokens == 1 and bool(self.output_token_ids)
