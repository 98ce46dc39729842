"""What a probe's traces say: prefill and decode apart, their fits, the ceilings, findings.

Input is the list of traces (each labelled with the probe phase that sent it); output is one
JSON-ready dict with units in its field names. Failed traces are counted and listed, never
turned into numbers.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdscope.analysis.rules import ITL_JUMP_RATIO, knob  # one table, shared with watch
from pdscope.analysis.stats import fit_poly, median
from pdscope.client.trace import Trace
from pdscope.report.units import fmt_bytes, fmt_count, fmt_seconds

# How a trace's cached-token count was obtained, in words.
_SOURCES = {
    "server-usage": "usage.prompt_tokens_details",
    "llamacpp-timings": "llama.cpp timings",
    "metrics-counter": "hit counter on /metrics, before vs after",
}


@dataclass
class Ceilings:
    """The roofline's view of this model on this device (from `pdscope plan`'s arithmetic)."""

    device: str
    decode_tok_s: Callable[[int], float]  # prompt tokens -> one-stream decode ceiling
    ttft_floor_s: Callable[[int], float | None]  # prompt tokens -> roofline prefill time
    model: str = ""  # the model the arithmetic assumed (--plan-model or the checkpoint)
    model_params: float | None = None
    # This machine's bandwidth (device "local"), read before the probe, before each sweep
    # size, after the sweep and after the probe; `decode_tok_s` is at their mean, and each sweep
    # point's ceiling is scaled to the readings just around it. Empty for a catalog device.
    bandwidth_readings_gb_s: list[float] = field(default_factory=list)
    # Its matmul rate read with them (TFLOP/s, in the model's compute type), and the peak
    # the floor assumed.
    tflops_readings: list[float] = field(default_factory=list)
    peak_tflops: float | None = None
    # The weights' width the ceiling counted (a MoE's experts', a GGUF's layers' mean): advice
    # to quantize is empty for weights already at a 4-bit format's few bits.
    weight_bits: float | None = None
    # This machine's last-level cache in bytes (device "local"): a decode reads what the
    # cache holds of a token's bytes faster than memory's ceiling allows.
    cache_bytes: float | None = None
    # When each bandwidth reading ran (the middle of it, on the traces' client clock), in
    # order; where empty, every point is held against all the readings.
    bandwidth_times_s: list[float] = field(default_factory=list)


@dataclass
class ModelBytes:
    """What one batch-1 decode step reads, for splitting a context slowdown into the part the
    bytes explain and the rest."""

    model: str
    params: float
    weight_bytes: float
    kv_bytes: Callable[[int], float]  # context tokens -> KV bytes read per step

    def per_token(self, context_tokens: int) -> float:
        return self.weight_bytes + self.kv_bytes(context_tokens)


# Readings or repeats further apart than this (max / min - 1) make a verdict a coin toss: two
# identical runs on a shared 2-core machine have landed on both sides of a threshold.
NOISE_LIMIT = 0.15
# A context slowdown within this factor of what its KV bytes predict (either way) is the bytes'.
BYTES_TOLERANCE = 0.9


def _ok(traces: list[Trace]) -> list[Trace]:
    return [t for t in traces if t.ok]


def _ms(s: float | None) -> float | None:
    return None if s is None else s * 1e3


def _ttfts(traces: list[Trace]) -> list[float]:
    return [t.ttft_s for t in traces if t.ttft_s is not None]


def _prompt_tokens(trace: Trace) -> int | None:
    return trace.prompt_tokens if trace.prompt_tokens is not None else trace.prompt_tokens_asked


# A request whose cached prompt tokens exceed this share of its prompt measured the prefix
# cache, not prefill. Fresh prompts can still share a chat template's first block or two.
CACHE_HIT_FRACTION = 0.1
# A prefix shorter than this (a few KV blocks) may simply not fill one: no "not reused" verdict.
MIN_JUDGED_PREFIX_TOKENS = 64
# The prefix check's prompts: a shared prefix, then this many fresh tokens, so the warm send is
# a new prompt that starts with a cached one (as a chat turn after a system prompt).
PREFIX_TAIL_TOKENS = 16
# The batch sweep's labels: "batch-decode x2", "batch-decode x32" (streams sent together).
BATCH_SWEEP_LABEL = "batch-decode x"


def sweep_size(label: str) -> int | None:
    """The streams a batch sweep point sent, from its label; None for any other label."""
    size = label.removeprefix(BATCH_SWEEP_LABEL)
    return int(size) if label.startswith(BATCH_SWEEP_LABEL) and size.isdigit() else None


# The join check: streams decoding together, and prompts sent among them one at a time.
JOIN_LABEL = "prefill-join"
JOIN_NEW_LABEL = "prefill-join-new"


def cache_hit(trace: Trace) -> bool | None:
    """Whether the server served a real part of this prompt from its prefix cache; None when
    the server gave no way to tell (no cached-token count, no hit counter)."""
    if trace.cached_tokens is None:
        return None
    prompt = _prompt_tokens(trace) or 0
    return trace.cached_tokens > max(CACHE_HIT_FRACTION * prompt, 0)


def point(traces: list[Trace]) -> dict[str, Any]:
    """One sweep point: medians and spread over its repeats. Failures and requests that hit
    the prefix cache are left out of every figure, and counted."""
    assert traces, "a point needs at least one request"
    answered = _ok(traces)
    hits = [t for t in answered if cache_hit(t)]
    good = [t for t in answered if not cache_hit(t)]
    ttft = [t.ttft_s for t in good if t.ttft_s is not None]
    decode = [t.decode_tok_s for t in good if t.decode_tok_s is not None]
    counts = [_prompt_tokens(t) for t in good if _prompt_tokens(t) is not None]
    out: dict[str, Any] = {
        "prompt_tokens": int(median(counts)) if counts else traces[0].prompt_tokens_asked,
        "repeats": len(traces),
        "failed": len(traces) - len(answered),
        "cache_hits": len(hits),
        # True when every answered repeat hit the cache: the point measured nothing of prefill.
        "cache_hit": bool(hits) and not good,
        "cache_known": any(cache_hit(t) is not None for t in answered),
        "ttft_ms": _ms(median(ttft)),
        "ttft_ms_min": _ms(min(ttft)) if ttft else None,
        "ttft_ms_max": _ms(max(ttft)) if ttft else None,
        "decode_tok_s": median(decode),
        "decode_tok_s_min": min(decode) if decode else None,
        "decode_tok_s_max": max(decode) if decode else None,
        "setup_ms": _ms(median([t.setup_s for t in good if t.setup_s is not None])),
        "output_tokens": median([t.n_output for t in good if t.n_output]),
        "cached_tokens": median([t.cached_tokens for t in answered if t.cached_tokens is not None]),
    }
    server = [t.server.get("ollama") for t in good if t.server.get("ollama")]
    if server:
        out["server_prompt_eval_ms"] = median(
            [s["prompt_eval_duration"] / 1e6 for s in server if s.get("prompt_eval_duration")]
        )
        # Ollama's eval_duration runs from its first token to its last (its runners start the
        # clock at the first sampled token), so it spans eval_count - 1 gaps: count/duration
        # (Ollama's own "eval rate") reads 32/31 fast at 32 tokens.
        evals = [
            (s["eval_count"] - 1) / (s["eval_duration"] / 1e9)
            for s in server
            if s.get("eval_duration") and (s.get("eval_count") or 0) >= 2
        ]
        out["server_eval_tok_s"] = median(evals)
    timings = [t.server.get("llamacpp") for t in good if t.server.get("llamacpp")]
    if timings:
        out["server_prompt_ms"] = median([x["prompt_ms"] for x in timings if "prompt_ms" in x])
        # llama.cpp starts predicted_ms at its first token too, and its predicted_per_second
        # is predicted_n over it: the gaps are one fewer, as with Ollama.
        out["server_predicted_tok_s"] = median(
            [
                (x["predicted_n"] - 1) / (x["predicted_ms"] / 1e3)
                for x in timings
                if (x.get("predicted_n") or 0) >= 2 and x.get("predicted_ms")
            ]
        )
    return out


def _spans(tokens: list[int]) -> bool:
    """Whether prompt lengths are far enough apart to fit a cost per token: the longest at
    least twice and 64 tokens past the shortest (1 and 2 tokens fitted -1 ms a token)."""
    return len(tokens) >= 2 and max(tokens) >= 2 * min(tokens) and max(tokens) - min(tokens) >= 64


def _ttft_fit(xs: list[int], ys: list[float]) -> list[float] | None:
    """[intercept, ms per token, ms per token²], none negative (a prompt token never saves
    time, and no request takes less than nothing): least squares over every subset of the
    three terms, the best whose coefficients are all >= 0; where several fit as well (two
    prompt lengths fit any two terms exactly), the one with the least fixed cost. None if that
    explains the points no better than their mean (a falling sweep). A line through 132 ms at
    200 tokens and 738 ms at 1,000 (llama.cpp; attention's square bends it up) gave
    "-19.9 ms + 0.758 ms x N"."""
    y = np.asarray(ys, dtype=float)
    scale = float(max(xs)) or 1.0  # x in units of the longest prompt: columns of like size
    x = np.asarray(xs, dtype=float) / scale
    columns = np.stack([np.ones_like(x), x, x * x], axis=1)
    fits: list[tuple[float, np.ndarray]] = []
    for keep in itertools.product((True, False), repeat=3):
        if not any(keep) or np.linalg.matrix_rank(columns[:, list(keep)]) < sum(keep):
            continue
        found, *_ = np.linalg.lstsq(columns[:, list(keep)], y, rcond=None)
        coef = np.zeros(3)
        coef[list(keep)] = found
        if (coef >= 0).all() and coef[1:].any():
            fits.append((float(((columns @ coef - y) ** 2).sum()), coef))
    if not fits:
        return None
    least = min(r for r, _ in fits)
    if least >= float(((y - y.mean()) ** 2).sum()):
        return None  # no better than a constant: the sweep falls, or is all noise
    tie = 1e-9 * float((y * y).sum())
    _, coef = min((f for f in fits if f[0] <= least + tie), key=lambda f: f[1][0])
    return [float(coef[0]), float(coef[1]) / scale, float(coef[2]) / scale**2]


def analyze(
    traces: list[Trace],
    runtime: str,
    ceilings: Ceilings | None = None,
    model_bytes: ModelBytes | None = None,
    served_model: dict[str, Any] | None = None,
) -> dict[str, Any]:
    by_label: dict[str, list[Trace]] = defaultdict(list)
    for t in traces:
        by_label[t.label].append(t)

    sweep_groups: dict[int, list[Trace]] = defaultdict(list)
    for t in by_label["sweep"]:
        sweep_groups[t.prompt_tokens_asked or 0].append(t)
    groups = [group for _, group in sorted(sweep_groups.items())]
    sweep = [point(group) for group in groups]
    usable = [p for p in sweep if p["ttft_ms"] is not None]

    result: dict[str, Any] = {"sweep": sweep}
    cold = _ok(by_label["cold"])
    result["cold"] = (
        {
            "ttft_ms": _ms(cold[0].ttft_s),
            # read in bursts, its decode measures the client (the sweep resends such a
            # response; a resent cold request would not be cold)
            "decode_tok_s": None if cold[0].read_in_bursts else cold[0].decode_tok_s,
            "read_in_bursts": cold[0].read_in_bursts,
            "prompt_tokens": _prompt_tokens(cold[0]),
            "cached_tokens": cold[0].cached_tokens,
            "cache_hit": cache_hit(cold[0]),  # a repeated --seed: not cold at all
            "server": cold[0].server,
        }
        if cold
        else None
    )

    # TTFT against prompt tokens: intercept + linear + quadratic, in ms.
    xs = [p["prompt_tokens"] for p in usable]
    ys = [p["ttft_ms"] for p in usable]
    fit = _ttft_fit(xs, ys) if _spans(xs) else None
    result["ttft_fit"] = (
        None
        if fit is None
        else {"intercept_ms": fit[0], "ms_per_token": fit[1], "ms_per_token2": fit[2]}
    )

    largest = usable[-1] if usable else None
    result["prefill_tok_s"] = (
        largest["prompt_tokens"] / (largest["ttft_ms"] / 1e3) if largest else None
    )
    decodes = [p for p in usable if p["decode_tok_s"]]
    result["decode_tok_s"] = decodes[0]["decode_tok_s"] if decodes else None
    slope = (
        fit_poly([p["prompt_tokens"] for p in decodes], [p["decode_tok_s"] for p in decodes], 1)
        if len(decodes) >= 2 and _spans([p["prompt_tokens"] for p in decodes])
        else None
    )
    result["decode_slope_tok_s_per_1k_prompt"] = slope[1] * 1000 if slope else None
    result["prefill_to_decode_ratio"] = (
        result["prefill_tok_s"] / result["decode_tok_s"]
        if result["prefill_tok_s"] and result["decode_tok_s"]
        else None
    )

    warm = _ok(by_label["prefix-warm"])
    first = _ok(by_label["prefix-cold"])
    result["prefix_cache"] = None
    cold_ttft, warm_ttft = _ttfts(first), _ttfts(warm)
    if warm_ttft and cold_ttft:
        warm_counts = [t.cached_tokens for t in warm]
        cold_counts = [t.cached_tokens for t in first if t.cached_tokens is not None]
        asked = first[0].prompt_tokens_asked
        result["prefix_cache"] = {
            "prompt_tokens": _prompt_tokens(first[0]),
            # As asked: the server's count adds a chat template's tokens after the tail
            "prefix_tokens": None if asked is None else asked - PREFIX_TAIL_TOKENS,
            "tail_tokens": PREFIX_TAIL_TOKENS,
            "pairs": min(len(first), len(warm)),
            # Medians over the fresh prefixes, each sent cold then warm.
            "cold_ttft_ms": _ms(median(cold_ttft)),
            "warm_ttft_ms": _ms(median(warm_ttft)),
            "warm_over_cold": median(warm_ttft) / median(cold_ttft),
            # Fastest over fastest: a host that slows two of three warm sends moves the
            # medians' ratio, not this one.
            "best_warm_over_cold": min(warm_ttft) / min(cold_ttft),
            # The fewest cached tokens any warm send reported: every one must have hit.
            "cached_tokens": None if None in warm_counts else min(warm_counts),  # type: ignore[type-var]
            "cached_source": warm[0].cached_source,
            "cold_cached_tokens": max(cold_counts) if cold_counts else None,
        }

    result["context"] = None
    if by_label["context-short"] and by_label["context-long"]:
        short, long = point(by_label["context-short"]), point(by_label["context-long"])
        result["context"] = {
            "short": short,
            "long": long,
            "long_over_short": (
                long["decode_tok_s"] / short["decode_tok_s"]
                if long["decode_tok_s"] and short["decode_tok_s"]
                else None
            ),
        }
        out = by_label["context-long"][0].max_tokens or 0
        if model_bytes and short["prompt_tokens"] and long["prompt_tokens"]:
            # Mean context over each decode: prompt + half the output, as the ceiling uses.
            a = model_bytes.per_token(short["prompt_tokens"] + out // 2)
            b = model_bytes.per_token(long["prompt_tokens"] + out // 2)
            result["context"]["bytes"] = {
                "model": model_bytes.model,
                "weight_bytes": model_bytes.weight_bytes,
                "kv_bytes_long": model_bytes.kv_bytes(long["prompt_tokens"] + out // 2),
                "explained_long_over_short": a / b,
            }
        ratio = result["context"]["long_over_short"]
        sweep_out = (by_label["sweep"][0].max_tokens or 0) if by_label["sweep"] else 0
        result["context"]["sweep"] = None
        if ratio:
            result["context"]["sweep"] = _sweep_context(
                result["sweep"], short, long, ratio, out // 2, sweep_out // 2
            )

    ctx = result["context"]
    result["batch_decode"] = batch_decode(
        _ok(by_label["batch-decode"]), ctx["short"] if ctx else None
    )
    # At long context the KV read joins the weights in every step: the point that shows
    # whether a batch's attention costs what its bytes say.
    result["batch_decode_long"] = batch_decode(_ok(by_label["batch-decode-long"]))
    # The other stream counts at short prompts: the step's cost by batch size.
    sweep = [(n, label) for label in by_label if (n := sweep_size(label)) is not None]
    result["batch_sweep"] = [
        checked
        for _, label in sorted(sweep)
        if (checked := batch_decode(_ok(by_label[label]), ctx["short"] if ctx else None))
    ]

    # What a prompt's prefill costs the streams already decoding: their step with it, against
    # their step without.
    result["prefill_join"] = [
        {
            "prompt_tokens": j.prompt_tokens,
            "decoding_together": len(j.contexts),
            "context_tokens": round(sum(j.contexts) / len(j.contexts)),
            "step_ms": j.step_s * 1e3,
            "decode_step_ms": _ms(j.decode_step_s),
        }
        for j in join_steps(traces)
    ]
    result["served_model"] = served_model
    context = by_label["context-short"] + by_label["context-long"]
    result["ceiling"] = (
        _ceiling(
            result,
            ceilings,
            served_model,
            [_span(g) for g in groups],
            _span(context) if context else None,
        )
        if ceilings
        else None
    )
    result["failures"] = [
        {"label": t.label, "prompt_tokens": t.prompt_tokens_asked, "error": t.error}
        for t in traces
        if not t.ok
    ]
    result["unmeasured"] = unmeasured(result, by_label)
    result["findings"] = findings(result, runtime)
    return result


def streams_overlap(traces: list[Trace]) -> float | None:
    """How many of ``traces`` were decoding at once, on average over their joint decode span:
    the sum of their decode windows over the span (8 for 8 fully overlapping streams; less
    when a server ran them one after another)."""
    windows = [(t.chunks[0].t_s, t.chunks[-1].t_s) for t in traces if t.streamed]
    if not windows:
        return None
    span = max(end for _, end in windows) - min(start for start, _ in windows)
    return sum(end - start for start, end in windows) / span if span > 0 else None


@dataclass(frozen=True)
class JointDecode:
    """The per-token gaps of streams sent together, taken while the most of them were decoding
    at once: each gap is one server step that carried ``streams`` decodes."""

    streams: int
    gaps_s: list[float]
    contexts: list[int]  # each gap's token's context (prompt + tokens before it)

    @property
    def context(self) -> int:
        """The mean context of the gaps' tokens (a decode's cost is linear in its context)."""
        return round(sum(self.contexts) / len(self.contexts))


def joint_decode(traces: list[Trace], steady: bool = False) -> JointDecode | None:
    """Group every per-token gap of ``traces`` by how many of them were between their first
    and last token at the gap's midpoint, and keep the largest group (ties: more streams).
    That drops the gaps of steps that also ran another stream's prefill (a stream still in
    prefill has no first token yet) and those after the first stream ended, so the group is
    steps of one batch size, whatever the server's order; a server that ran fewer at once
    (Ollama's parallel slots) gives its own batch size.

    ``steady``: gaps only from streams the client read steadily (not
    :attr:`Trace.read_in_bursts`); every stream's window still counts who was decoding. A
    stream read in bursts has runs of ~0 gaps and one long one, and the midpoint rule puts
    them in different groups: a loaded client's 2-stream point read 0.11 ms a step, a 3-stream
    group 0.02 ms, where one stream's step took 0.3 (tiny model, AMD EPYC)."""
    streams = [t for t in traces if t.streamed]
    windows = [(t.chunks[0].t_s, t.chunks[-1].t_s) for t in streams]
    groups: dict[int, tuple[list[float], list[int]]] = defaultdict(lambda: ([], []))
    for t in streams:
        if steady and t.read_in_bursts:
            continue
        prompt = _prompt_tokens(t) or 0
        end = t.chunks[0].t_s
        for i, gap in enumerate(t.itl_samples_s()):
            mid, end = end + gap / 2, end + gap
            k = sum(start <= mid <= stop for start, stop in windows)
            groups[k][0].append(gap)
            groups[k][1].append(prompt + 1 + i)  # the first token was the prefill's
    if not groups:
        return None
    k = max(groups, key=lambda n: (len(groups[n][0]), n))
    return JointDecode(k, *groups[k])


def batch_joint(traces: list[Trace]) -> JointDecode | None:
    """A batch's :func:`joint_decode`: its gaps grouped without those of streams read in
    bursts (which fall in the wrong groups) where any stream was read steadily, else all of
    them. The report's ``decoding_together`` and the sweep's rule for sizes over the most a
    server carried both read this."""
    return joint_decode(traces, steady=True) or joint_decode(traces)


@dataclass(frozen=True)
class JoinStep:
    """The step a new prompt's prefill shared with streams already decoding: in each stream,
    the gap that ends with the token delivered with the new prompt's first token."""

    prompt_tokens: int
    contexts: list[int]  # each decoding stream's context in that step
    step_s: float  # the median of those gaps over the streams read steadily
    decode_step_s: float | None  # the streams' median gap over the rest of their decode
    steady_streams: int  # the streams whose gaps were taken (read steadily, a gap in span)


def join_steps(traces: list[Trace]) -> list[JoinStep]:
    """The join check's steps, one per new prompt whose first token came while two or more of
    the streams decoded (between their first and last token), two of them read steadily: the
    step carried all of those, where each of its tokens came in a chunk of its own (two at
    least: the second bounds the step's end). In each stream, the join step is the gap
    ending at the token sampled with the new prompt's first (:func:`_join_token`, which says
    how it is found and when a stream has none). A stream with none, or read in bursts,
    counts among the step's decodes but gives no gap (see :func:`joint_decode`). Two new
    prompts whose first tokens came within half a step of each other are left out (one step
    may have carried both), and so is a new prompt of unknown length."""
    streams = [t for t in traces if t.ok and t.label == JOIN_LABEL and t.streamed]
    sent = [t for t in traces if t.ok and t.label == JOIN_NEW_LABEL and t.chunks]
    # Timed only where each of a new prompt's tokens came in a chunk of its own. Where the
    # server counted more tokens than chunks, the first token's text may have been held back
    # (llama.cpp sends no chunk then), and the first chunk be the second token's, a step
    # late, the gaps near it the steps after the prefill's: a random model's 128-token
    # prompt sent 1 chunk for its 2 tokens in every one of 60 probes against llama.cpp (the
    # same prompt, the same tokens). A second chunk bounds the join step's end.
    news = [t for t in sent if len(t.chunks) >= max(t.output_tokens or 0, 2)]
    out = []
    for new in news:
        first_s, prompt = new.chunks[0].t_s, _prompt_tokens(new)
        # the last token the client read before it began the request
        read_s = [c.t_s for t in streams for c in t.chunks if c.t_s <= new.start_s]
        read_before_s = max(read_s, default=-math.inf)
        gaps: list[float] = []
        contexts: list[int] = []
        rest: list[float] = []
        for t in streams:
            times = [c.t_s for c in t.chunks]
            if not times[0] < first_s <= times[-1]:
                continue  # not decoding then
            near = min(range(len(times)), key=lambda k: abs(times[k] - first_s))
            i = _join_token(times, new, near, read_before_s)
            # token i's step reads prompt + i
            contexts.append((_prompt_tokens(t) or 0) + (near if i is None else i))
            if t.read_in_bursts or i is None:
                continue
            gaps.append(times[i] - times[i - 1])
            rest += [b - a for k, (a, b) in enumerate(itertools.pairwise(times), 1) if k != i]
        if len(gaps) < 2 or not prompt:
            continue
        step_s = median(gaps)
        assert step_s is not None
        # against every prompt sent, timed or not: one step may have carried both
        if any(abs(o.chunks[0].t_s - first_s) < step_s / 2 for o in sent if o is not new):
            continue
        out.append(JoinStep(prompt, contexts, step_s, median(rest) if rest else None, len(gaps)))
    return out


def _join_token(times: list[float], new: Trace, near: int, read_before_s: float) -> int | None:
    """The index of a stream's token sampled in the step that ran ``new``'s prefill, or None
    where no gap of the stream can be that step. ``times``: the stream's chunk times;
    ``new``: a prompt with two chunks at least; ``near``: the stream's token nearest its
    first; ``read_before_s``: the last token the client read, of any join stream, before it
    began ``new``'s request.

    The longest of the gaps ending at the three tokens nearest the first one (a prefill step
    is longer than a decode step, and the client may read either token late: the new
    prompt's first 4 ms after the streams' of its step, against llama.cpp on a loaded host),
    where the gap
    - began at or after ``read_before_s``, less the stream's median gap: the step holding
      the prefill can begin no earlier than the server's last token before the request, and
      where a server waits a while after a token, one sent just after it may join the next
      step (the client's own delay to begin it can exceed a decode step);
    - began before the first token;
    - ended after the request began, and before the second token (which came a step later),
      plus that median gap.
    A stream whose text was held back around the join (llama.cpp sends no chunk for a token
    that ends mid-character) has one gap over the whole span, and its neighbours lie before
    or after the join: the rules leave them all out, but for a hold of the join token alone,
    whose gap holds the step after the join's too. (One held from 86 ms before the request
    to 95 ms after the first token gave the gap after its hold, and the median of two
    streams' gaps read 61 ms where llama.cpp timed the prompt at 121.)"""
    first_s, second_s = new.chunks[0].t_s, new.chunks[1].t_s
    slack_s = median([b - a for a, b in itertools.pairwise(times)]) or 0.0
    candidates = [
        k
        for k in (near - 1, near, near + 1)
        if 1 <= k < len(times)
        and read_before_s - slack_s <= times[k - 1] < first_s
        and new.start_s < times[k] <= second_s + slack_s
    ]
    return max(candidates, key=lambda k: times[k] - times[k - 1], default=None)


def batch_decode(
    traces: list[Trace], one_stream: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """A batched-decode check: several prompts sent together. The median per-token gap is one
    step carrying most of them (``decoding_together`` and ``context_tokens`` from
    :func:`joint_decode`); against one stream's at a similar context (``one_stream``, a context
    check point) it shows what each extra sequence costs a step. The gaps and TPOTs are the
    streams' the client read steadily: one read in bursts (:attr:`Trace.read_in_bursts`) still
    counts in ``decoding_together`` by its window. One that came in one read (not
    :attr:`Trace.streamed`) has neither gaps nor a window: it counts in neither. Where no
    stream is left, ``itl_ms`` and ``tpot_ms`` are None (``bursty_streams`` and
    ``one_read_streams`` say why); where the steady streams' median gap is 0, ``itl_ms``
    alone."""
    if not traces:
        return None
    joint = batch_joint(traces)
    # A loaded client's probe (tests/data/probe-tiny-epyc-loaded-client.json.gz; one stream's
    # step 0.27-0.34 ms) read 0.050 ms a step over 4 streams, all read in bursts, and 0.0 ms
    # over 2: the bursts' gaps of microseconds, which measure the client.
    # A CI run (medium model, loaded 2-core host) read every stream of a batch of 128-token
    # prompts either in bursts or in one read: no step to show.
    steady = [t for t in traces if t.streamed and not t.read_in_bursts]
    tpot = [t.tpot_s for t in steady if t.tpot_s is not None]
    counts = [_prompt_tokens(t) for t in traces if _prompt_tokens(t) is not None]
    out: dict[str, Any] = {
        "streams": len(traces),
        "concurrency": streams_overlap(traces),
        "decoding_together": joint.streams if joint else None,
        "context_tokens": joint.context if joint else None,
        "prompt_tokens": int(median(counts)) if counts else traces[0].prompt_tokens_asked,
        "output_tokens": median([t.n_output for t in traces if t.n_output]),
        # Over all the steady streams' gaps, not joint_decode's largest group: in one CI run
        # (medium model, loaded 2-core host) that group's median was 23x one stream's step.
        # A median of 0 (a few reads each carrying several tokens, too few gaps to call
        # bursts) is no step either.
        "itl_ms": _ms(median([x for t in steady for x in t.itl_samples_s()]) or None),
        "tpot_ms": _ms(median(tpot)),
        # Streams the client read in bursts, left out of itl_ms and tpot_ms.
        "bursty_streams": sum(t.read_in_bursts for t in traces),
        # Streams whose whole response came in one read: no gaps to time.
        "one_read_streams": sum(not t.streamed for t in traces),
        # The median gap against one stream's mean step (its TPOT, from the context check's
        # requests sent alone at another moment): below 1 is noise or the client, never a
        # batched step cheaper than one stream's.
        "step_over_one_stream": None,
    }
    if one_stream and one_stream.get("decode_tok_s") and out["itl_ms"]:
        out["step_over_one_stream"] = out["itl_ms"] / (1e3 / one_stream["decode_tok_s"])
    return out


def unmeasured(r: dict[str, Any], by_label: dict[str, list[Trace]]) -> list[str]:
    """Each part of the probe that yielded no figure, and why: the CLI exits non-zero on any."""
    out = []
    for p in r["sweep"]:
        if p["ttft_ms"] is None:
            why = (
                "every repeat hit the prefix cache"
                if p["cache_hit"]
                else f"{p['failed']} of {p['repeats']} requests failed"
            )
            out.append(f"sweep point {p['prompt_tokens']} tokens: {why}")
    if not r["sweep"]:
        out.append("prompt-length sweep: no request was sent")
    if r["prefix_cache"] is None:
        out.append("prefix-cache check: " + _why(by_label, "prefix-cold", "prefix-warm"))
    if r["context"] is None or r["context"]["long_over_short"] is None:
        out.append("context check: " + _why(by_label, "context-short", "context-long"))
    return out


def _why(by_label: dict[str, list[Trace]], *labels: str) -> str:
    sent = [t for label in labels for t in by_label[label]]
    failed = [t for t in sent if not t.ok]
    if not sent:
        return "not run"
    if failed:
        return f"{len(failed)} of {len(sent)} requests failed ({failed[0].error})"
    # point() leaves cache hits out of its figures; the prefix check's warm sends hit by design
    hits = [t for t in sent if cache_hit(t) and t.label != "prefix-warm"]
    if hits:
        return (
            f"{len(hits)} of {len(sent)} requests hit the prefix cache (prompts seen before: "
            "a repeated --seed?)"
        )
    return "no decode rate (each response came in one piece, or had under 2 tokens)"


def _over_limit(spread: float) -> str:
    """A spread over NOISE_LIMIT as a percentage with the decimals that show it over: 15.3%,
    not "15%" beside "(more than 15%)"."""
    for digits in range(3):
        text = f"{spread:.{digits}%}"
        if float(text.rstrip("%")) / 100 > NOISE_LIMIT:
            return text
    return f"over {NOISE_LIMIT:.0%}"


def _spread(values: list[float]) -> float | None:
    """max / min - 1: how far apart readings of one quantity are."""
    values = [v for v in values if v]
    return max(values) / min(values) - 1 if len(values) >= 2 else None


# A weight width at or under this is a 4- or 5-bit format already (Q4_K_M is 4.9 bits a weight,
# more where rows K-quants cannot take fall back to Q5_0/Q8_0; Q5_K_M 5.7; AWQ, MXFP4 4.25),
# not Q6_K (6.56) or Q8_0 (8.5), which a Q4_K_M would still halve.
LIGHT_WEIGHT_BITS = 6.0


def _span(traces: list[Trace]) -> tuple[float, float]:
    """When a sweep point's requests ran: the first one's start to the last one's end."""
    return min(t.start_s for t in traces), max(t.end_s or t.start_s for t in traces)


def _around(c: Ceilings, span: tuple[float, float] | None) -> list[float]:
    """The bandwidth readings nearest a span of requests: the last one before them and the
    first one after. A host whose speed swings mid-run (issue 12: a shared Xeon read 3-18 GB/s
    minutes apart) holds a point against the bandwidth of its own seconds, not the run's mean.
    All the readings where their times are unknown or they do not bracket the span."""
    readings, times = c.bandwidth_readings_gb_s, c.bandwidth_times_s
    if span is None or len(times) != len(readings):
        return list(readings)
    assert times == sorted(times), "readings are taken one after another"
    before = [g for t, g in zip(times, readings, strict=True) if t <= span[0]]
    after = [g for t, g in zip(times, readings, strict=True) if t >= span[1]]
    return [before[-1], after[0]] if before and after else list(readings)


def _ceiling(
    result: dict[str, Any],
    c: Ceilings,
    served: dict[str, Any] | None = None,
    spans: list[tuple[float, float]] | None = None,
    context_span: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """The sweep against the roofline. ``spans``: when each sweep point's requests ran, for
    the bandwidth readings around it (None: every point against all the readings);
    ``context_span``: when the context check's ran, for its slack."""
    readings = c.bandwidth_readings_gb_s
    mean_bw = sum(readings) / len(readings) if readings else None
    out: dict[str, Any] = {
        "device": c.device,
        "model": c.model,
        "model_params": c.model_params,
        "bandwidth_readings_gb_s": readings,
        # when each was read, seconds from the first (an interrupted run has fewer)
        "bandwidth_reading_times_s": [t - c.bandwidth_times_s[0] for t in c.bandwidth_times_s],
        "tflops_readings": c.tflops_readings,
        "peak_tflops": c.peak_tflops,
        "weight_bits": c.weight_bits,
        "points": [],
    }
    for i, p in enumerate(result["sweep"]):
        n = p["prompt_tokens"]  # the server's count: calibrated prompts are never exact
        near = _around(c, spans[i] if spans and i < len(spans) else None)
        near_bw = sum(near) / len(near) if near else None
        # The ceiling is the bytes' rate: it scales with the bandwidth read around the point.
        scale = near_bw / mean_bw if near_bw and mean_bw else 1.0
        ceiling = c.decode_tok_s(n) * scale if n else None
        floor = c.ttft_floor_s(n) if n else None
        pct = 100 * p["decode_tok_s"] / ceiling if ceiling and p["decode_tok_s"] else None
        low = high = pct
        if pct is not None and ceiling:
            # The margin: slowest repeat against the ceiling at the fastest bandwidth reading
            # around the point, fastest repeat against the slowest.
            fast = max(near) / near_bw if near_bw else 1.0
            slow = min(near) / near_bw if near_bw else 1.0
            low = 100 * p["decode_tok_s_min"] / (ceiling * fast)
            high = 100 * p["decode_tok_s_max"] / (ceiling * slow)
        out["points"].append(
            {
                "prompt_tokens": n,
                "bandwidth_readings_gb_s": near,
                "decode_ceiling_tok_s": ceiling,
                "decode_pct_of_ceiling": pct,
                "decode_pct_range": None if pct is None else [low, high],
                "ttft_floor_ms": _ms(floor),
                "prefill_pct_of_floor": (
                    100 * floor * 1e3 / p["ttft_ms"] if floor and p["ttft_ms"] else None
                ),
            }
        )
    measured = [p for p in out["points"] if p["decode_pct_of_ceiling"] is not None]
    timed = [p for p in out["points"] if p["prefill_pct_of_floor"] is not None]
    first = measured[0] if measured else {}
    out["decode_pct_of_ceiling"] = first.get("decode_pct_of_ceiling")
    out["decode_pct_range"] = first.get("decode_pct_range")
    out["prefill_pct_of_floor"] = timed[-1]["prefill_pct_of_floor"] if timed else None
    sweep_first = next((p for p in result["sweep"] if p["decode_tok_s"]), None)
    out["bandwidth_spread"] = _spread(readings)  # the whole run's
    # the context check's slack: the readings around it (its requests come minutes after the
    # sweep's, and every reading more would widen a spread over them all)
    out["context_bandwidth_spread"] = _spread(_around(c, context_span))
    near = first.get("bandwidth_readings_gb_s", readings)
    out["decode_bandwidth_spread"] = _spread(near)  # the verdict's point's own readings
    out["compute_spread"] = _spread(c.tflops_readings)
    out["repeat_spread"] = (
        _spread([sweep_first["decode_tok_s_min"], sweep_first["decode_tok_s_max"]])
        if sweep_first
        else None
    )
    noisy = []
    if first and (out["decode_bandwidth_spread"] or 0) > NOISE_LIMIT:
        noisy.append(
            f"bandwidth read {' and '.join(f'{g:.1f}' for g in near)} GB/s around the decode "
            f"at {first['prompt_tokens']:,} tokens ({_over_limit(out['decode_bandwidth_spread'])}"
            " apart)"
        )
    if (out["repeat_spread"] or 0) > NOISE_LIMIT and sweep_first:
        noisy.append(
            f"decode repeats at {sweep_first['prompt_tokens']} tokens ranged "
            f"{sweep_first['decode_tok_s_min']:.1f}–{sweep_first['decode_tok_s_max']:.1f} tok/s "
            f"({_over_limit(out['repeat_spread'])} apart)"
        )
    out["noisy"] = noisy
    out["compute_noisy"] = None
    if (out["compute_spread"] or 0) > NOISE_LIMIT:
        # Kept apart from `noisy` (the decode verdict's): it only withholds the prefill verdict.
        out["compute_noisy"] = (
            f"the matmul rate read {' and '.join(f'{t:.3f}' for t in c.tflops_readings)} "
            f"TFLOP/s before and after ({_over_limit(out['compute_spread'])} apart)"
        )
    out["cache_bytes"] = c.cache_bytes
    out["decode_from_cache"] = _from_cache(out, c, served)
    out["impossible"] = _impossible(out, result, c, served)
    return out


# The most of a token's bytes a cache is taken to serve (a shared L3 also holds the KV, the
# activations and other tenants' lines), and the most past memory's ceiling it is taken to
# explain: the Xeon's best round read 1.45x (bench/ceiling_check.py); a server far past that
# is not this CPU's (a GPU's, probed with --device local) or not this model.
CACHE_SHARE_MOST = 0.9
CACHE_REACH_MOST_PCT = 150.0


def _other_model(c: Ceilings, served: dict[str, Any] | None) -> bool:
    """Whether the server reports a parameter count unlike the arithmetic's by over 1.5x."""
    params = (served or {}).get("params")
    return bool(params and c.model_params and not 0.67 < c.model_params / params < 1.5)


def _from_cache(out: dict[str, Any], c: Ceilings, served: dict[str, Any] | None) -> str | None:
    """Why decode past memory's ceiling is possible here, where this CPU's cache explains it:
    every repeat past the ceiling (else the ceiling's own verdict or noise), the model the
    arithmetic's, and the slowest repeat against the fastest reading within 100 / (1 - share)%
    (at most CACHE_REACH_MOST_PCT), what a step could run at were the cache's share of the
    bytes free. On a Xeon with 300 MiB of L3 the engine decoded the 304 MB small model at
    1.24-1.37x the ceiling, 1.18x a plain read of its weights (docs/performance.md)."""
    pct = out["decode_pct_of_ceiling"]
    low = (out["decode_pct_range"] or [pct])[0]
    first = next((p for p in out["points"] if p["decode_pct_of_ceiling"] is not None), None)
    near = first["bandwidth_readings_gb_s"] if first else []
    if not (pct and low and low > 100 and c.cache_bytes and near):
        return None
    if _other_model(c, served):
        return None  # _impossible names the mismatch
    token_bytes = sum(near) / len(near) * 1e9 / first["decode_ceiling_tok_s"]
    share = min(c.cache_bytes / token_bytes, CACHE_SHARE_MOST)
    reach = min(100 / (1 - share), CACHE_REACH_MOST_PCT)
    if low > reach:
        return None
    return (
        f"this CPU's last-level cache ({fmt_bytes(c.cache_bytes)}, against the "
        f"{fmt_bytes(token_bytes)} a token reads) serves part of each token's bytes faster "
        f"than memory (up to {reach:.0f}% of the ceiling explained); the ceiling counts "
        "memory alone"
    )


def _impossible(
    out: dict[str, Any], result: dict[str, Any], c: Ceilings, served: dict[str, Any] | None
) -> list[str]:
    """Above 100% of the bandwidth ceiling or the compute floor cannot happen: name what is
    wrong instead (a cached prompt, the wrong plan model, the wrong device)."""
    over = []
    # Past 100% at the slowest repeat against the fastest reading too: `make demo` on a host
    # whose speed flips between phases read 133% (margin 87-136%: one repeat of three under
    # the ceiling) and called it impossible, naming "the wrong device" for this machine.
    low = (out["decode_pct_range"] or [out["decode_pct_of_ceiling"]])[0]
    if (
        (out["decode_pct_of_ceiling"] or 0) > 100
        and (low or 0) > 100
        and not out.get("decode_from_cache")
    ):
        over.append(f"decode at {out['decode_pct_of_ceiling']:.0f}% of the bandwidth ceiling")
    # The floor takes the faster matmul reading; past 100% by more than the readings' spread,
    # no slowed reading explains it.
    slack = (out["compute_spread"] or 0) if out.get("compute_noisy") else 0.0
    if (out["prefill_pct_of_floor"] or 0) > 100 * (1 + slack):
        over.append(f"prefill at {out['prefill_pct_of_floor']:.0f}% of the compute floor")
    if not over:
        return []
    causes = []
    if any(p.get("cache_hits") for p in result["sweep"]):
        causes.append("prompts served from the prefix cache")
    params = (served or {}).get("params")
    if _other_model(c, served):
        causes.append(
            f"the wrong model for the arithmetic: it assumed {c.model} "
            f"({fmt_count(c.model_params)} parameters), the server reports "
            f"{(served or {}).get('name')} with {fmt_count(params)}"
        )
    elif not params:
        causes.append(
            f"the wrong model for the arithmetic ({c.model}; the server does not say its "
            "parameter count, so this cannot be checked)"
        )
    causes.append(f"the wrong device ({c.device}): pass --device for the hardware serving it")
    return [f"{' and '.join(over)} is impossible; likely: " + "; or ".join(causes)]


SWEEP_NEAR = 1.6  # the sweep's 2,000 tokens beside a 4,096-token server's 3,072


def _sweep_context(
    sweep: list[dict[str, Any]],
    short: dict[str, Any],
    long: dict[str, Any],
    ratio: float,
    check_half: int,
    sweep_half: int,
) -> dict[str, Any] | None:
    """The same fall read from the sweep, minutes apart from the context check: its decode at
    the points nearest the check's two lengths (the longer at twice the shorter's prompt at
    least, and within SWEEP_NEAR of the check's long prompt either way, so the line below
    is not stretched far), against what the check's fall predicts there. A decode step's
    time grows in a line with its context (KV bytes and attention alike): t(n) = t0 (1 + c
    n), n the mean context over a decode (prompt + half the output, ``*_half``); the check's
    ``ratio`` gives c, and c the ratio at the sweep's two lengths. None where the sweep has
    no two such points."""
    points = [p for p in sweep if p["decode_tok_s"] and p["prompt_tokens"]]
    if len(points) < 2 or not short["prompt_tokens"] or not long["prompt_tokens"]:
        return None
    a = min(points, key=lambda p: abs(p["prompt_tokens"] - short["prompt_tokens"]))
    b = min(points, key=lambda p: abs(p["prompt_tokens"] - long["prompt_tokens"]))
    far = max(b["prompt_tokens"], long["prompt_tokens"]) / min(
        b["prompt_tokens"], long["prompt_tokens"]
    )
    if b["prompt_tokens"] < 2 * a["prompt_tokens"] or far > SWEEP_NEAR:
        return None
    n_short, n_long = short["prompt_tokens"] + check_half, long["prompt_tokens"] + check_half
    if not n_long - n_short / ratio > 0:  # a fall steeper than the line allows: no slope
        return None
    c = (1 / ratio - 1) / (n_long - n_short / ratio)
    m_short, m_long = a["prompt_tokens"] + sweep_half, b["prompt_tokens"] + sweep_half
    if not 1 + c * m_long > 0:
        return None
    return {
        "short_tokens": a["prompt_tokens"],
        "long_tokens": b["prompt_tokens"],
        "long_over_short": b["decode_tok_s"] / a["decode_tok_s"],
        "predicted_long_over_short": (1 + c * m_short) / (1 + c * m_long),
    }


def _context_finding(
    c: dict[str, Any],
    add: Callable[[str, str, str, str], None],
    noise: float = 0.0,
    cache_bytes: float | None = None,
) -> None:
    """Decode at a long context against a short one, split into what the extra KV bytes
    explain and the rest (attention compute, the kernel): on CPUs the rest is often most.
    The split is a verdict only where it holds over the repeats' range widened by ``noise``,
    how far the host's bandwidth or the decode repeats moved during the probe (a fraction).
    ``cache_bytes``, this CPU's last-level cache, given where decode read past memory's ceiling
    by what the cache explains (``_from_cache``): the fall past the bytes may be the cache's."""
    ratio = c["long_over_short"]
    short, long = c["short"], c["long"]
    measured = (
        f"{short['decode_tok_s']:.1f} tok/s at {short['prompt_tokens']:,} tokens of context, "
        f"{long['decode_tok_s']:.1f} at {long['prompt_tokens']:,} ({ratio:.0%})"
    )
    # The sweep's decode near the check's lengths, read minutes before: a second reading of
    # the same fall. Two probes of the 7B-shaped model on 2 CPU cores, the host's speed
    # moving: the check kept 103% where its sweep fell to 68% (the check predicted 103% at
    # the sweep's lengths), and 72% where the sweep kept 86% (69% predicted).
    again = c.get("sweep") or {}
    if again.get("predicted_long_over_short"):
        apart = _spread([again["long_over_short"], again["predicted_long_over_short"]]) or 0.0
        if apart > NOISE_LIMIT:  # the host's movement is what this reports: no widening
            add(
                "decode",
                "Decode against context length: no verdict",
                f"{measured}; the sweep's decode at {again['short_tokens']:,} and "
                f"{again['long_tokens']:,} tokens, read at another moment, kept "
                f"{again['long_over_short']:.0%} where this fall predicts "
                f"{again['predicted_long_over_short']:.0%} there ({_over_limit(apart)} apart, "
                f"more than {NOISE_LIMIT:.0%}): the host's speed moved between the two",
                "run again on a quiet machine, or with more --repeats",
            )
            return
    if ratio >= 0.9:
        add(
            "decode",
            "Decode barely moves with context length",
            measured,
            "weights dominate each step's reads at these lengths",
        )
        return
    split = c.get("bytes")
    if not split:
        add(
            "decode",
            "Decode slows as context fills",
            measured + "; no model config to split bytes from the rest (pass --plan-model)",
            "keep conversations short or summarise old turns",
        )
        return
    explained = split["explained_long_over_short"]
    remainder = ratio / explained
    evidence = (
        f"{measured}; the extra KV bytes ({fmt_bytes(split['kv_bytes_long'])} at the long "
        f"context against {fmt_bytes(split['weight_bytes'])} of weights) predict a fall to "
        f"{explained:.0%}"
    )
    # The remainder over the repeats: slowest long over fastest short, and the other way.
    lo_hi = [
        long.get(a) / short.get(b) / explained if long.get(a) and short.get(b) else remainder
        for a, b in (
            ("decode_tok_s_min", "decode_tok_s_max"),
            ("decode_tok_s_max", "decode_tok_s_min"),
        )
    ]
    low, high = min(lo_hi) / (1 + noise), max(lo_hi) * (1 + noise)
    # The bytes explain the fall where the remainder lies within BYTES_TOLERANCE of 1 either
    # way: below, the steps cost more than their bytes (attention compute, the kernel); above,
    # less (the bytes over-predict: fixed per-step costs, not bandwidth, set the step).
    below, above = BYTES_TOLERANCE, 1 / BYTES_TOLERANCE
    moved = f", the host moving {noise:.0%} during the probe" if noise else ""
    why = f"the repeats{moved} put the remaining factor at {low:.2f}–{high:.2f}"
    if low < below <= high or low <= above < high:
        rivals = (["attention compute"] if low < below else []) + (
            ["fixed per-step costs (steps not bandwidth-bound)"] if high > above else []
        )
        add(
            "decode",
            "Decode slows as context fills: no verdict on why",
            f"{evidence}; {why}, so the run cannot tell the KV bytes from {' or '.join(rivals)}",
            "run again on a quiet machine, or with more --repeats",
        )
    elif remainder < below and cache_bytes:
        # On a Xeon with 300 MiB of L3, a plain read of the 304 MB small model's step bytes fell
        # from 64 to 4,000 tokens as far as its decode did (0.771 both; the bytes: 0.863):
        # the KV took the cache from the weights (docs/performance.md, bench/ceiling_check.py).
        add(
            "decode",
            "Decode slows with context more than its KV bytes explain: the CPU's cache, or "
            "attention compute",
            f"{evidence}; the remaining factor {remainder:.2f} is either this CPU's last-level "
            f"cache ({fmt_bytes(cache_bytes)}, against {fmt_bytes(split['weight_bytes'])} of "
            "weights), which holds part of the weights at a short context and gives it to the "
            "long context's KV, or attention compute or kernel cost",
            "shorter contexts help; if attention compute is the cause, a faster "
            "decode-attention kernel (or backend) for this device",
        )
    elif remainder < below:
        add(
            "decode",
            "Decode slows with context far more than its KV bytes explain: attention compute "
            "or the attention kernel, not bandwidth",
            f"{evidence}; the remaining factor {remainder:.2f} is attention compute or kernel "
            "cost, not bandwidth",
            "a faster decode-attention kernel (or backend) for this device; shorter contexts "
            "help, more bandwidth or a quantized KV cache barely will",
        )
    elif remainder > above:
        add(
            "decode",
            "Decode slows with context less than its KV bytes predict: it is not "
            "bandwidth-bound at this size",
            f"{evidence}, yet it kept {ratio:.0%} ({remainder:.2f}x the rate the bytes "
            "predict): the bytes a step reads do not set its time; fixed per-step costs (the "
            "serving loop, kernel launches, sampling) take much of each step",
            "cut per-step costs in the serving stack; a quantized KV cache or more bandwidth "
            "barely helps at this size",
        )
    else:
        add(
            "decode",
            "Decode slows as context fills: the extra KV bytes explain it",
            f"{evidence}; what remains (factor {remainder:.2f}) is small",
            "keep conversations short, or a quantized KV cache (fewer bytes per token)",
        )


def findings(r: dict[str, Any], runtime: str) -> list[dict[str, str]]:
    """Plain-language findings from the article's two lists, each with its evidence and knob."""
    out: list[dict[str, str]] = []
    sweep = [p for p in r["sweep"] if p["ttft_ms"] is not None]

    def add(kind: str, title: str, evidence: str, action: str) -> None:
        out.append({"kind": kind, "finding": title, "evidence": evidence, "action": action})

    if len(sweep) >= 2:
        a, b = sweep[0], sweep[-1]
        growth = b["ttft_ms"] / a["ttft_ms"]
        tokens = b["prompt_tokens"] / a["prompt_tokens"]
        evidence = (
            f"TTFT {a['ttft_ms']:.0f} ms at {a['prompt_tokens']} tokens, "
            f"{b['ttft_ms']:.0f} ms at {b['prompt_tokens']} ({growth:.1f}x for "
            f"{tokens:.1f}x the tokens)"
        )
        if growth >= 1.5:
            add(
                "ttft",
                "Prefill sets TTFT: it grows with the prompt",
                evidence,
                f"shorten the prompt; {knob('prefill_batch', runtime)}",
            )
        else:
            add(
                "ttft",
                "TTFT barely grows with the prompt: fixed costs dominate it",
                evidence,
                "look at what every request pays: network, queueing, scheduling",
            )
    if r.get("context") and r["context"]["long_over_short"]:
        ceiling = r.get("ceiling") or {}
        spreads = [
            ceiling.get("context_bandwidth_spread", ceiling.get("bandwidth_spread")),
            ceiling.get("repeat_spread"),
        ]
        _context_finding(
            r["context"],
            add,
            max((x for x in spreads if x), default=0.0),
            cache_bytes=ceiling.get("cache_bytes") if ceiling.get("decode_from_cache") else None,
        )
    pc = r.get("prefix_cache")
    if pc:
        cached = pc["cached_tokens"]
        reported = (
            "the server reports no cached-token count"
            if cached is None
            else f"server reports {cached:,} cached tokens "
            f"({_SOURCES.get(pc.get('cached_source') or '', '')})"
        )
        if (pc.get("cold_cached_tokens") or 0) > CACHE_HIT_FRACTION * (pc["prompt_tokens"] or 0):
            add(
                "error",
                "The prefix check's first send already hit the cache: no cold reference",
                f"{pc['cold_cached_tokens']:,} cached tokens on the first send of the prefix",
                "run again without --seed (fresh prompts)",
            )
        elif pc["warm_over_cold"] < 0.5 or (cached or 0) > 0:
            add(
                "ttft",
                "Prefix caching works",
                f"a repeated {pc['prefix_tokens']}-token prefix: TTFT {pc['cold_ttft_ms']:.0f} → "
                f"{pc['warm_ttft_ms']:.0f} ms; {reported}",
                "put long shared text (system prompt, documents) first and keep it identical",
            )
        elif (pc["prompt_tokens"] or 0) >= MIN_JUDGED_PREFIX_TOKENS:
            add(
                "ttft",
                "A repeated prefix is not being reused",
                f"TTFT {pc['cold_ttft_ms']:.0f} → {pc['warm_ttft_ms']:.0f} ms on the second send; "
                f"{reported}",
                knob("prefix_cache", runtime),
            )
    hits = sum(p.get("cache_hits", 0) for p in r["sweep"])
    if hits:
        add(
            "error",
            f"{hits} sweep request(s) hit the prefix cache and were left out of the figures",
            ", ".join(
                f"{p['cache_hits']} of {p['repeats']} at {p['prompt_tokens']} tokens"
                for p in r["sweep"]
                if p.get("cache_hits")
            )
            + " (cached tokens over 10% of the prompt)",
            "these prompts were seen before (a repeated --seed?): run without --seed",
        )
    cold = r.get("cold")
    if (
        cold
        and not cold.get("cache_hit")
        and sweep
        and cold["ttft_ms"]
        and sweep[0]["ttft_ms"]
        and cold["ttft_ms"] > 3 * sweep[0]["ttft_ms"]
    ):
        add(
            "ttft",
            "The first request paid a cold start",
            f"cold TTFT {cold['ttft_ms']:.0f} ms vs {sweep[0]['ttft_ms']:.0f} ms warm",
            knob("cold", runtime),
        )
    ceiling = r.get("ceiling")
    if ceiling and ceiling.get("impossible"):
        for text in ceiling["impossible"]:
            add(
                "error",
                "Faster than the hardware allows: no verdict on the ceiling",
                text,
                "fix the comparison (--plan-model, --device) or run without --seed",
            )
    elif ceiling and ceiling.get("noisy") and ceiling.get("decode_pct_of_ceiling"):
        add(
            "decode",
            "The machine is noisy: no verdict on decode against the ceiling",
            f"{ceiling['decode_pct_of_ceiling']:.0f}% of the bandwidth ceiling, but "
            + "; ".join(ceiling["noisy"])
            + f" (more than {NOISE_LIMIT:.0%})",
            "run again on a quiet machine (nothing else using its memory bandwidth), or with "
            "more --repeats",
        )
    elif ceiling and ceiling.get("decode_pct_of_ceiling"):
        pct = ceiling["decode_pct_of_ceiling"]
        low, high = ceiling.get("decode_pct_range") or [pct, pct]
        evidence = (
            f"{pct:.0f}% of the bandwidth ceiling on {ceiling['device']} (margin "
            f"{low:.0f}–{high:.0f}% over repeats and bandwidth readings)"
        )
        bits = ceiling.get("weight_bits")
        # Weights already at a 4- or 5-bit width: quantizing further costs quality, and on a
        # few CPU cores unpacking them is compute that holds decode below the bytes' ceiling
        # (docs/metrics.md: llama.cpp decoded a Q4_K_M GGUF at 45-58% of it where the same
        # model in BF16 reached 66-90%).
        light = bits is not None and bits <= LIGHT_WEIGHT_BITS
        if light:
            evidence += f"; the weights are already {bits:.1f} bits each"
        if ceiling.get("decode_from_cache"):
            add(
                "decode",
                "Decode beats memory's ceiling: the CPU's cache holds part of the model",
                f"{evidence}; {ceiling['decode_from_cache']}",
                f"fewer bytes per token: {knob('quantize', runtime)} (more of the model then "
                "fits in the cache too); otherwise the hardware is the limit",
            )
        elif pct >= 70:
            add(
                "decode",
                "Decode is near the bandwidth ceiling: the hardware is the limit",
                evidence,
                "a smaller model, or more memory bandwidth"
                if light
                else f"fewer bytes per token: {knob('quantize', runtime)}; or a smaller model, "
                "or more memory bandwidth",
            )
        elif pct < 50:
            add(
                "decode",
                "Decode is far below the bandwidth ceiling: look at the serving stack",
                evidence,
                knob("stack", runtime),
            )
        elif light:
            add(
                "decode",
                "Decode reaches a fair share of the bandwidth ceiling",
                evidence,
                "fewer bits barely help: the rest of the step is not the weights' bytes (on a "
                "CPU, unpacking them is compute on every token); " + knob("stack", runtime),
            )
        else:
            add(
                "decode",
                "Decode reaches a fair share of the bandwidth ceiling",
                evidence,
                f"more needs fewer bytes per token: {knob('quantize', runtime)}",
            )
    pct_floor = ceiling.get("prefill_pct_of_floor") if ceiling else None
    if ceiling and pct_floor and ceiling.get("compute_noisy") and not ceiling.get("impossible"):
        add(
            "ttft",
            "The machine is noisy: no verdict on prefill against the compute floor",
            f"{pct_floor:.0f}% of the floor at the best reading, but {ceiling['compute_noisy']} "
            f"(more than {NOISE_LIMIT:.0%})",
            "run again on a quiet machine (nothing else using its cores)",
        )
    elif ceiling and pct_floor and not ceiling.get("impossible"):
        add(
            "ttft",
            "Prefill against the compute floor",
            f"TTFT at the longest prompt is {100 / pct_floor:.1f}x the compute-bound floor "
            f"({pct_floor:.0f}% of peak FLOP/s)",
            "near the floor only fewer prompt tokens or more FLOP/s help"
            if pct_floor >= 50
            else knob("prefill_batch", runtime),
        )
    _join_finding(r.get("prefill_join") or [], runtime, add)
    if r["failures"]:
        timed_out = any(
            (f["error"] or "").startswith("timeout: no whole answer") for f in r["failures"]
        )
        add(
            "error",
            f"{len(r['failures'])} request(s) failed and were left out",
            r["failures"][0]["error"] or "",
            "see the failures list"
            + ("; --timeout SECONDS gives every request that long" if timed_out else ""),
        )
    return out


# A pause in a stream of text that a reader sees: a join step this long or longer is a
# finding (a GPU server's 30 ms step beside 10 ms ones, 3x, is not one).
STALL_SEEN_S = 0.2


def _join_finding(
    joins: list[dict[str, Any]], runtime: str, add: Callable[[str, str, str, str], None]
) -> None:
    """The join check's longest timed prompt, where its step held the streams decoding beside it
    ITL_JUMP_RATIO times their step or more (watch's rule on ITL p99 over p50, here read
    from one step) and STALL_SEEN_S at least: each stream's next token waited for the
    prompt's prefill."""
    timed = [j for j in joins if j.get("step_ms") and j.get("decode_step_ms")]
    if not timed:
        return
    j = max(timed, key=lambda j: j["prompt_tokens"])
    ratio = j["step_ms"] / j["decode_step_ms"]
    if ratio < ITL_JUMP_RATIO or j["step_ms"] < STALL_SEEN_S * 1e3:
        return
    add(
        "decode",
        "A prompt joining running streams stalls them: prefill interrupts decode",
        f"a {j['prompt_tokens']:,}-token prompt joining {j['decoding_together']} decoding "
        f"streams: their step {fmt_seconds(j['step_ms'] / 1e3)} against "
        f"{fmt_seconds(j['decode_step_ms'] / 1e3)} without it ({ratio:.1f}x)",
        knob("chunked_prefill", runtime),
    )
