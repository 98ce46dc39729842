"""`pdscope simulate`: bench's workloads through the engine's own scheduler on a roofline clock.

The model, precision and device are resolved exactly as `plan` resolves them; the engine knobs
carry vLLM's names as `serve` does; the workloads and arrival schedules are bench's; every
simulated request becomes a Trace and the run is summarised by bench's own analysis, so the
result has bench's shape (`pdscope bench compare` reads both).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

from pdscope import __version__
from pdscope.analysis.bench import SLO, by_kind, summarize
from pdscope.analysis.server_metrics import MetricsReport
from pdscope.client.load import LoadPlan
from pdscope.client.server_metrics import TimelinePoint
from pdscope.client.trace import trace_from_timeline
from pdscope.client.workloads import (
    Lengths,
    RequestSpec,
    WorkloadError,
    long_prompt_workload,
    random_workload,
    shared_prefix_workload,
)
from pdscope.commands.bench import BenchState, request_record, vllm_fields
from pdscope.commands.plan import PlanInputs, resolve
from pdscope.engine.scheduler import SchedulerConfig
from pdscope.engine.simulator import SimRequest, SimResult, Simulator
from pdscope.roofline import arithmetic as rf
from pdscope.roofline.step_cost import CostModel, CostParams
from pdscope.specs import SpecError

WORKLOADS = ("random", "shared-prefix", "long-prompt")
LONG_PROMPT_DURATION_S = 30.0  # how long long prompts keep arriving when --duration is not given

# Fractions of a catalog device's peak figures that a tuned server reaches, and the costs per
# step and per sequence that no roofline sees. Assumptions, not measurements: --bandwidth-
# efficiency, --flops-efficiency and the overhead flags replace them, and a measured device
# (--device local) uses its measured rates as they are.
GPU_BANDWIDTH_EFFICIENCY = 0.8
GPU_FLOPS_EFFICIENCY = 0.6
GPU_STEP_OVERHEAD_MS = 2.0
GPU_SEQ_OVERHEAD_MS = 0.01


@dataclass(frozen=True)
class SimulateSettings:
    # what is simulated: plan's flags
    model: str = "8b"
    device: str | None = "h100-sxm"
    dtype: str = "bf16"
    kv_dtype: str | None = None
    bandwidth_gb_s: float | None = None
    tflops: float | None = None
    memory_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    bandwidth_efficiency: float | None = None
    flops_efficiency: float | None = None
    step_overhead_ms: float | None = None
    seq_overhead_ms: float | None = None
    # the engine: serve's knobs, vLLM's names
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 8192
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # the load: bench's flags
    workload: str = "random"
    input_len: str = "128"
    output_len: str = "128"
    num_prompts: int = 100
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    groups: int = 4
    prefix_len: int = 1024
    suffix_len: int = 64
    streams: int = 8
    stream_output: int = 256
    long_len: int = 2000
    long_rate: float = 0.5
    duration_s: float | None = None  # stop sending after this (long-prompt: default 30 s)
    slo: str | None = None

    def validate(self) -> None:
        """Refuse nonsense before anything runs; the message names the flag."""
        if self.workload not in WORKLOADS:
            raise SpecError(
                f"--workload must be one of {', '.join(WORKLOADS)}, got {self.workload!r}"
            )
        for flag, value in (
            ("--max-num-batched-tokens", self.max_num_batched_tokens),
            ("--max-num-seqs", self.max_num_seqs),
            ("--max-model-len", self.max_model_len),
            ("--block-size", self.block_size),
            ("--num-prompts", self.num_prompts),
        ):
            if value < 1:
                raise SpecError(f"{flag} must be >= 1, got {value}")
        for flag, value in (
            ("--bandwidth-efficiency", self.bandwidth_efficiency),
            ("--flops-efficiency", self.flops_efficiency),
        ):
            if value is not None and not 0 < value <= 1:
                raise SpecError(f"{flag} must be in (0, 1], got {value}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise SpecError(f"--kv-cache-memory must be > 0, got {self.kv_cache_memory_bytes}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise SpecError(f"--duration must be > 0 seconds, got {self.duration_s}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise SpecError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")


def cost_params(s: SimulateSettings, p: PlanInputs) -> CostParams:
    """Achieved rates: measured ones as they are, catalog peaks times the efficiencies."""
    d = p.device
    peak = d.peak_flops(p.weights.compute)
    if peak is None:
        raise SpecError(f"device {d.name} has no peak FLOP/s: pass --tflops")
    measured = p.local is not None
    bw_eff = s.bandwidth_efficiency or (1.0 if measured else GPU_BANDWIDTH_EFFICIENCY)
    fl_eff = s.flops_efficiency or (1.0 if measured else GPU_FLOPS_EFFICIENCY)
    step_ms = s.step_overhead_ms
    seq_ms = s.seq_overhead_ms
    if step_ms is None:
        step_ms = 0.0 if measured else GPU_STEP_OVERHEAD_MS
    if seq_ms is None:
        seq_ms = 0.0 if measured else GPU_SEQ_OVERHEAD_MS
    source = "measured on this machine" if measured else f"{d.name} catalog peaks"
    return CostParams(
        d.bandwidth_gb_s * bw_eff,
        peak / 1e12 * fl_eff,
        step_overhead_s=step_ms / 1e3,
        seq_overhead_s=seq_ms / 1e3,
        source=f"{source} x bandwidth {bw_eff:g}, FLOP/s {fl_eff:g}",
    )


def kv_pool_blocks(s: SimulateSettings, p: PlanInputs) -> int:
    """Blocks in the simulated pool: --kv-cache-memory, else plan's pool for the device."""
    per_block = rf.kv_bytes_per_token(p.model, p.kv) * s.block_size
    if s.kv_cache_memory_bytes is not None:
        pool_bytes = float(s.kv_cache_memory_bytes)
    else:
        pool = rf.kv_pool(p.model, p.device, p.weights, p.kv, 1, s.gpu_memory_utilization)
        if pool is None:
            raise SpecError(f"device {p.device.name} has no memory size: pass --memory")
        if pool.pool_bytes <= 0:
            raise SpecError(
                f"{p.model.name} does not fit {p.device.name}: weights need "
                f"{pool.weight_bytes / 1e9:.1f} GB, {-pool.pool_bytes / 1e9:.1f} GB more than "
                f"{s.gpu_memory_utilization:.0%} of its memory"
            )
        pool_bytes = pool.pool_bytes
    weights_bytes = rf.weight_bytes(p.model, p.weights)
    memory = p.device.memory_bytes
    if memory is not None and weights_bytes + pool_bytes > memory:
        raise SpecError(
            f"{p.model.name} weights ({weights_bytes / 1e9:.1f} GB) plus a "
            f"{pool_bytes / 1e9:.1f} GB KV pool need more than {p.device.name}'s "
            f"{memory / 1e9:.1f} GB"
        )
    blocks = int(pool_bytes // per_block)
    if blocks < 1:
        raise SpecError(f"the KV pool ({pool_bytes:.0f} bytes) holds no {s.block_size}-token block")
    return blocks


class _SyntheticPrompts:
    """Bench's workloads ask a prompt builder for token ids; a simulation needs no tokenizer,
    only ids that are unique per prompt (and shared where the workload shares a prefix)."""

    use_tokenize = True

    def __init__(self, seed: int, vocab_size: int):
        self.rng = random.Random(seed)
        self.vocab_size = vocab_size

    async def ids(self, tokens: int) -> list[int]:
        return [self.rng.randrange(self.vocab_size) for _ in range(tokens)]


async def _workload(s: SimulateSettings, vocab_size: int) -> list[RequestSpec]:
    builder: Any = _SyntheticPrompts(s.seed, vocab_size)
    output = Lengths.parse(s.output_len, "--output-len")
    if s.workload == "random":
        inputs = Lengths.parse(s.input_len, "--input-len")
        return await random_workload(builder, s.num_prompts, inputs, output, s.seed)
    if s.workload == "shared-prefix":
        return await shared_prefix_workload(
            builder, s.num_prompts, s.groups, s.prefix_len, s.suffix_len, output, s.seed
        )
    duration_s = s.duration_s if s.duration_s is not None else LONG_PROMPT_DURATION_S
    return await long_prompt_workload(
        builder, s.streams, s.stream_output, s.long_len, s.long_rate, duration_s, s.seed
    )


def _server_report(sim: Simulator, result: SimResult, url: str) -> MetricsReport:
    """What a `/metrics` sampler would have seen, read off the simulated steps: the gauges at
    most ~500 points in time, the counters' totals, the maxima over every step."""
    steps = result.steps
    stride = max(1, len(steps) // 500)
    start = steps[0].start_s if steps else 0.0
    pool = sim.pool
    hits, queries = pool.prefix_cache_hits, pool.prefix_cache_queries
    return MetricsReport(
        available=True,
        runtime="pdscope simulate",
        url=url,
        duration_s=result.end_s - start,
        timeline=[
            TimelinePoint(x.end_s - start, x.num_running, x.num_waiting, x.kv_cache_usage)
            for x in steps[::stride]
        ],
        deltas={
            "preemptions": result.num_preemptions,
            "prefix_hits": hits,
            "prefix_queries": queries,
            # As the server's counter: every started request's whole prompt, hits included.
            "prompt_tokens": sum(
                r.timeline.prompt_tokens for r in result.requests if r.timeline.token_s
            ),
            "generation_tokens": sum(1 for r in result.requests for _ in r.output_token_ids),
        },
        prefix_hit_rate=hits / queries if queries else None,
        max_waiting=max((x.num_waiting for x in steps), default=0),
        max_running=max((x.num_running for x in steps), default=0),
        max_kv_usage=max((x.kv_cache_usage for x in steps), default=0.0),
        warnings=["simulated: no latency histograms (the traces hold every latency)"],
    )


def simulate(s: SimulateSettings) -> dict[str, Any]:
    """One simulated run, as a dict shaped like `pdscope bench`'s result (plus `simulated`)."""
    s.validate()
    p = resolve(
        model=s.model,
        device=s.device,
        dtype=s.dtype,
        kv_dtype=s.kv_dtype,
        gpu_memory_utilization=s.gpu_memory_utilization,
        bandwidth_gb_s=s.bandwidth_gb_s,
        tflops=s.tflops,
        memory_gb=s.memory_gb,
    )
    limit = p.model.max_position_embeddings
    if limit is not None and s.max_model_len > limit:
        raise SpecError(
            f"--max-model-len {s.max_model_len} exceeds {p.model.name}'s "
            f"max_position_embeddings {limit}"
        )
    params = cost_params(s, p)
    cost = CostModel(p.model, p.weights, p.kv, params)
    blocks = kv_pool_blocks(s, p)
    try:
        specs = asyncio.run(_workload(s, p.model.vocab_size))
        slo = SLO.parse(s.slo) if s.slo else None
    except (WorkloadError, ValueError) as exc:
        raise SpecError(str(exc)) from None
    plan = LoadPlan(request_rate=s.request_rate, burstiness=s.burstiness, seed=s.seed)
    times = plan.schedule(len(specs))
    requests = [
        SimRequest(
            spec.prompt,  # type: ignore[arg-type]  # token ids from the synthetic builder
            spec.output_tokens,
            arrival_s=spec.at_s if spec.at_s is not None else at,
            label=spec.kind,
        )
        for spec, at in zip(specs, times, strict=True)
    ]
    if s.duration_s is not None and s.workload != "long-prompt":
        # As bench's --duration: nothing is sent after it (running requests finish).
        requests = [r for r in requests if r.arrival_s <= s.duration_s]
    config = SchedulerConfig(
        s.max_num_batched_tokens, s.max_num_seqs, s.max_model_len, s.enable_chunked_prefill
    )
    sim = Simulator(
        config,
        blocks,
        s.block_size,
        lambda out: cost.step(out.scheduled).seconds,
        s.enable_prefix_caching,
    )
    wall = time.perf_counter()
    result = sim.run(requests, s.max_concurrency)
    wall = time.perf_counter() - wall

    url = f"simulated://{p.device.name}"
    traces = []
    for spec, request in zip(requests, result.requests, strict=True):
        trace = trace_from_timeline(
            request.timeline, api="simulated", url=url, model=p.model.name, label=spec.label
        )
        trace.scheduled_s = spec.arrival_s
        if request.finish_reason and request.finish_reason.startswith("error"):
            trace.error = request.finish_reason
        traces.append(trace)
    duration_s = result.end_s  # from the run's start at 0, as bench measures it
    summary = summarize(traces, duration_s, slo=slo)
    rate = None if math.isinf(s.request_rate) else s.request_rate
    metadata = {
        "url": url,
        "runtime": "pdscope simulate",
        "runtime_version": __version__,
        "pdscope_version": __version__,
        "model": p.model.name,
        "api": "simulated",
        "workload": s.workload,
        "exact_prompt_tokens": True,
        "prompt_mode": "exact (synthetic token ids, no tokenizer)",
        "device": p.device.name,
        "dtype": p.weights.name,
        "kv_dtype": p.kv.name,
        "kv_pool_blocks": blocks,
        "kv_pool_tokens": blocks * s.block_size,
        "cost_params": asdict(params),
        "settings": {**asdict(s), "request_rate": rate},
        "seed": s.seed,
        "seed_given": True,
        "wall_s": wall,
    }
    run = {
        "request_rate": rate,
        "max_concurrency": s.max_concurrency,
        "input_tokens_requested": _requested(s),
        "summary": summary,
        "by_kind": by_kind(traces, duration_s, (50, 90, 95, 99)),
        "server": _server_report(sim, result, url).to_dict(),
        "warnings": [],
        "partial": None,
        "vllm": vllm_fields(
            traces, metadata, s.burstiness, s.request_rate, s.max_concurrency, summary
        ),
        "requests": [request_record(t) for t in traces],
    }
    return {**BenchState(metadata, [run]).result(), "simulated": True}


def _requested(s: SimulateSettings) -> str:
    if s.workload == "shared-prefix":
        return f"{s.prefix_len}+{s.suffix_len}"
    if s.workload == "long-prompt":
        return f"32 (streams), {s.long_len} (long prompts)"
    return s.input_len
