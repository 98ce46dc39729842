"""The load generator: send workload requests on an arrival schedule, record one Trace each.

Open loop: arrival times are drawn up front (gamma-distributed gaps with shape = burstiness and
scale = 1 / (rate x burstiness), as vllm bench serve draws them; burstiness 1 is Poisson) and a
request goes out at its time however slow earlier responses are, so there is no coordinated
omission. ``max_concurrency`` caps requests in flight (closed loop, or a cap on open loop); the
wait it causes is measured per request as client lag behind schedule.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from pdscope.client.adapters import run_request
from pdscope.client.trace import Trace
from pdscope.client.workloads import RequestSpec


@dataclass(frozen=True)
class LoadPlan:
    request_rate: float = math.inf  # requests per second; inf sends everything at once
    burstiness: float = 1.0
    max_concurrency: int | None = None
    duration_s: float | None = None  # stop sending new requests after this
    ramp_up_s: float = 0.0  # the rate climbs linearly from 0 over this long
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request rate must be positive, got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be positive, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max concurrency must be >= 1, got {self.max_concurrency}")

    def schedule(self, n: int) -> list[float]:
        """Send times (seconds from the start) for ``n`` requests."""
        if math.isinf(self.request_rate):
            return [0.0] * n
        rng = random.Random(self.seed)
        times, expected = [], 0.0
        for _ in range(n):
            # Arrivals counted in expected requests (gaps of mean 1), then mapped to seconds
            # through the rate's integral: exact for a ramp, where drawing each gap at the rate
            # of the last arrival began at rate/100 and idled tens of seconds.
            expected += rng.gammavariate(self.burstiness, 1 / self.burstiness)
            times.append(self._seconds_at(expected))
        return times

    def _seconds_at(self, expected: float) -> float:
        """When ``expected`` requests are due: the rate climbs from 0 to its full value over
        ``ramp_up_s`` (rate x ramp / 2 requests by its end), then holds."""
        rate, ramp = self.request_rate, self.ramp_up_s
        if ramp <= 0:
            return expected / rate
        if expected < rate * ramp / 2:
            return math.sqrt(2 * ramp * expected / rate)
        return ramp + (expected - rate * ramp / 2) / rate


@dataclass
class Progress:
    sent: int = 0
    completed: int = 0
    failed: int = 0
    in_flight: int = 0
    output_tokens: int = 0
    started_s: float = field(default_factory=time.perf_counter)

    @property
    def output_tok_s(self) -> float:
        elapsed = time.perf_counter() - self.started_s
        return self.output_tokens / elapsed if elapsed > 0 else 0.0


@dataclass
class LoadResult:
    traces: list[Trace]
    start_s: float
    end_s: float
    partial: str | None = None  # why the run stopped early, if it did

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


async def send(
    client: aiohttp.ClientSession,
    url: str,
    api: str,
    model: str,
    spec: RequestSpec,
    headers: dict[str, str] | None = None,
    label: str = "",
) -> Trace:
    return await run_request(
        client, url, api, model, spec.prompt, spec.output_tokens, label, spec.input_tokens, headers
    )


async def run_load(
    client: aiohttp.ClientSession,
    url: str,
    api: str,
    model: str,
    specs: list[RequestSpec],
    plan: LoadPlan,
    headers: dict[str, str] | None = None,
    on_progress: Callable[[Progress], None] | None = None,
) -> LoadResult:
    """Send every spec on schedule; returns when all sent requests have ended."""
    offsets = plan.schedule(len(specs))
    for i, spec in enumerate(specs):
        if spec.at_s is not None:
            offsets[i] = spec.at_s
    order = sorted(range(len(specs)), key=lambda i: offsets[i])
    gate = asyncio.Semaphore(plan.max_concurrency) if plan.max_concurrency else None
    progress = Progress()
    traces: list[Trace] = []
    tasks: set[asyncio.Task] = set()
    start = time.perf_counter()
    partial = None

    async def one(spec: RequestSpec, scheduled: float) -> None:
        try:
            trace = await send(client, url, api, model, spec, headers, spec.kind)
        except Exception as exc:  # a bug or an odd reply fails this request, not the run
            trace = Trace(
                api,
                url,
                model,
                label=spec.kind,
                prompt_tokens_asked=spec.input_tokens,
                start_s=time.perf_counter(),
                error=f"{type(exc).__name__}: {exc}",
            )
        finally:
            if gate:
                gate.release()
            progress.in_flight -= 1
        trace.scheduled_s = scheduled
        traces.append(trace)
        if trace.ok:
            progress.completed += 1
            progress.output_tokens += trace.n_output or 0
        else:
            progress.failed += 1
        if on_progress:
            on_progress(progress)

    try:
        for i in order:
            scheduled = start + offsets[i]
            if plan.duration_s is not None and offsets[i] > plan.duration_s:
                break
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if gate:
                await gate.acquire()
            if plan.duration_s is not None and time.perf_counter() - start > plan.duration_s:
                if gate:
                    gate.release()  # out of time: the wall clock bounds closed loops too
                break
            progress.sent += 1
            progress.in_flight += 1
            task = asyncio.create_task(one(specs[i], scheduled))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
    except asyncio.CancelledError:
        partial = "interrupted"
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return LoadResult(traces, start, time.perf_counter(), partial)
