"""The C heap (glibc's malloc) under the engine.

torch's CPU tensors are malloc's. glibc as it starts maps every request past a threshold
afresh and unmaps it when freed, so its pages are faulted in and zeroed by the kernel again
the next time; the threshold slides up to the size of the largest mapping freed (at most 32
MiB), and the heap's top is handed back past twice that. A step's tensors of a few to 32 MiB
(a 2,000-token prefill's hidden states, q/k/v, attention blocks) land on either side of those
moving lines, by the process's history: on the AMX Xeon the 1.1B model took 7,000 to 165,000
minor faults a 2,000-token prefill from one process to the next (docs/performance.md).

:func:`settle_heap` fixes the lines once: every request under 32 MiB comes from the heap, and
the heap's top is handed back only past :data:`KEEP_FREE_BYTES`. Requests of 32 MiB or more are
still mapped each time; the model keeps its widest ones (the MLP's gate/up output) in buffers
of its own instead (model.Scratch). The settings are the process's: the engine applies them
(``--kernels heap=settled``, the rule on CPU with glibc) once the weights are loaded, and a
process that embeds it gets them too (``heap=default`` leaves glibc as it is).

Not tried and why: turning glibc's mappings off altogether (``M_MMAP_MAX`` 0) made the 65.5
MB outputs come from the heap too, where torch's 64-byte aligned requests do not always fit the
chunk a freed one left, and the heap grew with every prefill (a 1-layer model whose qkv output
is 49.2 MB: +94 MiB over two prefills).
"""

from __future__ import annotations

import ctypes
import threading

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
# glibc's largest mapping threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): the line it
# slides up to on its own; mallopt refuses more.
MAP_FROM_BYTES = 32 << 20
# Free memory at the heap's top kept for the next step, past which glibc hands it back.
KEEP_FREE_BYTES = 512 << 20

_lock = threading.Lock()
_settled = False


def _libc() -> ctypes.CDLL | None:
    """The process's C library where it is glibc (the one whose mallopt this module knows)."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError, TypeError):  # TypeError: CDLL(None) on some Windows
        return None
    return libc


def is_glibc() -> bool:
    return _libc() is not None


def heap_settled() -> bool:
    """Whether :func:`settle_heap` has set this process's heap."""
    return _settled


def share_main_heap() -> bool:
    """Make threads that have not yet allocated take their memory from the main heap (glibc
    gives each new thread a heap of its own otherwise, in 64 MiB pieces whose free tops are
    handed back on their own terms). Call before the thread that runs the engine starts: the
    settings of :func:`settle_heap` then hold for its tensors. False where not glibc."""
    libc = _libc()
    return libc is not None and libc.mallopt(_M_ARENA_MAX, 1) == 1


def settle_heap() -> bool:
    """Fix glibc's mapping threshold at :data:`MAP_FROM_BYTES` and its trim threshold at
    :data:`KEEP_FREE_BYTES` (neither slides any more), and share the main heap with threads
    started from now on; for the whole process. False (nothing set) where not glibc."""
    global _settled
    libc = _libc()
    if libc is None:
        return False
    with _lock:
        ok = (
            share_main_heap()
            and libc.mallopt(_M_MMAP_THRESHOLD, MAP_FROM_BYTES) == 1
            and libc.mallopt(_M_TRIM_THRESHOLD, KEEP_FREE_BYTES) == 1
        )
        _settled = _settled or ok
    return ok


def release_freed_memory() -> bool:
    """Hand the pages the C heap holds free back to the system (glibc's ``malloc_trim``). A
    start's trials and one-call check free tensors small enough for the heap, whose pages
    glibc keeps: 1.25 GB of a 7B-shaped model's uncached start stayed resident. False where
    the C library has no ``malloc_trim`` (not glibc); it frees nothing where another allocator
    is preloaded (jemalloc, tcmalloc), whose own heap it does not reach."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # TypeError: CDLL(None) on some Windows
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True
