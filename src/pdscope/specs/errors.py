"""The one error type for bad facts: unknown names, missing config fields, nonsense numbers."""

from __future__ import annotations

import difflib


class SpecError(ValueError):
    """A device, model or precision that cannot be resolved, or a number that makes no sense."""


def unknown_name(kind: str, name: str, known: list[str]) -> SpecError:
    """A :class:`SpecError` for an unknown name that lists the closest known names."""
    close = difflib.get_close_matches(name.lower(), [k.lower() for k in known], n=4, cutoff=0.4)
    if not close:
        # Substring matches catch "h100" -> "h100-sxm" when edit distance does not.
        close = [k for k in known if name.lower() in k.lower()][:4]
    hint = f"; closest: {', '.join(close)}" if close else ""
    return SpecError(f"unknown {kind} '{name}'{hint}")
