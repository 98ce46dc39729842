"""The scheduler: who runs in the next step, and how many tokens each. Pure Python, no torch.

One idea covers prefill, decode, chunked prefill, prefix caching and recomputation after
preemption: each step, every scheduled request's computed-token count catches up towards its
token count, within one token budget (running requests first, then waiting ones).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdscope.engine.block_pool import BlockPool
from pdscope.engine.request import Request, Status


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 64  # most requests running at once
    max_model_len: int = 2048  # prompt + output tokens of one request
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        assert self.max_num_batched_tokens >= 1 and self.max_num_seqs >= 1
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len}) or long prompts never run"
            )


@dataclass
class SchedulerOutput:
    """One step's plan: ``scheduled`` pairs a request with how many new tokens it computes."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool):
        self.config = config
        self.pool = pool
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        assert request.num_tokens <= self.config.max_model_len
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        # Running requests first: a decode costs one token, an unfinished prefill one chunk.
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            new = min(request.num_tokens - request.num_computed_tokens, budget)
            assert new > 0, "a running request always has a token to compute"
            while not self._grow(request, new):
                victim = self.running.pop()  # most recently admitted
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append((request, new))
                budget -= new
                index += 1

        # Then waiting requests fill what is left, unless this step had to preempt (the pool is
        # short; admitting more would only cause more preemption).
        while (
            self.waiting
            and budget > 0
            and not out.preempted
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            cached = self.pool.find_cached_prefix(request.all_token_ids)
            num_cached = len(cached) * self.pool.block_size
            new = request.num_tokens - num_cached
            if new > budget and not self.config.enable_chunked_prefill:
                break
            new = min(new, budget)
            needed = self.pool.blocks_needed(num_cached + new) - len(cached)
            reusable = sum(1 for b in cached if self.pool.blocks[b].ref_count == 0)
            if needed > self.pool.num_free_blocks - reusable:
                break  # pool full: the request waits
            self.waiting.popleft()
            if request.timeline.preemptions == 0:  # re-admissions are recomputation, not demand
                self.pool.record_lookup(request.num_tokens, num_cached)
            self.pool.touch(cached)
            request.block_table = cached + self.pool.allocate(needed)
            request.block_hashes = self.pool.hashes_for(request.all_token_ids[:num_cached], [])
            request.num_computed_tokens = num_cached
            if request.timeline.first_scheduled_s is None:
                request.timeline.num_cached_tokens = num_cached
            request.status = Status.RUNNING
            self.running.append(request)
            out.scheduled.append((request, new))
            budget -= new

        assert out.num_tokens <= self.config.max_num_batched_tokens
        assert len(self.running) <= self.config.max_num_seqs
        return out

    def _grow(self, request: Request, new: int) -> bool:
        """Make room in ``request``'s block table for ``new`` more tokens; False if the pool is
        out of blocks."""
        needed = self.pool.blocks_needed(request.num_computed_tokens + new)
        extra = needed - len(request.block_table)
        if extra <= 0:
            return True
        if extra > self.pool.num_free_blocks:
            return False
        request.block_table += self.pool.allocate(extra)
        return True

    def _preempt(self, request: Request) -> None:
        """Free everything the request holds; it goes back to the front of the queue and
        recomputes its tokens (prompt and outputs so far) when it is admitted again."""
        self.pool.free(request.block_table)
        request.block_table = []
        request.block_hashes = []
        request.num_computed_tokens = 0
        request.status = Status.WAITING
        request.timeline.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(self, out: SchedulerOutput) -> None:
        """Advance computed counts after the model ran, and publish newly full blocks."""
        for request, new in out.scheduled:
            if request.status is not Status.RUNNING:
                continue  # aborted during the step
            request.num_computed_tokens += new
            assert request.num_computed_tokens <= request.num_tokens
            full = request.num_computed_tokens // self.pool.block_size
            if full > len(request.block_hashes):
                tokens = request.all_token_ids[: full * self.pool.block_size]
                request.block_hashes = self.pool.hashes_for(tokens, request.block_hashes)
                self.pool.register_full_blocks(request.block_table, request.block_hashes)

    def finish(self, request: Request, reason: str) -> None:
        """Remove a request (done or aborted) from wherever it is and free its blocks."""
        if request.status is Status.RUNNING:
            self.running.remove(request)
            self.pool.free(request.block_table)
        elif request.status is Status.WAITING:
            self.waiting.remove(request)
        request.block_table = []
        request.status = Status.FINISHED
        request.finish_reason = reason
