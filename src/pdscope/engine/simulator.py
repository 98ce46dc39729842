"""The engine's own scheduler and block pool on a simulated clock. Pure Python, no torch.

Everything but the forward pass is the real engine: requests, the token budget, chunked
prefill, prefix caching, preemption. Where :class:`LLMEngine` runs the model, the simulator asks
a cost model how long the step would take and moves its clock on by that much. Each request's
timeline is the same :class:`RequestTimeline` the real engine keeps, so the same conversions
and analysis apply to both.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdscope.engine.block_pool import BlockPool
from pdscope.engine.request import Request
from pdscope.engine.sampling_params import SamplingParams
from pdscope.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pdscope.engine.timeline import RequestTimeline, StepRecord


@dataclass(frozen=True)
class SimRequest:
    """One request to simulate: its prompt's token ids (only their equality matters: prefix
    caching hashes them), how many tokens it generates, and when the client means to send it
    (seconds). Under a concurrency cap it is sent later, when a slot frees; its timeline's
    ``arrival_s`` is when it was sent."""

    prompt_token_ids: Sequence[int]
    output_tokens: int
    arrival_s: float = 0.0
    request_id: str = ""
    label: str = ""


@dataclass
class SimResult:
    requests: list[Request]  # in submission order; failed ones have finish_reason "error: ..."
    steps: list[StepRecord] = field(default_factory=list)
    end_s: float = 0.0  # clock when the last request finished

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preempted for s in self.steps)


class Simulator:
    """Steps a :class:`Scheduler` with ``step_seconds(out)`` in place of the model runner.

    One simulator is one server's life: its clock and its pool (prefix cache included) carry
    over from one :meth:`run` to the next, as a real server's do between benchmark runs.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        num_blocks: int,
        block_size: int,
        step_seconds: Callable[[SchedulerOutput], float],
        enable_prefix_caching: bool = True,
        admission_delay_s: float = 0.0,
    ):
        """``admission_delay_s``: how long a sent request takes to reach the scheduler (a
        server's HTTP handling and hand-off to the engine loop; the cost model's
        ``request_overhead_s``). It counts in TTFT and queue time, never in a step."""
        assert admission_delay_s >= 0
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(config, self.pool)
        self.step_seconds = step_seconds
        self.admission_delay_s = admission_delay_s
        self.now_s = 0.0

    def run(self, specs: Sequence[SimRequest], max_concurrency: int | None = None) -> SimResult:
        """Simulate ``specs`` to the end. ``max_concurrency`` caps requests in flight, as a
        client-side semaphore does (vllm bench's --max-concurrency): a due request waits for a
        finished one."""
        assert max_concurrency is None or max_concurrency >= 1
        result = SimResult([])
        arrivals: list[tuple[float, int, Request]] = []
        max_len = self.scheduler.config.max_model_len
        tags: dict[int, int] = {}  # id(request) -> index in specs
        for index, spec in enumerate(specs):
            request = self._request(index, spec)
            tags[id(request)] = index
            result.requests.append(request)
            if not spec.prompt_token_ids:
                self._fail(request, spec.arrival_s, "empty prompt")
            elif spec.output_tokens < 1:
                self._fail(request, spec.arrival_s, "output_tokens must be >= 1")
            elif request.num_tokens + spec.output_tokens > max_len:
                # What a server's 400 would say: the request cannot fit max_model_len.
                total = request.num_tokens + spec.output_tokens
                self._fail(request, spec.arrival_s, f"{total} tokens > max_model_len {max_len}")
            # The last sampled token's KV is never computed, so it needs no slot.
            elif self.pool.blocks_needed(request.num_tokens + spec.output_tokens - 1) > (
                self.pool.num_blocks
            ):
                self._fail(request, spec.arrival_s, "larger than the whole KV pool")
            else:
                heapq.heappush(arrivals, (spec.arrival_s, index, request))
        scheduler = self.scheduler
        held: deque[Request] = deque()  # due, waiting for a free slot under the cap
        # When each free slot became free: a held request is sent at max(due, that time).
        free_since: deque[float] = deque([0.0] * (max_concurrency or 0))
        # Sent, on their way to the scheduler: (when they reach it, order, request).
        admitting: list[tuple[float, int, Request]] = []

        while arrivals or held or admitting or scheduler.has_work:
            while arrivals and arrivals[0][0] <= self.now_s:
                held.append(heapq.heappop(arrivals)[2])
            while held and (max_concurrency is None or free_since):
                request = held.popleft()
                if max_concurrency is not None:
                    sent_s = max(request.timeline.arrival_s, free_since.popleft())
                    request.timeline.arrival_s = sent_s
                due_s = request.timeline.arrival_s + self.admission_delay_s
                heapq.heappush(admitting, (due_s, tags[id(request)], request))
            while admitting and admitting[0][0] <= self.now_s:
                scheduler.add(heapq.heappop(admitting)[2])
            if not scheduler.has_work:
                # Idle until the next request is sent or reaches the scheduler.
                self.now_s = min(x[0][0] for x in (arrivals, admitting) if x)
                continue
            out = scheduler.schedule()
            assert not out.is_empty, "work that can never be scheduled (checked on arrival)"
            start = self.now_s
            scheduler.started(out, start)
            self.now_s += self.step_seconds(out)
            scheduler.update(out)
            now_s = self.now_s
            for entry in out.scheduled:
                if not entry.samples:
                    continue
                request = entry.request
                # Outputs are negative ids unique to the request: they never match a prompt's
                # (non-negative) tokens, so they never fake a prefix-cache hit. Inlined
                # Request.append_output: this runs once per sampled token.
                token = -1 - tags[id(request)]
                outputs = request.output_token_ids
                outputs.append(token)
                request.token_ids.append(token)
                request.timeline.token_s.append(now_s)
                if len(outputs) >= request.params.max_tokens:
                    if max_concurrency is not None:
                        free_since.append(self.now_s)
                    scheduler.finish(request, "length")
                    request.timeline.finished_s = self.now_s
                    request.timeline.finish_reason = "length"
            result.steps.append(scheduler.record(out, start, self.now_s))
        result.end_s = self.now_s
        return result

    @staticmethod
    def _request(index: int, spec: SimRequest) -> Request:
        request_id = spec.request_id or f"sim-{index}"
        prompt = list(spec.prompt_token_ids)
        timeline = RequestTimeline(spec.arrival_s, prompt_tokens=len(prompt))
        params = SamplingParams(max_tokens=max(spec.output_tokens, 1), ignore_eos=True)
        return Request(request_id, prompt, params, timeline)

    @staticmethod
    def _fail(request: Request, now_s: float, reason: str) -> None:
        request.finish_reason = f"error: {reason}"
        request.timeline.finished_s = now_s
        request.timeline.finish_reason = "error"
