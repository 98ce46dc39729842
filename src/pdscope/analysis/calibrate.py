"""Fit the simulator's cost parameters to a saved `pdscope probe --json` of the server modelled.

A probe measures one server's steps in three shapes: prefills of several lengths (TTFT, one
request at a time), single-stream decodes at short and long context (TPOT), and batched
decodes at short and long context (several streams at once: the mean per-token gap while
most of them decode together is one step carrying that many).
Each becomes an :class:`Observation`: the steps the engine's scheduler would run for it, and the
seconds they took. The cost model prices a step as a sum of roofline terms ``max(FLOPs / F,
bytes / B)`` plus ``step_overhead + seq_overhead x entries`` (the per-sequence cost may change
at each batch size the probe measured), and a TTFT also pays
``request_overhead`` once (HTTP, hand-off to the engine: time outside any step). At fixed rates
F and B the time is linear in the overheads; which side of each term binds depends on
the rates, so :func:`fit` searches the rates on a grid and solves the overheads at each point
(see its docstring for the loss and for how it chooses among fits the probe cannot tell apart).

The parameters mean what the cost model says they mean: F and B are the achieved rates over
everything the roofline counts; the overheads are what it does not see (Python, launches,
sampling, HTTP for the first token). What one probe cannot separate is said in the residuals.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from pdscope.analysis.probe import (
    JOIN_LABEL,
    JOIN_NEW_LABEL,
    join_steps,
    joint_decode,
    sweep_size,
)
from pdscope.analysis.stats import median
from pdscope.client.trace import UNREAD, Trace
from pdscope.roofline.step_cost import CostModel, CostParams
from pdscope.specs import SpecError

# Probe's batched-decode checks: short prompts, and (newer probes) long ones, and the batch
# sweep's other sizes at short prompts ("batch-decode x2", ...).
BATCH_LABELS = ("batch-decode", "batch-decode-long")


def is_batch_label(label: str) -> bool:
    return label in BATCH_LABELS or sweep_size(label) is not None


@dataclass(frozen=True)
class WorkEntry:
    """One scheduled entry as the cost model reads it (the engine's ScheduledRequest's shape)."""

    start: int
    num_new_tokens: int
    samples: bool = True


@dataclass(frozen=True)
class Observation:
    """Measured seconds for a run of steps; ``steps`` lists each step's entries."""

    label: str
    kind: str  # prefill, decode, batch-decode or mixed (a prefill joining decodes: one gap)
    steps: tuple[tuple[WorkEntry, ...], ...]
    seconds: float
    samples: int = 1  # requests the median was taken over (gaps, for a batch-decode mean)

    @property
    def requests(self) -> int:
        """Request overheads inside the measured time: a TTFT includes one, a gap none."""
        return 1 if self.kind == "prefill" else 0


@dataclass(frozen=True)
class Residual:
    label: str
    kind: str
    measured_s: float
    fitted_s: float

    @property
    def error(self) -> float:
        """fitted / measured - 1."""
        return self.fitted_s / self.measured_s - 1


@dataclass(frozen=True)
class StepJitter:
    """How much a server's step times scatter about their cost: every single-stream decode gap
    of the probe over its own request's mean gap, sorted. A simulated step gets one of them
    drawn at random (:meth:`apply`); each request's ratios average 1, so the draws do too (the
    fit prices a step's mean; this spreads it). A perfectly steady server gives all ones, i.e.
    no jitter.

    What disturbs a step (the OS, another tenant) takes time, not a share of the step: on the
    Xeon a 128-token prompt's TTFT and a decode gap had the same p99 - p50, 13-14 ms, at 40 and
    10 ms medians. So a step up to ``scale_s`` (the probe's decode step) is multiplied by the
    ratio, and a longer one gets the extra seconds the ratio gives a step of ``scale_s``:
    multiplying a prefill's 40 ms by a decode's ratios put its p99 at twice the measured.

    Each request is its own scale, so a stall in one request adds one large ratio and shrinks
    only its own request's others. Scaled by its median gap and then rescaled to mean 1 over
    the whole probe, a request read in bursts gave ratios in the thousands, and the rescaling
    shrank every other step twenty-fold. A request read in bursts (``bursty``:
    :attr:`Trace.read_in_bursts`) measures the client, not the server's steps, and is left
    out."""

    ratios: tuple[float, ...]  # sorted ascending, mean 1
    bursty: int = 0  # requests left out
    scale_s: float = 0.0  # the median of the requests' mean gaps (0: every step multiplied)

    @property
    def samples(self) -> int:
        return len(self.ratios)

    @property
    def quantiles(self) -> tuple[float, ...]:
        """p0..p100 of the ratios (for reports; draws come from the ratios themselves)."""
        return tuple(float(x) for x in np.percentile(self.ratios, range(101)))

    def draw(self, u: float) -> float:
        """The ratio at cumulative probability ``u`` in [0, 1): each ratio is drawn with
        probability 1 / samples, so the draws' mean is the ratios' mean, 1. (Interpolating
        between 101 quantiles instead gave the largest ratio a weight of 1/200, more than its
        1/samples: one stall then shrank every other draw.)"""
        return self.ratios[min(int(u * len(self.ratios)), len(self.ratios) - 1)]

    def apply(self, cost_s: float, u: float) -> float:
        """A step of ``cost_s`` seconds, disturbed by the ratio drawn at ``u``."""
        scale = min(cost_s, self.scale_s) if self.scale_s > 0 else cost_s
        return cost_s + (self.draw(u) - 1) * scale

    def to_dict(self) -> dict[str, Any]:
        q = self.quantiles
        return {
            "samples": self.samples,
            "bursty_requests_left_out": self.bursty,
            "scale_ms": self.scale_s * 1e3,
            "p1": q[1],
            "p50": q[50],
            "p90": q[90],
            "p99": q[99],
        }


# Single-stream decodes of a probe: every gap is one step carrying one decode.
_SINGLE_LABELS = ("sweep", "prefix-cold", "prefix-warm", "context-short", "context-long")
SCATTER_MIN_GAPS = 8  # a request's gaps the scatter takes: fewer scale by too rough a mean


def step_jitter(probe: dict[str, Any]) -> StepJitter | None:
    """The probe's step-time scatter (see :class:`StepJitter`); None without a decode of at
    least ``SCATTER_MIN_GAPS`` gaps read steadily. The cold request is left out: its first
    steps pay one-off work."""
    ratios: list[float] = []
    means: list[float] = []
    bursty = 0
    for t in (Trace.from_dict(d) for d in probe.get("traces") or []):
        if not t.ok or t.label.removesuffix(UNREAD) not in _SINGLE_LABELS:
            continue
        gaps = t.itl_samples_s()
        mean_gap = sum(gaps) / len(gaps) if len(gaps) >= SCATTER_MIN_GAPS else 0.0
        if not mean_gap > 0:
            continue
        if t.read_in_bursts:
            bursty += 1
            continue
        ratios += [g / mean_gap for g in gaps]
        means.append(mean_gap)
    if not ratios:
        return None
    return StepJitter(tuple(sorted(ratios)), bursty, median(means) or 0.0)


@dataclass
class Calibration:
    params: CostParams
    residuals: list[Residual]
    notes: list[str] = field(default_factory=list)
    jitter: StepJitter | None = None

    def to_dict(self) -> dict[str, Any]:
        p = self.params
        return {
            "bandwidth_gb_s": p.bandwidth_gb_s,
            "tflops": p.tflops,
            "step_overhead_ms": p.step_overhead_s * 1e3,
            "prefill_step_overhead_ms": p.prefill_step_overhead_s * 1e3,
            "seq_overhead_ms": p.seq_overhead_s * 1e3,
            # [n, ms]: each sequence of a step past the n-th costs ms instead
            "seq_overhead_above_ms": [[n, cost * 1e3] for n, cost in p.seq_overhead_above],
            "request_overhead_ms": p.request_overhead_s * 1e3,
            "source": p.source,
            "residuals": [
                {
                    "label": r.label,
                    "kind": r.kind,
                    "measured_ms": r.measured_s * 1e3,
                    "fitted_ms": r.fitted_s * 1e3,
                    "error": r.error,
                }
                for r in self.residuals
            ],
            "notes": self.notes,
            "step_jitter": self.jitter.to_dict() if self.jitter else None,
        }


def prefill_steps(prompt: int, cached: int, budget: int) -> tuple[tuple[WorkEntry, ...], ...]:
    """The steps one request's prefill takes alone on a server: its uncached tokens in chunks
    of ``budget``; the last chunk samples the first token."""
    steps = []
    start = min(cached, prompt - 1)  # a hit never covers the last prompt token
    while start < prompt:
        n = min(budget, prompt - start)
        steps.append((WorkEntry(start, n, start + n == prompt),))
        start += n
    return tuple(steps)


def observations(probe: dict[str, Any], budget: int) -> list[Observation]:
    """What a saved probe measured, as steps and seconds. ``budget`` is the server's
    max_num_batched_tokens (a prompt over it prefills in several steps). Failed requests, the
    cold request (model load, first-use work), prefix hits the server did not count and the
    decode of a stream read in bursts (:attr:`Trace.read_in_bursts`) are left out; repeats of one
    point give one observation, their median."""
    traces = [Trace.from_dict(t) for t in probe.get("traces") or []]
    prefill: dict[tuple[str, int, int], list[float]] = defaultdict(list)
    decode: dict[tuple[str, int], list[float]] = defaultdict(list)
    batch: dict[str, list[Trace]] = defaultdict(list)
    for t in traces:
        if not t.ok or t.label == "cold" or t.label.endswith(UNREAD):
            continue  # an unread one's TTFT waited in the client with its tokens
        if is_batch_label(t.label):
            batch[t.label].append(t)
            continue
        if t.label in (JOIN_LABEL, JOIN_NEW_LABEL):
            continue  # read together below
        prompt = t.prompt_tokens or t.prompt_tokens_asked
        if not prompt:
            continue
        cached = t.cached_tokens
        if cached is None and t.label == "prefix-warm":
            continue  # a hit of unknown size: no step to price
        if t.ttft_s is not None:
            prefill[(t.label, prompt, cached or 0)].append(t.ttft_s)
        n = t.n_output
        if t.tpot_s is not None and n and n >= 2 and not t.read_in_bursts:
            # Decode steps run at contexts prompt+1 .. prompt+n-1; the cost is linear in the
            # context, so the middle one prices their mean.
            decode[(t.label, prompt + n // 2)].append(t.tpot_s)
    out = [
        Observation(
            f"{label} {prompt} tok" + (f" ({cached} cached)" if cached else ""),
            "prefill",
            prefill_steps(prompt, cached, budget),
            median(times),  # type: ignore[arg-type]
            len(times),
        )
        for (label, prompt, cached), times in sorted(prefill.items(), key=lambda kv: kv[0][1])
    ]
    out += [
        Observation(
            f"{label} decode at {context} tok",
            "decode",
            ((WorkEntry(context - 1, 1),),),
            median(times),  # type: ignore[arg-type]
            len(times),
        )
        for (label, context), times in sorted(decode.items(), key=lambda kv: kv[0][1])
    ]
    for label, group in sorted(batch.items()):
        joint = joint_decode(group, steady=True)
        if joint is None or joint.streams < 2:
            continue
        entries = tuple(WorkEntry(joint.context - 1, 1) for _ in range(joint.streams))
        # a sweep point is named by the streams it carried, as the batched check is
        name = "batch-decode" if sweep_size(label) is not None else label
        # The mean gap, as a single stream's TPOT is: a client too loaded to keep up reads
        # several streamed tokens at once, and the gaps of ~0 between them sank the median to
        # half a step, or to 0 (a tiny model's probe beside a busy core), while their sum is
        # still the streams' decode time.
        out.append(
            Observation(
                f"{name} x{joint.streams} at {joint.context} tok",
                "batch-decode",
                (entries,),
                sum(joint.gaps_s) / len(joint.gaps_s),
                len(joint.gaps_s),
            )
        )
    for join in join_steps(traces):
        if join.prompt_tokens + len(join.contexts) > budget:
            continue  # its prefill was chunked: the gap holds one chunk of a size unknown here
        entries = tuple(WorkEntry(c - 1, 1) for c in join.contexts)
        out.append(
            Observation(
                f"prefill {join.prompt_tokens} tok joining x{len(join.contexts)} decodes",
                "mixed",
                ((*entries, WorkEntry(0, join.prompt_tokens)),),
                join.step_s,
                join.steady_streams,
            )
        )
    return out


def _terms(cost: CostModel, obs: Observation) -> tuple[np.ndarray, np.ndarray]:
    """Every roofline term of the observation's steps as FLOPs and bytes arrays."""
    terms = [t for step in obs.steps for t in cost.roofline_terms(step)]
    return np.array([f for f, _ in terms]), np.array([b for _, b in terms])


# The loss a fit may give up to explain the probe with less overhead: 1% of the best loss
# (plus a floor for a noiseless probe, whose best loss is ~0).
NEAR_BEST = 0.01
NEAR_BEST_FLOOR = 1e-4
GRID = 40  # points per rate on each pass of the grid
IRLS_ROUNDS = 4  # reweightings toward least absolute relative error


def _overheads(a: np.ndarray, b: np.ndarray, w: np.ndarray) -> np.ndarray:
    """For every grid point g: the overheads x >= 0 minimizing sum_i (w[g,i] (a[i] x - b[g,i]))^2,
    by trying each subset of them held at zero. a: (n, k); b, w: (G, n); returns (G, k)."""
    g, k = b.shape[0], a.shape[1]
    best = np.zeros((g, k))
    best_norm = np.sqrt(((w * b) ** 2).sum(axis=1))
    subsets = [np.array(keep) for keep in itertools.product((1.0, 0.0), repeat=k) if any(keep)]
    for keep in subsets:
        if (keep.astype(bool) & ~a.any(axis=0)).any():
            continue  # an overhead that applies to no observation cannot be fitted
        ak = a * keep  # dropped columns are zero; a ridge of 1 on them keeps the solve regular
        aw = w[:, :, None] * ak[None]  # (G, n, 3)
        lhs = np.einsum("gni,gnj->gij", aw, aw) + np.diag(1.0 - keep + 1e-12)[None]
        rhs = np.einsum("gni,gn->gi", aw, w * b)
        x = np.linalg.solve(lhs, rhs[..., None])[..., 0] * keep
        norm = np.sqrt(((w * (x @ a.T - b)) ** 2).sum(axis=1))
        better = (x >= 0).all(axis=1) & (norm < best_norm - 1e-15)
        best[better], best_norm[better] = x[better], norm[better]
    return best


def _in_segment(seqs: int, lo: int, hi: int | None) -> int:
    """How many of a step's ``seqs`` sequences fall in the counts lo+1 .. hi (None: no end)."""
    return max(0, (seqs if hi is None else min(seqs, hi)) - lo)


def _grid_fit(
    terms: Sequence[tuple[np.ndarray, np.ndarray]],
    seconds: np.ndarray,
    counts: np.ndarray,
    log_f: np.ndarray,
    log_b: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """At every (FLOP/s, bytes/s) pair of the grid: the overheads minimizing the sum of
    |relative error| (least squares reweighted toward it, so one disturbed point among many
    moves the fit little), the mean |relative error| and the overheads' share of the fitted
    time. Returns (rates (G, 2) as log10, overheads (G, k), loss (G,), share (G,))."""
    lf, lb = (m.ravel() for m in np.meshgrid(log_f, log_b, indexing="ij"))
    inv_f, inv_b = 10.0**-lf, 10.0**-lb
    roof = np.stack(
        [np.maximum(np.outer(inv_f, f), np.outer(inv_b, b)).sum(axis=1) for f, b in terms],
        axis=1,
    )  # (G, n) seconds of roofline time
    a = counts / seconds[:, None]
    b = 1.0 - roof / seconds
    w = np.ones_like(b)
    for _ in range(IRLS_ROUNDS):
        x = _overheads(a, b, w)
        w = 1.0 / np.sqrt(np.maximum(np.abs(x @ a.T - b), 0.02))
    loss = np.abs(x @ a.T - b).mean(axis=1)
    over_s = x @ counts.T
    share = over_s.sum(axis=1) / (roof + over_s).sum(axis=1)
    return np.stack([lf, lb], axis=1), x, loss, share


def fit(cost: CostModel, obs: Sequence[Observation], source: str = "") -> Calibration:
    """Achieved FLOP/s and bandwidth and the overheads that best explain ``obs``.

    Which side of each roofline term binds depends on the rates, so the loss has several local
    minima: the rates are searched on a log grid (refined twice around the best point) and the
    overheads solved exactly at each. The loss is the mean |relative error| (a disturbed point
    of a noisy host counts once, not squared). A decode's time is weights / bandwidth plus the
    per-step overhead, so a probe can often be explained as well by a fast memory and a large
    overhead as by a slower memory and none: among rates within ``NEAR_BEST`` (1%) of the best loss
    the fit takes those whose overheads explain the least time, letting the roofline (which
    knows how time grows with batch, context and prompt) carry what the probe cannot tell apart.
    """
    notes = []
    timeless = [o.label for o in obs if not o.seconds > 0]
    if timeless:
        notes.append(f"left out, not a positive time (no step takes none): {', '.join(timeless)}")
        obs = [o for o in obs if o.seconds > 0]
    kinds = {o.kind for o in obs}
    if "prefill" not in kinds or not kinds & {"decode", "batch-decode"}:
        raise SpecError(
            "the probe file needs answered prefill and decode requests to fit anything "
            f"(found: {', '.join(sorted(kinds)) or 'none'})"
        )
    terms = [_terms(cost, o) for o in obs]
    seconds = np.array([o.seconds for o in obs])
    # The per-sequence cost may change at each batch size the probe measured but the largest:
    # one cost per segment of sequence counts, each fitted from the batch point that ends it.
    # Short prompts' points only: the long one's streams may overlap one fewer (7 beside 8
    # would make a segment of one sequence, fitted from the KV read's difference).
    sizes = sorted(
        {
            len(o.steps[0])
            for o in obs
            if o.kind == "batch-decode" and not o.label.startswith("batch-decode-long")
        }
    )
    bounds = [0, *sizes[:-1], None]
    segments = list(itertools.pairwise(bounds))
    counts = np.array(
        [
            [
                len(o.steps),
                sum(any(e.num_new_tokens > 1 for e in st) for st in o.steps),
                *(sum(_in_segment(len(st), lo, hi) for st in o.steps) for lo, hi in segments),
                o.requests,
            ]
            for o in obs
        ],
        dtype=float,
    )
    if not any(o.kind == "batch-decode" for o in obs):
        notes.append(
            "no usable batched-decode point (probe with --batch-streams 8, on a client "
            "that keeps up): the per-sequence overhead cannot be told apart from the "
            "per-step one and is held at 0"
        )
        counts[:, 2] = 0.0
    if "mixed" not in kinds:
        # A prefill measured alone (its TTFT) holds its step's extra cost and the request's
        # time outside any step together: only a prefill timed inside a running batch splits
        # them. Without one the request carries both, as before.
        notes.append(
            "no prefill timed inside a running batch (probe's join check): a prefill step's "
            "extra cost cannot be told apart from the per-request one and is held at 0"
        )
        counts[:, 1] = 0.0
    # The rates that would explain each observation alone bound the search.
    alone = np.array([[f.sum() / t, b.sum() / t] for (f, b), t in zip(terms, seconds, strict=True)])
    lo = np.log10(alone.min(axis=0) / 10)
    hi = np.log10(alone.max(axis=0) * 100)
    found = []
    for _ in range(3):
        rates, over, loss, share = _grid_fit(
            terms, seconds, counts, np.linspace(lo[0], hi[0], GRID), np.linspace(lo[1], hi[1], GRID)
        )
        found.append((rates, over, loss, share))
        cell = (hi - lo) / (GRID - 1)
        lo, hi = rates[loss.argmin()] - 2 * cell, rates[loss.argmin()] + 2 * cell
    rates, over, loss, share = (np.concatenate(parts) for parts in zip(*found, strict=True))
    near = np.flatnonzero(loss <= loss.min() * (1 + NEAR_BEST) + NEAR_BEST_FLOOR)
    pick = near[np.lexsort((loss[near], share[near]))[0]]
    x = np.array([10.0 ** -rates[pick, 0], 10.0 ** -rates[pick, 1], *over[pick]])
    per_seq = [float(v) for v in x[4:-1]]
    params = CostParams(
        bandwidth_gb_s=1 / x[1] / 1e9,
        tflops=1 / x[0] / 1e12,
        step_overhead_s=float(x[2]),
        prefill_step_overhead_s=float(x[3]),
        seq_overhead_s=per_seq[0],
        seq_overhead_above=tuple(zip(sizes[:-1], per_seq[1:], strict=True)),
        request_overhead_s=float(x[-1]),
        source=source or "fitted to a probe",
    )
    fitted = replace(cost, params=params)
    residuals = [
        Residual(
            o.label,
            o.kind,
            o.seconds,
            sum(fitted.step(list(step)).seconds for step in o.steps)
            + params.request_overhead_s * o.requests,
        )
        for o in obs
    ]
    return Calibration(params, residuals, notes)
