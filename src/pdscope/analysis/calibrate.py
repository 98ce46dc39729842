"""Fit the simulator's cost parameters to a saved `pdscope probe --json` of the server modelled.

A probe measures one server's steps in three shapes: prefills of several lengths (TTFT, one
request at a time), single-stream decodes at short and long context (TPOT), and one batched
decode (several streams at once: the median per-token gap is one step carrying all of them).
Each becomes an :class:`Observation`: the steps the engine's scheduler would run for it, and the
seconds they took. The cost model prices a step as a sum of roofline terms ``max(FLOPs / F,
bytes / B)`` plus ``step_overhead + seq_overhead x entries``, and a TTFT also pays
``request_overhead`` once (HTTP, hand-off to the engine: time outside any step); once each
term's binding side is chosen the time is linear in ``(1/F, 1/B, step_overhead,
seq_overhead, request_overhead)``, so the fit alternates
choosing sides at the current parameters and solving a non-negative least-squares problem in
relative error, until the sides stop changing.

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

from pdscope.analysis.probe import streams_overlap
from pdscope.analysis.stats import median
from pdscope.client.trace import Trace
from pdscope.roofline.step_cost import CostModel, CostParams
from pdscope.specs import SpecError


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
    kind: str  # prefill, decode or batch-decode
    steps: tuple[tuple[WorkEntry, ...], ...]
    seconds: float
    samples: int = 1  # requests (or gaps) the median was taken over

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


@dataclass
class Calibration:
    params: CostParams
    residuals: list[Residual]
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        p = self.params
        return {
            "bandwidth_gb_s": p.bandwidth_gb_s,
            "tflops": p.tflops,
            "step_overhead_ms": p.step_overhead_s * 1e3,
            "seq_overhead_ms": p.seq_overhead_s * 1e3,
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
    cold request (model load, first-use work) and prefix hits the server did not count are left
    out; repeats of one point give one observation, their median."""
    traces = [Trace.from_dict(t) for t in probe.get("traces") or []]
    prefill: dict[tuple[str, int, int], list[float]] = defaultdict(list)
    decode: dict[tuple[str, int], list[float]] = defaultdict(list)
    batch: list[Trace] = []
    for t in traces:
        if not t.ok or t.label == "cold":
            continue
        if t.label == "batch-decode":
            batch.append(t)
            continue
        prompt = t.prompt_tokens or t.prompt_tokens_asked
        if not prompt:
            continue
        cached = t.cached_tokens
        if cached is None and t.label == "prefix-warm":
            continue  # a hit of unknown size: no step to price
        if t.ttft_s is not None:
            prefill[(t.label, prompt, cached or 0)].append(t.ttft_s)
        n = t.n_output
        if t.tpot_s is not None and n and n >= 2:
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
    concurrency = streams_overlap(batch)
    gaps = [x for t in batch for x in t.itl_samples_s()]
    if concurrency is not None and round(concurrency) >= 2 and gaps:
        prompt = int(median([t.prompt_tokens or t.prompt_tokens_asked or 0 for t in batch]) or 0)
        n = int(median([t.n_output or 0 for t in batch]) or 0)
        k = round(concurrency)
        entries = tuple(WorkEntry(prompt + n // 2 - 1, 1) for _ in range(k))
        out.append(
            Observation(
                f"batch-decode x{k} at {prompt + n // 2} tok",
                "batch-decode",
                (entries,),
                median(gaps),  # type: ignore[arg-type]
                len(gaps),
            )
        )
    return out


def _row(cost: CostModel, obs: Observation, x: np.ndarray) -> np.ndarray:
    """The observation's time as coefficients of (1/F, 1/B, step, seq, request), each roofline
    term on the side that binds at ``x`` (1/F, 1/B in s/FLOP and s/byte)."""
    row = np.zeros(5)
    for step in obs.steps:
        for flops, nbytes in cost.roofline_terms(step):
            if flops * x[0] >= nbytes * x[1]:
                row[0] += flops
            else:
                row[1] += nbytes
        row[2] += 1
        row[3] += len(step)
    row[4] = obs.requests
    return row


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """Least squares with x >= 0 and both rates free (x[0], x[1] > 0), by trying every set of
    overheads held at zero (five unknowns: eight solves)."""
    best, best_norm = None, np.inf
    for keep in itertools.product((True, False), repeat=3):
        cols = [0, 1] + [2 + i for i, k in enumerate(keep) if k]
        sol, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
        if (sol[:2] <= 0).any() or (sol < 0).any():
            continue
        x = np.zeros(5)
        x[cols] = sol
        norm = float(np.linalg.norm(a @ x - b))
        if norm < best_norm - 1e-15:
            best, best_norm = x, norm
    return best


def fit(cost: CostModel, obs: Sequence[Observation], source: str = "") -> Calibration:
    """Achieved FLOP/s and bandwidth and the two overheads that best explain ``obs`` (least
    squares in relative error). ``cost`` gives the model and precisions; its params are only a
    starting point."""
    kinds = {o.kind for o in obs}
    if "prefill" not in kinds or not kinds & {"decode", "batch-decode"}:
        raise SpecError(
            "the probe file needs answered prefill and decode requests to fit anything "
            f"(found: {', '.join(sorted(kinds)) or 'none'})"
        )
    notes = []
    if "batch-decode" not in kinds:
        notes.append(
            "no batched-decode point (probe with --batch-streams 8): the per-sequence "
            "overhead cannot be told apart from the per-step one and is held at 0"
        )
    x = np.array([1 / cost.params.flops_per_s, 1 / cost.params.bandwidth_bytes_s, 0, 0, 0.0])
    weights = np.array([1 / o.seconds for o in obs])
    sides: list[np.ndarray] = []
    for _ in range(30):
        rows = np.array([_row(cost, o, x) for o in obs])
        if sides and all(np.array_equal(r, s) for r, s in zip(rows, sides, strict=True)):
            break
        sides = list(rows)
        a = rows * weights[:, None]
        if "batch-decode" not in kinds:
            a[:, 3] = 0.0
        found = _nnls(a, np.ones(len(obs)))
        if found is None:
            raise SpecError(
                "no positive FLOP/s and bandwidth explain this probe: its prefill and decode "
                "figures contradict each other (a shared, noisy machine?)"
            )
        x = found
    params = CostParams(
        bandwidth_gb_s=1 / x[1] / 1e9,
        tflops=1 / x[0] / 1e12,
        step_overhead_s=float(x[2]),
        seq_overhead_s=float(x[3]),
        request_overhead_s=float(x[4]),
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
