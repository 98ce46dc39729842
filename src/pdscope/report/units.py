"""Human formatting of bytes, FLOPs, rates and durations for terminal reports."""

from __future__ import annotations

from collections.abc import Callable


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def fmt_count(n: float | None, suffix: str = "") -> str:
    if n is None:
        return "-"
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}{suffix}"
    return f"{n:,.0f} {suffix}".rstrip()


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:,.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:,.2f} ms"
    return f"{s * 1e6:,.1f} µs"


def fmt_left(s: float | None) -> str:
    """A prediction of time left that is a bound more than an estimate (probe's: a batch's
    steps counted as one stream's times its streams until a batch is read), rounded as such:
    "up to about 3 min left"."""
    if s is None or s <= 0:
        return ""
    if s < 60:
        return "under a minute left"
    minutes = round(s / 60)
    if minutes < 90:
        return f"up to about {minutes} min left"
    hours, minutes = divmod(minutes, 60)
    return f"up to about {hours} h {minutes} min left" if minutes else f"up to about {hours} h left"


def fmt_rate(x: float | None, unit: str = "tok/s") -> str:
    if x is None:
        return "-"
    return f"{x:,.0f} {unit}" if x >= 100 else f"{x:,.1f} {unit}"


def fmt(x: float | None, pattern: str = "{:,.1f}") -> str:
    """``pattern`` applied to a figure, or "-" when there is none."""
    return "-" if x is None else pattern.format(x)


def fmt_quantile(
    value: float | None, edge: list | None, show: Callable[[float | None], str] = fmt
) -> str:
    """A histogram quantile; one known only by a bucket bound (``edge``: ["below" or "above",
    the bound], from `quantile_edge`) reads "< bound" or "> bound", not a number the buckets
    cannot give."""
    if value is None or not edge:
        return show(value)
    return ("< " if edge[0] == "below" else "> ") + show(edge[1])
