"""`pdscope simulate` at cluster scale: replicas behind a router, tensor parallelism, and
prefill/decode disaggregation over a KV link. Builds each pool's workers from simulate's own
pieces (plan's resolution, the cost model, the KV pool, bench's workloads and result), runs
:class:`pdscope.engine.cluster.Cluster`, and adds the cluster's own figures to bench's result.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from pdscope.client.load import LoadPlan
from pdscope.commands.plan import PlanInputs
from pdscope.commands.simulate import (
    SimulateSettings,
    bench_result,
    build_requests,
    cost_params,
    kv_pool_blocks,
    resolve_inputs,
    server_report,
    settle_model_len,
    simulate,
)
from pdscope.engine.cluster import (
    FIRST_TOKEN_SOURCES,
    ROUTERS,
    Cluster,
    ClusterResult,
    KVLink,
    Worker,
    WorkerSpec,
)
from pdscope.engine.request import Request
from pdscope.engine.simulator import SimRequest
from pdscope.engine.timeline import StepRecord
from pdscope.roofline import arithmetic as rf
from pdscope.roofline.parallel import (
    LINKS,
    Link,
    TensorParallel,
    default_link,
    gpu_memory,
    tensor_parallel,
)
from pdscope.roofline.step_cost import CostModel, CostParams
from pdscope.specs import SpecError

# One 400 Gb/s NIC (InfiniBand NDR / RoCE) between the pools, and a transfer's fixed cost
# (registration, the request to pull, completion). Assumptions: --kv-link-gb-s and
# --kv-link-latency-ms replace them.
DEFAULT_KV_LINK_GB_S = 50.0
DEFAULT_KV_LINK_LATENCY_MS = 0.1
POOL_KEYS = {
    "device": "device",
    "tp": "tensor_parallel_size",
    "tensor-parallel-size": "tensor_parallel_size",
    "max-num-batched-tokens": "max_num_batched_tokens",
    "max-num-seqs": "max_num_seqs",
    "gpu-memory-utilization": "gpu_memory_utilization",
}


@dataclass(frozen=True)
class PoolArgs:
    """One pool's own settings; None: the cluster-wide flag's value."""

    device: str | None = None
    tensor_parallel_size: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    gpu_memory_utilization: float | None = None

    @classmethod
    def parse(cls, text: str | None, flag: str) -> PoolArgs:
        """``key=value,...`` with keys device, tp, max-num-batched-tokens, max-num-seqs,
        gpu-memory-utilization."""
        if not text:
            return cls()
        values: dict[str, Any] = {}
        for part in text.split(","):
            key, sep, value = part.strip().partition("=")
            name = POOL_KEYS.get(key.strip().lstrip("-"))
            if not sep or name is None:
                raise SpecError(
                    f"{flag} takes key=value pairs with keys {', '.join(POOL_KEYS)}, got {part!r}"
                )
            try:
                if name == "device":
                    values[name] = value.strip()
                elif name == "gpu_memory_utilization":
                    values[name] = float(value)
                else:
                    values[name] = int(value)
            except ValueError:
                raise SpecError(f"{flag}: {key} needs a number, got {value!r}") from None
        return cls(**values)


@dataclass(frozen=True)
class ClusterSettings:
    base: SimulateSettings = field(default_factory=SimulateSettings)
    replicas: int | None = None  # None: --gpus / TP, or 1
    router: str = "round-robin"
    tensor_parallel_size: int = 1
    tp_link: str | None = None  # a LINKS name; None: the device's
    tp_link_gb_s: float | None = None
    tp_link_latency_us: float | None = None
    disaggregate: str | None = None  # "P:D"
    prefill: PoolArgs = PoolArgs()
    decode: PoolArgs = PoolArgs()
    kv_link_gb_s: float = DEFAULT_KV_LINK_GB_S
    kv_link_latency_ms: float = DEFAULT_KV_LINK_LATENCY_MS
    first_token: str = "prefill"
    gpus: int | None = None

    @classmethod
    def from_flags(
        cls,
        base: SimulateSettings,
        prefill_args: str | None,
        decode_args: str | None,
        prefill_device: str | None,
        decode_device: str | None,
        plan_capacity: bool,
        **fields: Any,
    ) -> ClusterSettings:
        """The CLI's cluster flags around ``base``; ``--prefill-device``/``--decode-device``
        override the pools' ``device=``. --calibrate and --find-capacity fit or search one
        replica, so they are refused beside any cluster flag."""
        c = cls(
            base,
            prefill=PoolArgs.parse(prefill_args, "--prefill-args"),
            decode=PoolArgs.parse(decode_args, "--decode-args"),
            **fields,
        )
        if (is_cluster(c) or plan_capacity) and (base.calibrate or base.find_capacity):
            raise SpecError(
                "--calibrate and --find-capacity simulate one replica: drop them, or drop the "
                "cluster flags (--replicas, --disaggregate, -tp, --gpus, --plan-capacity)"
            )
        for pool, device in (("prefill", prefill_device), ("decode", decode_device)):
            if device is not None:
                c = replace(c, **{pool: replace(getattr(c, pool), device=device)})
        return c

    def split(self) -> tuple[int, int] | None:
        if self.disaggregate is None:
            return None
        p, sep, d = self.disaggregate.partition(":")
        try:
            split = int(p), int(d)
        except ValueError:
            split = (0, 0)
        if not sep or min(split) < 1:
            raise SpecError(
                f"--disaggregate takes P:D, prefill and decode workers (>= 1 each), "
                f"got {self.disaggregate!r}"
            )
        return split

    def validate(self) -> None:
        self.base.validate()
        if self.router not in ROUTERS:
            raise SpecError(f"--router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if self.first_token not in FIRST_TOKEN_SOURCES:
            raise SpecError(
                f"--first-token must be one of {', '.join(FIRST_TOKEN_SOURCES)}, "
                f"got {self.first_token!r}"
            )
        if self.tensor_parallel_size < 1:
            raise SpecError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.replicas is not None and self.replicas < 1:
            raise SpecError(f"--replicas must be >= 1, got {self.replicas}")
        if self.gpus is not None and self.gpus < 1:
            raise SpecError(f"--gpus must be >= 1, got {self.gpus}")
        if not self.kv_link_gb_s > 0:
            raise SpecError(f"--kv-link-gb-s must be > 0, got {self.kv_link_gb_s:g}")
        if not self.kv_link_latency_ms >= 0:
            raise SpecError(f"--kv-link-latency-ms must be >= 0, got {self.kv_link_latency_ms:g}")
        if self.tp_link is not None and self.tp_link not in LINKS:
            raise SpecError(f"--tp-link must be one of {', '.join(LINKS)}, got {self.tp_link!r}")
        if self.tp_link_gb_s is not None and not self.tp_link_gb_s > 0:
            raise SpecError(f"--tp-link-gb-s must be > 0, got {self.tp_link_gb_s:g}")
        split = self.split()
        if split is None and (self.prefill != PoolArgs() or self.decode != PoolArgs()):
            raise SpecError("per-pool settings (--prefill-*, --decode-*) need --disaggregate P:D")
        if split is not None and self.replicas is not None:
            raise SpecError("--replicas and --disaggregate are exclusive: P:D sets the workers")


@dataclass(frozen=True)
class Pool:
    """One pool's workers, all alike."""

    name: str
    workers: int
    settings: SimulateSettings
    inputs: PlanInputs
    params: CostParams
    tp: TensorParallel
    blocks: int
    spec: WorkerSpec

    @property
    def gpus(self) -> int:
        return self.workers * self.tp.size

    def describe(self) -> dict[str, Any]:
        return {
            "workers": self.workers,
            "device": self.inputs.device.name,
            "tensor_parallel_size": self.tp.size,
            "kv_split": self.tp.kv_split,
            "tp_link": None if self.tp.link is None else asdict(self.tp.link),
            "gpus": self.gpus,
            "kv_pool_blocks": self.blocks,
            "kv_pool_tokens": self.blocks * self.settings.block_size,
            "max_num_batched_tokens": self.settings.max_num_batched_tokens,
            "max_num_seqs": self.settings.max_num_seqs,
            "cost_params": asdict(self.params),
        }


def _tp_link(c: ClusterSettings, p: PlanInputs) -> Link:
    link = LINKS[c.tp_link] if c.tp_link else default_link(p.device)
    return replace(
        link,
        bandwidth_gb_s=c.tp_link_gb_s if c.tp_link_gb_s is not None else link.bandwidth_gb_s,
        latency_s=(
            c.tp_link_latency_us * 1e-6 if c.tp_link_latency_us is not None else link.latency_s
        ),
    )


def _tp_pool_blocks(s: SimulateSettings, p: PlanInputs, tp: TensorParallel) -> int:
    """Blocks per replica when its model is split ``tp.size`` ways (every GPU holds the same
    token slots, each its share of every token's KV)."""
    kv_per_token = rf.kv_bytes_per_token(p.model, p.kv)
    g = gpu_memory(p.model, p.device, p.weights, kv_per_token, tp, s.gpu_memory_utilization)
    where = f"{p.device.name} at --tensor-parallel-size {tp.size}"
    if s.kv_cache_memory_bytes is not None:
        pool_bytes = float(s.kv_cache_memory_bytes)  # per GPU
        if g.weight_bytes + pool_bytes > g.memory_bytes:
            raise SpecError(
                f"{p.model.name}'s {g.weight_bytes / 1e9:.1f} GB of weights per GPU plus a "
                f"{pool_bytes / 1e9:.1f} GB KV pool need more than {where}'s "
                f"{g.memory_bytes / 1e9:.1f} GB"
            )
    else:
        if g.pool_bytes <= 0:
            raise SpecError(
                f"{p.model.name} does not fit {where}: {g.weight_bytes / 1e9:.1f} GB of "
                f"weights per GPU, {-g.pool_bytes / 1e9:.1f} GB more than "
                f"{s.gpu_memory_utilization:.0%} of its memory"
            )
        pool_bytes = g.pool_bytes
    blocks = int(pool_bytes // (g.kv_bytes_per_token * s.block_size))
    if blocks < 1:
        raise SpecError(f"the KV pool on {where} holds no {s.block_size}-token block")
    return blocks


def _pool(c: ClusterSettings, name: str, workers: int, args: PoolArgs, tp_size: int) -> Pool:
    overrides = {k: v for k, v in asdict(args).items() if v is not None}
    overrides.pop("tensor_parallel_size", None)
    s = replace(c.base, **overrides)
    s.validate()
    p = resolve_inputs(s)
    s = settle_model_len(s, p)
    link = _tp_link(c, p) if tp_size > 1 else None
    tp = tensor_parallel(p.model, tp_size, link)
    params = cost_params(s, p)
    cost = CostModel(p.model, p.weights, p.kv, params, tp)
    try:
        blocks = kv_pool_blocks(s, p) if tp.size == 1 else _tp_pool_blocks(s, p, tp)
    except SpecError as exc:
        raise SpecError(f"{name} pool: {exc}" if name != "replica" else str(exc)) from None
    config = s.scheduler_config()
    spec = WorkerSpec(
        config,
        blocks,
        s.block_size,
        lambda out: cost.step(out.scheduled).seconds,
        s.enable_prefix_caching,
        gpus=tp.size,
    )
    return Pool(name, workers, s, p, params, tp, blocks, spec)


def build_pools(c: ClusterSettings) -> list[Pool]:
    """The pools the settings describe, with the GPU count checked against --gpus."""
    c.validate()
    split = c.split()
    if split is None:
        tp = c.tensor_parallel_size
        replicas = c.replicas
        if c.gpus is not None:
            if c.gpus % tp:
                raise SpecError(f"--tensor-parallel-size {tp} does not divide --gpus {c.gpus}")
            if replicas is not None and replicas * tp != c.gpus:
                raise SpecError(
                    f"--replicas {replicas} x --tensor-parallel-size {tp} uses "
                    f"{replicas * tp} GPUs, not --gpus {c.gpus}"
                )
            replicas = c.gpus // tp
        return [_pool(c, "replica", replicas or 1, PoolArgs(), tp)]
    p_workers, d_workers = split
    p_tp = c.prefill.tensor_parallel_size or c.tensor_parallel_size
    d_tp = c.decode.tensor_parallel_size or c.tensor_parallel_size
    used = p_workers * p_tp + d_workers * d_tp
    if c.gpus is not None and used != c.gpus:
        raise SpecError(
            f"--disaggregate {c.disaggregate} at TP {p_tp}/{d_tp} (prefill/decode) uses "
            f"{used} GPUs, not --gpus {c.gpus}"
        )
    return [
        _pool(c, "prefill", p_workers, c.prefill, p_tp),
        _pool(c, "decode", d_workers, c.decode, d_tp),
    ]


def _dist_ms(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    a = np.asarray(values) * 1e3
    return {
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "max": float(a.max()),
    }


def _max_link_queue(result: ClusterResult) -> int:
    """Most transfers waiting for the link at once (queued, not yet sending)."""
    events = sorted(
        [(t.ready_s, 1) for t in result.transfers] + [(t.start_s, -1) for t in result.transfers]
    )
    depth = best = 0
    for _, delta in events:  # at equal times a start (-1) sorts before a new arrival (+1)
        depth += delta
        best = max(best, depth)
    return best


def _merged_steps(workers: list[Worker]) -> list[StepRecord]:
    """The cluster as one server for bench's timeline: at every step's end, running and
    waiting summed over the workers and KV use averaged (each worker's latest)."""
    latest: dict[int, StepRecord] = {}
    running = waiting = 0
    usage = 0.0
    merged = []
    tagged = sorted(
        ((s.end_s, w.index, s) for w in workers for s in w.steps), key=lambda x: (x[0], x[1])
    )
    n = len(workers)
    for _end_s, index, step in tagged:
        old = latest.get(index)
        if old is not None:
            running -= old.num_running
            waiting -= old.num_waiting
            usage -= old.kv_cache_usage
        latest[index] = step
        running += step.num_running
        waiting += step.num_waiting
        usage += step.kv_cache_usage
        merged.append(
            replace(step, num_running=running, num_waiting=waiting, kv_cache_usage=usage / n)
        )
    return merged


def _cluster_figures(
    c: ClusterSettings, pools: list[Pool], result: ClusterResult, summary: dict[str, Any]
) -> dict[str, Any]:
    end = result.end_s or 1.0
    gpus = sum(p.gpus for p in pools)
    workers = []
    for w in result.workers:
        busy = w.busy_s
        workers.append(
            {
                "index": w.index,
                "pool": w.pool,
                "completed": w.completed,
                "steps": len(w.steps),
                "busy_s": busy,
                "utilization": busy / end,
                "prefill_tokens": sum(s.prefill_tokens for s in w.steps),
                "decode_tokens": sum(s.decode_tokens for s in w.steps),
                "preemptions": sum(s.num_preempted for s in w.steps),
                "max_running": max((s.num_running for s in w.steps), default=0),
                "max_waiting": max((s.num_waiting for s in w.steps), default=0),
            }
        )
    pool_info = {}
    for p in pools:
        mine = [x for x in workers if x["pool"] == p.name]
        pool_info[p.name] = {
            **p.describe(),
            "utilization": statistics.fmean(x["utilization"] for x in mine),
            "completed": sum(x["completed"] for x in mine),
        }
    out: dict[str, Any] = {
        "mode": "disaggregated" if c.split() else "colocated",
        "router": c.router,
        "gpus": gpus,
        "pools": pool_info,
        "workers": workers,
        "output_tok_s_per_gpu": summary["output_throughput"] / gpus,
        "request_goodput_per_gpu": (
            None if summary.get("request_goodput") is None else summary["request_goodput"] / gpus
        ),
        "conservation": "checked: every request finished or failed, tokens out = asked, "
        "no blocks held, link bytes = transferred KV",
    }
    if c.split():
        out["first_token"] = c.first_token
        out["link"] = {
            "gb_s": c.kv_link_gb_s,
            "latency_ms": c.kv_link_latency_ms,
            "transfers": len(result.transfers),
            "bytes": result.link_bytes,
            "utilization": result.link_bytes / (c.kv_link_gb_s * 1e9) / end,
            "transfer_ms": _dist_ms([t.total_s for t in result.transfers]),
            "queue_ms": _dist_ms([t.queue_s for t in result.transfers]),
            "max_queue": _max_link_queue(result),
        }
    return out


def link_cross_traffic(
    c: ClusterSettings,
    requests: Sequence[SimRequest],
    copies: int,
    kv_bytes: Callable[[int], float],
) -> list[tuple[float, float]]:
    """The KV that ``copies - 1`` other copies of a split send over the link it shares with
    them, as (ready time in s, bytes), for a run of one copy on ``requests``.

    Each other copy is fed what this one is: the same arrival process (rate, burstiness), new
    seeds, prompts drawn from this copy's own (those with more than one output token cross the
    link). A transfer is ready at its request's arrival rather than after its prefill: delaying
    every point of a Poisson process by independent amounts leaves it a Poisson process of the
    same rate, so in steady state the link sees the full cluster's offered bytes with the right
    statistics; what is lost is the prefill pools' smoothing of that stream, and the first
    prefill's worth of time (tens of ms of a 15 s run)."""
    if copies <= 1:
        return []
    rate = c.base.request_rate
    if math.isinf(rate) or c.base.max_concurrency is not None:
        raise SpecError("a split's copies need an open-loop rate (no --max-concurrency)")
    sizes = [len(r.prompt_token_ids) for r in requests if r.output_tokens > 1]
    if not sizes:
        return []
    share = len(sizes) / len(requests)
    out = []
    horizon_s = max(r.arrival_s for r in requests)
    for j in range(1, copies):
        seed = c.base.seed + 7919 * j
        plan = LoadPlan(request_rate=rate, burstiness=c.base.burstiness, seed=seed)
        rng = random.Random(f"copy-sizes-{seed}")  # not the arrival gaps' stream
        # Twice the requests: a copy's draws may run slower than this one's; cut at its end.
        for at_s in plan.schedule(2 * len(requests) + 10):
            if at_s > horizon_s:
                break
            if rng.random() < share:
                out.append((at_s, float(kv_bytes(rng.choice(sizes)))))
    out.sort()
    return out


def simulate_cluster(
    c: ClusterSettings,
    stop: Callable[[float, Sequence[Request]], bool] | None = None,
    link_copies: int = 1,
) -> dict[str, Any]:
    """One cluster run as bench's result, plus ``cluster``: pools, workers, the KV link.
    ``stop``: see :meth:`Cluster.run` (raises :class:`RunStopped`). ``link_copies``: a split
    that is one of this many identical copies sharing its KV link; the others' transfers
    (:func:`link_cross_traffic`) queue on the link with this copy's own."""
    pools = build_pools(c)
    s, p = pools[0].settings, pools[0].inputs
    requests, slo = build_requests(c.base, p)
    front = [pools[0].spec] * pools[0].workers
    background: list[tuple[float, float]] = []
    if len(pools) == 2:
        kv, model = pools[0].inputs.kv, pools[0].inputs.model

        def kv_bytes(tokens: int) -> float:
            return rf.kv_bytes_at_context(model, kv, tokens)

        cluster = Cluster(
            front,
            c.router,
            [pools[1].spec] * pools[1].workers,
            KVLink(c.kv_link_gb_s, c.kv_link_latency_ms / 1e3),
            kv_bytes,
            c.first_token,
        )
        background = link_cross_traffic(c, requests, link_copies, kv_bytes)
    else:
        if link_copies != 1:
            raise SpecError("link_copies applies to a disaggregated split only")
        cluster = Cluster(front, c.router)
    wall = time.perf_counter()
    result = cluster.run(requests, c.base.max_concurrency, stop, link_background=background)
    wall = time.perf_counter() - wall
    url = f"simulated://{p.device.name}"
    hits = sum(w.sim.pool.prefix_cache_hits for w in result.workers)
    queries = sum(w.sim.pool.prefix_cache_queries for w in result.workers)
    steps = result.workers[0].steps if len(result.workers) == 1 else _merged_steps(result.workers)
    server = server_report(steps, result.requests, result.end_s, hits, queries, url)
    blocks = pools[0].blocks
    metadata = {"kv_pool_blocks": blocks, "kv_pool_tokens": blocks * s.block_size}
    base = settle_model_len(c.base, p)  # the length every pool ran with, in the result
    r = bench_result(
        base, p, pools[0].params, requests, result.requests, result.end_s, server, wall,
        metadata, slo,
    )  # fmt: skip
    r["cluster"] = _cluster_figures(c, pools, result, r)
    if link_copies > 1:
        r["cluster"]["link"]["shared_with_copies"] = link_copies - 1
        r["cluster"]["link"]["cross_traffic_bytes"] = result.background_bytes
        r["cluster"]["link"]["cross_traffic_transfers"] = result.background_transfers
        r["cluster"]["link"]["utilization"] = (
            (result.link_bytes + result.background_bytes) / (c.kv_link_gb_s * 1e9)
            / (result.end_s or 1.0)
        )  # fmt: skip
    return r


def is_cluster(c: ClusterSettings) -> bool:
    """Whether the settings ask for anything beyond one single-GPU replica."""
    return (
        c.replicas is not None
        or c.gpus is not None
        or c.disaggregate is not None
        or c.tensor_parallel_size != 1
        or c.router != "round-robin"
        or c.prefill != PoolArgs()
        or c.decode != PoolArgs()
    )


def simulate_any(c: ClusterSettings) -> dict[str, Any]:
    """`pdscope simulate`'s run: the cluster when any cluster flag is given, else one replica
    (whose result carries no cluster section)."""
    return simulate_cluster(c) if is_cluster(c) else simulate(c.base)
