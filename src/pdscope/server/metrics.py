"""Prometheus metrics with vLLM's names, buckets and ``model_name`` label.

Every value comes from the engine, never from the HTTP layer: histograms and counters from the
timeline (RequestTimeline, StepRecord) through the engine's listeners on its own thread
(prometheus_client is thread-safe), gauges from the scheduler and pool when scraped.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdscope import __version__
from pdscope.engine.kernels import cpu_model
from pdscope.engine.llm_engine import LLMEngine
from pdscope.engine.request import Request
from pdscope.engine.timeline import StepRecord

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
        # Which kernel each machine-dependent engine path took on this CPU (engine/kernels.py).
        kernels = engine.kernels
        Gauge(
            "pdscope:build_info",
            "Constant 1; the labels say what this engine runs on and which kernels it chose.",
            ["model_name", "version", "cpu", "linear", "prefill_attention", "decode_math"],
            registry=r,
        ).labels(
            model_name,
            __version__,
            cpu_model(),
            kernels.linear,
            kernels.prefill_attention,
            kernels.decode_math,
        ).set(1)
        self._pool = engine.pool
        self._seen = (0, 0, 0)  # prefix queries, hits, preemptions already counted
        self._scheduler = engine.scheduler
        engine.step_listeners.append(self.on_step)
        engine.finish_listeners.append(self.on_finish)

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
        self._success.labels(self.model_name, t.finish_reason or "abort").inc()
        for hist, value in (
            (self.e2e, t.e2e_s),
            (self.queue, t.queue_s),
            (self.prefill, t.prefill_s),
            (self.decode, t.decode_s),
        ):
            if value is not None:
                hist.observe(value)
