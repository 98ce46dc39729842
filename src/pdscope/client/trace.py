"""The trace: one request's life as a client saw it. The one record every measurement produces.

Times are ``time.perf_counter()`` seconds on the client (monotonic). Derived figures are defined
once here and documented in docs/metrics.md; analysis and reports only read them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pdscope.engine.timeline import RequestTimeline

# A gap under this share of its request's mean gap is tokens read at once, not a step.
BURST_GAP = 0.1
# Nor is one under this, whatever the mean: two reads this close carried tokens that waited
# for each other, not steps (a decode step and its response write take longer; a speculative
# decoder's accepted tokens, sent as events microseconds apart, count as a burst too: their
# arrival times are not steps either).
BURST_FLOOR_S = 20e-6
BURSTY_SHARE = 0.25  # of a request's gaps: read in bursts (Trace.read_in_bursts)
BURST_MIN_GAPS = 4  # fewer cannot tell a burst from a step's jitter
BURST_MIN_SHORT = 2  # nor can one short gap: two tokens in one read mid-stream leave TPOT whole
# Label suffix of a probe response whose decode could not be read and that was sent again: kept
# in the traces, left out of every figure and fit.
UNREAD = "-unread"


@dataclass
class Chunk:
    """One piece of a streamed response that carried a generated token: its text, or none where
    the server held the text back (adapters.py's completions chunks of empty text, and a
    finishing chunk that carried the last token)."""

    t_s: float
    text: str
    tokens: int | None = None  # tokens in this chunk when the server says; else unknown


@dataclass
class Trace:
    api: str  # openai-completions, openai-chat, ollama
    url: str
    model: str
    label: str = ""  # what the request was for: "cold", "sweep", "prefix-warm", ...
    prompt_tokens_asked: int | None = None
    max_tokens: int | None = None
    # client clock
    scheduled_s: float | None = None  # when the load plan meant to send it (bench)
    start_s: float = 0.0  # the client began (before any connection work)
    connected_s: float | None = None  # TCP (and TLS) connection ready; None: reused
    sent_s: float | None = None  # request fully written
    headers_s: float | None = None  # response headers received
    chunks: list[Chunk] = field(default_factory=list)
    end_s: float | None = None  # last byte received
    # what the server said
    status: int | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    # Where cached_tokens came from: "server-usage", "llamacpp-timings", or "metrics-counter"
    # (the server's prefix-hit counter read before and after this request alone).
    cached_source: str | None = None
    token_source: str = "none"  # server-usage, ollama-counters, llamacpp-timings, chunks, ...
    finish_reason: str | None = None
    server: dict[str, Any] = field(default_factory=dict)  # server-side phase numbers
    error: str | None = None  # set when the request failed; a failed trace yields no figures
    # Set when the request was sent again on a fresh connection because a reused keep-alive
    # connection was closed under it before any response byte came back; says why.
    retried: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_s is not None and bool(self.chunks)

    # --- derived figures (seconds) -------------------------------------------------------

    @property
    def setup_s(self) -> float | None:
        """Connection setup: start to connection ready (0 on a reused connection)."""
        if self.connected_s is None:
            return 0.0 if self.sent_s is not None else None
        return self.connected_s - self.start_s

    @property
    def lag_s(self) -> float | None:
        """How late the client sent it against its schedule (concurrency cap, client load)."""
        return None if self.scheduled_s is None else self.start_s - self.scheduled_s

    @property
    def request_start_s(self) -> float:
        """Where the TTFT clock starts: after connection setup, when sending began."""
        return self.connected_s if self.connected_s is not None else self.start_s

    @property
    def ttft_s(self) -> float | None:
        """Request sent to the first chunk carrying a generated token, excluding connection
        setup: text, or a completions chunk whose token's text the server held back (empty,
        ending nothing); never chat's role-only or empty chunks."""
        if not self.ok:
            return None
        return self.chunks[0].t_s - self.request_start_s

    @property
    def e2e_s(self) -> float | None:
        """Request sent to the last token's chunk (:class:`Chunk`), as vLLM's bench ends its
        latency; the wait from there to the stream's last byte (usage event, [DONE], the close)
        is `close_s`."""
        if not self.ok:
            return None
        return self.chunks[-1].t_s - self.request_start_s

    @property
    def close_s(self) -> float | None:
        """Last token's chunk to the last byte of the response: the final usage event, the
        end marker and the server's close, which can lag under load."""
        if not self.ok:
            return None
        return self.end_s - self.chunks[-1].t_s  # type: ignore[operator]

    @property
    def n_output(self) -> int | None:
        """Output tokens: the server's count, else one per chunk (labelled). A count
        below the chunks cannot be (each chunk holds a token at least): the chunks."""
        if self.output_tokens is not None and self.output_tokens >= len(self.chunks):
            return self.output_tokens
        return len(self.chunks) if self.chunks else None

    @property
    def tpot_s(self) -> float | None:
        """Per request: (last content - first content) / (tokens - 1); the first token
        excluded, as vLLM defines TPOT."""
        n = self.n_output
        if not self.ok or n is None or n < 2 or not self.streamed:
            return None
        return (self.chunks[-1].t_s - self.chunks[0].t_s) / (n - 1)

    @property
    def streamed(self) -> bool:
        """Whether content arrived over time. A response delivered in one network read (a
        buffering proxy, a non-incremental server) has no inter-token timing to measure."""
        return len(self.chunks) > 1 and self.chunks[-1].t_s > self.chunks[0].t_s

    @property
    def decode_tok_s(self) -> float | None:
        tpot = self.tpot_s
        return None if not tpot else 1 / tpot

    @property
    def read_in_bursts(self) -> bool:
        """Whether the client read this stream in bursts (a quarter of its gaps or more, and two
        at least, under a tenth of its mean gap or under 20 us, which no step is): its gaps,
        and the span they add up to, measure the client. Its first tokens waited in the client
        while its last came in time, so its TPOT reads short: a tiny model's probe read so
        gave ~0.04 ms a token where its steps took 0.7. An 8-token response that came in 61 us
        over several reads read 113,670 tok/s in a CI run: its 7 gaps were too few for the
        rule then, and gaps all that short stand out from no mean. Fewer than 4 gaps cannot
        tell."""
        gaps = self.itl_samples_s()
        if len(gaps) < BURST_MIN_GAPS:
            return False
        short_s = max(BURST_GAP * sum(gaps) / len(gaps), BURST_FLOOR_S)
        short = sum(g < short_s for g in gaps)
        return short >= max(BURST_MIN_SHORT, BURSTY_SHARE * len(gaps))

    def itl_samples_s(self) -> list[float]:
        """Per-token inter-token latencies: a gap that delivered k tokens counts k times at
        gap / k. k is the chunk's own token count when the server gives it; else tokens are
        spread evenly over the gaps so the samples sum to the decode time (when the server's
        token total equals the chunk count, that is exactly one token per chunk). The samples
        always sum to the time from first to last chunk."""
        if not self.ok or not self.streamed:
            return []
        gaps = [b.t_s - a.t_s for a, b in zip(self.chunks, self.chunks[1:], strict=False)]
        known = [c.tokens for c in self.chunks[1:]]
        if all(k is not None and k > 0 for k in known):
            counts: list[int] = known  # type: ignore[assignment]
        else:
            # n - 1 tokens over the gaps, as evenly as whole tokens allow (earlier gaps take the
            # remainder), at least one per gap.
            tokens = max((self.n_output or len(self.chunks)) - 1, len(gaps))
            base, extra = divmod(tokens, len(gaps))
            counts = [base + (1 if i < extra else 0) for i in range(len(gaps))]
        samples: list[float] = []
        for gap, k in zip(gaps, counts, strict=True):
            samples.extend([gap / k] * k)
        return samples

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trace:
        """The inverse of :meth:`to_dict` (a saved probe or bench file): the derived figures
        are dropped and recomputed, unknown keys are ignored."""
        known = {f for f in cls.__dataclass_fields__}
        fields = {k: v for k, v in data.items() if k in known}
        fields["chunks"] = [Chunk(**c) for c in data.get("chunks") or []]
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: raw fields plus derived figures in milliseconds."""
        data = asdict(self)
        data["derived"] = {
            "setup_ms": _ms(self.setup_s),
            "ttft_ms": _ms(self.ttft_s),
            "e2e_ms": _ms(self.e2e_s),
            "close_ms": _ms(self.close_s),
            "tpot_ms": _ms(self.tpot_s),
            "decode_tok_s": self.decode_tok_s,
            "output_tokens": self.n_output,
        }
        return data


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def trace_from_timeline(
    timeline: RequestTimeline, *, api: str, url: str, model: str, label: str = ""
) -> Trace:
    """A Trace from an engine timeline (the in-process engine, or the simulator's clock).

    The request is taken as sent at arrival on a ready connection (no setup, no network), each
    output token as one chunk at the end of the step that sampled it. A request the engine
    failed or never finished becomes a failed trace, never a figure.
    """
    trace = Trace(
        api=api,
        url=url,
        model=model,
        label=label,
        prompt_tokens_asked=timeline.prompt_tokens,
        start_s=timeline.arrival_s,
        sent_s=timeline.arrival_s,
        prompt_tokens=timeline.prompt_tokens,
        cached_tokens=timeline.num_cached_tokens,
        token_source="engine-timeline",
        finish_reason=timeline.finish_reason,
    )
    if timeline.finish_reason in (None, "abort", "error") or not timeline.token_s:
        trace.error = f"engine: request ended with {timeline.finish_reason or 'no finish'}"
        return trace
    trace.status = 200
    trace.chunks = [Chunk(t, "", 1) for t in timeline.token_s]
    trace.output_tokens = len(timeline.token_s)
    trace.end_s = timeline.token_s[-1]
    return trace
