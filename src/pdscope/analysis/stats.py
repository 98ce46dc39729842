"""Summary statistics. Percentiles use numpy's default linear interpolation, as vLLM does."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def summary(values: Sequence[float], percentiles: Sequence[float] = (50, 90, 99)) -> dict:
    """mean, median, std (population), min, max and pNN of the values; empty -> count 0."""
    if not values:
        return {"count": 0}
    a = np.asarray(values, dtype=float)
    out = {
        "count": int(a.size),
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "std": float(a.std()),
        "min": float(a.min()),
        "max": float(a.max()),
    }
    for p in percentiles:
        out[f"p{p:g}"] = float(np.percentile(a, p))
    return out


def median(values: Sequence[float]) -> float | None:
    return float(np.median(values)) if len(values) else None


def fit_poly(x: Sequence[float], y: Sequence[float], degree: int) -> list[float] | None:
    """Least-squares coefficients, lowest order first; None without enough distinct points."""
    if len(set(x)) <= degree:
        return None
    return [float(c) for c in np.polynomial.polynomial.polyfit(x, y, degree)]
