"""The server's figures for one run, from what `client.server_metrics` scraped: counter
deltas, gauge maxima, and histogram quantiles of the run alone (the difference of cumulative
bucket counts between the first and the last scrape, as Prometheus' ``histogram_quantile``
computes over ``increase(..._bucket[run])``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pdscope.client.server_metrics import (
    COUNTER_ROLES,
    GAUGE_ROLES,
    HISTOGRAM_ROLES,
    SUM,
    ScrapedRun,
    Snapshot,
    TimelinePoint,
    candidate_names,
    first_present,
    gauge_problem,
)

QUANTILES = (0.5, 0.9, 0.99)


# --- histogram quantiles ------------------------------------------------------------------------


def _merged(buckets: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(bound, count) pairs with counts of one bound added up, by bound."""
    merged: dict[float, float] = {}
    for bound, count in buckets:
        merged[bound] = merged.get(bound, 0.0) + count
    return sorted(merged.items())


def _locate(
    q: float, buckets: list[tuple[float, float]]
) -> tuple[list[float], list[float], int, float] | None:
    """Bounds, monotonic cumulative counts, the index of the bucket holding rank q·total, and
    the rank; None where Prometheus' ``histogram_quantile`` returns NaN."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be within [0, 1], got {q}")
    ordered = _merged(buckets)
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
    return bounds, counts, b, rank


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
    found = _locate(q, buckets)
    if found is None:
        return None
    bounds, counts, b, rank = found
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


def quantile_edge(q: float, buckets: list[tuple[float, float]]) -> tuple[str, float] | None:
    """Where the q-quantile is known only by one bound: ("below", the first bound) when its rank
    falls in the first bucket, ("above", the largest finite bound) when it falls in +Inf; None
    when it lies between two bounds or cannot be computed. `histogram_quantile` still gives
    Prometheus' figure (the first bucket interpolated from 0, e.g. 5 ms for samples all under
    10 ms), so a display can say "< 10 ms" instead."""
    found = _locate(q, buckets)
    if found is None:
        return None
    bounds, counts, b, _ = found
    if b == len(counts) - 1:
        return "above", bounds[-2]
    if b == 0 and bounds[0] > 0:
        return "below", bounds[0]
    return None


# --- the report ---------------------------------------------------------------------------------


@dataclass
class HistogramSummary:
    """One latency histogram over the run (final − first bucket counts), in milliseconds.

    `name` is the histogram's base name on the server. Quantiles follow `histogram_quantile`, so
    they are only as fine as the server's buckets; `max_bound_ms` is the largest finite bound
    (no quantile exceeds it). `edges` maps a quantile ("p50_ms") known only by one bound to
    `quantile_edge`'s ["below" or "above", the bound in ms]. Quantiles and the mean are None
    when the run observed nothing or the server exports no buckets (e.g. a summary).
    """

    name: str
    count: float
    mean_ms: float | None
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    max_bound_ms: float | None
    edges: dict[str, list[Any]] = field(default_factory=dict)
    dip: float = 0.0  # `dipped` of the window's bucket counts: 0 for a well-formed histogram

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "count": self.count,
            "mean_ms": self.mean_ms,
            "p50_ms": self.p50_ms,
            "p90_ms": self.p90_ms,
            "p99_ms": self.p99_ms,
            "max_bound_ms": self.max_bound_ms,
            "edges": {k: list(v) for k, v in self.edges.items()},
        }


@dataclass
class MetricsReport:
    """What the server's ``/metrics`` said about one run.

    When `available` is False, `reason` says why (no endpoint, not Prometheus, unknown runtime)
    and the figures are empty. `deltas` maps each counter role to final − first (tokens,
    requests), None where the runtime lacks the role or the counter went backwards (a server
    restart). `prefix_hit_rate` is Δhits / Δqueries over the run (prompt tokens), None without
    queries. The gauges' maxima are over the scrapes inside the load (`load_scrapes` of them,
    see `inside_load`): the first scrape comes before the first request and the final one after
    the last response, both idle. A run shorter than the scrape interval has none: its maxima
    are None (too short to sample), while its counters and histograms, first to final scrape,
    still cover it. `load_scrapes` is None where no timeline was given.
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
    load_scrapes: int | None = None
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
            "load_scrapes": self.load_scrapes,
            "histograms": {k: (h.to_dict() if h else None) for k, h in self.histograms.items()},
            "warnings": list(self.warnings),
        }


def _histogram_present(snapshot: Snapshot, base: str) -> bool:
    return any(snapshot.has(f"{base}{suffix}") for suffix in ("_bucket", "_count", "_sum"))


def histogram_summary(first: Snapshot, last: Snapshot, base: str) -> HistogramSummary:
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
    edges: dict[str, list[Any]] = {}
    for q in QUANTILES:
        if (edge := quantile_edge(q, delta)) is not None:
            edges[f"p{round(q * 100)}_ms"] = [edge[0], edge[1] * 1e3]
    return HistogramSummary(
        name=base,
        count=d_count,
        mean_ms=d_sum / d_count * 1e3 if d_count > 0 and last.has(f"{base}_sum") else None,
        p50_ms=quantiles[0.5],
        p90_ms=quantiles[0.9],
        p99_ms=quantiles[0.99],
        max_bound_ms=max(finite) * 1e3 if finite else None,
        edges=edges,
        dip=dipped(delta),
    )


# prometheus_client's process collector: on vLLM's /metrics (0.32.0, recorded) and pdscope serve's.
START_TIME = "process_start_time_seconds"


def restarted(first: Snapshot, last: Snapshot) -> str | None:
    """Why deltas between two scrapes mean nothing because the server restarted between them,
    else None: its process start time moved. A restart whose counters already passed their old
    values shows nothing else: they only ever read lower when fewer requests came since."""
    before, after = first.total(START_TIME), last.total(START_TIME)
    if before is None or after is None or abs(after - before) < 1.0:
        return None
    return f"the server restarted ({START_TIME} moved by {after - before:+.0f} s)"


def dipped(buckets: list[tuple[float, float]]) -> float:
    """How far a histogram's cumulative bucket counts fall below an earlier bucket's (0 when
    they never do). A dip is no histogram a server should send; quantiles then take the
    running maximum, as Prometheus' histogram_quantile does."""
    running = worst = 0.0
    for _, count in _merged(buckets):
        worst = max(worst, running - count)
        running = max(running, count)
    return worst


def counter_delta(first: Snapshot, last: Snapshot, name: str) -> tuple[float, str | None]:
    """A counter's increase between two scrapes (absent at the first: it started at 0), or
    why there is none: a reading that is not a finite number (NaN reads as no value). A sum of
    counters ("a + b") increases by the sum of theirs, each from its own start."""
    if SUM in name:
        deltas = [counter_delta(first, last, part) for part in name.split(SUM)]
        problem = next((why for _, why in deltas if why is not None), None)
        return (0.0, problem) if problem else (math.fsum(d for d, _ in deltas), None)
    before, after = first.total(name), last.total(name)
    # total() skips NaN: a series present whose value is None read NaN, not "absent".
    if first.has(name) and (before is None or not math.isfinite(before)):
        return 0.0, f"read {_shown(before)} at the window's start, not a count"
    if after is None or not math.isfinite(after):
        return 0.0, f"read {_shown(after)}, not a count"
    return after - (before or 0.0), None


def inside_load(timeline: list[TimelinePoint], final_failed: bool = False) -> list[TimelinePoint]:
    """The timeline's points scraped while the load ran. The sampler scrapes once before the
    first request (the first point) and once after the last response (the last point, unless
    that scrape failed: ``final_failed``); every point between them is inside the load."""
    if len(timeline) < 2:
        return []
    return timeline[1:] if final_failed else timeline[1:-1]


def _shown(value: float | None) -> str:
    return "NaN" if value is None else f"{value:g}"


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
    final_failed: bool = False,
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
    # A delta across a restart spans two processes' counters: no figure of this run. The
    # gauges, read scrape by scrape, still are.
    restart = restarted(first, last)
    if restart is not None:
        report.warnings.append(f"{restart}: no counter or histogram of the run is shown")
    for role in COUNTER_ROLES:
        # Resolved on the last scrape: a counter created during the run started at 0.
        name = first_present(last, candidate_names(runtime, role))
        if name is None:
            report.deltas[role] = None
            continue
        report.names[role] = name
        delta, problem = counter_delta(first, last, name)
        if restart is not None:
            report.deltas[role] = None
        elif problem is not None:
            report.warnings.append(f"{name} {problem}")
            report.deltas[role] = None
        elif delta < 0:
            report.warnings.append(f"{name} went backwards ({delta:+g}): did the server restart?")
            report.deltas[role] = None
        else:
            report.deltas[role] = delta
    queries, hits = report.deltas.get("prefix_queries"), report.deltas.get("prefix_hits")
    if queries and hits is not None:
        report.prefix_hit_rate = hits / queries
        if hits > queries:  # more tokens found in the cache than looked up
            report.warnings.append(
                f"prefix-cache hits ({hits:g}) exceed queries ({queries:g}): no hit rate"
            )
            report.prefix_hit_rate = None
    for role in GAUGE_ROLES:
        name = first_present(last, candidate_names(runtime, role)) or first_present(
            first, candidate_names(runtime, role)
        )
        if name:
            report.names[role] = name
    load = inside_load(timeline, final_failed)
    report.load_scrapes = len(load) if timeline else None
    for role in GAUGE_ROLES:
        read = [v for p in load if (v := getattr(p, role)) is not None]
        kept = [v for v in read if gauge_problem(role, v) is None]
        if len(kept) < len(read):
            bad = next(v for v in read if gauge_problem(role, v) is not None)
            report.warnings.append(
                f"{report.names.get(role, role)} {gauge_problem(role, bad)}; "
                f"{len(read) - len(kept)} of {len(read)} scrapes left out of its maximum"
            )
        setattr(report, f"max_{role}", max(kept) if kept else None)
    for role in HISTOGRAM_ROLES:
        base = next(
            (n for n in candidate_names(runtime, role) if _histogram_present(last, n)), None
        )
        if base is None:
            report.histograms[role] = None
            continue
        report.names[role] = base
        summary = histogram_summary(first, last, base)
        if restart is not None:
            report.histograms[role] = None
            continue
        if summary.count < 0:
            report.warnings.append(f"{base} went backwards: did the server restart?")
            report.histograms[role] = None
            continue
        report.histograms[role] = summary
        if summary.dip:
            report.warnings.append(
                f"{base}'s buckets are not cumulative (one is {summary.dip:g} below a lower "
                "bucket): its quantiles take the running maximum, as Prometheus does"
            )
    return report


def report_of(run: ScrapedRun) -> MetricsReport:
    """A sampler's run as a `MetricsReport` (unavailable, with the reason, when it saw none)."""
    if run.first is None or run.last is None or run.runtime is None:
        return MetricsReport(available=False, reason=run.reason, url=run.url)
    return build_report(
        run.first,
        run.last,
        run.timeline,
        run.runtime,
        url=run.url,
        interval_s=run.interval_s,
        scrapes=run.scrapes,
        scrape_errors=run.scrape_errors,
        errors=run.errors,
        final_failed=run.final_failed,
    )
