"""Many simulated servers on one clock: replicas behind a router, or prefill and decode pools
joined by a KV link. Pure Python, no torch.

Every worker is a :class:`Simulator` (the engine's own scheduler and block pool, one clock
each). The cluster interleaves them by time with one event queue: request arrivals, prefills
that finish (their KV joins the link's queue), transfers that land on a decode worker, and each
worker's next step. Events at the same instant run in that order, so a worker's step sees every
request that arrived by its start, as :meth:`Simulator.run` does; one replica behind any router
therefore reproduces a single simulator exactly.

A worker applies a step's results (tokens, finishes, freed blocks) when the step is taken off
the queue, i.e. at its start; a router deciding during that step sees them a little early.
Real routers read load that is older than that, so this is not the error that matters.

Disaggregation (DistServe's shape, and vLLM's P/D connectors'): a prefill worker runs each
request with ``max_tokens = 1`` (the prefill and its first sampled token); the request's KV
(:func:`kv_bytes`, the prompt's full KV at the KV dtype) then crosses one shared link, first
come first served, taking ``latency + bytes / bandwidth``; the decode worker with the fewest
outstanding tokens receives it and admits it, holding its blocks, once it has the room and no
older request waits. Where the first token comes from is a choice (``first_token``):

* ``"prefill"``: the prefill worker streams it as soon as it is sampled (DistServe): TTFT is
  the prefill's alone; the transfer delays the *second* token.
* ``"decode"``: a proxy streams only the decode worker's output (vLLM's disaggregated proxy): the
  prefill's token is dropped and the decode worker computes the last prompt token over the
  shipped KV to sample the first one, so the transfer is inside TTFT.

The prefill worker frees its blocks when the prefill ends (the KV is assumed buffered for the
send); its prefix cache keeps them, as a colocated server's does.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdscope.engine.request import Request, Status
from pdscope.engine.sampling_params import SamplingParams
from pdscope.engine.scheduler import SchedulerConfig, SchedulerOutput
from pdscope.engine.simulator import SimRequest, Simulator
from pdscope.engine.timeline import RequestTimeline, StepRecord

ROUTERS = ("round-robin", "least-loaded", "prefix-aware")
FIRST_TOKEN_SOURCES = ("prefill", "decode")


class ConservationError(AssertionError):
    """A run broke a conservation law (a lost request, a leaked block, unaccounted bytes)."""


class RunStopped(Exception):
    """A run's ``stop`` check ended it early (its caller knows the outcome already)."""


@dataclass(frozen=True)
class WorkerSpec:
    """One worker (a replica: one scheduler and KV pool, on TP GPUs)."""

    config: SchedulerConfig
    num_blocks: int
    block_size: int
    step_seconds: Callable[[SchedulerOutput], float]
    enable_prefix_caching: bool = True
    gpus: int = 1


@dataclass(frozen=True)
class KVLink:
    """The link prefill workers send KV over to decode workers: one queue, FIFO."""

    bandwidth_gb_s: float  # math.inf: instantaneous
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth_gb_s > 0:
            raise ValueError(f"--kv-link-gb-s must be > 0, got {self.bandwidth_gb_s}")
        if not self.latency_s >= 0:
            raise ValueError(f"--kv-link-latency-ms must be >= 0, got {self.latency_s * 1e3}")

    def busy_s(self, nbytes: float) -> float:
        """How long ``nbytes`` occupy the link (the latency does not: transfers pipeline)."""
        return nbytes / (self.bandwidth_gb_s * 1e9)


@dataclass(frozen=True)
class Transfer:
    """One request's KV on the link: queued at ``ready_s``, sent from ``start_s``, landed at
    ``done_s`` (seconds on the cluster clock)."""

    request_index: int
    nbytes: float
    ready_s: float
    start_s: float
    done_s: float
    decode_worker: int

    @property
    def queue_s(self) -> float:
        return self.start_s - self.ready_s

    @property
    def total_s(self) -> float:
        return self.done_s - self.ready_s


class Worker:
    """A :class:`Simulator` plus what the cluster tracks around it."""

    def __init__(self, index: int, pool: str, spec: WorkerSpec):
        self.index = index
        self.pool = pool  # "replica", "prefill" or "decode"
        self.spec = spec
        self.sim = Simulator(
            spec.config,
            spec.num_blocks,
            spec.block_size,
            spec.step_seconds,
            spec.enable_prefix_caching,
        )
        self.steps: list[StepRecord] = []
        self.kv_arrived: deque[Request] = deque()  # decode pool: KV here, not yet admitted
        self.queued = False  # has a step event in the cluster's queue
        self.completed = 0
        # Outstanding tokens (least-loaded routing): what in-flight requests were given here,
        # less what they have sampled here. See Cluster._load.
        self._assigned = 0
        self._sampled_by_finished = 0
        self._given: dict[int, tuple[int, int]] = {}  # id(request) -> (tokens, outputs at entry)

    @property
    def load_tokens(self) -> int:
        return self._assigned - (self.sim.num_sampled - self._sampled_by_finished)

    def assign(self, request: Request, tokens: int) -> None:
        self._assigned += tokens
        self._given[id(request)] = (tokens, len(request.output_token_ids))

    def release(self, request: Request) -> None:
        tokens, outputs_at_entry = self._given.pop(id(request))
        self._assigned -= tokens
        self._sampled_by_finished += len(request.output_token_ids) - outputs_at_entry

    @property
    def busy_s(self) -> float:
        return sum(s.end_s - s.start_s for s in self.steps)

    @property
    def has_work(self) -> bool:
        return self.sim.scheduler.has_work or bool(self.kv_arrived)

    def admit_arrived_kv(self) -> None:
        """Admit requests whose KV has landed, oldest first, while they fit and nothing older
        (a preempted request) waits: their blocks are taken and they run from the next step."""
        scheduler, pool = self.sim.scheduler, self.sim.pool
        while self.kv_arrived and not scheduler.waiting:
            request = self.kv_arrived[0]
            needed = pool.blocks_needed(request.num_computed_tokens)
            if len(scheduler.running) >= scheduler.config.max_num_seqs:
                return
            if needed > pool.num_free_blocks:
                return
            self.kv_arrived.popleft()
            request.block_table = pool.allocate(needed)
            request.status = Status.RUNNING
            scheduler.running.append(request)


@dataclass
class ClusterResult:
    requests: list[Request]  # per spec, in submission order: the request's last incarnation
    workers: list[Worker]
    transfers: list[Transfer] = field(default_factory=list)
    link_bytes: float = 0.0  # what the link carried, counted as it carried it
    end_s: float = 0.0
    # Other clusters' KV sharing the link (``Cluster.run``'s ``link_background``): it occupies
    # the link and lands nowhere here, so it is counted apart from ``link_bytes``.
    background_bytes: float = 0.0
    background_transfers: int = 0

    def pool(self, name: str) -> list[Worker]:
        return [w for w in self.workers if w.pool == name]


# Event kinds, in the order they run at one instant.
_ARRIVE, _KV_READY, _KV_LANDED, _STEP = 0, 1, 2, 3


class Cluster:
    """Colocated replicas (``decode`` empty) or a disaggregated prefill/decode pair of pools.

    ``kv_bytes(prompt_tokens)`` prices one request's KV on the link (disaggregated only).
    """

    def __init__(
        self,
        replicas: Sequence[WorkerSpec],
        router: str = "round-robin",
        decode: Sequence[WorkerSpec] = (),
        link: KVLink | None = None,
        kv_bytes: Callable[[int], float] | None = None,
        first_token: str = "prefill",
    ):
        if router not in ROUTERS:
            raise ValueError(f"--router must be one of {', '.join(ROUTERS)}, got {router!r}")
        if first_token not in FIRST_TOKEN_SOURCES:
            raise ValueError(
                f"--first-token must be one of {', '.join(FIRST_TOKEN_SOURCES)}, "
                f"got {first_token!r}"
            )
        if not replicas:
            raise ValueError("a cluster needs at least one worker")
        self.disaggregated = bool(decode)
        if self.disaggregated and (link is None or kv_bytes is None):
            raise ValueError("a disaggregated cluster needs a KV link and a KV size")
        front = "prefill" if self.disaggregated else "replica"
        self.front = [Worker(i, front, spec) for i, spec in enumerate(replicas)]
        self.back = [Worker(len(replicas) + i, "decode", spec) for i, spec in enumerate(decode)]
        self.workers = self.front + self.back
        self.router = router
        self.link = link
        self.kv_bytes = kv_bytes
        self.first_token = first_token
        self._next_rr = 0

    # --- routing -------------------------------------------------------------------------

    def _least_loaded(self, workers: Sequence[Worker]) -> Worker:
        return min(workers, key=lambda w: (w.load_tokens, w.index))

    def _route(self, request: Request) -> Worker:
        workers = self.front
        if len(workers) == 1:
            return workers[0]
        if self.router == "round-robin":
            worker = workers[self._next_rr % len(workers)]
            self._next_rr += 1
            return worker
        if self.router == "prefix-aware":
            pool0 = workers[0].sim.pool
            hashes = pool0.extend_hashes(request.block_hashes, request.token_ids)
            usable = hashes[: (request.num_tokens - 1) // pool0.block_size]
            best, best_hit = [], 0
            for w in workers:
                if not w.sim.pool.enable_prefix_caching:
                    continue
                cached = w.sim.pool.cached
                hit = 0
                for h in usable:
                    if h not in cached:
                        break
                    hit += 1
                if hit > best_hit:
                    best, best_hit = [w], hit
                elif hit == best_hit and hit:
                    best.append(w)
            if best:
                return self._least_loaded(best)
        return self._least_loaded(workers)

    # --- the run ---------------------------------------------------------------------------

    def run(
        self,
        specs: Sequence[SimRequest],
        max_concurrency: int | None = None,
        stop: Callable[[float, Sequence[Request]], bool] | None = None,
        stop_every_s: float = 0.25,
        link_background: Sequence[tuple[float, float]] = (),
    ) -> ClusterResult:
        """Simulate ``specs`` to the end, on every worker; checks conservation before returning.
        ``max_concurrency`` caps requests in flight across the cluster, as a client would.
        ``stop(now_s, requests)``, asked every ``stop_every_s`` simulated seconds with each
        request's latest incarnation, ends the run by raising :class:`RunStopped` when true.
        ``link_background``: (ready time in s, bytes) of transfers from outside this cluster
        (other copies of it behind the same link); they queue on the link with this cluster's
        own, first come first served, and land nowhere."""
        assert max_concurrency is None or max_concurrency >= 1
        assert not link_background or self.disaggregated
        events: list[tuple[float, int, int, object]] = []
        seq = 0

        def push(time_s: float, kind: int, payload: object) -> None:
            nonlocal seq
            heapq.heappush(events, (time_s, kind, seq, payload))
            seq += 1

        def wake(worker: Worker, time_s: float) -> None:
            if not worker.queued:
                worker.sim.now_s = max(worker.sim.now_s, time_s)
                worker.queued = True
                push(worker.sim.now_s, _STEP, worker)

        result = ClusterResult([], self.workers)
        final: list[Request] = []
        index_of: dict[int, int] = {}
        for index, spec in enumerate(specs):
            request = Simulator._request(index, spec)
            if self.disaggregated:
                request.params = SamplingParams(max_tokens=1, ignore_eos=True)
            final.append(request)
            index_of[id(request)] = index
            reason = self._refusal(spec)
            if reason is not None:
                Simulator._fail(request, spec.arrival_s, reason)
            else:
                push(spec.arrival_s, _ARRIVE, request)
        for ready_s, nbytes in link_background:
            push(ready_s, _KV_READY, float(nbytes))
        free_slots = max_concurrency if max_concurrency is not None else math.inf
        held: deque[Request] = deque()
        link_free_s = 0.0
        outputs = [spec.output_tokens for spec in specs]

        next_check_s = stop_every_s
        while events:
            now, kind, _, payload = heapq.heappop(events)
            if stop is not None and now >= next_check_s:
                if stop(now, final):
                    raise RunStopped(f"stopped at {now:.3f} s")
                next_check_s = now + stop_every_s
            if kind == _ARRIVE:
                if payload is None:  # a request finished: the client's slot frees now
                    free_slots += 1
                    if not held:
                        continue
                    payload = held.popleft()
                request = payload  # type: ignore[assignment]
                assert isinstance(request, Request)
                if free_slots <= 0:
                    held.append(request)
                    continue
                free_slots -= 1
                request.timeline.arrival_s = max(request.timeline.arrival_s, now)
                worker = self._route(request)
                index = index_of[id(request)]
                worker.sim.tags[id(request)] = index
                worker.assign(request, request.num_tokens + request.params.max_tokens)
                worker.sim.scheduler.add(request)
                wake(worker, now)
            elif kind == _KV_READY and isinstance(payload, float):  # another cluster's KV
                assert self.link is not None
                link_free_s = max(now, link_free_s) + self.link.busy_s(payload)
                result.background_bytes += payload
                result.background_transfers += 1
            elif kind == _KV_READY:
                request = payload  # type: ignore[assignment]
                assert isinstance(request, Request) and self.link and self.kv_bytes
                index = index_of[id(request)]
                target = self._least_loaded(self.back)
                nbytes = float(self.kv_bytes(request.num_prompt_tokens))
                start = max(now, link_free_s)
                link_free_s = start + self.link.busy_s(nbytes)
                done = link_free_s + self.link.latency_s
                result.link_bytes += nbytes
                result.transfers.append(
                    Transfer(index, nbytes, now, start, done, target.index - len(self.front))
                )
                incoming = self._decode_side(request, outputs[index])
                final[index] = incoming
                index_of[id(incoming)] = index
                target.sim.tags[id(incoming)] = index
                # A decode worker owes the outputs still to come (plus the last prompt token
                # when it samples the first one itself).
                target.assign(incoming, outputs[index] - len(incoming.output_token_ids))
                push(done, _KV_LANDED, (target, incoming))
            elif kind == _KV_LANDED:
                target, incoming = payload  # type: ignore[misc]
                target.kv_arrived.append(incoming)
                wake(target, now)
            else:
                worker = payload  # type: ignore[assignment]
                assert isinstance(worker, Worker)
                worker.queued = False
                worker.admit_arrived_kv()
                if not worker.sim.scheduler.has_work:
                    raise ConservationError(
                        f"worker {worker.index}: KV arrived that can never be admitted"
                    )
                record, finished = worker.sim.step()
                worker.steps.append(record)
                for request in finished:
                    worker.release(request)
                    index = index_of[id(request)]
                    if worker.pool == "prefill" and outputs[index] > 1:
                        push(record.end_s, _KV_READY, request)
                        continue
                    worker.completed += 1
                    if max_concurrency is not None:
                        push(record.end_s, _ARRIVE, None)
                if worker.has_work:
                    wake(worker, worker.sim.now_s)

        result.requests = final
        result.end_s = max((w.sim.now_s for w in self.workers if w.steps), default=0.0)
        self.check_conservation(specs, result)
        return result

    def _refusal(self, spec: SimRequest) -> str | None:
        if not self.disaggregated:
            return self.front[0].sim.refusal(spec)
        first = SimRequest(spec.prompt_token_ids, 1, spec.arrival_s)
        reason = self.front[0].sim.refusal(first) if spec.output_tokens >= 1 else None
        return reason or self.back[0].sim.refusal(spec)

    def _decode_side(self, done: Request, output_tokens: int) -> Request:
        """The request as the decode worker receives it, its prompt's KV shipped. The timeline
        carries on (arrival, queueing and prefill chunks stay the prefill worker's)."""
        timeline: RequestTimeline = done.timeline
        timeline.finished_s = None
        timeline.finish_reason = None
        params = SamplingParams(max_tokens=output_tokens, ignore_eos=True)
        request = Request(done.request_id, list(done.prompt_token_ids), params, timeline)
        request.block_hashes = done.block_hashes
        if self.first_token == "prefill":
            # The first token was streamed by the prefill worker; decoding starts after it.
            request.append_output(done.output_token_ids[0])
            request.num_computed_tokens = request.num_prompt_tokens
        else:
            # The proxy drops the prefill's token; the decode worker recomputes the last
            # prompt token over the shipped KV to sample its own first token.
            timeline.token_s.clear()
            request.num_computed_tokens = request.num_prompt_tokens - 1
        return request

    # --- conservation ----------------------------------------------------------------------

    def check_conservation(self, specs: Sequence[SimRequest], result: ClusterResult) -> None:
        """Every request finished with the tokens it asked for, or failed with a reason; no
        worker holds a block or a request; the link carried exactly the transferred KV."""
        for spec, request in zip(specs, result.requests, strict=True):
            reason = request.finish_reason or ""
            if reason.startswith("error"):
                continue
            if reason != "length" or len(request.output_token_ids) != spec.output_tokens:
                raise ConservationError(
                    f"request {request.request_id}: {len(request.output_token_ids)} of "
                    f"{spec.output_tokens} tokens, finish {reason!r}"
                )
        for w in result.workers:
            if w.has_work or w.sim.pool.num_used_blocks or w._given:
                raise ConservationError(
                    f"worker {w.index} ({w.pool}) ended holding "
                    f"{w.sim.pool.num_used_blocks} blocks and {len(w._given)} requests"
                )
            w.sim.pool.check_invariants()
        carried = sum(t.nbytes for t in result.transfers)
        expected = sum(
            self.kv_bytes(len(specs[t.request_index].prompt_token_ids))  # type: ignore[misc]
            for t in result.transfers
        )
        if not (math.isclose(result.link_bytes, carried) and math.isclose(carried, expected)):
            raise ConservationError(
                f"link carried {result.link_bytes:.0f} bytes, transfers sum to {carried:.0f}, "
                f"their KV to {expected:.0f}"
            )
        if self.disaggregated:
            shipped = sum(1 for s in specs if s.output_tokens > 1)
            failed = sum(
                1
                for s, r in zip(specs, result.requests, strict=True)
                if s.output_tokens > 1 and (r.finish_reason or "").startswith("error")
            )
            if len(result.transfers) != shipped - failed:
                raise ConservationError(
                    f"{len(result.transfers)} transfers for {shipped - failed} requests"
                )
