"""`pdscope bench`: load a server, measure the latency distribution, find where p99 breaks.

One run = one workload at one load level (request rate and/or concurrency). A series runs
several levels; ``--sweep auto`` doubles concurrency until throughput stops growing; a capacity
search finds the highest concurrency (or rate) whose run meets aggregate SLOs. Every request is a
Trace; the server's /metrics is sampled during each run for its own view.
"""

from __future__ import annotations

import math
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from pdscope import __version__
from pdscope.analysis.bench import SLO, by_kind, summarize
from pdscope.client.adapters import session as adapter_session
from pdscope.client.detect import ProbeError, Runtime, detect
from pdscope.client.load import LoadPlan, Progress, run_load, send
from pdscope.client.prompts import PromptBuilder
from pdscope.client.workloads import (
    Lengths,
    RequestSpec,
    WorkloadError,
    file_workload,
    long_prompt_workload,
    random_workload,
    shared_prefix_workload,
)

WORKLOADS = ("random", "shared-prefix", "long-prompt", "file:PATH")


@dataclass
class BenchSettings:
    url: str
    api: str = "auto"
    model: str | None = None
    api_key: str | None = None
    workload: str = "random"
    num_prompts: int = 100
    input_len: str = "128"
    output_len: str = "128"
    groups: int = 4  # shared-prefix
    prefix_len: int = 1024
    suffix_len: int = 64
    streams: int = 8  # long-prompt: decode streams
    stream_output: int = 256
    long_len: int = 2000
    long_rate: float = 0.5
    request_rates: list[float] = field(default_factory=lambda: [math.inf])
    concurrencies: list[int | None] = field(default_factory=lambda: [None])
    burstiness: float = 1.0
    duration_s: float | None = None
    warmup: int = 1
    ramp_up_s: float = 0.0
    seed: int = 0
    percentiles: tuple[float, ...] = (50, 90, 95, 99)
    goodput_slo: str | None = None  # ttft=2s,tpot=100ms
    capacity_slo: str | None = None  # p99_ttft=2s,p99_itl=100ms
    sweep_auto: bool = False
    metrics_interval_s: float = 0.5
    timeout_s: float = 300.0
    max_runs: int = 10  # bound on auto sweeps and capacity searches


@dataclass
class BenchState:
    """Everything measured so far, so an interrupted bench still writes what it has."""

    metadata: dict[str, Any] = field(default_factory=dict)
    runs: list[dict[str, Any]] = field(default_factory=list)
    capacity: dict[str, Any] | None = None
    partial: str | None = None

    def result(self) -> dict[str, Any]:
        single = self.runs[0]["summary"] if len(self.runs) == 1 else {}
        return {
            **single,
            "metadata": self.metadata,
            "runs": self.runs,
            "capacity": self.capacity,
            "partial": self.partial,
        }


class Bench:
    def __init__(
        self,
        s: BenchSettings,
        client: httpx.AsyncClient,
        runtime: Runtime,
        model: str,
        state: BenchState,
        on_progress: Callable[[str, Progress], None] | None,
        streams: aiohttp.ClientSession | None = None,
    ):
        self.s, self.client, self.runtime, self.model = s, client, runtime, model
        self.streams = streams  # generation requests; `client` for tokenize and /metrics
        self.state, self.on_progress = state, on_progress
        self.headers = {"Authorization": f"Bearer {s.api_key}"} if s.api_key else None
        self.api = runtime.api if s.api == "auto" else s.api
        exact = self.api == "openai-completions" and runtime.has_tokenize
        self.builder = PromptBuilder(client, runtime.url, model, exact, self.headers, s.seed)
        self.goodput = SLO.parse(s.goodput_slo)
        self.runs_made = 0

    async def workload(self) -> list[RequestSpec]:
        """Fresh prompts for every run, so no run gets a prefix-cache hit from an earlier one
        (shared-prefix shares within its run, by design)."""
        s, seed = self.s, self.s.seed + self.runs_made
        out = Lengths.parse(s.output_len, "--output-len")
        if s.workload == "random":
            return await random_workload(
                self.builder, s.num_prompts, Lengths.parse(s.input_len, "--input-len"), out, seed
            )
        if s.workload == "shared-prefix":
            return await shared_prefix_workload(
                self.builder, s.num_prompts, s.groups, s.prefix_len, s.suffix_len, out, seed
            )
        if s.workload == "long-prompt":
            return await long_prompt_workload(
                self.builder,
                s.streams,
                s.stream_output,
                s.long_len,
                s.long_rate,
                s.duration_s or 30.0,
                seed,
            )
        if s.workload.startswith("file:"):
            specs = file_workload(
                Path(s.workload[5:]), s.num_prompts, out.draw(random.Random(seed))
            )
            chat = any(isinstance(spec.prompt, list) for spec in specs)
            if chat and self.api == "openai-completions":
                if s.api != "auto":
                    raise WorkloadError(f"{s.workload} holds chat messages: use --api openai-chat")
                self.api = "openai-chat"  # messages need the chat endpoint
                self.state.metadata["api"] = self.api
            return specs
        raise WorkloadError(f"unknown workload {s.workload!r}; choose from {', '.join(WORKLOADS)}")

    async def warm_up(self) -> None:
        if self.s.warmup < 1:
            return
        for spec in await random_workload(
            self.builder, self.s.warmup, Lengths("fixed", 32), Lengths("fixed", 8), self.s.seed - 1
        ):
            await send(
                self.streams, self.runtime.url, self.api, self.model, spec, self.headers, "warmup"
            )

    async def run(self, rate: float, concurrency: int | None) -> dict[str, Any]:
        from pdscope.client.server_metrics import MetricsSampler

        s = self.s
        specs = await self.workload()
        self.runs_made += 1
        plan = LoadPlan(
            request_rate=rate,
            burstiness=s.burstiness,
            max_concurrency=concurrency,
            duration_s=None if s.workload == "long-prompt" else s.duration_s,
            ramp_up_s=s.ramp_up_s,
            seed=s.seed + self.runs_made,
        )
        level = f"rate {rate:g}/s" + (f", concurrency {concurrency}" if concurrency else "")
        sampler = MetricsSampler(self.client, self.runtime.url, s.metrics_interval_s, self.headers)
        await sampler.start()
        try:
            load = await run_load(
                self.streams,
                self.runtime.url,
                self.api,
                self.model,
                specs,
                plan,
                self.headers,
                (lambda p: self.on_progress(level, p)) if self.on_progress else None,
            )
        finally:
            server = await sampler.stop()
        summary = summarize(load.traces, load.duration_s, s.percentiles, self.goodput)
        run = {
            "request_rate": None if math.isinf(rate) else rate,
            "max_concurrency": concurrency,
            "summary": summary,
            "by_kind": by_kind(load.traces, load.duration_s, s.percentiles),
            "server": server.to_dict(),
            "partial": load.partial,
            "requests": [_request_record(t) for t in load.traces],
        }
        self.state.runs.append(run)
        if load.partial:
            self.state.partial = load.partial
            raise KeyboardInterrupt
        return run

    async def series(self) -> None:
        s = self.s
        if s.capacity_slo:
            pass  # the search chooses its own load levels
        elif s.sweep_auto:
            await self.auto_sweep()
        else:
            for rate in s.request_rates:
                for concurrency in s.concurrencies:
                    await self.run(rate, concurrency)
        if s.capacity_slo:
            await self.find_capacity(SLO.parse(s.capacity_slo, aggregate=True))

    async def auto_sweep(self) -> None:
        """Double concurrency until output throughput grows by less than 10% (saturation)."""
        best = 0.0
        concurrency = 1
        for _ in range(self.s.max_runs):
            run = await self.run(math.inf, concurrency)
            throughput = run["summary"]["output_throughput"] or 0.0
            if throughput < best * 1.10:
                self.state.metadata["saturation_concurrency"] = concurrency // 2
                return
            best = max(best, throughput)
            concurrency *= 2
        self.state.metadata["saturation_concurrency"] = concurrency // 2

    async def find_capacity(self, slo: SLO) -> None:
        """Highest load whose run meets every aggregate SLO: concurrency (closed loop) by
        default, request rate (open loop) when --request-rate names a finite starting rate.
        Double until a run fails, then bisect between the last pass and the first failure
        (to the next integer for concurrency, within 10% for rate); at most max_runs runs."""
        finite = [r for r in self.s.request_rates if not math.isinf(r)]
        by_rate = bool(finite)
        level: float = min(finite) if by_rate else 1
        passed: tuple[float, dict] | None = None
        failed_at: float | None = None
        runs = 0
        while runs < self.s.max_runs:
            if not by_rate and level > self.s.num_prompts:
                break  # more streams than requests adds no load: --num-prompts caps the search
            run = await (self.run(level, None) if by_rate else self.run(math.inf, int(level)))
            runs += 1
            ok = slo.met_by_run(run["summary"]) and run["summary"]["failed"] == 0
            run["meets_slo"] = ok
            if ok:
                passed = (level, run)
                if failed_at is None:
                    level *= 2
                    continue
            else:
                failed_at = level
            if passed is None:
                if not by_rate:
                    break  # one request at a time already misses the SLO
                level /= 2  # look lower for a rate that passes
                continue
            assert failed_at is not None
            if (failed_at / passed[0] <= 1.1) if by_rate else (failed_at - passed[0] <= 1):
                break
            level = (passed[0] * failed_at) ** 0.5 if by_rate else (passed[0] + failed_at) // 2
        unit = "rate" if by_rate else "concurrency"
        self.state.capacity = {
            "by": unit,
            "slo": {k: v for k, v in slo.limits.items()},
            f"max_{unit}_meeting_slo": passed[0] if passed else None,
            f"first_failing_{unit}": failed_at,
            "run": passed[1]["summary"] if passed else None,
            "searched_runs": runs,
        }


def _request_record(t: Any) -> dict[str, Any]:
    return {
        "kind": t.label,
        "ok": t.ok,
        "error": t.error,
        "prompt_tokens": t.prompt_tokens,
        "output_tokens": t.n_output,
        "cached_tokens": t.cached_tokens,
        "ttft_ms": None if t.ttft_s is None else t.ttft_s * 1e3,
        "tpot_ms": None if t.tpot_s is None else t.tpot_s * 1e3,
        "e2el_ms": None if t.e2e_s is None else t.e2e_s * 1e3,
        "lag_ms": None if t.lag_s is None else t.lag_s * 1e3,
        "itl_ms": [round(x * 1e3, 3) for x in t.itl_samples_s()],
    }


async def bench(
    s: BenchSettings, state: BenchState, on_progress: Callable[[str, Progress], None] | None = None
) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(s.timeout_s, connect=10)
    async with (
        httpx.AsyncClient(limits=limits, timeout=timeout) as client,
        adapter_session(s.timeout_s) as streams,
    ):
        headers = {"Authorization": f"Bearer {s.api_key}"} if s.api_key else None
        runtime = await detect(client, s.url, s.api, headers)
        model = runtime.pick_model(s.model)
        state.metadata = {
            "url": runtime.url,
            "runtime": runtime.name,
            "runtime_version": runtime.version,
            "runtime_evidence": runtime.evidence,
            "model": model,
            "api": runtime.api if s.api == "auto" else s.api,
            "workload": s.workload,
            "settings": _settings(s),
            "pdscope_version": __version__,
            "started_unix_s": time.time(),
            "machine": {
                "platform": platform.platform(),
                "python": sys.version.split()[0],
                "cpus": os.cpu_count(),
            },
        }
        b = Bench(s, client, runtime, model, state, on_progress, streams)
        state.metadata["exact_prompt_tokens"] = b.builder.use_tokenize
        await b.warm_up()
        await b.series()
    return state.result()


def _settings(s: BenchSettings) -> dict[str, Any]:
    data = asdict(s)
    data.pop("api_key", None)
    data["request_rates"] = [None if math.isinf(r) else r for r in s.request_rates]
    return data


__all__ = ["WORKLOADS", "BenchSettings", "BenchState", "ProbeError", "WorkloadError", "bench"]
