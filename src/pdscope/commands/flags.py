"""Flag text into values, for the commands' settings objects.

Every error is a ``ValueError`` whose message names the flag, so the CLI can print it as the
one line of a usage error (exit 2).
"""

from __future__ import annotations


def _items(text: str, flag: str) -> list[str]:
    """The comma-separated items, refusing an empty one ('1,,2' is a typo, not '1,2')."""
    items = [v.strip() for v in text.split(",")]
    if len(items) > 1 and not all(items):
        raise ValueError(f"{flag} has an empty item in {text!r}")
    return [v for v in items if v]


def int_list(text: str, flag: str) -> list[int]:
    """'200,500,500' → [200, 500]: positive, sorted, without repeats."""
    items = _items(text, flag)
    try:
        values = [int(v) for v in items]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{flag} needs positive integers, got {text!r}")
    return sorted(set(values))


def float_list(text: str, flag: str) -> list[float]:
    """'1,2,inf' → [1.0, 2.0, inf]: positive, in the order given."""
    items = _items(text, flag)
    try:
        values = [float(v) for v in items]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated numbers (or inf), got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise ValueError(f"{flag} needs positive numbers, got {text!r}")
    return values


def names(text: str) -> tuple[str, ...]:
    """'a, b,,c' → ('a', 'b', 'c')."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def at_least(low: float, *flags: tuple[str, float]) -> None:
    """Refuse the first (flag, value) pair below ``low``."""
    for flag, value in flags:
        if value < low:
            raise ValueError(f"{flag} must be >= {low:g}, got {value}")
