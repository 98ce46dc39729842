"""The server's own view of a load run, sampled from its Prometheus ``/metrics``.

`MetricsSampler` scrapes ``/metrics`` before, during and after a run and returns what it saw
(`ScrapedRun`); ``analysis/server_metrics.py`` turns that into a `MetricsReport`:

* a **timeline** of gauges (running, waiting, KV-cache usage), one point per scrape;
* **deltas** of counters (tokens, prefix-cache queries and hits, preemptions), final − first;
* **histogram quantiles** of the run alone (TTFT, ITL, E2E, queue time), computed from the
  difference of the cumulative bucket counts between the first and the last scrape, as
  Prometheus' ``histogram_quantile`` does over ``increase(..._bucket[run])``.

Server figures come from the engine clock and the server's definitions (docs/metrics.md): the
server's TTFT starts at HTTP receipt and excludes the network, and vLLM and SGLang record one ITL
sample per chunk gap. They are shown beside the client's figures, never subtracted from them.

Names differ between runtimes; `RUNTIME_NAMES` maps each runtime's sample names to runtime-neutral
roles, and `OLDER_NAMES` lists the names earlier releases used for the same role.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

# A sample's identity: its name as in the text format (``vllm:prompt_tokens_total``,
# ``..._bucket``) and its labels other than ``model_name``, as a frozenset of (label, value).
SampleKey = tuple[str, frozenset[tuple[str, str]]]

# Labels that only say which model a sample belongs to: dropped so a one-model server's samples
# are keyed by name alone, and several models' samples with otherwise equal labels add up.
_DROPPED_LABELS = frozenset({"model_name"})

GAUGE_ROLES = ("running", "waiting", "kv_usage")
COUNTER_ROLES = (
    "prefix_hits",
    "prefix_queries",
    "preemptions",
    "prompt_tokens",
    "generation_tokens",
)
HISTOGRAM_ROLES = ("ttft", "itl", "e2e", "queue")

_VLLM = {
    # gauges: requests in the running batch / waiting; KV-cache blocks in use as a 0-1 fraction
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "kv_usage": "vllm:kv_cache_usage_perc",
    # counters (prompt tokens looked up in / found in the prefix cache; preempted requests)
    "prefix_hits": "vllm:prefix_cache_hits_total",
    "prefix_queries": "vllm:prefix_cache_queries_total",
    "preemptions": "vllm:num_preemptions_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    # histograms in seconds (base names: samples are <base>_bucket, _sum, _count)
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
    "queue": "vllm:request_queue_time_seconds",
}

RUNTIME_NAMES: dict[str, dict[str, str]] = {
    "vllm": _VLLM,
    # `pdscope serve` exposes vLLM's names (server/metrics.py); on /metrics it reads as "vllm".
    "pdscope": _VLLM,
    # Checked against sglang python/sglang/srt/metrics/collector.py and
    # docs/references/production_metrics.md.
    "sglang": {
        "running": "sglang:num_running_reqs",
        "waiting": "sglang:num_queue_reqs",
        # SGLang has no block-usage gauge; token_usage is used KV tokens / pool size (0-1),
        # the nearest figure.
        "kv_usage": "sglang:token_usage",
        # cached_tokens counts cached prompt tokens and prompt_tokens all prompt tokens, so their
        # ratio is vLLM's hits/queries. (sglang:cache_hit_rate is a gauge of a recent window,
        # which cannot give the run's rate.)
        "prefix_hits": "sglang:cached_tokens_total",
        "prefix_queries": "sglang:prompt_tokens_total",
        # A retraction is SGLang's preemption (a request evicted from the batch for KV space).
        "preemptions": "sglang:num_retracted_requests_total",
        "prompt_tokens": "sglang:prompt_tokens_total",
        "generation_tokens": "sglang:generation_tokens_total",
        "ttft": "sglang:time_to_first_token_seconds",
        "itl": "sglang:inter_token_latency_seconds",
        "e2e": "sglang:e2e_request_latency_seconds",
        "queue": "sglang:queue_time_seconds",
    },
    # Checked against text-generation-inference docs/source/reference/metrics.md. TGI has no
    # TTFT histogram, no KV-usage gauge and no prefix-cache or preemption counters, so those
    # roles are absent. Its tgi_request_mean_time_per_token_duration is a per-request mean
    # (TPOT), not one sample per token gap, so it is not offered as ITL.
    "tgi": {
        "running": "tgi_batch_current_size",
        "waiting": "tgi_queue_size",
        # Token totals are the sums of TGI's per-request token-count histograms (monotonic like
        # a counter). They move when a request is recorded, not token by token.
        "prompt_tokens": "tgi_request_input_length_sum",
        "generation_tokens": "tgi_request_generated_tokens_sum",
        "e2e": "tgi_request_duration",
        "queue": "tgi_request_queue_duration",
    },
    # Checked against llama.cpp's server README and a real llama-server (`make llamacpp`).
    # llama.cpp has no latency histograms and no preemption counter. Its prompt_tokens_total
    # counts the prompt tokens it computed, leaving out those its slots reused from their
    # cache, which current builds count in prompt_tokens_cached_total: their sum is every
    # prompt token (vLLM's prompt count), and the cached share its prefix-cache hit rate.
    "llama.cpp": {
        "running": "llamacpp:requests_processing",
        "waiting": "llamacpp:requests_deferred",
        # Exported by older builds only; current builds lack it, and the role then reads None.
        "kv_usage": "llamacpp:kv_cache_usage_ratio",
        "prefix_hits": "llamacpp:prompt_tokens_cached_total",
        "prefix_queries": "llamacpp:prompt_tokens_total + llamacpp:prompt_tokens_cached_total",
        "prompt_tokens": "llamacpp:prompt_tokens_total + llamacpp:prompt_tokens_cached_total",
        "generation_tokens": "llamacpp:tokens_predicted_total",
    },
}
# Joins the names of counters a role reads as one sum (Snapshot.total).
SUM = " + "

# Names earlier releases used for a role, tried in order after RUNTIME_NAMES' name. Never summed
# with it: versions that export both (deprecation periods) export the same figure twice.
OLDER_NAMES: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm": {
        "kv_usage": ("vllm:gpu_cache_usage_perc",),
        "prefix_hits": ("vllm:gpu_prefix_cache_hits_total",),
        "prefix_queries": ("vllm:gpu_prefix_cache_queries_total",),
        # Deprecated in vLLM 0.11; same one-sample-per-chunk-gap meaning.
        "itl": ("vllm:time_per_output_token_seconds",),
    },
    "sglang": {"itl": ("sglang:time_per_output_token_seconds",)},
    # builds without the cached-token counter: the tokens computed are all it counts
    "llama.cpp": {"prompt_tokens": ("llamacpp:prompt_tokens_total",)},
}
OLDER_NAMES["pdscope"] = OLDER_NAMES["vllm"]

# Metric-name prefixes that identify a runtime: the one list (detect.py reads it too).
METRIC_PREFIXES = (
    ("vllm:", "vllm"),
    ("sglang:", "sglang"),
    ("tgi_", "tgi"),
    ("llamacpp:", "llama.cpp"),
)

_MAX_ERRORS_KEPT = 10  # scrape error messages kept in the report; all are counted


def candidate_names(runtime: str, role: str) -> tuple[str, ...]:
    """Sample (or histogram base) names that may carry `role` on `runtime`, preferred first."""
    primary = RUNTIME_NAMES.get(runtime, {}).get(role)
    older = OLDER_NAMES.get(runtime, {}).get(role, ())
    return ((primary,) if primary else ()) + older


# --- parsing ------------------------------------------------------------------------------------


@dataclass
class Snapshot(Mapping[SampleKey, float]):
    """One scrape of ``/metrics``: every sample's value, keyed by `SampleKey`.

    `t_s` is ``time.perf_counter()`` on the client when the scrape was taken (the sampler uses
    the midpoint between sending the request and receiving the response). Samples whose labels
    differ only in ``model_name`` are summed into one key.
    """

    samples: dict[SampleKey, float] = field(default_factory=dict)
    t_s: float = 0.0
    # Samples summed into each key (one per model_name); absent: one. `mean` divides by them.
    merged: dict[SampleKey, int] = field(default_factory=dict)

    def __getitem__(self, key: SampleKey) -> float:
        return self.samples[key]

    def __iter__(self) -> Iterator[SampleKey]:
        return iter(self.samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __post_init__(self) -> None:
        # Name -> values, so role lookups on every scrape don't walk every sample.
        self._by_name: dict[str, list[float]] = {}
        self._raw: dict[str, int] = {}  # raw samples behind each name's values
        for key, value in self.samples.items():
            self._by_name.setdefault(key[0], []).append(value)
            if not math.isnan(value):
                self._raw[key[0]] = self._raw.get(key[0], 0) + self.merged.get(key, 1)

    def names(self) -> set[str]:
        """The distinct sample names in this scrape."""
        return set(self._by_name)

    def has(self, name: str) -> bool:
        """Whether any sample is called `name` (every one of a sum's names, see `total`)."""
        return all(part in self._by_name for part in name.split(SUM))

    def total(self, name: str) -> float | None:
        """The sum of `name` over all its label sets (models, finish reasons, ...); None if absent.

        NaN values (Prometheus' "no data") are skipped. A name "a + b" (`SUM`) reads the sum
        of counters a and b, None unless both are there: a figure a server splits in two
        (llama.cpp's prompt tokens, processed and taken from its cache).
        """
        if SUM in name:
            parts = [self.total(part) for part in name.split(SUM)]
            return None if None in parts else math.fsum(parts)  # type: ignore[arg-type]
        values = [v for v in self._by_name.get(name, ()) if not math.isnan(v)]
        return math.fsum(values) if values else None

    def mean(self, name: str) -> float | None:
        """The mean of `name` over every sample the server sent, label sets merged by dropping
        `model_name` included; None if absent. NaN values are skipped."""
        values = [v for v in self._by_name.get(name, ()) if not math.isnan(v)]
        return math.fsum(values) / self._raw[name] if values else None

    def buckets(self, base: str) -> list[tuple[float, float]]:
        """Histogram `base`'s cumulative buckets [(upper bound, count)], summed over label sets.

        Sorted by bound; +Inf included when exported; empty when the histogram is absent.
        """
        by_bound: dict[float, float] = {}
        for (name, labels), value in self.samples.items():
            if name != f"{base}_bucket":
                continue
            le = dict(labels).get("le")
            if le is None:
                continue
            bound = float(le)
            by_bound[bound] = by_bound.get(bound, 0.0) + value
        return sorted(by_bound.items())


def parse_metrics(text: str) -> Snapshot:
    """Parse Prometheus text exposition format into a `Snapshot` (with `t_s` = 0; caller sets it).

    Raises ValueError on text the parser rejects.
    """
    samples: dict[SampleKey, float] = {}
    merged: dict[SampleKey, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = frozenset((k, v) for k, v in sample.labels.items() if k not in _DROPPED_LABELS)
            key = (sample.name, labels)
            samples[key] = samples.get(key, 0.0) + float(sample.value)
            merged[key] = merged.get(key, 0) + 1
    return Snapshot(samples, merged=merged)


def detect_runtime(snapshot: Snapshot) -> str | None:
    """The runtime whose metric-name prefix the most sample names carry; None if none does.

    Returns "vllm" for `pdscope serve`, which exports vLLM's names.
    """
    counts = {runtime: 0 for _, runtime in METRIC_PREFIXES}
    for name in snapshot.names():
        for prefix, runtime in METRIC_PREFIXES:
            if name.startswith(prefix):
                counts[runtime] += 1
    best = max(counts.items(), key=lambda kv: kv[1])  # ties: the first in METRIC_PREFIXES order
    return best[0] if best[1] > 0 else None


# --- gauges at one scrape ------------------------------------------------------------------------


@dataclass
class TimelinePoint:
    """Gauges at one scrape. `t_s` is seconds since the first scrape; a missing role is None."""

    t_s: float
    running: float | None
    waiting: float | None
    kv_usage: float | None  # fraction of KV cache in use, 0-1


def gauge_problem(role: str, value: float) -> str | None:
    """Why a gauge's reading cannot be what its role means, or None. Request counts are never
    negative; KV usage is a fraction 0-1 on every runtime read here (vLLM's
    ``kv_cache_usage_perc`` too, despite its name), so 70 is a percentage or a broken server."""
    if not math.isfinite(value):
        return f"read {value:g}, not a number"
    if role in ("running", "waiting") and value < 0:
        return f"read {value:g}: a count of requests is never negative"
    if role == "kv_usage" and not 0.0 <= value <= 1.0:
        return f"read {value:g}: KV usage is a fraction within 0-1"
    return None


def first_present(snapshot: Snapshot, names: tuple[str, ...]) -> str | None:
    return next((n for n in names if snapshot.has(n)), None)


def gauge_reading(snapshot: Snapshot, role: str, name: str) -> float | None:
    """A gauge role's value: request counts summed over label sets (models, data-parallel
    engines); KV usage averaged, the fraction of all the pools in use (summed, two engines at
    0.6 would read 1.2)."""
    return snapshot.mean(name) if role == "kv_usage" else snapshot.total(name)


def timeline_point(snapshot: Snapshot, runtime: str, t0_s: float) -> TimelinePoint:
    """The gauges of `snapshot`, its time made relative to `t0_s` (seconds)."""
    values: dict[str, float | None] = {}
    for role in GAUGE_ROLES:
        name = first_present(snapshot, candidate_names(runtime, role))
        values[role] = gauge_reading(snapshot, role, name) if name else None
    return TimelinePoint(t_s=snapshot.t_s - t0_s, **values)


# --- the sampler --------------------------------------------------------------------------------


class ScrapeError(RuntimeError):
    """A scrape of /metrics failed (network, HTTP status, or text that is not Prometheus)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass
class ScrapedRun:
    """What a sampler saw of one run: the first and last full scrapes and one gauge point per
    scrape; or, when ``first`` is None, the ``reason`` it could not sample."""

    url: str
    reason: str | None = None
    first: Snapshot | None = None
    last: Snapshot | None = None
    timeline: list[TimelinePoint] = field(default_factory=list)
    runtime: str | None = None
    interval_s: float = 0.0
    scrapes: int = 0
    scrape_errors: int = 0
    errors: list[str] = field(default_factory=list)
    final_failed: bool = False  # the final scrape failed: `last` was taken during the load


class MetricsSampler:
    """Scrape a server's ``/metrics`` every `interval_s` seconds during a run.

    `url` is the server's base URL (``http://host:port``) or the full metrics URL (ending in
    ``/metrics``). `headers` go with every scrape (e.g. an API key). Call `start()` before the
    load and `stop()` after it; `stop()` returns the `ScrapedRun`.

    Memory stays bounded on long runs: only the first and the latest full scrapes are kept, plus
    one small `TimelinePoint` per scrape. A failed scrape during the run is counted and skipped;
    if the first scrape fails the sampler is disabled and the report says why.
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        url: str,
        interval_s: float = 0.5,
        headers: dict[str, str] | None = None,
        *,
        timeout_s: float = 5.0,
    ):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        base = url.rstrip("/")
        self.url = base if base.endswith("/metrics") else f"{base}/metrics"
        self.client = client
        self.interval_s = interval_s
        self.headers = headers
        self.timeout_s = timeout_s
        self.runtime: str | None = None
        self._reason: str | None = "not started"
        self._first: Snapshot | None = None
        self._last: Snapshot | None = None
        self._timeline: list[TimelinePoint] = []
        self._scrapes = 0
        self._errors = 0
        self._messages: list[str] = []
        self._task: asyncio.Task[None] | None = None

    @property
    def enabled(self) -> bool:
        """True once `start()` has seen a Prometheus page of a known runtime."""
        return self._first is not None

    async def scrape(self) -> Snapshot:
        """One scrape, timed at the midpoint of the request (client perf_counter seconds)."""
        sent = time.perf_counter()
        try:
            r = await self.client.get(self.url, headers=self.headers, timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            raise ScrapeError(f"GET {self.url}: {type(exc).__name__}: {exc}") from exc
        received = time.perf_counter()
        if r.status_code != 200:
            raise ScrapeError(f"GET {self.url}: HTTP {r.status_code}", r.status_code)
        try:
            snapshot = parse_metrics(r.text)
        except Exception as exc:  # the parser raises ValueError and others on foreign text
            raise ScrapeError(f"GET {self.url}: not Prometheus text ({exc})") from exc
        snapshot.t_s = (sent + received) / 2
        return snapshot

    async def start(self) -> None:
        """Take the first scrape and start sampling in the background (or disable the sampler)."""
        if self._task is not None or self._first is not None:
            raise RuntimeError("MetricsSampler.start() called twice")
        try:
            first = await self.scrape()
        except ScrapeError as exc:
            if exc.status == 404:
                self._reason = f"{self.url} answered 404: the server exposes no /metrics"
            else:
                self._reason = f"first scrape failed: {exc}"
            return
        runtime = detect_runtime(first)
        if runtime is None:
            self._reason = (
                f"{self.url} has no metrics of a known runtime "
                f"({', '.join(prefix for prefix, _ in METRIC_PREFIXES)})"
            )
            return
        self.runtime, self._reason = runtime, None
        self._first = self._last = first
        self._record(first)
        self._task = asyncio.create_task(self._run(), name="metrics-sampler")

    async def stop(self) -> ScrapedRun:
        """Stop sampling, take the final scrape, and return what was seen
        (``analysis.server_metrics.report_of`` turns it into the run's figures)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._first is None or self.runtime is None:
            return ScrapedRun(url=self.url, reason=self._reason)
        final_failed = False
        try:
            final = await self.scrape()
        except ScrapeError as exc:
            # Fall back on the last good scrape: the figures then end a little early.
            self._error(f"final scrape: {exc}")
            final_failed = True
        else:
            self._last = final
            self._record(final)
        assert self._last is not None
        return ScrapedRun(
            url=self.url,
            first=self._first,
            last=self._last,
            timeline=self._timeline,
            runtime=self.runtime,
            interval_s=self.interval_s,
            scrapes=self._scrapes,
            scrape_errors=self._errors,
            errors=self._messages,
            final_failed=final_failed,
        )

    async def _run(self) -> None:
        # A fixed-rate schedule on the client clock, so slow scrapes don't stretch the interval;
        # ticks missed while a scrape ran long are skipped, not bunched up.
        assert self._first is not None
        next_s = self._first.t_s + self.interval_s
        while True:
            await asyncio.sleep(max(0.0, next_s - time.perf_counter()))
            try:
                snapshot = await self.scrape()
            except Exception as exc:  # one bad scrape (of any kind) must not end the sampling
                self._error(str(exc) if isinstance(exc, ScrapeError) else repr(exc))
            else:
                self._last = snapshot
                self._record(snapshot)
            now = time.perf_counter()
            next_s += self.interval_s
            if next_s < now:
                next_s = now + self.interval_s - (now - next_s) % self.interval_s

    def _record(self, snapshot: Snapshot) -> None:
        assert self._first is not None and self.runtime is not None
        self._scrapes += 1
        self._timeline.append(timeline_point(snapshot, self.runtime, self._first.t_s))

    def _error(self, message: str) -> None:
        self._errors += 1
        if len(self._messages) < _MAX_ERRORS_KEPT:
            self._messages.append(message)
