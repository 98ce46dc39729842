"""Sizes written by people ("2GiB", "500MB") read as bytes. Pure Python: the CLI reads
`--kv-cache-memory` with it for commands that never load torch."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "ki": 2**10,
    "kib": 2**10,
    "mi": 2**20,
    "mib": 2**20,
    "gi": 2**30,
    "gib": 2**30,
    "ti": 2**40,
    "tib": 2**40,
}


def parse_bytes(value: int | str) -> int:
    """``"2GiB"`` -> 2147483648; ``"500MB"`` -> 500000000; an int is bytes already."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = _SIZE.match(str(value))
        if not match:
            raise ValueError(f"cannot read {value!r} as a size (examples: 2GiB, 512MiB, 1e9)")
        size = int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])
    if size <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return size
