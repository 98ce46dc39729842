"""The C heap (glibc's malloc) under the engine.

torch's CPU tensors are malloc's. glibc as it starts maps a request past its mapping threshold
afresh and unmaps it when freed, so its pages are faulted in and zeroed by the kernel again the
next time. The threshold starts at 128 KiB and slides up to the size of the largest mapping
freed (at most 32 MiB); the trim threshold, past which the heap's free top is handed back,
starts at 128 KiB and slides to twice the mapping threshold. A step's tensors of a few to 32
MiB (a 2,000-token prefill's hidden states, q/k/v, attention blocks) land on either side of
those moving lines by the process's history: on the AMX Xeon the 1.1B model took 51,000 to
165,000 minor faults a 2,000-token prefill from one process to the next, and 15 to 1,600
settled (docs/performance.md).

:func:`settle_heap` fixes the lines once: a request under 32 MiB comes from the heap, and the
heap's free top is handed back only past :data:`KEEP_FREE_BYTES`. A larger request comes from
the heap where its free lists or free top hold it, else from a mapping of its own; the model
keeps its widest ones (the MLP's gate/up output) in buffers of its own (model.Scratch). The
settings are the process's: the engine applies them (``--kernels heap=settled``, the rule on
CPU with glibc) once its weights are loaded and its kernels chosen, and a program that embeds
it gets them too, one heap for its threads included (``heap=default`` leaves glibc as it is).

Withdrawn before this: turning glibc's mappings off while a step ran (``M_MMAP_MAX`` 0). The
65.5 MB outputs then came from the heap too, where torch's 64-byte aligned requests do not
always fit the chunk a freed one left, and the heap grew with every prefill (a 1-layer model
whose qkv output is 49.2 MB: +94 MiB over two prefills). Measured again in session 52: for
the whole process, +1.5 GB over six rounds of a server's mix of steps against +0.8 as
settled; around oneDNN's packed matmul alone (``prefill_linear=onednn``, whose 65.5 MB gate/up
output no buffer reaches: 257,000 faults a 2,000-token prefill of the 1.1B model, a median of
4 with it), a 1.20x prefill, but +0.25-0.31 GB by the fifth round, the gap still widening
(docs/performance.md). Not taken. What stands in its place: the MLP runs that matmul in row
blocks each under the line (model.MLP), whose outputs the heap serves as it does any step's
tensors under 32 MiB: faults a prefill ~9 (AMX Xeon), and over five rounds of 48 mixed prompts the
process's resident size within +0.05-0.10 GB of the unblocked path's, the gap narrowing
after the second (docs/performance.md).
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
# Free memory at the heap's top kept for the next step, past which glibc hands it back. Lines
# of 32 MiB to 512 MiB made no clear difference to what a process held (docs/performance.md);
# the higher one keeps the freed memory of steps larger than those measured too.
KEEP_FREE_BYTES = 512 << 20

_lock = threading.Lock()
_settled = False


def _libc() -> ctypes.CDLL | None:
    """The C library where malloc is glibc's own (the one whose mallopt this module knows):
    None for another C library, or where another allocator is preloaded (jemalloc, tcmalloc),
    whose heap glibc's settings do not reach."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it
        glibc = ctypes.CDLL("libc.so.6")
        ours = ctypes.cast(libc.malloc, ctypes.c_void_p).value
        if ours != ctypes.cast(glibc.malloc, ctypes.c_void_p).value:
            return None
    except (OSError, AttributeError, TypeError):  # TypeError: CDLL(None) on some Windows
        return None
    return glibc


def is_glibc() -> bool:
    """Whether this process's malloc is glibc's."""
    return _libc() is not None


def heap_settled() -> bool:
    """Whether :func:`settle_heap` has set this process's heap."""
    return _settled


def share_main_heap() -> bool:
    """Let glibc make no more heaps (``M_ARENA_MAX`` 1): a thread that has not allocated yet
    then takes an existing heap, the main one where it is the only one (the one
    :func:`settle_heap`'s settings are for), where glibc would make it one of its own (in 64
    MiB pieces, trimmed on their own terms). Call it before the thread that runs the engine
    starts. A thread that has allocated keeps the heap it has; a process that has had more
    than 8 heaps may keep making them (glibc fixes its limit then). False where malloc is not
    glibc's."""
    libc = _libc()
    return libc is not None and libc.mallopt(_M_ARENA_MAX, 1) == 1


def settle_heap() -> bool:
    """Fix glibc's mapping threshold at :data:`MAP_FROM_BYTES` and its trim threshold at
    :data:`KEEP_FREE_BYTES` (neither slides any more), then :func:`share_main_heap` with
    threads started from now on; for the whole process. False where malloc is not glibc's,
    or where glibc refused a setting (heaps in huge pages cap the mapping threshold lower);
    the ones after a refused one are not set."""
    global _settled
    libc = _libc()
    if libc is None:
        return False
    with _lock:
        if not _settled:
            _settled = (
                libc.mallopt(_M_MMAP_THRESHOLD, MAP_FROM_BYTES) == 1
                and libc.mallopt(_M_TRIM_THRESHOLD, KEEP_FREE_BYTES) == 1
                and share_main_heap()
            )
    return _settled


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
