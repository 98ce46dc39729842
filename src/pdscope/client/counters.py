"""Server counters read around one request: how many prompt tokens the prefix cache served.

vLLM leaves cached tokens out of ``usage`` unless started with ``--enable-prompt-tokens-details``,
and SGLang reports them only in some versions; both (and `pdscope serve`) count prefix-cache hits
in tokens on ``/metrics``. Requests that run one at a time (probe) can read that counter just
before and just after each request: the difference is that request's cached tokens, as long as
nothing else is using the server meanwhile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import httpx

from pdscope.client.server_metrics import candidate_names, detect_runtime, parse_metrics


@dataclass
class PrefixHitCounter:
    """Reads the server's prefix-cache hit counter (tokens); `name` says which one was found."""

    client: httpx.AsyncClient
    url: str
    headers: dict[str, str] | None = None
    name: str | None = None  # the sample name read, once the first read found one

    async def read(self) -> float | None:
        """The counter's current value; None when the server has no such counter or /metrics
        cannot be read (the caller then says the cache state is unknown)."""
        try:
            r = await self.client.get(f"{self.url}/metrics", headers=self.headers, timeout=10)
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        try:
            snapshot = parse_metrics(r.text)
        except Exception:  # foreign text on /metrics: no counter to read
            return None
        if self.name is None:
            runtime = detect_runtime(snapshot)
            if runtime is None:
                return None
            self.name = next(
                (n for n in candidate_names(runtime, "prefix_hits") if snapshot.has(n)), None
            )
            if self.name is None:
                return None
        value = snapshot.total(self.name)
        # NaN or +Inf is no count: the cache state is unknown, as without the counter.
        return value if value is not None and math.isfinite(value) else None

    @property
    def label(self) -> str:
        """The counter's name as users know it (without Prometheus' ``_total`` suffix)."""
        return (self.name or "").removesuffix("_total")
