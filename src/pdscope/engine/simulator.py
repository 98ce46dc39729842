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
        self.tags: dict[int, int] = {}  # id(request) -> a number unique to it (output token ids)
        self.num_sampled = 0  # tokens sampled so far (a cluster's router reads load off it)

    def run(self, specs: Sequence[SimRequest], max_concurrency: int | None = None) -> SimResult:
        """Simulate ``specs`` to the end. ``max_concurrency`` caps requests in flight, as a
        client-side semaphore does (vllm bench's --max-concurrency): a due request waits for a
        finished one."""
        assert max_concurrency is None or max_concurrency >= 1
        result = SimResult([])
        arrivals: list[tuple[float, int, Request]] = []
        for index, spec in enumerate(specs):
            request = self._request(index, spec)
            self.tags[id(request)] = index
            result.requests.append(request)
            reason = self.refusal(spec)
            if reason is not None:
                self._fail(request, spec.arrival_s, reason)
            else:
                heapq.heappush(arrivals, (spec.arrival_s, index, request))
        scheduler, tags = self.scheduler, self.tags
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
            record, finished = self.step()
            result.steps.append(record)
            if max_concurrency is not None:
                free_since.extend(self.now_s for _ in finished)
        result.end_s = self.now_s
        return result

    # --- one event at a time: the hooks a cluster of simulators interleaves by time ----------

    def refusal(self, spec: SimRequest) -> str | None:
        """Why this server would refuse ``spec`` outright (a 400), or None if it can run."""
        max_len = self.scheduler.config.max_model_len
        prompt = len(spec.prompt_token_ids)
        if not prompt:
            return "empty prompt"
        if spec.output_tokens < 1:
            return "output_tokens must be >= 1"
        if prompt + spec.output_tokens > max_len:
            return f"{prompt + spec.output_tokens} tokens > max_model_len {max_len}"
        # The last sampled token's KV is never computed, so it needs no slot.
        if self.pool.blocks_needed(prompt + spec.output_tokens - 1) > self.pool.num_blocks:
            return "larger than the whole KV pool"
        return None

    def step(self) -> tuple[StepRecord, list[Request]]:
        """Run one step from ``now_s`` (the scheduler must have work) and apply its results as
        :class:`LLMEngine` does. Returns the step's record and the requests it finished.
        ``tags[id(request)]`` must hold a per-request number (output ids are derived from it)."""
        scheduler = self.scheduler
        out = scheduler.schedule()
        assert not out.is_empty, "work that can never be scheduled (checked on arrival)"
        start = self.now_s
        scheduler.started(out, start)
        self.now_s += self.step_seconds(out)
        scheduler.update(out)
        finished: list[Request] = []
        tags, now_s, sampled = self.tags, self.now_s, 0
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
            sampled += 1
            if len(outputs) >= request.params.max_tokens:
                scheduler.finish(request, "length")
                request.timeline.finished_s = now_s
                request.timeline.finish_reason = "length"
                finished.append(request)
        self.num_sampled += sampled
        return scheduler.record(out, start, self.now_s), finished

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
