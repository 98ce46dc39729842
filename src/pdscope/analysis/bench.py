"""What a load run's traces say: latency distributions, throughput, goodput, failures.

Field names follow vllm bench serve's result JSON where both have a figure (``duration``,
``completed``, ``request_throughput``, ``mean_ttft_ms``, ``p99_itl_ms``, ...), so saved runs can be
read side by side with vLLM's. Percentiles: numpy linear interpolation, as vLLM. Failed requests
are counted by kind and listed; they contribute to no latency figure.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from pdscope.analysis.stats import median, summary
from pdscope.client.adapters import CHUNKS_OVER_COUNT
from pdscope.client.trace import Trace

METRICS = ("ttft", "tpot", "itl", "e2el")
_UNITS = {"ms": 1e-3, "s": 1.0, "us": 1e-6}


class SLOError(ValueError):
    """An SLO spec that cannot be read."""


@dataclass(frozen=True)
class SLO:
    """Per-request limits (seconds) for goodput, or aggregate ``pNN_metric`` limits for
    capacity searches. Unset limits are None."""

    limits: dict[str, float]

    @classmethod
    def parse(cls, text: str | None, aggregate: bool = False) -> SLO:
        if not text:
            return cls({})
        limits = {}
        for part in text.split(","):
            m = re.fullmatch(r"\s*([a-z0-9_.]+)\s*=\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|us)\s*", part)
            if not m:
                raise SLOError(f"cannot read SLO {part!r}; write e.g. ttft=2s,tpot=100ms")
            key = m.group(1)
            metric = key.split("_", 1)[1] if aggregate and "_" in key else key
            if metric == "e2e":
                metric = "e2el"
                key = key.replace("e2e", "e2el")
            if metric not in METRICS or (
                aggregate and not re.fullmatch(r"p[0-9.]+_.+|mean_.+", key)
            ):
                expected = (
                    "pNN_ttft, pNN_tpot, pNN_itl, pNN_e2el" if aggregate else "ttft, tpot, itl, e2e"
                )
                raise SLOError(f"unknown SLO {key!r}; expected {expected}")
            limits[key if aggregate else metric] = float(m.group(2)) * _UNITS[m.group(3)]
        return cls(limits)

    def met_by(self, trace: Trace) -> bool:
        """A request meets the SLO when each limited figure it has is within its limit (ITL by
        its worst gap)."""
        if not trace.ok:
            return False
        values = {
            "ttft": trace.ttft_s,
            "tpot": trace.tpot_s,
            "e2el": trace.e2e_s,
            "itl": max(trace.itl_samples_s(), default=None),
        }
        return all(values.get(k) is None or values[k] <= limit for k, limit in self.limits.items())

    @property
    def percentiles(self) -> list[float]:
        """Percentiles the aggregate limits need computed (p99_ttft -> 99)."""
        return sorted({float(k[1:].split("_")[0]) for k in self.limits if k.startswith("p")})

    def met_by_run(self, result: dict[str, Any]) -> bool:
        """Aggregate limits such as p99_ttft against a summarised run (ms fields)."""
        for key, limit in self.limits.items():
            value = result.get(f"{key}_ms")
            if value is None or value > limit * 1e3:
                return False
        return True


def failure_kind(error: str) -> str:
    if error.startswith("HTTP "):
        return error.split(":")[0]
    if error.startswith("timeout"):
        return "timeout"
    if "malformed" in error:
        return "malformed stream"
    if "ended before" in error:
        return "truncated stream"
    if "no generated content" in error:
        return "no content"
    if "finish_reason abort" in error:
        return "aborted by the server"
    return error.split(":")[0][:40]


def _count_source(token_source: str) -> str:
    """Trace.token_source with the server's own figure dropped, so requests group by source."""
    if token_source.startswith(CHUNKS_OVER_COUNT):
        return f"{CHUNKS_OVER_COUNT} fewer)"
    return token_source


def summarize(
    traces: list[Trace],
    duration_s: float,
    percentiles: tuple[float, ...] = (50, 90, 95, 99),
    slo: SLO | None = None,
) -> dict[str, Any]:
    """One run's figures with vllm bench serve's names, plus ours."""
    good = [t for t in traces if t.ok]
    failed = [t for t in traces if not t.ok]
    samples = {
        "ttft": [t.ttft_s for t in good if t.ttft_s is not None],
        "tpot": [t.tpot_s for t in good if t.tpot_s is not None],
        "itl": [s for t in good for s in t.itl_samples_s()],
        "e2el": [t.e2e_s for t in good if t.e2e_s is not None],
    }
    input_tokens = sum(t.prompt_tokens or t.prompt_tokens_asked or 0 for t in good)
    output_tokens = sum(t.n_output or 0 for t in good)
    out: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(good),
        "failed": len(failed),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(good) / duration_s if duration_s > 0 else None,
        "output_throughput": output_tokens / duration_s if duration_s > 0 else None,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s
        if duration_s > 0
        else None,
    }
    for name, values in samples.items():
        s = summary([v * 1e3 for v in values], percentiles)
        out[f"mean_{name}_ms"] = s.get("mean")
        out[f"median_{name}_ms"] = s.get("median")
        out[f"std_{name}_ms"] = s.get("std")
        for p in percentiles:
            out[f"p{p:g}_{name}_ms"] = s.get(f"p{p:g}")
    # Where pdscope's clocks differ from vLLM's, the difference is its own figure: connection
    # setup (vLLM's TTFT includes it) and the close (last content chunk to the last byte, which
    # an E2E to the last byte would include).
    for name, values in (
        ("setup", [t.setup_s for t in good if t.setup_s is not None]),
        ("close", [t.close_s for t in good if t.close_s is not None]),
    ):
        s_ = summary([v * 1e3 for v in values], (99,))
        out[f"mean_{name}_ms"] = s_.get("mean")
        out[f"p99_{name}_ms"] = s_.get("p99")
    out["request_goodput"] = None  # vLLM's key is always there; null without an SLO
    if slo and slo.limits:
        met = sum(1 for t in traces if slo.met_by(t))
        out["request_goodput"] = met / duration_s if duration_s > 0 else None
        out["goodput_fraction"] = met / len(traces) if traces else None
        out["slo"] = {k: v for k, v in slo.limits.items()}
    reported = [t.prompt_tokens for t in good if t.prompt_tokens is not None]
    out["input_tokens_achieved"] = (
        {
            "median": median(reported),
            "min": min(reported),
            "max": max(reported),
            "source": "server prompt counts",
        }
        if reported
        else None
    )
    out["output_tokens_source"] = dict(Counter(_count_source(t.token_source) for t in good))
    out["retried"] = sum(1 for t in traces if t.retried)
    # Kept in the figures, as vllm bench serve keeps them, but counted: such a request's first
    # tokens waited in the client, so its TPOT and gaps measure the client, not the server.
    out["read_in_bursts"] = sum(1 for t in good if t.read_in_bursts)
    lags = [t.lag_s for t in traces if t.lag_s is not None]
    lag = summary([v * 1e3 for v in lags], (50, 99))
    out["client_lag_ms"] = {"mean": lag.get("mean"), "p99": lag.get("p99"), "max": lag.get("max")}
    cached = [t.cached_tokens for t in good if t.cached_tokens is not None]
    out["total_cached_tokens"] = sum(cached) if cached else None
    out["failures_by_kind"] = dict(Counter(failure_kind(t.error or "") for t in failed))
    out["failures"] = [
        {"error": t.error, "kind": t.label, "prompt_tokens": t.prompt_tokens_asked} for t in failed
    ][:50]
    out["percentile_method"] = "numpy linear interpolation"
    return out


def by_kind(
    traces: list[Trace], duration_s: float, percentiles: tuple[float, ...]
) -> dict[str, dict[str, Any]]:
    """The same summary per request kind (e.g. decode streams vs long prompts)."""
    kinds = sorted({t.label for t in traces if t.label})
    return {
        k: summarize([t for t in traces if t.label == k], duration_s, percentiles) for k in kinds
    }


def nothing_completed(result: dict[str, Any]) -> str | None:
    """Where a run (bench's or simulate's) completed no request but failed some: the first
    failure's message, for a one-line error and a non-zero exit. None otherwise."""
    for run in result.get("runs", []):
        s = run["summary"]
        if s["completed"] == 0 and s.get("failures"):
            return str(s["failures"][0]["error"])
    return None
