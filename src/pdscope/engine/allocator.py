"""Keep freed memory in the process, so that a step's activations land on pages already mapped.

glibc's malloc serves a block above its mmap threshold (128 KiB at start, rising with the blocks
freed, to at most 32 MiB) from fresh pages that it hands back to the kernel on free. A
2,000-token prefill of the small model allocates and frees dozens of activations of several MB
each step, and every page of them then faults in, zeroed by the kernel. Interleaved in one
process on the AMX Xeon (the small model, bf16, 2,000-token prefill, load 2.5-3.5, the setting
switched between rounds): one thread, 6 rounds, 1,758 → 1,976 tok/s (CPU 1.13 → 0.99 s a
prefill); two threads, 4 rounds, 740 → 856 tok/s (CPU 1.79 → 1.54 s). So the engine raises
both thresholds once for its process, as preloading tcmalloc or jemalloc would (vLLM's CPU
guide asks for tcmalloc): blocks up to ``limit_bytes`` come from the heap and stay there for
the next step. The cost: the process keeps the peak of what it freed mapped instead of
returning it (the small model loaded, then after 12 prefills and a batch-32 decode, separate
processes: 40-170 MB more RSS on ~2.2 GB). ``keep_freed_memory=False``
(``--no-keep-freed-memory``) leaves malloc as it was.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger("pdscope.engine")

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
KEEP_BYTES = 1 << 30

_kept: int | None = None


def keep_freed_memory(limit_bytes: int = KEEP_BYTES) -> bool:
    """Raise glibc's mmap and trim thresholds to ``limit_bytes`` for this process (once);
    False where the C library is not glibc (musl, macOS) or refuses."""
    global _kept
    if _kept is not None:
        return _kept >= limit_bytes
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    if not (mallopt(_M_MMAP_THRESHOLD, limit_bytes) and mallopt(_M_TRIM_THRESHOLD, limit_bytes)):
        log.info("malloc: glibc refused to keep freed blocks; each step maps fresh pages")
        return False
    _kept = limit_bytes
    log.info(
        "malloc: freed blocks up to %d MiB stay in the process for reuse (glibc mallopt)",
        limit_bytes >> 20,
    )
    return True
