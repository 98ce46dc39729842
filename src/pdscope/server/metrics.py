"""Prometheus metrics with vLLM's names, buckets and ``model_name`` label.

Every value comes from the engine, never from the HTTP layer: histograms and counters from the
timeline (RequestTimeline, StepRecord) through the engine's listeners on its own thread
(prometheus_client is thread-safe), gauges from the scheduler and pool when scraped.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)

from pdscope import __version__
from pdscope.engine.kernels import OPTIONS as KERNEL_PATHS
from pdscope.engine.llm_engine import LLMEngine
from pdscope.engine.request import Request
from pdscope.engine.timeline import StepRecord
from pdscope.specs.local import cpu_model

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class EngineMetrics:
    """The vLLM dashboard, fed by one engine."""

    def __init__(self, engine: LLMEngine, model_name: str):
        self.registry = CollectorRegistry()
        # process_*, python_gc_* and python_info as vLLM's default registry has them: a reader
        # sees a restart by the start time (analysis/server_metrics.restarted), the server's
        # memory and CPU seconds, and how often the garbage collector ran (pdscope/heap.py).
        ProcessCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        r, labels = self.registry, ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        self.ttft = hist(
            "vllm:time_to_first_token_seconds", "Arrival to first output token.", TTFT_BUCKETS
        )
        self.itl = hist(
            "vllm:inter_token_latency_seconds",
            "Gap between consecutive output tokens.",
            ITL_BUCKETS,
        )
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS)
        self.queue = hist(
            "vllm:request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_BUCKETS
        )
        self.prefill = hist(
            "vllm:request_prefill_time_seconds", "First scheduled to first token.", REQUEST_BUCKETS
        )
        self.decode = hist(
            "vllm:request_decode_time_seconds", "First token to last token.", REQUEST_BUCKETS
        )
        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge(
            "vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)."
        )
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.preemptions = counter("vllm:num_preemptions", "Requests preempted.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of started requests.")
        self.generation_tokens = counter("vllm:generation_tokens", "Output tokens generated.")
        self._success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        # Gauges read the engine when scraped, so an idle server (no steps) is still current:
        # an aborted request's blocks show as freed at once. Reads of list/dict sizes from
        # another thread are atomic in CPython.
        self.running.set_function(lambda: len(engine.scheduler.running))
        self.waiting.set_function(lambda: len(engine.scheduler.waiting))
        self.kv_usage.set_function(lambda: engine.pool.usage)
        self.model_name = model_name
        # Which kernel each machine-dependent engine path took on this CPU (engine/kernels.py),
        # and how a decode step runs on them (engine/step_check.py).
        kernels = engine.kernels
        Gauge(
            "pdscope:build_info",
            "Constant 1; the labels say what this engine runs on and which kernels it chose.",
            ["model_name", "version", "cpu", "torch_isa", "c_march", *KERNEL_PATHS, "decode_step"],
            registry=r,
        ).labels(
            model_name,
            __version__,
            cpu_model(),
            engine.torch_isa,
            engine.c_march,
            *(getattr(kernels, p) for p in KERNEL_PATHS),
            engine.decode_step,
        ).set(1)
        self._pool = engine.pool
        self._seen = (0, 0, 0)  # prefix queries, hits, preemptions already counted
        self._scheduler = engine.scheduler
        engine.step_listeners.append(self.on_step)
        engine.finish_listeners.append(self.on_finish)
        self.dashboard = DashboardMetrics(engine, model_name, self.registry)

    def on_step(self, record: StepRecord, produced: list[Request]) -> None:
        now = (
            self._pool.prefix_cache_queries,
            self._pool.prefix_cache_hits,
            self._scheduler.num_preemptions,
        )
        queries, hits, preempted = (a - b for a, b in zip(now, self._seen, strict=True))
        self._seen = now
        self.prefix_queries.inc(queries)
        self.prefix_hits.inc(hits)
        self.preemptions.inc(preempted)
        for request in produced:
            t = request.timeline
            self.generation_tokens.inc()
            if len(t.token_s) == 1:
                self.ttft.observe(t.token_s[0] - t.arrival_s)
                self.prompt_tokens.inc(t.prompt_tokens)
            else:
                self.itl.observe(t.token_s[-1] - t.token_s[-2])

    def on_finish(self, request: Request) -> None:
        t = request.timeline
        if t.cancelled:  # vLLM drops a request its client aborted from these series too
            return
        self._success.labels(self.model_name, t.finish_reason or "abort").inc()
        for hist, value in (
            (self.e2e, t.e2e_s),
            (self.queue, t.queue_s),
            (self.prefill, t.prefill_s),
            (self.decode, t.decode_s),
        ):
            if value is not None:
                hist.observe(value)


# --- the rest of vLLM's dashboard series ------------------------------------------------------
# Checked against vLLM 0.32's own /metrics (tests/fixtures/vllm-0.32.0-cpu-metrics.txt, recorded
# from its CPU build): same names, types, buckets and model_name label.

# vLLM's iteration_tokens_total buckets as its CPU build exports them.
ITERATION_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0,
                     8192.0, 16384.0)  # fmt: skip
PREEMPTION_BUCKETS = (1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0)


def one_two_five_buckets(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit`: vLLM's token-count buckets for a max_model_len."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


class DashboardMetrics:
    """Per-request and per-step histograms vLLM's Grafana dashboards read beyond the five:
    inference time, per-request TPOT, prompt and generation lengths, tokens per step,
    preemptions per request, requested max_tokens, and cached prompt tokens."""

    def __init__(self, engine: LLMEngine, model_name: str, registry: CollectorRegistry):
        labels = ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry).labels(
                model_name
            )

        lengths = one_two_five_buckets(engine.max_model_len)
        self.inference = hist(
            "vllm:request_inference_time_seconds",
            "First scheduled to finished (prefill + decode).",
            REQUEST_BUCKETS,
        )
        self.tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Per request: first to last token over output tokens - 1.",
            ITL_BUCKETS,
        )
        self.prompt_len = hist(
            "vllm:request_prompt_tokens", "Prompt tokens per finished request.", lengths
        )
        self.generation_len = hist(
            "vllm:request_generation_tokens", "Output tokens per finished request.", lengths
        )
        self.max_tokens = hist(
            "vllm:request_params_max_tokens", "max_tokens asked per request.", lengths
        )
        self.max_generation = hist(
            "vllm:request_max_num_generation_tokens",
            "Most output tokens a request may produce (max_tokens; n is 1).",
            lengths,
        )
        self.step_tokens = hist(
            "vllm:iteration_tokens_total",
            "Tokens computed per engine step (prefill + decode).",
            ITERATION_BUCKETS,
        )
        self.preemptions = hist(
            "vllm:request_num_preemptions", "Preemptions per finished request.", PREEMPTION_BUCKETS
        )
        self.cached = Counter(
            "vllm:prompt_tokens_cached",
            "Prompt tokens served from the prefix cache.",
            labels,
            registry=registry,
        ).labels(model_name)
        engine.step_listeners.append(self.on_step)
        engine.finish_listeners.append(self.on_finish)

    def on_step(self, record: StepRecord, produced: list[Request]) -> None:
        tokens = record.prefill_tokens + record.decode_tokens
        if tokens > 0:
            self.step_tokens.observe(tokens)
        for request in produced:
            t = request.timeline
            if len(t.token_s) == 1:  # counted once, at the first token, as prompt_tokens is
                self.cached.inc(t.num_cached_tokens)

    def on_finish(self, request: Request) -> None:
        t = request.timeline
        if t.cancelled:  # as in ServerMetrics.on_finish
            return
        self.max_tokens.observe(request.params.max_tokens)
        self.max_generation.observe(request.params.max_tokens)
        if not t.token_s:  # aborted before its first token: no lengths or times to report
            return
        self.prompt_len.observe(t.prompt_tokens)
        self.generation_len.observe(len(t.token_s))
        self.preemptions.observe(t.preemptions)
        if t.finished_s is not None and t.first_scheduled_s is not None:
            self.inference.observe(t.finished_s - t.first_scheduled_s)
        if len(t.token_s) > 1 and t.decode_s is not None:
            self.tpot.observe(t.decode_s / (len(t.token_s) - 1))
