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
import secrets
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from pdscope import __version__
from pdscope.analysis.bench import SLO, by_kind, summarize
from pdscope.analysis.server_metrics import report_of
from pdscope.client.adapters import API_OLLAMA, APIS
from pdscope.client.adapters import session as adapter_session
from pdscope.client.detect import ProbeError, Runtime, detect
from pdscope.client.load import LoadPlan, Progress, run_load, send
from pdscope.client.prompts import PromptBuilder
from pdscope.client.trace import Trace
from pdscope.client.workloads import (
    Lengths,
    RequestSpec,
    WorkloadError,
    file_workload,
    long_prompt_workload,
    random_workload,
    shared_prefix_workload,
)
from pdscope.commands.flags import at_least, float_list, int_list

WORKLOADS = ("random", "shared-prefix", "long-prompt", "file:PATH")
# vllm bench serve's limit on one request (aiohttp's total): a request a slow server keeps
# queued is served late, and counted with its wait, not failed. A 7B-shaped model served on 2
# CPU cores prefills ~31 tokens a second: the default 100 prompts of 128 tokens sent at once
# are 12,800 prompt tokens, ~410 s of prefill, past the 300 s this limit was.
TIMEOUT_S = 6 * 60 * 60.0


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
    # None: fresh prompts for every bench (a random seed, recorded), so a before/after pair
    # never meets the first run's prompts in the prefix cache; a seed repeats a run exactly.
    seed: int | None = None
    percentiles: tuple[float, ...] = (50, 90, 95, 99)
    goodput_slo: str | None = None  # ttft=2s,tpot=100ms
    capacity_slo: str | None = None  # p99_ttft=2s,p99_itl=100ms
    sweep_auto: bool = False
    metrics_interval_s: float = 0.5
    timeout_s: float = TIMEOUT_S
    max_runs: int = 10  # bound on auto sweeps and capacity searches

    @classmethod
    def from_flags(
        cls,
        url: str | None,
        request_rate: str,
        max_concurrency: str | None,
        percentiles: str,
        slo: str | None,
        find_capacity: bool,
        sweep: str | None,
        typed: frozenset[str] | None = None,
        **fields: Any,
    ) -> BenchSettings:
        """The CLI's flags, checked before any request is sent (a ``ValueError`` names the
        flag). No URL: the embedded server, under a short default load unless one is given
        (``typed``: the flags the user typed, as the CLI knows them; else those off their
        defaults count as given)."""
        s = cls(url=url or "", sweep_auto=sweep == "auto", **fields)
        if s.api != "auto" and s.api not in APIS:
            raise ValueError(f"--api must be auto or one of {', '.join(APIS)}, got {s.api!r}")
        if s.workload not in WORKLOADS[:3] and not s.workload.startswith("file:"):
            raise ValueError(
                f"--workload must be one of {', '.join(WORKLOADS)}, got {s.workload!r}"
            )
        if sweep not in (None, "auto"):
            raise ValueError(f"--sweep takes 'auto', got {sweep!r}")
        at_least(
            1,
            ("--num-prompts", s.num_prompts),
            ("--groups", s.groups),
            ("--streams", s.streams),
            ("--prefix-len", s.prefix_len),
            ("--long-len", s.long_len),
            ("--stream-output", s.stream_output),
        )
        at_least(0, ("--warmup", s.warmup), ("--ramp-up", s.ramp_up_s))
        if not s.burstiness > 0:
            raise ValueError(f"--burstiness must be > 0, got {s.burstiness}")
        # read here, so that a bad length is a bad flag (exit 2), not a failed run
        Lengths.parse(s.input_len, "--input-len")
        Lengths.parse(s.output_len, "--output-len")
        # Zero would mean no limit or no load, never what was asked for.
        for flag, value in (("--timeout", s.timeout_s), ("--duration", s.duration_s)):
            if value is not None and not value > 0:
                raise ValueError(f"{flag} must be > 0, got {value}")
        s.request_rates = float_list(request_rate, "--request-rate")
        if max_concurrency:
            s.concurrencies = [*int_list(max_concurrency, "--max-concurrency")]
        if len(s.request_rates) > 1 and len(s.concurrencies) > 1:
            raise ValueError("give a series of --request-rate or of --max-concurrency, not both")
        try:
            s.percentiles = tuple(float(p) for p in percentiles.split(","))
            if any(not 0 < p < 100 for p in s.percentiles):
                raise ValueError
        except ValueError:
            raise ValueError(
                f"--percentiles takes numbers in (0, 100), got {percentiles!r}"
            ) from None
        if find_capacity:
            if not slo:
                raise ValueError("--find-capacity needs --slo, e.g. p99_ttft=2s,p99_itl=100ms")
            aggregate = SLO.parse(slo, aggregate=True).percentiles
            s.percentiles = tuple(sorted({*s.percentiles, *aggregate}))
            s.capacity_slo = slo
        else:
            SLO.parse(slo)
            s.goodput_slo = slo
        if typed is None:
            typed = frozenset(
                name
                for name, off_default in (
                    ("max_concurrency", bool(max_concurrency)),
                    ("request_rate", s.request_rates != [math.inf]),
                    ("num_prompts", s.num_prompts != 100),
                    ("output_len", s.output_len != "128"),
                )
                if off_default
            )
        # long-prompt sets its own load (its streams decode while long prompts arrive): capped
        # at 8 at once, its long prompts queued behind its 8 streams and measured nothing.
        if url is None and s.workload != "long-prompt" and not typed & LOAD_FLAGS:
            s.num_prompts, s.concurrencies = 32, [8]  # a short default load
            if "output_len" not in typed:
                s.output_len = "64"
        return s


# The flags that choose the load; the embedded server's short default yields to any of them.
LOAD_FLAGS = frozenset(
    ("num_prompts", "request_rate", "max_concurrency", "duration", "sweep", "find_capacity")
)


@dataclass
class BenchState:
    """Everything measured so far, so an interrupted bench still writes what it has."""

    metadata: dict[str, Any] = field(default_factory=dict)
    runs: list[dict[str, Any]] = field(default_factory=list)
    capacity: dict[str, Any] | None = None
    partial: str | None = None

    def result(self) -> dict[str, Any]:
        # One run: its figures and vllm bench serve's keys at the top level, as vLLM writes
        # them. A series keeps them per run (each run record has the same keys).
        single = {**self.runs[0]["summary"], **self.runs[0]["vllm"]} if len(self.runs) == 1 else {}
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
        self.seed = s.seed if s.seed is not None else secrets.randbelow(2**31)
        self.builder = PromptBuilder(
            client, runtime.url, model, exact, self.headers, self.seed, runtime.tokenize_key
        )
        self.goodput = SLO.parse(s.goodput_slo)
        self.runs_made = 0

    async def workload(self) -> list[RequestSpec]:
        """Fresh prompts for every run, so no run gets a prefix-cache hit from an earlier one
        (shared-prefix shares within its run, by design)."""
        s, seed = self.s, self.seed + self.runs_made
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
            self.builder, self.s.warmup, Lengths("fixed", 32), Lengths("fixed", 8), self.seed - 1
        ):
            await send(
                self.streams, self.runtime.url, self.api, self.model, spec, self.headers, "warmup"
            )

    def target_input_tokens(self) -> int:
        """The prompt length that matters most in this workload (for calibration)."""
        s = self.s
        if s.workload == "shared-prefix":
            return s.prefix_len + s.suffix_len
        if s.workload == "long-prompt":
            return s.long_len
        lengths = Lengths.parse(s.input_len, "--input-len")
        return int(lengths.a if lengths.kind != "uniform" else (lengths.a + lengths.b) / 2)

    async def calibrate(self) -> None:
        """Without a tokenizer route, size text prompts by the server's own prompt counts:
        four prompts of the target length (one output token each), tokens per word pooled
        over them. Records what was learned; says when nothing could be."""
        if self.builder.use_tokenize or self.s.workload.startswith("file:"):
            return
        target = self.target_input_tokens()
        record: dict[str, Any] = {"target_tokens": target, "requests": 0, "reported": []}
        for _ in range(4):
            text = self.builder.text(target)
            spec = RequestSpec(text, 1, target)
            url, api = self.runtime.url, self.api
            trace = await send(self.streams, url, api, self.model, spec, self.headers, "calibrate")
            record["requests"] += 1
            if not trace.ok or not trace.prompt_tokens:
                record["error"] = trace.error or "the server reported no prompt token count"
                break
            record["reported"].append(trace.prompt_tokens)
            self.builder.calibrate(len(text.split()), trace.prompt_tokens)
        record["tokens_per_word"] = self.builder.tokens_per_word
        if self.builder.implausible and not self.builder.calibrations:
            record["error"] = (
                f"the server's prompt counts ({', '.join(map(str, record['reported']))} for "
                f"about {target} tokens of text) are no tokenizer's: not learned from"
            )
        self.state.metadata["prompt_calibration"] = record

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
            seed=self.seed + self.runs_made,
        )
        level = f"rate {rate:g}/s" + (f", concurrency {concurrency}" if concurrency else "")
        sampler = MetricsSampler(self.client, self.runtime.url, s.metrics_interval_s, self.headers)
        await sampler.start()
        try:
            # A pool bounded to the run's concurrency (vllm bench serve's connector does the
            # same): no idle surplus connections for the server's keep-alive timer to close.
            # llama-server answers "Keep-Alive: timeout=5" but closes the connection after each
            # streamed response (the build `make llamacpp` makes), so a reused one fails its
            # next write: there a new connection per request, as every client gets anyway.
            fresh = self.runtime.name == "llama.cpp"
            async with adapter_session(
                s.timeout_s, fresh_connections=fresh, limit=concurrency or 0
            ) as streams:
                load = await run_load(
                    streams,
                    self.runtime.url,
                    self.api,
                    self.model,
                    specs,
                    plan,
                    self.headers,
                    (lambda p: self.on_progress(level, p)) if self.on_progress else None,
                )
        finally:
            server = report_of(await sampler.stop())
        summary = summarize(load.traces, load.duration_s, s.percentiles, self.goodput)
        run = {
            "request_rate": None if math.isinf(rate) else rate,
            "max_concurrency": concurrency,
            "input_tokens_requested": _requested(s),
            "summary": summary,
            "by_kind": by_kind(load.traces, load.duration_s, s.percentiles),
            "server": server.to_dict(),
            "warnings": _reuse_warnings(s.workload, summary, server.to_dict()),
            "partial": load.partial,
            "vllm": vllm_fields(
                load.traces, self.state.metadata, s.burstiness, rate, concurrency, summary
            ),
            "requests": [request_record(t) for t in load.traces],
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
        """Highest load meeting every aggregate SLO (see :func:`search_capacity`)."""
        finite = [r for r in self.s.request_rates if not math.isinf(r)]
        self.state.capacity = await search_capacity(
            self.run, slo, min(finite) if finite else None, self.s.max_runs, self.s.num_prompts
        )


async def search_capacity(
    run_at: Callable[[float, int | None], Awaitable[dict[str, Any]]],
    slo: SLO,
    start_rate: float | None,
    max_runs: int,
    num_prompts: int,
) -> dict[str, Any]:
    """Highest load whose run meets every aggregate SLO: concurrency (closed loop) by default,
    request rate (open loop) from ``start_rate`` when one is given. ``run_at(rate,
    concurrency)`` makes one run and returns its record (bench measures a server, simulate
    simulates one: one search for both).

    Double until a run fails, then bisect between the last pass and the first failure
    (to the next integer for concurrency, within 10% for rate); at most max_runs runs. A
    rate search judges the rate the server served, not the one offered: a run whose served
    rate fell below 90% of the offered one (the rate its requests were sent at, at most the
    nominal one) did not keep up (its SLO figures describe a
    queue still filling when the prompts ran out), and once served throughput stops
    growing the search stops climbing. The capacity reported is the served rate of the
    best passing run, never more. Why the search stopped is always recorded."""
    by_rate = start_rate is not None
    level: float = start_rate if start_rate is not None else 1
    passed: tuple[float, dict] | None = None
    failed_at: float | None = None
    best_served = 0.0
    runs = 0
    stop: str | None = None
    notes: list[str] = []
    while runs < max_runs:
        if not by_rate and level > num_prompts:
            stop = f"ran out of prompts: concurrency {level:g} exceeds --num-prompts {num_prompts}"
            break
        run = await (run_at(level, None) if by_rate else run_at(math.inf, int(level)))
        runs += 1
        summary = run["summary"]
        served = summary.get("request_throughput") or 0.0
        ok = slo.met_by_run(summary) and summary["failed"] == 0
        run["meets_slo"] = ok
        run["served_rate"] = served
        if by_rate:
            # Offered: the arrivals actually sent, not the nominal rate. A few dozen Poisson
            # arrivals can spread well past n / rate: 16 at a nominal 1/s were served at
            # 0.59/s and judged "fell behind" on a server that held ~19/s.
            offered = min(level, _sent_rate(run) or level)
            kept_up = served >= 0.9 * offered
            run["kept_up"] = kept_up
            if ok and not kept_up:
                notes.append(
                    f"offered {offered:.3g}/s, served {served:.3g}/s: the server fell behind, "
                    "so this run counts as failing whatever its percentiles say"
                )
                ok = False
            elif ok and passed and served < best_served * 1.1 and level > passed[0]:
                notes.append(
                    f"offered {level:.3g}/s, served {served:.3g}/s: served throughput "
                    "stopped growing"
                )
                ok = False
        if ok:
            passed = (level, run)
            best_served = max(best_served, served)
            if failed_at is None:
                level *= 2
                continue
        else:
            failed_at = level if failed_at is None else min(failed_at, level)
        if passed is None:
            if not by_rate:
                stop = "one request at a time already misses the SLO"
                break
            level /= 2  # look lower for a rate that passes
            continue
        assert failed_at is not None
        if (failed_at / passed[0] <= 1.1) if by_rate else (failed_at - passed[0] <= 1):
            stop = "bracketed: the last passing and first failing loads are adjacent"
            break
        level = (passed[0] * failed_at) ** 0.5 if by_rate else (passed[0] + failed_at) // 2
    if stop is None:
        stop = f"ran out of runs (--max-runs {max_runs}) before bracketing the capacity" + (
            "" if failed_at else ": no failing load was found, so it may be higher"
        )
    unit = "rate" if by_rate else "concurrency"
    best = passed[0] if passed else None
    if by_rate and passed:
        best = min(passed[0], passed[1]["served_rate"])  # never above what was served
    return {
        "by": unit,
        "slo": {k: v for k, v in slo.limits.items()},
        f"max_{unit}_meeting_slo": best,
        f"first_failing_{unit}": failed_at,
        "offered_rate": passed[0] if passed and by_rate else None,
        "served_rate": passed[1]["served_rate"] if passed else None,
        "run": passed[1]["summary"] if passed else None,
        "searched_runs": runs,
        "stopped": stop,
        "notes": notes,
    }


def _requested(s: BenchSettings) -> str:
    if s.workload == "shared-prefix":
        return f"{s.prefix_len}+{s.suffix_len}"
    if s.workload == "long-prompt":
        return f"32 (streams), {s.long_len} (long prompts)"
    if s.workload.startswith("file:"):
        return "from the file"
    return s.input_len


def _reuse_warnings(workload: str, summary: dict[str, Any], server: dict[str, Any]) -> list[str]:
    """A workload of fresh prompts that the cache served anyway was run before (same seed)."""
    if workload not in ("random", "long-prompt"):
        return []  # shared-prefix and files share prompts by design
    rate = server.get("prefix_hit_rate")
    if rate is None and summary.get("total_cached_tokens") is not None:
        rate = summary["total_cached_tokens"] / max(summary["total_input_tokens"], 1)
    if rate is not None and rate > 0.3:
        return [
            f"{rate:.0%} of prompt tokens came from the prefix cache: these prompts were seen "
            "before (an earlier run with the same --seed?), so TTFT is not prefill's"
        ]
    return []


_BACKENDS = {"openai-completions": "openai", "openai-chat": "openai-chat", "ollama": "ollama"}


def vllm_fields(
    traces: list[Trace],
    metadata: dict[str, Any],
    burstiness: float,
    rate: float,
    concurrency: int | None,
    summary: dict[str, Any],
) -> dict[str, Any]:
    """vllm bench serve's result keys with vLLM's meanings, so tools that read its JSON read
    ours. Per-request arrays follow its conventions: seconds, every request in send order,
    failed ones with 0 and their error (vLLM's own convention; our `requests` records keep
    None instead), `itls` one sample per chunk gap as vLLM records it (our per-token samples are
    in `requests[].itl_ms`)."""
    order = sorted(traces, key=lambda t: t.start_s)
    t0 = min((t.start_s for t in order), default=0.0)
    api = metadata.get("api", "openai-completions")
    return {
        "backend": _BACKENDS.get(api, api),
        "endpoint_type": _BACKENDS.get(api, api),
        "label": None,
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "model_id": metadata.get("model"),
        "tokenizer_id": metadata.get("model"),  # prompts are tokenized by the server itself
        "num_prompts": len(traces),
        "request_rate": "inf" if math.isinf(rate) else rate,
        "burstiness": burstiness,
        "max_concurrency": concurrency,
        "max_concurrent_requests": _max_in_flight(order),
        "max_output_tokens_per_s": _max_output_tokens_per_s(order),
        "request_goodput": summary.get("request_goodput"),
        "input_lens": [t.prompt_tokens or t.prompt_tokens_asked or 0 for t in order],
        "output_lens": [(t.n_output or 0) if t.ok else 0 for t in order],
        "ttfts": [t.ttft_s or 0.0 for t in order],
        "itls": [
            [b.t_s - a.t_s for a, b in zip(t.chunks, t.chunks[1:], strict=False)] if t.ok else []
            for t in order
        ],
        "latencies": [t.e2e_s or 0.0 for t in order],
        "start_times": [t.start_s - t0 for t in order],
        "errors": [t.error or "" for t in order],
    }


def _max_in_flight(traces: list[Trace]) -> int:
    events = sorted(
        [(t.start_s, 1) for t in traces] + [(t.end_s or t.start_s, -1) for t in traces],
        key=lambda e: (e[0], e[1]),
    )
    now = peak = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


def _max_output_tokens_per_s(traces: list[Trace]) -> float:
    """Most output tokens delivered in any whole second of the run (chunks carry the tokens;
    a request's count is spread over its chunks)."""
    t0 = min((t.start_s for t in traces), default=0.0)
    per_second: dict[int, float] = {}
    for t in traces:
        if not t.ok or not t.chunks:
            continue
        each = (t.n_output or len(t.chunks)) / len(t.chunks)
        for c in t.chunks:
            second = int(c.t_s - t0)
            per_second[second] = per_second.get(second, 0.0) + each
    # rounded: a count spread over chunks sums to 127.99999999999989 for 128
    return round(max(per_second.values(), default=0.0), 6)


def request_record(t: Trace) -> dict[str, Any]:
    """One request of a run, as the saved result and the HTML report keep it."""
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
        # through Ollama's API (pdscope serve speaks it too) a long output stops at the
        # context, as Ollama's does, rather than being refused
        refuses = runtime.name if runtime.api != API_OLLAMA else ""
        _refuse_what_cannot_fit(s, runtime.max_model_len, refuses)
        b = Bench(s, client, runtime, model, state, on_progress, streams)
        state.metadata["exact_prompt_tokens"] = b.builder.use_tokenize
        state.metadata["seed"] = b.seed
        state.metadata["seed_given"] = s.seed is not None
        await b.warm_up()
        await b.calibrate()
        await b.series()
    return state.result()


def _sent_rate(run: dict[str, Any]) -> float | None:
    """Requests a second as they were sent: their count over the last send's time."""
    starts = (run.get("vllm") or {}).get("start_times") or []
    return len(starts) / max(starts) if len(starts) > 1 and max(starts) > 0 else None


# Runtimes that refuse a request whose prompt and output together pass the context (HTTP 400;
# TGI 422) through their OpenAI API; Ollama and llama.cpp shift the context or stop at it.
REFUSE_PAST_CONTEXT = frozenset(("vllm", "sglang", "tgi", "pdscope"))


def _refuse_what_cannot_fit(s: BenchSettings, max_model_len: int | None, runtime: str = "") -> None:
    """A workload whose every request is past the server's context would only fail (and
    building a prompt of 10^8 tokens takes minutes): refused before a request is sent. The
    output counts where the runtime refuses a prompt and output past its context. Lengths
    that only sometimes exceed it stay, as failures the load test counts."""
    if not max_model_len:
        return
    output_counts = runtime in REFUSE_PAST_CONTEXT
    why = f"the server's context is {max_model_len:,}"
    if output_counts:
        why += f", and {runtime} refuses a request whose prompt and output pass it"
    if s.workload == "random":
        prompt, output = _least(s.input_len, "--input-len"), _least(s.output_len, "--output-len")
        if prompt >= max_model_len:
            raise ValueError(
                f"--input-len {s.input_len}: every prompt is at least {prompt:,} tokens, and "
                f"the server's context is {max_model_len:,}"
            )
        if output_counts and prompt + output > max_model_len:
            raise ValueError(
                f"--input-len {s.input_len} and --output-len {s.output_len}: every request is "
                f"at least {prompt:,} + {output:,} tokens; {why}"
            )
    elif s.workload == "long-prompt":
        if s.long_len >= max_model_len:
            raise ValueError(f"--long-len {s.long_len}: every long prompt is past it; {why}")
        if output_counts and 32 + s.stream_output > max_model_len:
            raise ValueError(
                f"--stream-output {s.stream_output}: every stream (32 prompt tokens and its "
                f"output) is past it; {why}"
            )


def _least(text: str, flag: str) -> int:
    """The fewest tokens a length flag draws (a normal draw is clipped at 1)."""
    lengths = Lengths.parse(text, flag)
    return int(lengths.a) if lengths.kind != "normal" else 1


def _settings(s: BenchSettings) -> dict[str, Any]:
    data = asdict(s)
    data.pop("api_key", None)
    data["request_rates"] = [None if math.isinf(r) else r for r in s.request_rates]
    return data


__all__ = ["WORKLOADS", "BenchSettings", "BenchState", "ProbeError", "WorkloadError", "bench"]
