"""`pdscope watch`: the article's five metrics of a live server, over a sliding window.

Every `interval_s` the watcher scrapes ``/metrics`` (reusing `client/server_metrics.py`: its
parser, runtime names and histogram quantiles) and turns the scrapes of the last `window_s`
seconds into one `WatchSnapshot`:

* gauges (running, waiting, KV use) as of the newest scrape;
* TTFT and ITL p50/p99 from the difference of the cumulative buckets between the oldest and the
  newest scrape of the window, as Prometheus' ``histogram_quantile(q, increase(..[window]))``;
* token rates, preemptions and the prefix-cache hit rate from counter deltas over the window;
* the reading rules of `analysis/rules.py` that hold now.

A figure the server does not export is None with the reason in `missing`, never 0. A server that
stops answering is reported as unreachable since the first failed scrape, and watched again when
it returns; a page that is not Prometheus text (or names no known runtime) ends the watch with a
`NotPrometheusError`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdscope.analysis.rules import LiveFigures, live_findings
from pdscope.analysis.server_metrics import (
    START_TIME,
    counter_delta,
    histogram_summary,
    restarted,
)
from pdscope.client.server_metrics import (
    SUM,
    MetricsSampler,
    ScrapeError,
    Snapshot,
    candidate_names,
    detect_runtime,
    gauge_problem,
    gauge_reading,
)

# The figures watch shows, in display order, with the role (client/server_metrics.py) each is
# read from. Units are in the names.
FIGURES: tuple[str, ...] = (
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "running",
    "waiting",
    "kv_usage",
    "generation_tok_s",
    "prompt_tok_s",
    "preemptions",
    "prefix_hit_rate",
)
_ROLES: dict[str, tuple[str, ...]] = {
    "ttft_p50_ms": ("ttft",),
    "ttft_p99_ms": ("ttft",),
    "itl_p50_ms": ("itl",),
    "itl_p99_ms": ("itl",),
    "running": ("running",),
    "waiting": ("waiting",),
    "kv_usage": ("kv_usage",),
    "generation_tok_s": ("generation_tokens",),
    "prompt_tok_s": ("prompt_tokens",),
    "preemptions": ("preemptions",),
    "prefix_hit_rate": ("prefix_hits", "prefix_queries"),
}
_ROLE_WORDS = {
    "ttft": "TTFT histogram",
    "itl": "inter-token-latency histogram",
    "running": "running-requests gauge",
    "waiting": "waiting-requests gauge",
    "kv_usage": "KV-cache usage gauge",
    "generation_tokens": "generated-tokens counter",
    "prompt_tokens": "prompt-tokens counter",
    "preemptions": "preemption counter",
    "prefix_hits": "prefix-cache counters",
    "prefix_queries": "prefix-cache counters",
}
_COUNTER_ROLES = ("generation_tokens", "prompt_tokens", "preemptions", "prefix_hits")


# The youngest server counted from its start time: prometheus_client gives that time to the
# second (from /proc's boot time), and a client on another host reads it on another clock, so a
# base younger than this could be a large share of the span it opens.
MIN_BASE_AGE_S = 20.0


class NotPrometheusError(RuntimeError):
    """The URL answers, but not with Prometheus metrics of a known runtime."""


@dataclass
class WatchSettings:
    url: str  # the server's base URL, or its full /metrics URL
    window_s: float = 60.0
    interval_s: float = 1.0
    history_s: float = 300.0  # how far back the sparklines reach
    api_key: str | None = None
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("window_s", "interval_s", "history_s", "timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.window_s < self.interval_s:
            raise ValueError(
                f"the window ({self.window_s:g} s) must span at least one scrape interval "
                f"({self.interval_s:g} s)"
            )


@dataclass
class WatchSnapshot:
    """What watch shows at one moment. JSON-ready through `to_dict` (one line of --record)."""

    time: str  # wall clock, ISO 8601 UTC
    t_s: float  # seconds since the watch started (client clock), for timelines
    url: str
    reachable: bool
    runtime: str | None = None  # whose metric names the server exports
    knobs_for: str | None = None  # whose settings the rules name (pdscope serve: "pdscope")
    window_s: float = 0.0
    covered_s: float = 0.0  # seconds the window's scrapes actually span (less at the start)
    scrapes_in_window: int = 0
    values: dict[str, float | None] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)  # figure -> why it has no value
    absent: list[str] = field(default_factory=list)  # figures the server exports no series for
    names: dict[str, str] = field(default_factory=dict)  # figure -> series it was read from
    # figure -> ["below"/"above", bound ms]: a quantile known only by a bucket bound
    edges: dict[str, list[Any]] = field(default_factory=dict)
    rules: list[dict[str, str]] = field(default_factory=list)
    unreachable_since: str | None = None
    error: str | None = None
    events: list[str] = field(default_factory=list)  # restarts, recoveries (this tick)
    # `--once`: every event of its window (a restart early in it is not this tick's event)
    window_events: list[str] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "t_s": self.t_s,
            "url": self.url,
            "reachable": self.reachable,
            "runtime": self.runtime,
            "knobs_for": self.knobs_for,
            "window_s": self.window_s,
            "covered_s": self.covered_s,
            "scrapes_in_window": self.scrapes_in_window,
            **{name: self.values.get(name) for name in FIGURES},
            "missing": dict(self.missing),
            "absent": list(self.absent),
            "names": dict(self.names),
            "edges": {k: list(v) for k, v in self.edges.items()},
            "rules": [dict(r) for r in self.rules],
            "unreachable_since": self.unreachable_since,
            "error": self.error,
            "events": list(self.events),
            **({} if self.window_events is None else {"window_events": self.window_events}),
        }


def _now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _gauge(snapshot: Snapshot, runtime: str, role: str) -> tuple[float | None, str | None]:
    name = next((n for n in candidate_names(runtime, role) if snapshot.has(n)), None)
    return (gauge_reading(snapshot, role, name) if name else None), name


def _nearest(snapshots: list[Snapshot], t_s: float) -> Snapshot:
    return min(snapshots, key=lambda s: abs(s.t_s - t_s))


def _p50_ms(first: Snapshot, last: Snapshot, base: str) -> float | None:
    summary = histogram_summary(first, last, base)
    return summary.p50_ms if summary.count > 0 else None


class Watcher:
    """Scrapes one server and keeps the window; `tick()` returns the next `WatchSnapshot`."""

    def __init__(self, settings: WatchSettings, client: httpx.AsyncClient):
        self.settings = settings
        headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else None
        # The sampler is used for its scrape alone: one GET, timed, parsed, errors classified.
        self._scraper = MetricsSampler(
            client, settings.url, settings.interval_s, headers, timeout_s=settings.timeout_s
        )
        self.url = self._scraper.url
        self.runtime: str | None = None
        # The runtime whose knobs the rules name: `pdscope serve` exports vLLM's names, but its
        # flags differ in places (--kv-cache-memory), so it is told apart once, by /v1/models.
        self.knob_runtime: str | None = None
        self._client = client
        self._headers = headers
        self._window: deque[Snapshot] = deque()
        self.history: deque[tuple[float, dict[str, float | None]]] = deque()
        self._unreachable_since: str | None = None
        self._events: list[str] = []
        # The last few events, for a view that should show a recovery for longer than a tick.
        self.recent_events: deque[str] = deque(maxlen=3)
        self._started_s = time.perf_counter()
        self._base: Snapshot | None = None  # the zero base at the server's start, if any

    async def tick(self) -> WatchSnapshot:
        """One scrape and the snapshot it gives. Raises NotPrometheusError on a foreign page."""
        try:
            snapshot = await self._scraper.scrape()
        except ScrapeError as exc:
            if exc.status is None and "not Prometheus text" in str(exc):
                raise NotPrometheusError(f"{self.url} is not Prometheus text: {exc}") from None
            if exc.status == 404:
                raise NotPrometheusError(
                    f"{self.url} answered 404: no /metrics there (give the server's base "
                    "URL, e.g. http://127.0.0.1:8000, or its /metrics URL)"
                ) from None
            return self._unreachable(str(exc))
        runtime = detect_runtime(snapshot)
        if runtime is None:
            raise NotPrometheusError(
                f"{self.url} is Prometheus text but names no series of a known runtime "
                f"(vllm:, sglang:, tgi_, llamacpp:)"
            )
        if self._unreachable_since is not None:
            self._events.append(
                f"recovered at {_now_iso()} (unreachable since {self._unreachable_since})"
            )
            self._unreachable_since = None
        if self.runtime is not None and runtime != self.runtime:
            self._events.append(f"runtime changed from {self.runtime} to {runtime}")
            self._window.clear()
            self.knob_runtime = None
        self.runtime = runtime
        if self.knob_runtime is None:
            self.knob_runtime = await self._knob_runtime(runtime)
        if self._window and (why := self._restart(self._window[-1], snapshot)):
            # A restarted server starts its counters again: deltas across it mean nothing.
            self._events.append(f"{why} at {_now_iso()}")
            self._window.clear()
        if not self._window and (base := self._zero_base(snapshot)) is not None:
            self._window.append(base)
            self._base = base
        self._window.append(snapshot)
        # Keep the newest scrape at or before the window's start as its base, so the deltas
        # cover the whole window (after a pause in scraping too), never less.
        horizon = snapshot.t_s - self.settings.window_s
        while len(self._window) > 2 and self._window[1].t_s <= horizon:
            self._window.popleft()
        out = self._compute(list(self._window), runtime)
        self._remember(snapshot.t_s, out.values)
        return out

    async def _knob_runtime(self, runtime: str) -> str:
        if runtime != "vllm":
            return runtime
        base = self.url.removesuffix("/metrics")
        try:
            r = await self._client.get(
                f"{base}/v1/models", headers=self._headers, timeout=self.settings.timeout_s
            )
            owners = {m.get("owned_by") for m in r.json().get("data", [])}
        except (httpx.HTTPError, ValueError, AttributeError):
            return runtime  # not an OpenAI front, or not one we can read: vLLM's knobs
        return "pdscope" if "pdscope" in owners else runtime

    def _zero_base(self, snapshot: Snapshot) -> Snapshot | None:
        """The scrape a server that started inside the window would have given at its start:
        every counter and histogram at 0 (an empty page), at its process start time. Deltas
        from it are exact to within the start time's second, so a restart (seen or not) or a
        fresh server needs no second scrape and loses nothing between its start and the first
        scrape. None where the page has no start time, or the start lies outside the window or
        less than MIN_BASE_AGE_S ago."""
        start_s = snapshot.total(START_TIME)
        if start_s is None or not math.isfinite(start_s):
            return None
        # the scrape's wall-clock time, from its perf_counter stamp
        age_s = time.time() - (time.perf_counter() - snapshot.t_s) - start_s
        if not MIN_BASE_AGE_S <= age_s <= self.settings.window_s:
            return None
        return Snapshot(t_s=snapshot.t_s - age_s)

    def _restart(self, before: Snapshot, after: Snapshot) -> str | None:
        """Why the server restarted between two scrapes (None: it did not, as far as either
        shows): its process start time moved, or a counter went backwards."""
        assert self.runtime is not None
        if (why := restarted(before, after)) is not None:
            return why
        for role in _COUNTER_ROLES:
            for name in candidate_names(self.runtime, role):
                a, b = before.total(name), after.total(name)
                if a is not None and b is not None and b < a:
                    return "counters went backwards: server restarted"
        return None

    def _unreachable(self, error: str) -> WatchSnapshot:
        if self._unreachable_since is None:
            self._unreachable_since = _now_iso()
        values: dict[str, float | None] = {name: None for name in FIGURES}
        now_s = time.perf_counter()
        self._remember(now_s, values)
        return WatchSnapshot(
            time=_now_iso(),
            t_s=now_s - self._started_s,
            url=self.url,
            reachable=False,
            runtime=self.runtime,
            window_s=self.settings.window_s,
            values=values,
            missing={name: "server unreachable" for name in FIGURES},
            unreachable_since=self._unreachable_since,
            error=error,
            events=self._take_events(),
        )

    def _take_events(self) -> list[str]:
        events, self._events = self._events, []
        self.recent_events.extend(events)
        return events

    def _remember(self, t_s: float, values: dict[str, float | None]) -> None:
        self.history.append((t_s, dict(values)))
        while self.history and self.history[0][0] < t_s - self.settings.history_s:
            self.history.popleft()

    def _scrapes(self, window: list[Snapshot]) -> list[Snapshot]:
        """The window's real scrapes, without a zero base standing in for the server's start
        (its halves and its scrape count are those watch saw)."""
        return window[1:] if window and window[0] is self._base else window

    def _compute(self, window: list[Snapshot], runtime: str) -> WatchSnapshot:
        first, last = window[0], window[-1]
        span_s = last.t_s - first.t_s
        out = WatchSnapshot(
            time=_now_iso(),
            t_s=last.t_s - self._started_s,
            url=self.url,
            reachable=True,
            runtime=runtime,
            knobs_for=self.knob_runtime,
            window_s=self.settings.window_s,
            covered_s=span_s,
            scrapes_in_window=len(self._scrapes(window)),
            events=self._take_events(),
        )
        values, missing, names = out.values, out.missing, out.names

        def absent(figure: str) -> bool:
            """Record why `figure` has no series on this server; True when it has none."""
            for role in _ROLES[figure]:
                candidates = candidate_names(runtime, role)
                if not candidates:
                    missing[figure] = f"{runtime} exports no {_ROLE_WORDS[role]}"
                    out.absent.append(figure)
                    return True
                histogram = role in ("ttft", "itl")
                present = [
                    n
                    for n in candidates
                    if last.has(f"{n}_bucket" if histogram else n)
                    or (histogram and last.has(f"{n}_count"))
                ]
                if not present:
                    missing[figure] = f"{' / '.join(candidates)} not on /metrics"
                    out.absent.append(figure)
                    return True
            return False

        for figure in ("running", "waiting", "kv_usage"):
            values[figure] = None
            if absent(figure):
                continue
            value, name = _gauge(last, runtime, figure)
            if name:
                names[figure] = name
            if value is None and name:  # the series is there, every value NaN
                missing[figure] = f"{name} read NaN"
                continue
            if value is not None and (problem := gauge_problem(figure, value)):
                missing[figure] = f"{name} {problem}"  # shown as why, never as a figure
                continue
            values[figure] = value
        two = len(window) >= 2 and span_s > 0
        why_one = "one scrape so far: the window needs two"
        for role, prefix in (("ttft", "ttft"), ("itl", "itl")):
            p50, p99 = f"{prefix}_p50_ms", f"{prefix}_p99_ms"
            values[p50] = values[p99] = None
            if absent(p50):
                missing[p99] = missing[p50]
                out.absent.append(p99)
                continue
            base = next(
                n
                for n in candidate_names(runtime, role)
                if last.has(f"{n}_bucket") or last.has(f"{n}_count")
            )
            names[p50] = names[p99] = base
            if not last.has(f"{base}_bucket"):
                missing[p50] = missing[p99] = f"{base} has no buckets (a summary?)"
                continue
            if not two:
                missing[p50] = missing[p99] = why_one
                continue
            summary = histogram_summary(first, last, base)
            if summary.count <= 0:
                missing[p50] = missing[p99] = (
                    f"no {prefix.upper()} observations in the last {span_s:.0f} s"
                )
                continue
            values[p50], values[p99] = summary.p50_ms, summary.p99_ms
            for key, figure in (("p50_ms", p50), ("p99_ms", p99)):
                if key in summary.edges:
                    out.edges[figure] = summary.edges[key]
        for figure, role in (
            ("generation_tok_s", "generation_tokens"),
            ("prompt_tok_s", "prompt_tokens"),
            ("preemptions", "preemptions"),
        ):
            values[figure] = None
            if absent(figure):
                continue
            name = next(n for n in candidate_names(runtime, role) if last.has(n))
            names[figure] = name
            if not two:
                missing[figure] = why_one
                continue
            delta, problem = counter_delta(first, last, name)
            if problem is not None:
                missing[figure] = f"{name} {problem}"
                continue
            values[figure] = delta if figure == "preemptions" else delta / span_s
        values["prefix_hit_rate"] = None
        if not absent("prefix_hit_rate"):
            hits = next(n for n in candidate_names(runtime, "prefix_hits") if last.has(n))
            queries = next(n for n in candidate_names(runtime, "prefix_queries") if last.has(n))
            names["prefix_hit_rate"] = f"{hits} / " + (
                f"({queries})" if SUM in queries else queries
            )
            d_queries, bad_queries = counter_delta(first, last, queries)
            d_hits, bad_hits = counter_delta(first, last, hits)
            if not two:
                missing["prefix_hit_rate"] = why_one
            elif bad_queries or bad_hits:
                missing["prefix_hit_rate"] = (
                    f"{queries} {bad_queries}" if bad_queries else f"{hits} {bad_hits}"
                )
            elif d_queries <= 0:
                missing["prefix_hit_rate"] = f"no prompt tokens looked up in {span_s:.0f} s"
            elif d_hits > d_queries:
                missing["prefix_hit_rate"] = (
                    f"hits ({d_hits:g}) exceed queries ({d_queries:g}) in {span_s:.0f} s"
                )
            else:
                values["prefix_hit_rate"] = d_hits / d_queries
        out.rules = live_findings(
            self._live_figures(self._scrapes(window), runtime, values),
            self.knob_runtime or runtime,
        )
        return out

    def _live_figures(
        self, window: list[Snapshot], runtime: str, values: dict[str, float | None]
    ) -> LiveFigures:
        first, last = window[0], window[-1]
        halves: dict[str, float | None] = {
            "ttft_p50_first_half_ms": None,
            "ttft_p50_second_half_ms": None,
            "running_max_first_half": None,
            "running_max_second_half": None,
        }
        base = next((n for n in candidate_names(runtime, "ttft") if last.has(f"{n}_bucket")), None)
        if len(window) >= 3:
            mid = _nearest(window[1:-1], (first.t_s + last.t_s) / 2)
            if base is not None:
                halves["ttft_p50_first_half_ms"] = _p50_ms(first, mid, base)
                halves["ttft_p50_second_half_ms"] = _p50_ms(mid, last, base)
            running = [(s.t_s, _gauge(s, runtime, "running")[0]) for s in window]
            running = [
                (t, v) for t, v in running if v is not None and not gauge_problem("running", v)
            ]
            a = [v for t, v in running if t <= mid.t_s]
            b = [v for t, v in running if t >= mid.t_s]
            halves["running_max_first_half"] = max(a) if a else None
            halves["running_max_second_half"] = max(b) if b else None
        return LiveFigures(
            running=values.get("running"),
            waiting=values.get("waiting"),
            kv_usage=values.get("kv_usage"),
            ttft_p50_ms=values.get("ttft_p50_ms"),
            itl_p50_ms=values.get("itl_p50_ms"),
            itl_p99_ms=values.get("itl_p99_ms"),
            prompt_tok_s=values.get("prompt_tok_s"),
            **halves,
        )


async def run(
    settings: WatchSettings,
    on_snapshot: Callable[[WatchSnapshot, Watcher], None],
    *,
    once: bool = False,
    client: httpx.AsyncClient | None = None,
) -> WatchSnapshot | None:
    """Tick every `interval_s` until cancelled, handing each snapshot to `on_snapshot`.

    With `once`, scrape for one window and return its last snapshot (also handed over),
    carrying every event of the window: a restart or an outage inside it would otherwise be
    told only by the tick that saw it.
    Raises NotPrometheusError when the page is not Prometheus text of a known runtime.
    """
    own = client is None
    client = client or httpx.AsyncClient()
    watcher = Watcher(settings, client)
    started_s = time.perf_counter()
    next_s = started_s
    seen: list[str] = []
    try:
        while True:
            snapshot = await watcher.tick()
            seen += snapshot.events
            now = time.perf_counter()
            if once:
                # every tick carries the window's events so far: one cut short by Ctrl-C too
                snapshot.window_events = list(seen)
            if once and now - started_s >= settings.window_s:
                on_snapshot(snapshot, watcher)
                return snapshot
            on_snapshot(snapshot, watcher)
            # Fixed rate on the client clock; ticks missed during a slow scrape are skipped.
            next_s += settings.interval_s
            if next_s < now:
                next_s = now + settings.interval_s - (now - next_s) % settings.interval_s
            await asyncio.sleep(next_s - now)
    finally:
        if own:
            await client.aclose()
