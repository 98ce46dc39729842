"""`pdscope simulate`: bench's workloads through the engine's own scheduler on a roofline clock.

The model, precision and device are resolved exactly as `plan` resolves them; the engine knobs
carry vLLM's names as `serve` does; the workloads and arrival schedules are bench's; every
simulated request becomes a Trace and the run is summarised by bench's own analysis, so the
result has bench's shape (`pdscope bench compare` reads both).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Coroutine, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pdscope import __version__
from pdscope.analysis.bench import SLO, by_kind, summarize
from pdscope.analysis.calibrate import Calibration, fit, observations, step_jitter
from pdscope.analysis.server_metrics import MetricsReport
from pdscope.client.load import LoadPlan
from pdscope.client.server_metrics import TimelinePoint
from pdscope.client.trace import trace_from_timeline
from pdscope.client.workloads import (
    Lengths,
    RequestSpec,
    WorkloadError,
    file_workload,
    long_prompt_workload,
    random_workload,
    shared_prefix_workload,
)
from pdscope.commands.bench import BenchState, request_record, search_capacity, vllm_fields
from pdscope.commands.plan import PlanInputs, resolve
from pdscope.engine.request import Request
from pdscope.engine.scheduler import SchedulerConfig
from pdscope.engine.simulator import SimRequest, SimResult, Simulator
from pdscope.engine.timeline import StepRecord
from pdscope.roofline import arithmetic as rf
from pdscope.roofline.step_cost import CostModel, CostParams
from pdscope.specs import SpecError
from pdscope.specs.sizes import parse_bytes

if TYPE_CHECKING:
    from pdscope.engine.tokenizer import Tokenizer

T = TypeVar("T")

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
DEFAULT_MODEL = "8b"
DEFAULT_DEVICE = "h100-sxm"
# The KV pool when calibrating without a device: `pdscope serve`'s on a CPU (EngineArgs).
CPU_SERVE_KV_CACHE_BYTES = 2**30


@dataclass(frozen=True)
class SimulateSettings:
    # what is simulated: plan's flags (None: the probe's model with --calibrate, else 8b; the
    # catalog H100 SXM, or with --calibrate a device of the fitted rates)
    model: str | None = None
    device: str | None = None
    calibrate: str | None = None  # a saved `pdscope probe --json` of the server modelled
    # the probed server's max_num_batched_tokens: its prompts over it prefilled in several steps
    calibrate_budget: int = 2048
    step_jitter: bool = True  # with --calibrate: the probe's step-time scatter
    dtype: str | None = None  # None: a GGUF model's own widths, else bf16 (as plan)
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
    # None: the probed server's length with --calibrate, else the model's
    # max_position_embeddings up to DEFAULT_MAX_MODEL_LEN (see settle_model_len)
    max_model_len: int | None = None
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
    tokenizer: str | None = None  # counts a file workload's text prompts (default: the model's)
    find_capacity: bool = False  # search the highest load meeting --slo, as bench does
    max_runs: int = 10  # bound on the capacity search

    @classmethod
    def from_flags(cls, kv_cache_memory: str | None, **fields: Any) -> SimulateSettings:
        """The CLI's flags as settings; ``kv_cache_memory`` is a size such as ``50MiB``.
        Checked by :meth:`validate` when the run starts."""
        kv_bytes = None if kv_cache_memory is None else parse_bytes(kv_cache_memory)
        return cls(kv_cache_memory_bytes=kv_bytes, **fields)

    def scheduler_config(self) -> SchedulerConfig:
        assert self.max_model_len is not None, "settle_model_len first"
        return SchedulerConfig(
            self.max_num_batched_tokens,
            self.max_num_seqs,
            self.max_model_len,
            self.enable_chunked_prefill,
        )

    def validate(self) -> None:
        """Refuse nonsense before anything runs; the message names the flag."""
        if self.workload not in WORKLOADS and not self.workload.startswith("file:"):
            raise SpecError(
                f"--workload must be one of {', '.join(WORKLOADS)} or file:PATH, "
                f"got {self.workload!r}"
            )
        if self.find_capacity and not self.slo:
            raise SpecError("--find-capacity needs --slo, e.g. p99_ttft=2s,p99_itl=100ms")
        if self.max_runs < 1:
            raise SpecError(f"--max-runs must be >= 1, got {self.max_runs}")
        for flag, value in (
            ("--max-num-batched-tokens", self.max_num_batched_tokens),
            ("--max-num-seqs", self.max_num_seqs),
            ("--max-model-len", self.max_model_len),
            ("--block-size", self.block_size),
            ("--num-prompts", self.num_prompts),
        ):
            if value is None:  # max_model_len not given: settled against the model
                continue
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
        if self.calibrate_budget < 1:
            raise SpecError(f"--calibrate-budget must be >= 1, got {self.calibrate_budget}")
        if self.calibrate is not None:
            given = [
                flag
                for flag, value in (
                    ("--bandwidth-efficiency", self.bandwidth_efficiency),
                    ("--flops-efficiency", self.flops_efficiency),
                    ("--step-overhead-ms", self.step_overhead_ms),
                    ("--seq-overhead-ms", self.seq_overhead_ms),
                )
                if value is not None
            ]
            if given:
                raise SpecError(f"--calibrate fits the cost parameters: drop {', '.join(given)}")


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


def read_probe(path: str) -> dict[str, Any]:
    """A saved `pdscope probe --json`, or a one-line error naming what is wrong with it."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SpecError(f"--calibrate: cannot read {path}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("traces"), list):
        raise SpecError(f"--calibrate: {path} is not a `pdscope probe --json` file (no traces)")
    return data


def calibrated_inputs(s: SimulateSettings) -> tuple[PlanInputs, Calibration, str, int | None]:
    """The model as plan resolves it, cost parameters fitted to the probe, and a device: the
    one named, or a custom one of the fitted rates (its KV pool then needs --kv-cache-memory,
    default serve's CPU pool); then the model's reference and the probed server's max length
    (None where the probe does not say)."""
    assert s.calibrate is not None
    probe = read_probe(s.calibrate)
    model = s.model or (probe.get("served_model") or {}).get("root")
    if not model:
        raise SpecError(
            f"--calibrate: {s.calibrate} names no local checkpoint: pass --model "
            "(the served model's preset or config.json)"
        )
    # The starting point of the fit only; any positive rates do.
    first = resolve(model=model, device=None, dtype=s.dtype, kv_dtype=s.kv_dtype,
                    bandwidth_gb_s=100.0, tflops=10.0)  # fmt: skip
    start = CostParams(100.0, 10.0)
    obs = observations(probe, s.calibrate_budget)
    calibration = fit(
        CostModel(first.model, first.weights, first.kv, start), obs, f"fitted to {s.calibrate}"
    )
    calibration.jitter = step_jitter(probe) if s.step_jitter else None
    fitted = calibration.params
    if s.device is None:
        p = replace(
            first,
            device=replace(
                first.device,
                name="calibrated",
                label=f"the server probed in {s.calibrate}",
                bandwidth_gb_s=fitted.bandwidth_gb_s,
                tflops_bf16=fitted.tflops,
                memory_gb=s.memory_gb,
                source=f"fitted to {s.calibrate}",
            ),
        )
        check_model_len(s, p)
    else:
        p = resolve_inputs(replace(s, model=model))  # the named device, as without --calibrate
    served = (probe.get("runtime") or {}).get("max_model_len")
    return p, calibration, model, served if isinstance(served, int) else None


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


def _tokenizer_for(s: SimulateSettings, model: str) -> Tokenizer:
    """The tokenizer that counts a file workload's text: --tokenizer, else the model's own
    checkpoint directory; a clear error when neither has a tokenizer.json."""
    from pdscope.engine.tokenizer import Tokenizer

    where = Path(s.tokenizer or model)
    if where.is_file():
        where = where.parent  # a config.json or tokenizer.json path: its directory
    try:
        return Tokenizer(where)
    except (FileNotFoundError, OSError, ValueError) as exc:
        hint = "" if s.tokenizer else ": pass --tokenizer DIR (a directory with tokenizer.json)"
        raise SpecError(f"{s.workload} has text prompts to count, but {exc}{hint}") from None


def _file_specs(s: SimulateSettings, model: str, seed: int) -> list[RequestSpec]:
    """Bench's file workload (JSONL or ShareGPT) with each prompt counted by a tokenizer, as
    the server would: a text prompt encoded as a completion, messages through the chat
    template. Equal texts give equal ids, so the prefix cache sees what a server would."""
    output = Lengths.parse(s.output_len, "--output-len").draw(random.Random(seed))
    specs = file_workload(Path(s.workload[5:]), s.num_prompts, output)
    tokenizer = _tokenizer_for(s, model)
    out = []
    for spec in specs:
        if isinstance(spec.prompt, list):
            try:
                text = tokenizer.apply_chat_template(spec.prompt)
            except ValueError as exc:
                raise SpecError(f"{s.workload} holds chat messages, but {exc}") from None
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = tokenizer.encode(str(spec.prompt))
        out.append(replace(spec, prompt=ids, input_tokens=len(ids)))
    return out


def _run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Drive a coroutine that never suspends (bench's workload builders over the synthetic
    prompts await nothing real) without an event loop: the capacity search runs inside one."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("a synthetic workload builder suspended")


async def _workload(s: SimulateSettings, vocab_size: int, seed: int) -> list[RequestSpec]:
    builder: Any = _SyntheticPrompts(seed, vocab_size)
    output = Lengths.parse(s.output_len, "--output-len")
    if s.workload == "random":
        inputs = Lengths.parse(s.input_len, "--input-len")
        return await random_workload(builder, s.num_prompts, inputs, output, seed)
    if s.workload == "shared-prefix":
        return await shared_prefix_workload(
            builder, s.num_prompts, s.groups, s.prefix_len, s.suffix_len, output, seed
        )
    duration_s = s.duration_s if s.duration_s is not None else LONG_PROMPT_DURATION_S
    return await long_prompt_workload(
        builder, s.streams, s.stream_output, s.long_len, s.long_rate, duration_s, seed
    )


def _server_report(sim: Simulator, result: SimResult, url: str) -> MetricsReport:
    """What a `/metrics` sampler would have seen, read off the simulated steps: the gauges at
    most ~500 points in time, the counters' totals, the maxima over every step."""
    return server_report(
        result.steps,
        result.requests,
        result.end_s,
        sim.pool.prefix_cache_hits,
        sim.pool.prefix_cache_queries,
        url,
    )


def server_report(
    steps: Sequence[StepRecord],
    requests: Sequence[Request],
    end_s: float,
    hits: int,
    queries: int,
    url: str,
) -> MetricsReport:
    """The server's view from step records (one server's, or a cluster's merged in time)."""
    stride = max(1, len(steps) // 500)
    start = steps[0].start_s if steps else 0.0
    return MetricsReport(
        available=True,
        runtime="pdscope simulate",
        url=url,
        duration_s=end_s - start,
        timeline=[
            TimelinePoint(x.end_s - start, x.num_running, x.num_waiting, x.kv_cache_usage)
            for x in steps[::stride]
        ],
        deltas={
            "preemptions": sum(x.num_preempted for x in steps),
            "prefix_hits": hits,
            "prefix_queries": queries,
            # As the server's counter: every started request's whole prompt, hits included.
            "prompt_tokens": sum(r.timeline.prompt_tokens for r in requests if r.timeline.token_s),
            "generation_tokens": sum(len(r.output_token_ids) for r in requests),
        },
        prefix_hit_rate=hits / queries if queries else None,
        max_waiting=max((x.num_waiting for x in steps), default=0),
        max_running=max((x.num_running for x in steps), default=0),
        max_kv_usage=max((x.kv_cache_usage for x in steps), default=0.0),
        warnings=["simulated: no latency histograms (the traces hold every latency)"],
    )


def simulate(s: SimulateSettings) -> dict[str, Any]:
    """One simulated run (or a capacity search of runs), as a dict shaped like `pdscope
    bench`'s result (plus `simulated`)."""
    s.validate()
    calibration = None
    if s.calibrate is not None:
        p, calibration, model_ref, served_len = calibrated_inputs(s)
        if s.device is None and s.kv_cache_memory_bytes is None and s.memory_gb is None:
            s = replace(s, kv_cache_memory_bytes=CPU_SERVE_KV_CACHE_BYTES)
        s = settle_model_len(s, p, served_len)
    else:
        p, model_ref = resolve_inputs(s), s.model or DEFAULT_MODEL
        s = settle_model_len(s, p)
    params = calibration.params if calibration else cost_params(s, p)
    cost = CostModel(p.model, p.weights, p.kv, params)
    blocks = kv_pool_blocks(s, p)
    try:
        first_specs = make_specs(s, p, model_ref, s.seed)  # run 1's: bad input fails first
        slo = SLO.parse(s.slo) if s.slo and not s.find_capacity else None
        capacity_slo = SLO.parse(s.slo, aggregate=True) if s.find_capacity and s.slo else None
    except (WorkloadError, ValueError) as exc:
        raise SpecError(str(exc)) from None
    metadata = base_metadata(s, p, params)
    metadata.update(kv_pool_blocks=blocks, kv_pool_tokens=blocks * s.block_size)
    metadata["calibration"] = calibration.to_dict() if calibration else None
    state = BenchState(metadata, [])

    def one_run(request_rate: float, concurrency: int | None) -> dict[str, Any]:
        """One simulated run at this load on a fresh server (its own pool and clock). Seeds
        follow bench's: run k (from 1) draws its workload from seed + k - 1 and its arrivals
        from seed + k, so a bench run and a simulation with one --seed share both."""
        k = len(state.runs) + 1
        specs = first_specs if k == 1 else make_specs(s, p, model_ref, s.seed + k - 1)
        requests = sim_requests(s, specs, request_rate, s.seed + k)
        config = s.scheduler_config()
        jitter = calibration.jitter if calibration else None
        # The probed server's step-time scatter, drawn per step from the run's own seed, so a
        # simulation repeats exactly.
        draw = random.Random(f"step-jitter-{s.seed + k}").random  # not the arrivals' stream
        sim = Simulator(
            config,
            blocks,
            s.block_size,
            (lambda out: jitter.apply(cost.step(out.scheduled).seconds, draw()))
            if jitter
            else (lambda out: cost.step(out.scheduled).seconds),
            s.enable_prefix_caching,
            admission_delay_s=params.request_overhead_s,
        )
        wall = time.perf_counter()
        result = sim.run(requests, concurrency)
        metadata["wall_s"] += time.perf_counter() - wall
        server = _server_report(sim, result, metadata["url"])
        run = run_record(
            s, p, requests, result.requests, result.end_s, server, slo, metadata,
            request_rate, concurrency,
        )  # fmt: skip
        state.runs.append(run)
        return run

    if capacity_slo is not None:

        async def run_at(request_rate: float, concurrency: int | None) -> dict[str, Any]:
            return one_run(request_rate, concurrency)

        rate = None if math.isinf(s.request_rate) else s.request_rate
        state.capacity = asyncio.run(
            search_capacity(run_at, capacity_slo, rate, s.max_runs, s.num_prompts)
        )
    else:
        one_run(s.request_rate, s.max_concurrency)
    return {**state.result(), "simulated": True}


# --- the pieces `simulate` is made of (the cluster simulation reuses them) -------------------


DEFAULT_MAX_MODEL_LEN = 8192  # a model's own length past this is not assumed served


def check_model_len(s: SimulateSettings, p: PlanInputs) -> None:
    limit = p.model.max_position_embeddings
    if s.max_model_len is not None and limit is not None and s.max_model_len > limit:
        raise SpecError(
            f"--max-model-len {s.max_model_len} exceeds {p.model.name}'s "
            f"max_position_embeddings {limit}: pass --max-model-len {limit} or less"
        )


def settle_model_len(
    s: SimulateSettings, p: PlanInputs, served: int | None = None
) -> SimulateSettings:
    """``s`` with its max_model_len: the one given (checked), else ``served`` (the probed
    server's) or DEFAULT_MAX_MODEL_LEN, either at most the model's max_position_embeddings."""
    check_model_len(s, p)
    if s.max_model_len is not None:
        return s
    limit = p.model.max_position_embeddings
    length = served or DEFAULT_MAX_MODEL_LEN
    return replace(s, max_model_len=min(length, limit) if limit else length)


def resolve_inputs(s: SimulateSettings) -> PlanInputs:
    """Model, precision and device as plan resolves them (the defaults when none is named);
    max_model_len checked against the model. Not for --calibrate (see calibrated_inputs)."""
    device = s.device
    if device is None and s.bandwidth_gb_s is None:
        device = DEFAULT_DEVICE  # with --bandwidth alone: a custom device, as plan
    p = resolve(
        model=s.model or DEFAULT_MODEL,
        device=device,
        dtype=s.dtype,
        kv_dtype=s.kv_dtype,
        gpu_memory_utilization=s.gpu_memory_utilization,
        bandwidth_gb_s=s.bandwidth_gb_s,
        tflops=s.tflops,
        memory_gb=s.memory_gb,
    )
    check_model_len(s, p)
    return p


def make_specs(s: SimulateSettings, p: PlanInputs, model_ref: str, seed: int) -> list[RequestSpec]:
    """Bench's workload drawn with ``seed`` (file workloads counted by a tokenizer)."""
    if s.workload.startswith("file:"):
        return _file_specs(s, model_ref, seed)
    return _run_sync(_workload(s, p.model.vocab_size, seed))


def sim_requests(
    s: SimulateSettings, specs: Sequence[RequestSpec], request_rate: float, arrival_seed: int
) -> list[SimRequest]:
    """The workload on bench's arrival schedule, as simulated requests."""
    plan = LoadPlan(request_rate=request_rate, burstiness=s.burstiness, seed=arrival_seed)
    times = plan.schedule(len(specs))
    requests = [
        SimRequest(
            spec.prompt,  # type: ignore[arg-type]  # token ids (synthetic or counted)
            spec.output_tokens,
            arrival_s=spec.at_s if spec.at_s is not None else at,
            label=spec.kind,
        )
        for spec, at in zip(specs, times, strict=True)
    ]
    if s.duration_s is not None and s.workload != "long-prompt":
        # As bench's --duration: nothing is sent after it (running requests finish).
        requests = [r for r in requests if r.arrival_s <= s.duration_s]
    return requests


def build_requests(s: SimulateSettings, p: PlanInputs) -> tuple[list[SimRequest], SLO | None]:
    """Run 1's requests (the seeds `simulate` gives its first run) and the parsed SLO."""
    try:
        specs = make_specs(s, p, s.model or DEFAULT_MODEL, s.seed)
        slo = SLO.parse(s.slo) if s.slo else None
    except (WorkloadError, ValueError) as exc:
        raise SpecError(str(exc)) from None
    return sim_requests(s, specs, s.request_rate, s.seed + 1), slo


def base_metadata(s: SimulateSettings, p: PlanInputs, params: CostParams) -> dict[str, Any]:
    """Bench's metadata for a simulated run; ``wall_s`` grows as runs are simulated."""
    rate = None if math.isinf(s.request_rate) else s.request_rate
    return {
        "url": f"simulated://{p.device.name}",
        "runtime": "pdscope simulate",
        "runtime_version": __version__,
        "pdscope_version": __version__,
        "model": p.model.name,
        "api": "simulated",
        "workload": s.workload,
        "exact_prompt_tokens": True,
        "prompt_mode": (
            "exact (counted by the tokenizer)"
            if s.workload.startswith("file:")
            else "exact (synthetic token ids, no tokenizer)"
        ),
        "device": p.device.name,
        "dtype": p.weights.name,
        "kv_dtype": p.kv.name,
        "cost_params": asdict(params),
        "settings": {**asdict(s), "request_rate": rate},
        "seed": s.seed,
        "seed_given": True,
        "wall_s": 0.0,
    }


def run_record(
    s: SimulateSettings,
    p: PlanInputs,
    requests: Sequence[SimRequest],
    done: Sequence[Request],
    end_s: float,
    server: MetricsReport,
    slo: SLO | None,
    metadata: dict[str, Any],
    request_rate: float,
    concurrency: int | None,
) -> dict[str, Any]:
    """Every simulated request as a Trace, summarised by bench's analysis into one of bench's
    runs."""
    url = metadata["url"]
    traces = []
    for spec, request in zip(requests, done, strict=True):
        trace = trace_from_timeline(
            request.timeline, api="simulated", url=url, model=p.model.name, label=spec.label
        )
        trace.scheduled_s = spec.arrival_s
        if request.finish_reason and request.finish_reason.startswith("error"):
            trace.error = request.finish_reason
        traces.append(trace)
    duration_s = end_s  # from the run's start at 0, as bench measures it
    summary = summarize(traces, duration_s, slo=slo)
    return {
        "request_rate": None if math.isinf(request_rate) else request_rate,
        "max_concurrency": concurrency,
        "input_tokens_requested": _requested(s),
        "summary": summary,
        "by_kind": by_kind(traces, duration_s, (50, 90, 95, 99)),
        "server": server.to_dict(),
        "warnings": [],
        "partial": None,
        "vllm": vllm_fields(traces, metadata, s.burstiness, request_rate, concurrency, summary),
        "requests": [request_record(t) for t in traces],
    }


def bench_result(
    s: SimulateSettings,
    p: PlanInputs,
    params: CostParams,
    requests: Sequence[SimRequest],
    done: Sequence[Request],
    end_s: float,
    server: MetricsReport,
    wall_s: float,
    metadata: dict[str, Any],
    slo: SLO | None,
) -> dict[str, Any]:
    """One run as bench's whole result (plus ``simulated: true``); ``metadata`` adds to
    bench's metadata."""
    meta = {**base_metadata(s, p, params), **metadata, "wall_s": wall_s}
    run = run_record(
        s, p, requests, done, end_s, server, slo, meta, s.request_rate, s.max_concurrency
    )
    return {**BenchState(meta, [run]).result(), "simulated": True}


def _requested(s: SimulateSettings) -> str:
    if s.workload == "shared-prefix":
        return f"{s.prefix_len}+{s.suffix_len}"
    if s.workload == "long-prompt":
        return f"32 (streams), {s.long_len} (long prompts)"
    return s.input_len
