"""The server's own view of a load run, sampled from its Prometheus ``/metrics``.

`MetricsSampler` scrapes ``/metrics`` before, during and after a run and turns what it saw into a
`MetricsReport`:

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
from typing import Any

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
QUANTILES = (0.5, 0.9, 0.99)

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
    # Checked against llama.cpp's server README. llama.cpp has no latency histograms and no
    # prefix-cache or preemption counters.
    "llama.cpp": {
        "running": "llamacpp:requests_processing",
        "waiting": "llamacpp:requests_deferred",
        # Exported by older builds only; current builds lack it, and the role then reads None.
        "kv_usage": "llamacpp:kv_cache_usage_ratio",
        "prompt_tokens": "llamacpp:prompt_tokens_total",
        "generation_tokens": "llamacpp:tokens_predicted_total",
    },
}

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
}
OLDER_NAMES["pdscope"] = OLDER_NAMES["vllm"]

# Metric-name prefixes that identify a runtime (as in client/detect.py).
_PREFIXES = (("vllm:", "vllm"), ("sglang:", "sglang"), ("tgi_", "tgi"), ("llamacpp:", "llama.cpp"))

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

    def __getitem__(self, key: SampleKey) -> float:
        return self.samples[key]

    def __iter__(self) -> Iterator[SampleKey]:
        return iter(self.samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __post_init__(self) -> None:
        # Name -> values, so role lookups on every scrape don't walk every sample.
        self._by_name: dict[str, list[float]] = {}
        for (name, _), value in self.samples.items():
            self._by_name.setdefault(name, []).append(value)

    def names(self) -> set[str]:
        """The distinct sample names in this scrape."""
        return set(self._by_name)

    def has(self, name: str) -> bool:
        """Whether any sample is called `name`."""
        return name in self._by_name

    def total(self, name: str) -> float | None:
        """The sum of `name` over all its label sets (models, finish reasons, ...); None if absent.

        NaN values (Prometheus' "no data") are skipped.
        """
        values = [v for v in self._by_name.get(name, ()) if not math.isnan(v)]
        return math.fsum(values) if values else None

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
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = frozenset((k, v) for k, v in sample.labels.items() if k not in _DROPPED_LABELS)
            key = (sample.name, labels)
            samples[key] = samples.get(key, 0.0) + float(sample.value)
    return Snapshot(samples)


def detect_runtime(snapshot: Snapshot) -> str | None:
    """The runtime whose metric-name prefix the most sample names carry; None if none does.

    Returns "vllm" for `pdscope serve`, which exports vLLM's names.
    """
    counts = {runtime: 0 for _, runtime in _PREFIXES}
    for name in snapshot.names():
        for prefix, runtime in _PREFIXES:
            if name.startswith(prefix):
                counts[runtime] += 1
    best = max(counts.items(), key=lambda kv: kv[1])  # ties: the first in _PREFIXES order
    return best[0] if best[1] > 0 else None


# --- histogram quantiles ------------------------------------------------------------------------


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile (0 ≤ q ≤ 1) of a histogram, as Prometheus' ``histogram_quantile`` computes it.

    `buckets` are cumulative (upper bound, count) pairs in any order, the +Inf bucket included;
    the result is in the bounds' unit. Within the bucket holding the rank q·total the value is
    interpolated linearly, the first bucket's lower bound being 0 (or its bound if that is ≤ 0).
    A rank that falls in the +Inf bucket returns the largest finite bound. Buckets with the
    same bound are added up, and counts are forced monotonic, as Prometheus does.

    Returns None where Prometheus returns NaN: no +Inf bucket, fewer than two buckets, or no
    observations. One deviation: where Prometheus divides 0/0 (q = 0 with an empty first
    bucket) this returns the bucket's lower bound.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be within [0, 1], got {q}")
    merged: dict[float, float] = {}
    for bound, count in buckets:
        merged[bound] = merged.get(bound, 0.0) + count
    ordered = sorted(merged.items())
    if len(ordered) < 2 or not math.isinf(ordered[-1][0]) or ordered[-1][0] < 0:
        return None
    # Cumulative counts can dip when buckets are scraped non-atomically or summed from series
    # scraped at slightly different moments; Prometheus takes the running maximum.
    bounds, counts = [b for b, _ in ordered], []
    running = 0.0
    for _, count in ordered:
        running = max(running, count)
        counts.append(running)
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    # First finite bucket whose cumulative count reaches the rank; the +Inf bucket otherwise.
    b = next((i for i in range(len(counts) - 1) if counts[i] >= rank), len(counts) - 1)
    if b == len(counts) - 1:
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start, end, count = 0.0, bounds[b], counts[b]
    if b > 0:
        start = bounds[b - 1]
        count -= counts[b - 1]
        rank -= counts[b - 1]
    if count == 0:
        return start
    return start + (end - start) * (rank / count)


# --- the report ---------------------------------------------------------------------------------


@dataclass
class TimelinePoint:
    """Gauges at one scrape. `t_s` is seconds since the first scrape; a missing role is None."""

    t_s: float
    running: float | None
    waiting: float | None
    kv_usage: float | None  # fraction of KV cache in use, 0-1


@dataclass
class HistogramSummary:
    """One latency histogram over the run (final − first bucket counts), in milliseconds.

    `name` is the histogram's base name on the server. Quantiles follow `histogram_quantile`, so
    they are only as fine as the server's buckets; `max_bound_ms` is the largest finite bound
    (no quantile exceeds it). Quantiles and the mean are None when the run observed nothing or
    the server exports no buckets (e.g. a summary).
    """

    name: str
    count: float
    mean_ms: float | None
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    max_bound_ms: float | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "count": self.count,
            "mean_ms": self.mean_ms,
            "p50_ms": self.p50_ms,
            "p90_ms": self.p90_ms,
            "p99_ms": self.p99_ms,
            "max_bound_ms": self.max_bound_ms,
        }


@dataclass
class MetricsReport:
    """What the server's ``/metrics`` said about one run.

    When `available` is False, `reason` says why (no endpoint, not Prometheus, unknown runtime)
    and the figures are empty. `deltas` maps each counter role to final − first (tokens,
    requests), None where the runtime lacks the role or the counter went backwards (a server
    restart). `prefix_hit_rate` is Δhits / Δqueries over the run (prompt tokens), None without
    queries. Maxima are over every scrape, first and final included.
    """

    available: bool
    reason: str | None = None
    runtime: str | None = None
    url: str = ""
    interval_s: float = 0.0
    duration_s: float = 0.0  # first scrape to last scrape, client clock
    scrapes: int = 0  # successful scrapes, first and final included
    scrape_errors: int = 0
    errors: list[str] = field(default_factory=list)  # the first few error messages
    names: dict[str, str] = field(default_factory=dict)  # role -> name used on this server
    timeline: list[TimelinePoint] = field(default_factory=list)
    deltas: dict[str, float | None] = field(default_factory=dict)
    prefix_hit_rate: float | None = None
    max_waiting: float | None = None
    max_running: float | None = None
    max_kv_usage: float | None = None
    histograms: dict[str, HistogramSummary | None] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: only str, float, int, bool, None, lists and dicts."""
        return {
            "available": self.available,
            "reason": self.reason,
            "runtime": self.runtime,
            "url": self.url,
            "interval_s": self.interval_s,
            "duration_s": self.duration_s,
            "scrapes": self.scrapes,
            "scrape_errors": self.scrape_errors,
            "errors": list(self.errors),
            "names": dict(self.names),
            "timeline": [vars(p).copy() for p in self.timeline],
            "deltas": dict(self.deltas),
            "prefix_hit_rate": self.prefix_hit_rate,
            "max_waiting": self.max_waiting,
            "max_running": self.max_running,
            "max_kv_usage": self.max_kv_usage,
            "histograms": {k: (h.to_dict() if h else None) for k, h in self.histograms.items()},
            "warnings": list(self.warnings),
        }


def _first_present(snapshot: Snapshot, names: tuple[str, ...]) -> str | None:
    return next((n for n in names if snapshot.has(n)), None)


def _histogram_present(snapshot: Snapshot, base: str) -> bool:
    return any(snapshot.has(f"{base}{suffix}") for suffix in ("_bucket", "_count", "_sum"))


def timeline_point(snapshot: Snapshot, runtime: str, t0_s: float) -> TimelinePoint:
    """The gauges of `snapshot`, its time made relative to `t0_s` (seconds)."""
    values: dict[str, float | None] = {}
    for role in GAUGE_ROLES:
        name = _first_present(snapshot, candidate_names(runtime, role))
        values[role] = snapshot.total(name) if name else None
    return TimelinePoint(t_s=snapshot.t_s - t0_s, **values)


def _histogram_summary(first: Snapshot, last: Snapshot, base: str) -> HistogramSummary:
    """Bucket, sum and count deltas of histogram `base` (in seconds) between two scrapes."""
    # A labelled histogram can appear only at its first observation; absent at the start means 0.
    before = dict(first.buckets(base))
    after = last.buckets(base)
    delta = [(bound, count - before.get(bound, 0.0)) for bound, count in after]
    d_count = (last.total(f"{base}_count") or 0.0) - (first.total(f"{base}_count") or 0.0)
    if not last.has(f"{base}_count") and delta and math.isinf(delta[-1][0]):
        d_count = delta[-1][1]
    d_sum = (last.total(f"{base}_sum") or 0.0) - (first.total(f"{base}_sum") or 0.0)
    finite = [b for b, _ in after if not math.isinf(b)]
    quantiles = {
        q: (None if (v := histogram_quantile(q, delta)) is None else v * 1e3) for q in QUANTILES
    }
    return HistogramSummary(
        name=base,
        count=d_count,
        mean_ms=d_sum / d_count * 1e3 if d_count > 0 and last.has(f"{base}_sum") else None,
        p50_ms=quantiles[0.5],
        p90_ms=quantiles[0.9],
        p99_ms=quantiles[0.99],
        max_bound_ms=max(finite) * 1e3 if finite else None,
    )


def build_report(
    first: Snapshot,
    last: Snapshot,
    timeline: list[TimelinePoint],
    runtime: str,
    *,
    url: str = "",
    interval_s: float = 0.0,
    scrapes: int = 2,
    scrape_errors: int = 0,
    errors: list[str] | None = None,
) -> MetricsReport:
    """Turn the first and last scrape and the gauge timeline into a `MetricsReport`."""
    report = MetricsReport(
        available=True,
        runtime=runtime,
        url=url,
        interval_s=interval_s,
        duration_s=last.t_s - first.t_s,
        scrapes=scrapes,
        scrape_errors=scrape_errors,
        errors=list(errors or []),
        timeline=timeline,
    )
    for role in COUNTER_ROLES:
        # Resolved on the last scrape: a counter created during the run started at 0.
        name = _first_present(last, candidate_names(runtime, role))
        if name is None:
            report.deltas[role] = None
            continue
        report.names[role] = name
        delta = (last.total(name) or 0.0) - (first.total(name) or 0.0)
        if delta < 0:
            report.warnings.append(f"{name} went backwards ({delta:+g}): did the server restart?")
            report.deltas[role] = None
        else:
            report.deltas[role] = delta
    queries, hits = report.deltas.get("prefix_queries"), report.deltas.get("prefix_hits")
    if queries and hits is not None:
        report.prefix_hit_rate = hits / queries
    for role in GAUGE_ROLES:
        name = _first_present(last, candidate_names(runtime, role)) or _first_present(
            first, candidate_names(runtime, role)
        )
        if name:
            report.names[role] = name
    for role, attr in (("waiting", "max_waiting"), ("running", "max_running")):
        values = [getattr(p, role) for p in timeline if getattr(p, role) is not None]
        setattr(report, attr, max(values) if values else None)
    kv = [p.kv_usage for p in timeline if p.kv_usage is not None]
    report.max_kv_usage = max(kv) if kv else None
    for role in HISTOGRAM_ROLES:
        base = next(
            (n for n in candidate_names(runtime, role) if _histogram_present(last, n)), None
        )
        if base is None:
            report.histograms[role] = None
            continue
        report.names[role] = base
        summary = _histogram_summary(first, last, base)
        if summary.count < 0:
            report.warnings.append(f"{base} went backwards: did the server restart?")
            report.histograms[role] = None
        else:
            report.histograms[role] = summary
    return report


# --- the sampler --------------------------------------------------------------------------------


class ScrapeError(RuntimeError):
    """A scrape of /metrics failed (network, HTTP status, or text that is not Prometheus)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class MetricsSampler:
    """Scrape a server's ``/metrics`` every `interval_s` seconds during a run.

    `url` is the server's base URL (``http://host:port``) or the full metrics URL (ending in
    ``/metrics``). `headers` go with every scrape (e.g. an API key). Call `start()` before the
    load and `stop()` after it; `stop()` returns the `MetricsReport`.

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
                f"{self.url} has no metrics of a known runtime (vllm:, sglang:, tgi_, llamacpp:)"
            )
            return
        self.runtime, self._reason = runtime, None
        self._first = self._last = first
        self._record(first)
        self._task = asyncio.create_task(self._run(), name="metrics-sampler")

    async def stop(self) -> MetricsReport:
        """Stop sampling, take the final scrape, and report on the run."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._first is None or self.runtime is None:
            return MetricsReport(available=False, reason=self._reason, url=self.url)
        try:
            final = await self.scrape()
        except ScrapeError as exc:
            # Fall back on the last good scrape: the figures then end a little early.
            self._error(f"final scrape: {exc}")
        else:
            self._last = final
            self._record(final)
        assert self._last is not None
        return build_report(
            self._first,
            self._last,
            self._timeline,
            self.runtime,
            url=self.url,
            interval_s=self.interval_s,
            scrapes=self._scrapes,
            scrape_errors=self._errors,
            errors=self._messages,
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
