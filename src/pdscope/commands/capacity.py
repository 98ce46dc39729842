"""`pdscope simulate --plan-capacity`: which way of using G GPUs serves the most traffic within
the SLOs, colocated replicas (replicas x TP x token budget) or prefill/decode pools (P:D x TP
per pool)?

For each configuration the search finds the highest Poisson request rate whose run meets every
aggregate SLO (bench's ``--find-capacity`` form: ``p99_ttft=2s,p99_itl=50ms``; an ITL limit also
holds over each request's worst gap, see :func:`_worst_gaps_ok`): doubling, then bisecting.
Every run that meets the SLOs is a point of tokens/s per GPU against tokens/s per user
(1 / median TPOT); the Pareto frontier is drawn from them.

Replicas that share nothing split steady traffic evenly, so R colocated replicas are simulated
as one replica at 1/R of the rate. What this leaves out (the burstiness a router evens out over
more replicas) is small next to the SLO margins searched for, and errs low. A P:D split with
k = gcd(P, D) > 1 is likewise k copies of a P/k : D/k unit, each fed 1/k of the arrivals, that
share one thing: the KV link. One unit is simulated at 1/k of the rate with the full link, on
which the other k - 1 copies' transfers queue with its own
(:func:`pdscope.commands.cluster.link_cross_traffic`): each transfer takes the full link's
time, and the link is as busy as the whole split's. (A unit with a 1/k share of the link as a
link of its own would take k times as long per transfer; without the others' traffic, it would
see a link k times too idle.) The unit errs low where the link is busy, so the best split
run this way (and one more within 25% of the best goodput) is then searched whole and its
figure used (:func:`_confirm_whole`). A split whose P and D have no common divisor runs whole. Each
run's arrivals span at least ``HORIZON_S`` seconds
(more requests than ``--num-prompts`` where the rate asks for it), so a rate past capacity has
time to build the queue that breaks a TTFT SLO. Configurations run in parallel processes.

Four more shortcuts, named in the plan's output and off with ``--plan-exhaustive``:
colocated configurations are searched first, and when the splits' one KV link cannot carry the
best colocated goodput (:func:`link_bound_req_s`, a bound, not an estimate) no split is
simulated, and a split whose pools (or link) cannot complete as many requests per second
as the best split found so far (:func:`split_bound_req_s`, a bound from the cost model) is not
simulated either; a configuration is run first at the best capacity its kind has reached so far
(:func:`search`'s ``floor_rate``), and one that fails there is not searched further: it cannot
win, and only its own capacity is left unknown (it is also run at one low rate, for the
frontier); and a run stops as soon as it
certainly misses a percentile TTFT or worst-gap limit (:class:`CertainMiss`).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from pdscope.analysis.bench import SLO, SLOError
from pdscope.client.workloads import Lengths
from pdscope.commands.cluster import ClusterSettings, Pool, PoolArgs, build_pools, simulate_cluster
from pdscope.commands.flags import int_list
from pdscope.commands.simulate import (
    DEFAULT_DEVICE,
    DEFAULT_MODEL,
    SimulateSettings,
    resolve_inputs,
)
from pdscope.engine.cluster import RunStopped
from pdscope.engine.request import Request
from pdscope.roofline import arithmetic as rf
from pdscope.roofline.parallel import tensor_parallel
from pdscope.roofline.step_cost import CostModel
from pdscope.specs import SpecError, load_model

TP_SIZES = (1, 2, 4, 8)  # inside one server
PREFILL_SHARES = (1 / 8, 1 / 4, 1 / 3, 1 / 2, 2 / 3, 3 / 4)  # of the GPUs, for P:D splits
DOUBLINGS = 14
BISECTIONS = 4
HORIZON_S = 15.0  # each run's arrivals span at least this long


@dataclass(frozen=True)
class Candidate:
    kind: str  # "colocated" or "disaggregated"
    label: str
    settings: ClusterSettings  # the reduced shape that is simulated
    scale: int  # copies of that shape in the full configuration
    gpus: int


def parse_plan_slo(text: str | None) -> SLO:
    """Aggregate SLOs as bench's --find-capacity takes them; ``ttft_p99`` is read as
    ``p99_ttft`` too."""
    if not text:
        raise SpecError("--plan-capacity needs --slo, e.g. p99_ttft=2s,p99_itl=50ms")
    parts = []
    for part in text.split(","):
        key, sep, value = part.partition("=")
        metric, _, pct = key.strip().partition("_")
        if pct.startswith("p") and not metric.startswith("p"):
            key = f"{pct}_{metric}"
        parts.append(f"{key.strip()}{sep}{value}")
    try:
        slo = SLO.parse(",".join(parts), aggregate=True)
    except SLOError as exc:
        raise SpecError(f"--slo: {exc}") from None
    return slo


def candidates(
    c: ClusterSettings,
    gpus: int,
    budgets: tuple[int, ...],
    tp_sizes: tuple[int, ...] = TP_SIZES,
    whole_splits: bool = False,
) -> list[Candidate]:
    """Every configuration of ``gpus`` GPUs worth simulating, at its smallest shape (a split
    whole with ``whole_splits``)."""
    model = load_model(c.base.model)
    sizes = []
    for tp in tp_sizes:
        try:
            tensor_parallel(model, tp, None if tp == 1 else _any_link())
        except SpecError:
            continue
        if tp <= gpus:
            sizes.append(tp)
    out = []
    for tp in sizes:
        if gpus % tp:
            continue
        replicas = gpus // tp
        for budget in budgets:
            base = replace(c.base, max_num_batched_tokens=budget)
            s = replace(c, base=base, replicas=1, gpus=None, disaggregate=None,
                        tensor_parallel_size=tp, prefill=PoolArgs(), decode=PoolArgs())  # fmt: skip
            label = f"{replicas} x TP{tp}, budget {budget}"
            out.append(Candidate("colocated", label, s, replicas, gpus))
    seen = set()
    for tp_p in sizes:
        for tp_d in sizes:
            for share in PREFILL_SHARES:
                p = max(1, round(gpus * share / tp_p))
                rest = gpus - p * tp_p
                if rest < tp_d or rest % tp_d:
                    continue
                d = rest // tp_d
                if (p, tp_p, d, tp_d) in seen:
                    continue
                seen.add((p, tp_p, d, tp_d))
                # k copies of a P/k : D/k unit, each fed 1/k of the traffic, sharing only the
                # KV link: one unit is simulated with the full link, the other copies'
                # transfers queued on it (see the module's docstring). No common divisor (or a
                # closed loop, whose copies would not see 1/k of the rate each): whole.
                k = math.gcd(p, d) if c.base.max_concurrency is None and not whole_splits else 1
                s = replace(
                    c, replicas=None, gpus=None, disaggregate=f"{p // k}:{d // k}",
                    tensor_parallel_size=1,
                    prefill=replace(c.prefill, tensor_parallel_size=tp_p,
                                    max_num_batched_tokens=max(budgets)),
                    decode=replace(c.decode, tensor_parallel_size=tp_d),
                )  # fmt: skip
                label = f"{p}P x TP{tp_p} : {d}D x TP{tp_d}"
                out.append(Candidate("disaggregated", label, s, k, gpus))
    return out


def _any_link():
    from pdscope.roofline.parallel import LINKS

    return LINKS["nvlink4"]


def _percentile_exceeds(count_above: int, n: int, pct: float) -> bool:
    """Whether ``count_above`` of ``n`` values above a limit already put the ``pct``-th
    percentile above it, whatever the other values are. numpy's (linear) percentile lies at or
    above the value at index floor(pct/100 (n - 1)) of the sorted values, which is above the
    limit once n minus that index values are."""
    return n > 0 and count_above >= n - math.floor(pct / 100 * (n - 1))


class CertainMiss:
    """A run's stop check: true once the run can no longer meet a percentile TTFT limit or a
    percentile worst-gap ITL limit (:func:`_worst_gaps_ok`), whatever the rest of it does.

    Known values only grow: a request's TTFT is at least the time it has waited for its first
    token, and its worst gap at least the worst gap it has shown or is in (since its last
    token, while it has more to come). Other limits (bench's ITL over
    all gaps, TPOT, E2EL) are left to the full run. A run past capacity builds its queue, and
    its TTFT breaks, within the first seconds of a 15-second horizon."""

    def __init__(self, slo: SLO):
        self.ttft = _percentile_limits(slo, "_ttft")
        self.gap = _percentile_limits(slo, "_itl")
        self.seen: list[int] = []  # tokens already scanned for gaps, per request
        self.worst: list[float] = []
        self.reason = ""

    def __bool__(self) -> bool:
        return bool(self.ttft or self.gap)

    def __call__(self, now_s: float, requests: Sequence[Request]) -> bool:
        n = len(requests)
        if len(self.seen) != n:
            self.seen, self.worst = [0] * n, [0.0] * n
        ttfts, gaps = [], []
        for i, request in enumerate(requests):
            timeline = request.timeline
            if timeline.arrival_s > now_s:
                continue
            tokens = timeline.token_s
            ttfts.append((tokens[0] if tokens else now_s) - timeline.arrival_s)
            # The decode side of a split may restart the list (its own first token).
            start = min(self.seen[i], len(tokens))
            for j in range(max(1, start), len(tokens)):
                self.worst[i] = max(self.worst[i], tokens[j] - tokens[j - 1])
            self.seen[i] = len(tokens)
            # An open gap: any token still to come is stamped after now (steps that began by
            # now have stamped theirs already).
            if tokens and timeline.finished_s is None:
                gaps.append(max(self.worst[i], now_s - tokens[-1]))
            else:
                gaps.append(self.worst[i])
        for limits, values, what in ((self.ttft, ttfts, "TTFT"), (self.gap, gaps, "worst gap")):
            for pct, limit_s in limits:
                above = sum(1 for v in values if v > limit_s)
                if _percentile_exceeds(above, n, pct):
                    self.reason = (
                        f"stopped at {now_s:.2f} s: {above} of {n} requests' {what} already "
                        f"above p{pct:g}'s {limit_s * 1e3:g} ms"
                    )
                    return True
        return False


def _percentile_limits(slo: SLO, suffix: str) -> list[tuple[float, float]]:
    """(percentile, limit in seconds) of the SLO's ``pNN<suffix>`` limits."""
    out = []
    for key, limit_s in slo.limits.items():
        head, _, tail = key.partition("_")
        if f"_{tail}" == suffix and head.startswith("p"):
            try:
                out.append((float(head[1:]), limit_s))
            except ValueError:
                continue
    return out


def _run(cand: Candidate, rate: float, horizon_s: float, slo: SLO | None = None) -> dict[str, Any]:
    """One run of the reduced shape at ``rate`` requests/s for the full configuration; with
    ``slo``, stopped as soon as it certainly misses it (:class:`CertainMiss`)."""
    reduced = rate / cand.scale
    # Enough requests to arrive over HORIZON_S: a rate past capacity must have time to build
    # the queue that breaks the TTFT SLO, however few prompts were asked for.
    n = max(cand.settings.base.num_prompts, math.ceil(reduced * horizon_s))
    base = replace(cand.settings.base, request_rate=reduced, num_prompts=n, slo=None)
    watch = CertainMiss(slo) if slo is not None else None
    try:
        copies = cand.scale if cand.kind == "disaggregated" else 1
        r = simulate_cluster(replace(cand.settings, base=base), watch or None, copies)
    except RunStopped:
        assert watch is not None
        return {"rate": rate, "summary": None, "stopped": watch.reason, "requests": 0,
                "tok_s_per_gpu": None, "req_s_per_gpu": None, "tok_s_per_user": None,
                "result": None}  # fmt: skip
    tpot = r.get("median_tpot_ms")
    return {
        "rate": rate,
        "summary": {
            k: r.get(k)
            for k in (
                "p99_ttft_ms",
                "p99_itl_ms",
                "p99_tpot_ms",
                "p99_e2el_ms",
                "median_tpot_ms",
                "median_ttft_ms",
                "completed",
                "failed",
                "output_throughput",
            )
        },
        "tok_s_per_gpu": r["output_throughput"] * cand.scale / cand.gpus,
        "req_s_per_gpu": r["request_throughput"] * cand.scale / cand.gpus,
        "tok_s_per_user": None if not tpot else 1e3 / tpot,
        "result": r,
    }


def _worst_gaps_ok(r: dict[str, Any], slo: SLO) -> bool:
    """ITL limits held per request too: the NN-th percentile over requests of each request's
    worst gap. Percentiles over all gaps hide a stall each request sees once — the wait for a
    decode slot after a split's prefill is one gap in hundreds."""
    worst = [max(gaps) for gaps in r.get("itls", []) if gaps]
    for key, limit in slo.limits.items():
        if not (key.endswith("_itl") and key.startswith("p") and worst):
            continue
        if float(np.percentile(worst, float(key[1:].split("_")[0]))) > limit:
            return False
    return True


def search(
    cand: Candidate,
    slo: SLO,
    horizon_s: float = HORIZON_S,
    floor_rate: float | None = None,
    exhaustive: bool = False,
    fails_at: float | None = None,
) -> dict[str, Any]:
    """The highest rate meeting ``slo`` for one configuration, and every run on the way.

    ``fails_at``: a rate this configuration is known to miss the SLO at. The search from the
    bottom would double up to the first grid rate (0.5 request/s per GPU times a power of 2)
    that fails and bisect below it; a rate above a failing one fails too (as bisection
    assumes), so that rate is at most the first grid rate at or above ``fails_at``. The search
    starts at the grid rate just below it and steps down the grid while a run fails: the same
    bracket, so the same capacity, without the passing runs below it (nor their points of the
    frontier).

    ``floor_rate``: the capacity this configuration must beat to matter (the best of its kind
    found so far). That rate is tested first; a configuration that fails there is not searched
    further (the search assumes, as bisection does, that a rate above a failing one fails
    too): it reports, in ``below_floor``, the rate it failed at and, as its capacity, the
    starting rate (0.5 request/s per GPU) if one run there meets the SLOs, else 0. One that
    meets it doubles on from there and is bisected as usual."""
    runs: list[dict[str, Any]] = []

    def ok(rate: float) -> bool:
        run = _run(cand, rate, horizon_s, None if exhaustive else slo)
        r = run.pop("result")
        if r is None:  # stopped early: it misses the SLO
            run["meets"] = False
        else:
            run["meets"] = r["failed"] == 0 and slo.met_by_run(r) and _worst_gaps_ok(r, slo)
            run["requests"] = r["completed"] + r["failed"]  # simulated: the run's work
        runs.append(run)
        return run["meets"]

    below_floor = None
    try:
        good, bad = 0.0, None
        rate = 0.5 * cand.gpus
        floor = floor_rate
        if fails_at is not None and floor is None:
            top = rate
            while top * 2 < fails_at:
                top *= 2
            bad = top * 2  # at or above fails_at: not run
            while top >= rate and not ok(top):
                bad, top = top, top / 2
            if top >= rate:
                good = top
            rate = bad
        if floor is not None and floor > rate:
            # The floor first: most configurations fail there (a past-capacity run usually
            # stops early), and then the runs below it, which run in full, are spared; one
            # run at the starting rate keeps a low-load point for the frontier.
            if ok(floor):
                good, rate, floor = floor, floor * 2, None
            else:
                below_floor = floor
                if ok(rate):
                    good = rate
                floor = None
        for _ in range(DOUBLINGS if below_floor is None and fails_at is None else 0):
            if floor is not None and rate >= floor:
                rate = floor  # test the floor itself on the way up
            if ok(rate):
                good, rate = rate, rate * 2
                if floor is not None and good >= floor:
                    floor = None  # it can beat the best so far: search it in full
            else:
                bad = rate
                if floor is not None:  # failed at or below the floor
                    below_floor = rate
                break
        if below_floor is not None:
            pass  # cannot beat the best of its kind: no bisection
        elif bad is not None and good == 0.0:
            # Even the first rate fails: look below it before giving up.
            for _ in range(BISECTIONS):
                rate /= 4
                if ok(rate):
                    good = rate
                    break
        if bad is not None and good and below_floor is None:
            lo, hi = good, bad
            for _ in range(BISECTIONS):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if ok(mid) else (lo, mid)
            good = lo
    except SpecError as exc:
        return {"kind": cand.kind, "label": cand.label, "error": str(exc), "runs": runs}
    best = max((r for r in runs if r["meets"]), key=lambda r: r["rate"], default=None)
    return {
        "kind": cand.kind,
        "label": cand.label,
        "gpus": cand.gpus,
        "capacity_req_s": good if best else 0.0,
        "req_s_per_gpu": best["req_s_per_gpu"] if best else 0.0,
        "tok_s_per_gpu": best["tok_s_per_gpu"] if best else 0.0,
        "tok_s_per_user": best["tok_s_per_user"] if best else None,
        "at_capacity": best["summary"] if best else None,
        "below_floor": below_floor,
        "runs": runs,
    }


def pareto(points: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """Points (tok/s per user, tok/s per GPU, label) no other point beats on both axes."""
    front: list[tuple[float, float, str]] = []
    for user, gpu, label in sorted(points, key=lambda p: (-p[0], -p[1])):
        if not front or gpu > front[-1][1]:
            front.append((user, gpu, label))
    return front


def _device_name(s: SimulateSettings) -> str:
    """The device a plan ran on, as the simulation resolved it when none was named."""
    if s.device:
        return s.device
    if s.calibrate:
        return "calibrated"
    return DEFAULT_DEVICE if s.bandwidth_gb_s is None else "custom"


def _int_tuple(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int_list(text, flag))
    except ValueError as exc:
        raise SpecError(str(exc)) from None


def plan_from_flags(
    c: ClusterSettings,
    plan_budgets: str,
    plan_tp: str,
    progress: Callable[[str], None] | None = None,
    exhaustive: bool = False,
) -> dict[str, Any]:
    """`simulate --plan-capacity`: ``--gpus`` GPUs searched against ``--slo``, which is the
    planner's (aggregate) SLO, so the base runs carry none of bench's per-request kind."""
    if c.gpus is None:
        raise SpecError("--plan-capacity needs --gpus")
    return plan_capacity(
        replace(c, base=replace(c.base, slo=None)),
        c.gpus,
        c.base.slo,
        budgets=_int_tuple(plan_budgets, "--plan-budgets"),
        tp_sizes=_int_tuple(plan_tp, "--plan-tp"),
        progress=progress,
        exhaustive=exhaustive,
    )


def link_bound_req_s(c: ClusterSettings) -> tuple[float, int] | None:
    """The most requests per second any run of a split can complete: its one KV link carries
    every request's prompt KV (all but one-token requests cross it), at least the shortest
    prompt's, and a run lasts at least as long as the link is busy. Returns the bound and that
    shortest prompt (tokens); None where the workload's
    lengths have no floor above that (file and other workloads, outputs of one token).

    A bound on what the search ranks, not an estimate: a run's request throughput is completed
    requests over its duration, and the duration covers the link's busy time."""
    if c.base.workload != "random":
        return None
    inputs = Lengths.parse(c.base.input_len, "--input-len")
    output = Lengths.parse(c.base.output_len, "--output-len")
    if inputs.kind == "normal" or output.kind == "normal" or output.a < 2:
        return None
    p = resolve_inputs(c.base)
    shortest = max(1, int(inputs.a))
    return c.kv_link_gb_s * 1e9 / rf.kv_bytes_at_context(p.model, p.kv, shortest), shortest


# Headroom on the pools' bound (:func:`split_bound_req_s`): it is exact for the expected prompt
# and output lengths, and a run's own draws (200 or more) have a mean within a few percent.
POOL_BOUND_SLACK = 1.1


def _lengths_grid(text: str, what: str) -> np.ndarray | None:
    """Every length a ``--input-len``/``--output-len`` draws, equally likely; None for a
    normal distribution (no bound is taken for it)."""
    lengths = Lengths.parse(text, what)
    if lengths.kind == "fixed":
        return np.array([max(1, int(lengths.a))], dtype=float)
    if lengths.kind == "uniform":
        return np.arange(max(1, int(lengths.a)), max(1, int(lengths.b)) + 1, dtype=float)
    return None


def _pool_cost(pool: Pool) -> CostModel:
    p = pool.inputs
    return CostModel(p.model, p.weights, p.kv, pool.params, pool.tp)


def worker_seconds_per_request(c: ClusterSettings) -> tuple[float, float] | None:
    """Least busy time one prefill worker and one decode worker of the split ``c`` spend on a
    request, on average over the workload's lengths: (prefill s, decode s). None where no
    bound is taken (a file or long-prompt workload, normal lengths, a windowed model's decode).

    A lower bound on every step's cost the worker can run, from the cost model itself: a
    prefill step carries at most its token budget B, and the linear layers', the all-reduces'
    and the step overhead's cost per token only fall as a step grows, so a prompt of L tokens
    costs at least L/B of a full step's, plus its attention's FLOPs (causal pairs do not
    depend on how the prompt is chunked) and one sequence overhead. A decode step runs at
    most b sequences (``max_num_seqs``, and no more than the KV pool holds at the shortest
    prompt), so each of a request's O - 1 decode tokens costs at least 1/b of a full step's
    weights, plus its own attention over its context and one sequence overhead."""
    if c.base.workload != "random":
        return None
    inputs = _lengths_grid(c.base.input_len, "--input-len")
    outputs = _lengths_grid(c.base.output_len, "--output-len")
    if inputs is None or outputs is None:
        return None
    prefill, decode = build_pools(replace(c, disaggregate="1:1", gpus=None))
    pc, dc = _pool_cost(prefill), _pool_cost(decode)
    model = prefill.inputs.model
    # A step may exceed its budget only by a prompt it cannot chunk: the larger is the cap.
    budget = max(prefill.settings.max_num_batched_tokens, int(inputs[-1]))
    full_s = (
        pc.linear_s(budget)
        + pc.tp.comm_s(model, budget)
        + pc.params.step_overhead_s
        + pc.params.prefill_step_overhead_s
    )
    head_s = pc.lm_head_work(1)[0] / pc.flops_per_s
    prefill_s = np.array(
        [
            length * full_s / budget + pc.attention_work(0, int(length))[0] / pc.flops_per_s
            for length in inputs
        ]
    ) + (head_s + pc.params.seqs_overhead_s(1))
    if dc.windowed:
        return None
    kv_tokens = decode.blocks * decode.settings.block_size
    seqs = max(1, min(decode.settings.max_num_seqs, kv_tokens // (int(inputs[0]) + 1)))
    per_token_s = (
        dc.linear_s(seqs)
        + dc.tp.comm_s(model, seqs)
        + dc.lm_head_s(seqs)
        + dc.params.step_overhead_s
        + dc.params.seqs_overhead_s(seqs)
    ) / seqs
    # Attention over the context is proportional to it with no window: decode token j
    # (j = 1 .. O - 1, the first came from the prefill worker) reads L + j tokens.
    per_context_s = dc.attention_s(0, 1)
    steps = outputs - 1
    mean_steps = float(steps.mean())
    mean_context = float((inputs + 1).mean()) * mean_steps + float((steps * (steps - 1) / 2).mean())
    decode_s = mean_steps * per_token_s + per_context_s * mean_context
    return float(prefill_s.mean()), decode_s


def split_bound_req_s(
    c: ClusterSettings,
    cand: Candidate,
    per_worker: dict[tuple[Any, ...], tuple[float, float] | None],
) -> tuple[float, str] | None:
    """The most requests per second the whole split ``cand`` stands for can complete in any
    run: min(P / one prefill worker's least time per request, D / one decode worker's, the KV
    link's :func:`link_bound_req_s`), the first two with ``POOL_BOUND_SLACK`` of headroom for
    a run's own draws. A run lasts at least as long as its busiest worker and its link are
    busy. Returns the bound and which term sets it; None where no bound is taken.
    ``per_worker`` caches the pools' figures by (device, TP, budget) of each pool."""
    split = cand.settings.split()
    assert split is not None
    p_workers, d_workers = (n * cand.scale for n in split)
    s = cand.settings
    key = (
        s.prefill.device or s.base.device, _tp(cand, "prefill"), s.prefill.max_num_batched_tokens,
        s.decode.device or s.base.device, _tp(cand, "decode"), s.decode.max_num_seqs,
    )  # fmt: skip
    if key not in per_worker:
        try:
            per_worker[key] = worker_seconds_per_request(s)
        except SpecError:  # e.g. a pool that does not fit: its search reports why
            per_worker[key] = None
    seconds = per_worker[key]
    if seconds is None:
        return None
    terms = [
        (POOL_BOUND_SLACK * p_workers / seconds[0], f"{p_workers} prefill workers"),
        (POOL_BOUND_SLACK * d_workers / seconds[1], f"{d_workers} decode workers"),
    ]
    link = link_bound_req_s(c)
    if link is not None:
        terms.append((link[0], f"the {c.kv_link_gb_s:g} GB/s KV link"))
    return min(terms)


def _search_all(
    cands: list[Candidate],
    slo: SLO,
    horizon_s: float,
    workers: int,
    floor_of: Callable[[Candidate], float | None],
    done: Callable[[dict[str, Any]], None],
    exhaustive: bool = False,
    skip: Callable[[Candidate], bool] | None = None,
    fails_at: dict[str, float] | None = None,
) -> None:
    """Search ``cands`` in order, up to ``workers`` at once; each starts with the floor its
    predecessors have set by then (``floor_of`` reads it when the search is submitted).
    ``skip``, read at the same moment, leaves a candidate out (it records why). ``fails_at``:
    a rate each label is known to fail at (:func:`search`)."""
    known = fails_at or {}
    if workers <= 1 or len(cands) <= 1:
        for cand in cands:
            if skip is None or not skip(cand):
                f = search(cand, slo, horizon_s, floor_of(cand), exhaustive, known.get(cand.label))
                done(f)
        return
    queue = list(cands)
    with ProcessPoolExecutor(max_workers=min(workers, len(cands))) as pool:
        running = set()
        while queue or running:
            while queue and len(running) < workers:
                cand = queue.pop(0)
                if skip is not None and skip(cand):
                    continue
                running.add(
                    pool.submit(
                        search,
                        cand,
                        slo,
                        horizon_s,
                        floor_of(cand),
                        exhaustive,
                        known.get(cand.label),
                    )
                )
            if not running:
                break
            finished, running = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                done(future.result())


def plan_capacity(
    c: ClusterSettings,
    gpus: int,
    slo_text: str | None,
    budgets: tuple[int, ...] = (512, 2048, 8192),
    tp_sizes: tuple[int, ...] = TP_SIZES,
    processes: int | None = None,
    horizon_s: float = HORIZON_S,
    progress: Callable[[str], None] | None = None,
    exhaustive: bool = False,
) -> dict[str, Any]:
    """Search every configuration of ``gpus`` GPUs; the best of each kind, the winner and its
    margin, and the Pareto frontier of all runs that met the SLOs.

    Unless ``exhaustive``, four shortcuts (each reported in the result): splits are skipped
    when their KV link's bound (:func:`link_bound_req_s`) is below the best colocated
    configuration's goodput; a split is skipped when its pools' and link's bound
    (:func:`split_bound_req_s`) is below the best split's found so far; a configuration that
    fails at the best capacity of its kind found so far is not bisected (:func:`search`'s
    ``floor_rate``); and runs stop once they certainly miss the SLO (:class:`CertainMiss`)."""
    if gpus < 1:
        raise SpecError(f"--gpus must be >= 1, got {gpus}")
    slo = parse_plan_slo(slo_text)
    c.validate()
    # No --model means simulate's default, as one run resolves it (the candidates need a spec).
    c = replace(c, base=replace(c.base, model=c.base.model or DEFAULT_MODEL))
    if not budgets or min(budgets) < 1 or not tp_sizes or min(tp_sizes) < 1:
        raise SpecError("--plan-budgets and --plan-tp take positive integers")
    cands = candidates(c, gpus, budgets, tp_sizes, whole_splits=exhaustive)
    if not cands:
        raise SpecError(f"no configuration of {c.base.model} fits {gpus} GPUs")
    wall_start = time.perf_counter()
    workers = processes or os.cpu_count() or 1
    found: list[dict[str, Any]] = []
    best_of_kind: dict[str, float] = {}  # capacity (req/s), every candidate has ``gpus``
    best_per_gpu: dict[str, float] = {}  # the ranking's figure: request throughput per GPU

    def done(f: dict[str, Any]) -> None:
        found.append(f)
        if "error" not in f and f["below_floor"] is None and f["capacity_req_s"] > 0:
            best_of_kind[f["kind"]] = max(best_of_kind.get(f["kind"], 0.0), f["capacity_req_s"])
        if "error" not in f:
            best_per_gpu[f["kind"]] = max(best_per_gpu.get(f["kind"], 0.0), f["req_s_per_gpu"])
        if progress is not None:
            if "error" in f:
                what = f["error"]
            elif f["below_floor"] is not None:
                what = (
                    f"met {f['capacity_req_s']:.3g} req/s, failed at {f['below_floor']:.3g}: "
                    "cannot beat the best of its kind, not bisected"
                )
            else:
                what = f"{f['capacity_req_s']:.3g} req/s"
            progress(f"{len(found)}/{len(cands)} {f['label']}: {what}")

    def floor_of(cand: Candidate) -> float | None:
        floor = None if exhaustive else best_of_kind.get(cand.kind)
        if floor is not None and cand.kind == "disaggregated" and cand.scale > 1:
            # A unit errs low (see _confirm_whole): held to the floor itself it could be
            # dropped before the whole split it stands for, which would beat it, is confirmed.
            floor *= 1 - CONFIRM_WITHIN
        return floor

    colocated = [x for x in cands if x.kind == "colocated"]
    split = [x for x in cands if x.kind == "disaggregated"]
    # Colocated first: each is one replica at 1/R of the rate, cheap at any G, and the best of
    # them is what a split's link bound is held against. Splits nearest half and half first:
    # they are usually the best, and a high floor early spares the rest their bisections.
    split.sort(
        key=lambda x: abs(x.settings.split()[0] * x.scale * _tp(x, "prefill") / gpus - 0.5)  # type: ignore[index]
    )
    _search_all(colocated, slo, horizon_s, workers, floor_of, done, exhaustive)
    pruned: list[dict[str, Any]] = []
    bound = None if exhaustive or not split else link_bound_req_s(c)
    best_colocated = max(
        (f["req_s_per_gpu"] for f in found if f["kind"] == "colocated" and "error" not in f),
        default=0.0,
    )
    if bound is not None and bound[0] / gpus < best_colocated:
        reason = (
            f"the {c.kv_link_gb_s:g} GB/s KV link carries at most {bound[0]:.0f} req/s "
            f"({bound[0] / gpus:.2f} per GPU; prompts of >= {bound[1]} tokens), below the best "
            f"colocated {best_colocated:.2f} req/s per GPU"
        )
        pruned = [{"label": x.label, "kind": x.kind, "by": "link", "reason": reason}
                  for x in split]  # fmt: skip
        split = []
    bounds: dict[tuple[Any, ...], tuple[float, float] | None] = {}

    def bounded(cand: Candidate) -> bool:
        """Leave out a split whose pools and link cannot complete as many requests per
        second, per GPU, as the best split found so far has (:func:`split_bound_req_s`): it
        cannot rank above it, so the best split, the winner and the margin stand."""
        best = best_per_gpu.get(cand.kind)
        if exhaustive or best is None:
            return False
        bound = split_bound_req_s(c, cand, bounds)
        if bound is None or bound[0] / gpus >= best:
            return False
        pruned.append({
            "label": cand.label, "kind": cand.kind, "by": "pools",
            "bound_req_s": bound[0], "bound_req_s_per_gpu": bound[0] / gpus,
            "set_by": bound[1], "best_req_s_per_gpu": best,
            "reason": f"at most {bound[0]:.0f} req/s ({bound[0] / gpus:.2f} per GPU, set by "
            f"{bound[1]}), below the best split's {best:.2f} req/s per GPU so far",
        })  # fmt: skip
        if progress is not None:
            progress(f"not simulated {cand.label}: {pruned[-1]['reason']}")
        return True

    _search_all(split, slo, horizon_s, workers, floor_of, done, exhaustive, bounded)
    confirmed: list[dict[str, Any]] = []
    if not exhaustive:  # the best splits that ran as units, searched whole (see _confirm_whole)
        confirmed = _confirm_whole(
            c, gpus, budgets, tp_sizes, cands, found, slo, horizon_s, workers, progress
        )
        # A split left out against a unit's estimate that its whole search then lowered may
        # now beat the best split: search those after all (the bound stays a bound).
        splits = [f for f in found if f["kind"] == "disaggregated" and "error" not in f]
        final = max((f["req_s_per_gpu"] for f in splits), default=0.0)
        back = {p["label"] for p in pruned
                if p["by"] == "pools" and p["bound_req_s_per_gpu"] >= final}  # fmt: skip
        if back:
            pruned = [p for p in pruned if p["label"] not in back]
            revisit = [x for x in cands if x.label in back]
            _search_all(revisit, slo, horizon_s, workers, floor_of, done)
    order = {cand.label: i for i, cand in enumerate(cands)}
    found.sort(key=lambda f: order[f["label"]])
    ranked = sorted((f for f in found if "error" not in f), key=lambda f: -f["req_s_per_gpu"])
    best = {
        kind: [f for f in ranked if f["kind"] == kind][:5]
        for kind in ("colocated", "disaggregated")
    }
    points = [
        (run["tok_s_per_user"], run["tok_s_per_gpu"], f"{f['label']} @ {run['rate']:.3g}/s")
        for f in ranked
        for run in f["runs"]
        if run["meets"] and run["tok_s_per_user"]
    ]
    winner = ranked[0] if ranked and ranked[0]["req_s_per_gpu"] > 0 else None
    margin = None
    if winner:
        other = "disaggregated" if winner["kind"] == "colocated" else "colocated"
        rival = best[other][0] if best[other] else None
        if rival and rival["req_s_per_gpu"] > 0:
            margin = winner["req_s_per_gpu"] / rival["req_s_per_gpu"]
    all_runs = [f["runs"] for f in found] + [f.get("unit_runs", []) for f in found]
    return {
        "gpus": gpus,
        "model": c.base.model or DEFAULT_MODEL,
        "device": _device_name(c.base),
        "slo": slo.limits,
        "workload": {
            "input_len": c.base.input_len,
            "output_len": c.base.output_len,
            "num_prompts": c.base.num_prompts,
            "seed": c.base.seed,
        },
        "searched": len(cands) - len(pruned),
        "exhaustive": exhaustive,
        # A split confirmed whole counts its unit's runs as well as the whole's.
        "simulated_runs": sum(len(r) for r in all_runs),
        "simulated_requests": sum(r.get("requests", 0) for rs in all_runs for r in rs),
        "stopped_runs": sum(1 for rs in all_runs for r in rs if r.get("stopped")),
        "wall_s": time.perf_counter() - wall_start,
        "pruned": pruned,
        "not_bisected": [
            {"label": f["label"], "fails_at_req_s": f["below_floor"]}
            for f in found
            if f.get("below_floor") is not None
        ],
        "skipped": [{"label": f["label"], "error": f["error"]} for f in found if "error" in f],
        "split_units": [
            {"label": x.label, "copies": x.scale, "unit": x.settings.disaggregate}
            for x in cands
            if x.kind == "disaggregated"
            and x.scale > 1
            and x.label not in {p["label"] for p in pruned}
        ],
        "confirmed_whole": confirmed,
        "top": best,
        "winner": winner,
        "margin_over_other_kind": margin,
        "frontier": [
            {"tok_s_per_user": u, "tok_s_per_gpu": g, "run": lbl} for u, g, lbl in pareto(points)
        ],
        "configurations": found,
    }


CONFIRM_WITHIN = 0.25  # of the best per-GPU goodput of either kind
CONFIRM_AT_MOST = 2


def _confirm_whole(
    c: ClusterSettings,
    gpus: int,
    budgets: tuple[int, ...],
    tp_sizes: tuple[int, ...],
    cands: list[Candidate],
    found: list[dict[str, Any]],
    slo: SLO,
    horizon_s: float,
    workers: int,
    progress: Callable[[str], None] | None,
) -> list[dict[str, Any]]:
    """Search whole the best split and any other within ``CONFIRM_WITHIN`` of the best
    per-GPU goodput of either kind (at most ``CONFIRM_AT_MOST``) that ran as copies of a
    unit, and put the whole figure in place of the unit's in ``found``.

    The unit errs low where the shared link is busy (its cross traffic is random, the whole
    split's transfers are not), by ~11% at 16 GPUs: enough to turn a close verdict. Each
    whole search starts at the unit's capacity as its floor, which it normally meets, and
    doubles and bisects upward from there; one that fails there is searched below it as the
    search from the bottom would end (:func:`search`'s ``fails_at``: the grid rate below the
    unit's capacity, stepping down while it fails, then bisected), so the figure kept is
    always the whole split's own."""
    scale = {x.label: x.scale for x in cands}
    ok = [f for f in found if "error" not in f and f["below_floor"] is None
          and f["capacity_req_s"] > 0]  # fmt: skip
    splits = sorted((f for f in ok if f["kind"] == "disaggregated"),
                    key=lambda f: -f["req_s_per_gpu"])  # fmt: skip
    # The best split if it ran as units, and any unit split within CONFIRM_WITHIN of the best
    # of either kind (a whole split ahead of it may be beaten once it runs whole too).
    top = max((f["req_s_per_gpu"] for f in ok), default=0.0)
    picked = [
        f for f in splits
        if scale[f["label"]] > 1
        and (f is splits[0] or f["req_s_per_gpu"] >= (1 - CONFIRM_WITHIN) * top)
    ][:CONFIRM_AT_MOST]  # fmt: skip
    if not picked:
        return []
    unit_of = {f["label"]: f for f in picked}
    # The same construction as --plan-exhaustive's, so the whole split is the one it runs.
    wholes = [x for x in candidates(c, gpus, budgets, tp_sizes, whole_splits=True)
              if x.kind == "disaggregated" and x.label in unit_of]  # fmt: skip
    results: dict[str, dict[str, Any]] = {}

    def done(f: dict[str, Any]) -> None:
        results[f["label"]] = f

    _search_all(wholes, slo, horizon_s, workers,
                lambda x: unit_of[x.label]["capacity_req_s"], done)  # fmt: skip
    retry = [x for x in wholes if "error" not in results[x.label]
             and results[x.label]["below_floor"] is not None]  # fmt: skip
    first_runs = {x.label: results[x.label]["runs"] for x in retry}
    # Below the unit's capacity: the search from the bottom, started where it would end.
    failed = {x.label: unit_of[x.label]["capacity_req_s"] for x in retry}
    _search_all(retry, slo, horizon_s, workers, lambda x: None, done, fails_at=failed)
    out = []
    for x in wholes:
        unit, whole = unit_of[x.label], results[x.label]
        if "error" in whole:  # keep the unit's estimate; say why it is not confirmed
            out.append({"label": x.label, "error": whole["error"]})
            continue
        whole["runs"] = first_runs.get(x.label, []) + whole["runs"]
        whole["unit_capacity_req_s"] = unit["capacity_req_s"]
        whole["unit_req_s_per_gpu"] = unit["req_s_per_gpu"]
        whole["unit_copies"] = scale[x.label]
        whole["unit_runs"] = unit["runs"]
        whole["confirmed_whole"] = True
        found[found.index(unit)] = whole
        out.append({
            "label": x.label,
            "copies": scale[x.label],
            "unit_capacity_req_s": unit["capacity_req_s"],
            "capacity_req_s": whole["capacity_req_s"],
        })  # fmt: skip
        if progress is not None:
            progress(f"confirmed whole {x.label}: {whole['capacity_req_s']:.3g} req/s "
                     f"(unit estimate {unit['capacity_req_s']:.3g})")  # fmt: skip
    return out


def _tp(cand: Candidate, pool: str) -> int:
    return getattr(cand.settings, pool).tensor_parallel_size or cand.settings.tensor_parallel_size


def render_plan(plan: dict[str, Any]) -> list[str]:
    slo = ", ".join(f"{k}={v * 1e3:g}ms" for k, v in plan["slo"].items())
    lines = [
        f"[bold]capacity plan[/]: {plan['model']} on {plan['gpus']} x {plan['device']}, SLO "
        f"{slo}; {plan['searched']} configurations searched"
        + (
            ""
            if "simulated_runs" not in plan
            else f" ({plan['simulated_runs']} runs, {plan.get('stopped_runs', 0)} of them "
            f"stopped early, {plan['simulated_requests']:,} requests in the others; "
            f"{plan['wall_s']:.0f} s)"
        )
    ]
    for kind, rows in plan["top"].items():
        lines.append(f"  best {kind}:")
        for f in rows:
            lines.append(
                f"    {f['label']:<34} {f['capacity_req_s']:8.2f} req/s  "
                f"{f['req_s_per_gpu']:6.3f} req/s/GPU  {f['tok_s_per_gpu']:8.1f} tok/s/GPU  "
                f"{f['tok_s_per_user'] or 0:6.1f} tok/s/user"
                + (
                    ""
                    if f.get("below_floor") is None
                    else f"  (met; fails at {f['below_floor']:.3g}, not bisected)"
                )
            )
        if not rows and kind == "disaggregated" and plan.get("pruned"):
            lines.append("    (none simulated: the KV link rules every split out, see below)")
        elif not rows:
            lines.append("    (none meets the SLOs)")
    w = plan["winner"]
    if w:
        margin = plan["margin_over_other_kind"]
        lines.append(
            f"  winner: {w['kind']} {w['label']}, {w['req_s_per_gpu']:.3f} req/s per GPU"
            + ("" if margin is None else f", {margin:.2f}x the best of the other kind")
        )
    else:
        lines.append("  no configuration meets the SLOs at any rate searched")
    lines.append("  Pareto frontier (tok/s per user -> tok/s per GPU):")
    front = plan["frontier"]
    stride = max(1, math.ceil(len(front) / 12))
    for p in front[::stride] + ([front[-1]] if front and (len(front) - 1) % stride else []):
        lines.append(f"    {p['tok_s_per_user']:7.1f} -> {p['tok_s_per_gpu']:8.1f}  {p['run']}")
    for s in plan["skipped"]:
        lines.append(f"  skipped {s['label']}: {s['error']}")
    by_link = [p for p in plan.get("pruned") or [] if p.get("by", "link") == "link"]
    by_pools = [p for p in plan.get("pruned") or [] if p.get("by") == "pools"]
    if by_link:
        lines.append(
            f"  not simulated: {len(by_link)} disaggregated configurations, {by_link[0]['reason']}"
        )
    if by_pools:
        lines.append(
            f"  not simulated: {len(by_pools)} splits whose pools or link cannot complete as "
            "many requests per second as the best split found before them (a bound from the "
            "cost model: P / a prefill worker's least time per request, D / a decode "
            f"worker's, the link's; {POOL_BOUND_SLACK - 1:.0%} headroom on the pools'); "
            "--plan-exhaustive simulates them:"
        )
        for p in by_pools:
            lines.append(f"    {p['label']}: {p['reason']}")
    units = plan.get("split_units") or []
    if units:
        lines.append(
            f"  {len(units)} splits simulated as k copies of a P/k:D/k unit at 1/k of the rate "
            "(assumed: the router splits arrivals evenly), one unit run with the full KV link "
            "and the other copies' transfers queued on it; splits with no common divisor of "
            "P and D run whole"
        )
    for w in plan.get("confirmed_whole") or []:
        if "error" in w:
            lines.append(f"  not confirmed whole: {w['label']}: {w['error']}")
        else:
            lines.append(
                f"  confirmed whole: {w['label']} {w['capacity_req_s']:.3g} req/s (as "
                f"{w['copies']} copies of its unit {w['unit_capacity_req_s']:.3g}); the figure "
                "above and the verdict are the whole split's"
            )
    if plan.get("not_bisected"):
        lines.append(
            f"  not bisected: {len(plan['not_bisected'])} configurations failed at the best "
            "capacity of their kind found before them, so cannot beat it (tested there first; "
            "the capacity shown for them is the one low rate, 0.5 req/s per GPU, they were "
            "also run at, 0 if that failed too); --plan-exhaustive bisects every one"
        )
    return lines


def plot_plan(plan: dict[str, Any], path: Path) -> None:
    """Every run that met the SLOs, by kind, and the frontier through them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind, marker in (("colocated", "o"), ("disaggregated", "s")):
        pts = [
            (run["tok_s_per_user"], run["tok_s_per_gpu"])
            for f in plan["configurations"]
            if f["kind"] == kind
            for run in f["runs"]
            if run["meets"] and run["tok_s_per_user"]
        ]
        if pts:
            ax.scatter(*zip(*pts, strict=True), marker=marker, alpha=0.5, label=kind)
    front = plan["frontier"]
    if front:
        ax.plot([p["tok_s_per_user"] for p in front], [p["tok_s_per_gpu"] for p in front],
                "k-", label="Pareto frontier")  # fmt: skip
    ax.set_xlabel("output tokens/s per user (1 / median TPOT)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title(f"{plan['model']} on {plan['gpus']} x {plan['device']}: runs within the SLOs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
