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
from pdscope.engine.timeline import StepRecord


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


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: tokens ``[start, start + num_new_tokens)`` are computed.

    Treated as immutable once the scheduler returns it. Not ``frozen``: a frozen dataclass's
    ``__init__`` costs ~4x a plain one, and one entry is built per running request per step
    (the simulator's hot path).

    ``is_prefill`` is decided here, once, by :attr:`Request.is_decode_next`; the runner picks
    its attention path by it and the timeline and metrics count tokens by it. An entry that
    computes only the last sampled token is a decode, also when it ends a recomputation after
    preemption (the rest of that request's KV came back from the prefix cache or earlier
    chunks): physically it is one query over a cached context.
    ``num_cached_tokens`` is the prefix-cache hit counted when the request was first admitted in
    this step, as the pool's ``prefix_cache_hits`` counts it (0 otherwise, and 0 for a
    re-admission after preemption, which is recomputation rather than demand).
    """

    request: Request
    num_new_tokens: int
    start: int
    is_prefill: bool
    samples: bool  # computes the request's last token, so it yields logits and a new token
    num_cached_tokens: int = 0

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


@dataclass
class SchedulerOutput:
    """One step's plan: which requests compute which tokens, and what it cost the pool."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # ``scheduled[:num_resumed]`` were already running; the rest were admitted from the queue
    # in this step (only those can be scheduled for the first time).
    num_resumed: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(e.num_new_tokens for e in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(e.num_new_tokens for e in self.scheduled if e.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return sum(e.num_new_tokens for e in self.scheduled if not e.is_prefill)

    @property
    def num_prefix_hit_tokens(self) -> int:
        return sum(e.num_cached_tokens for e in self.scheduled)

    @property
    def num_preemptions(self) -> int:
        return len(self.preempted)

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
        # The common case (the request's blocks already hold the new tokens, or the pool has
        # the few it needs) is inlined: this loop runs once per running request per step.
        pool = self.pool
        block_size = pool.block_size
        running = self.running
        scheduled = out.scheduled
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            num_tokens = len(request.token_ids)
            start = request.num_computed_tokens
            new = num_tokens - start
            assert new > 0, "a running request always has a token to compute"
            if new > budget:
                new = budget
            extra = -(-(start + new) // block_size) - len(request.block_table)
            if extra > 0 and extra <= pool.num_free_blocks:
                pool.extend(request.block_table, extra)
            elif extra > 0:
                preempted_self = False
                while not self._grow(request, new):
                    victim = running.pop()  # most recently admitted
                    self._preempt(victim)
                    out.preempted.append(victim)
                    if victim is request:
                        preempted_self = True
                        break
                if preempted_self:
                    continue
            # Phase and sampling by the one rule (Request.is_decode_next), inlined.
            is_prefill = not (num_tokens - start == 1 and request.output_token_ids)
            scheduled.append(
                ScheduledRequest(request, new, start, is_prefill, start + new == num_tokens)
            )
            budget -= new
            index += 1
        out.num_resumed = len(scheduled)

        # Then waiting requests fill what is left, unless this step had to preempt (the pool is
        # short; admitting more would only cause more preemption).
        while (
            self.waiting
            and budget > 0
            and not out.preempted
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            cached = []
            if self.pool.enable_prefix_caching:
                hashes = self.pool.extend_hashes(request.block_hashes, request.token_ids)
                cached = self.pool.find_cached_prefix(hashes, request.num_tokens)
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
            # Re-admissions are recomputation, not demand: only first admissions count as lookups.
            counted_hit = num_cached if request.timeline.preemptions == 0 else 0
            if request.timeline.preemptions == 0:
                self.pool.record_lookup(request.num_tokens, num_cached)
            self.pool.touch(cached)
            request.block_table = list(cached)
            self.pool.extend(request.block_table, needed)
            request.num_published_blocks = len(cached)  # a hit's blocks are all published
            request.num_computed_tokens = num_cached
            if request.timeline.first_scheduled_s is None:
                request.timeline.num_cached_tokens = num_cached
            request.status = Status.RUNNING
            self.running.append(request)
            out.scheduled.append(self._entry(request, new, counted_hit))
            budget -= new

        assert budget >= 0  # the step's tokens fit max_num_batched_tokens
        assert len(self.running) <= self.config.max_num_seqs
        return out

    @staticmethod
    def _entry(request: Request, new: int, num_cached: int = 0) -> ScheduledRequest:
        start = request.num_computed_tokens
        samples = start + new == request.num_tokens
        is_prefill = not request.is_decode_next
        return ScheduledRequest(request, new, start, is_prefill, samples, num_cached)

    def _grow(self, request: Request, new: int) -> bool:
        """Make room in ``request``'s block table for ``new`` more tokens; False if the pool is
        out of blocks."""
        needed = self.pool.blocks_needed(request.num_computed_tokens + new)
        extra = needed - len(request.block_table)
        if extra <= 0:
            return True
        if extra > self.pool.num_free_blocks:
            return False
        self.pool.extend(request.block_table, extra)
        return True

    def _preempt(self, request: Request) -> None:
        """Free everything the request holds; it goes back to the front of the queue and
        recomputes its tokens (prompt and outputs so far) when it is admitted again."""
        self.pool.free(request.block_table)
        request.block_table = []
        request.num_published_blocks = 0
        request.num_computed_tokens = 0
        request.status = Status.WAITING
        request.timeline.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(self, out: SchedulerOutput) -> None:
        """Advance computed counts after the model ran, and publish newly full blocks."""
        pool = self.pool
        block_size = pool.block_size
        caching = pool.enable_prefix_caching
        running = Status.RUNNING
        for entry in out.scheduled:
            request = entry.request
            if request.status is not running:
                continue  # aborted during the step
            start = entry.start
            assert request.num_computed_tokens == start
            end = request.num_computed_tokens = start + entry.num_new_tokens
            if caching and end // block_size > start // block_size:
                # Blocks became full in this step. Offer every full block past the leading run
                # already published, not just the new ones: a block skipped earlier because a
                # twin held its hash can be published now that the twin may have been evicted.
                full = end // block_size
                hashes = pool.extend_hashes(request.block_hashes, request.token_ids)
                request.num_published_blocks = pool.register_full_blocks(
                    request.block_table, hashes, request.num_published_blocks, full
                )

    def started(self, out: SchedulerOutput, start_s: float) -> None:
        """Stamp the step's start on requests scheduled for the first time (queue time ends).
        Only requests admitted in this step can be new (``scheduled[num_resumed:]``)."""
        for entry in out.scheduled[out.num_resumed :]:
            if entry.request.timeline.first_scheduled_s is None:
                entry.request.timeline.first_scheduled_s = start_s

    def record(self, out: SchedulerOutput, start_s: float, end_s: float) -> StepRecord:
        """After :meth:`update`: log the step's prefill chunks on their requests' timelines and
        return the step's record. The engine and the simulator both close a step with this."""
        prefill_tokens = decode_tokens = hit_tokens = 0
        for entry in out.scheduled:
            if entry.is_prefill:
                prefill_tokens += entry.num_new_tokens
                entry.request.timeline.prefill_chunks.append((end_s, entry.num_new_tokens))
            else:
                decode_tokens += entry.num_new_tokens
            hit_tokens += entry.num_cached_tokens
        return StepRecord(
            start_s=start_s,
            end_s=end_s,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.pool.usage,
            prefill_tokens=prefill_tokens,
            decode_tokens=decode_tokens,
            num_preempted=len(out.preempted),
            prefix_hit_tokens=hit_tokens,
        )

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
