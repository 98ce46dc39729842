"""The C heap (glibc's malloc) under the engine: what it hands back to the system, and when.

torch's CPU tensors are malloc's. glibc serves a request of 32 MiB or more (its largest
mapping threshold, M_MMAP_THRESHOLD's cap) with a fresh mapping and unmaps it when freed, so
the next one is faulted in and zeroed by the kernel page by page again. A 2,000-token prefill
of a model with an intermediate size of 8,192 (a 1.1B one, hidden 2,048; a 3B one, hidden
3,072) makes one such tensor in every layer (the fused gate/up projection's output, 2,000 x
16,384 bf16 = 65.5 MB; a 2,048-row chunk two, with the SiLU product's 32 MiB), faulted in
and unmapped again layer after layer (the embedded ``small`` model's is 22.5 MB: none): on
the AMX Xeon (family 6
model 207) a 2,000-row gate/up matmul took 92-99 ms into fresh memory against 76-80 ms into
memory kept (3 interleaved processes each; docs/performance.md). vLLM's compiled graph
plans its buffers once per forward; a step here can keep what it frees instead
(``--kernels freed_memory=kept``): :func:`freed_memory_kept` turns glibc's mappings off while
a step runs, so what a step frees stays in the heap for the next step's tensors.

Not the default: torch asks for 64-byte aligned memory (posix_memalign), which glibc serves
from a chunk a little larger than the tensor, so a freed tensor's chunk may not fit the next
tensor of the same size. The engine's heap was measured to level off (a 1.1B model, 30
prefills of 700-3,000 tokens: flat at +334 MiB after the 12th, against +196 with glibc as
it is), but a loop of one such tensor and small objects between grows without end.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
M_ARENA_MAX = -8
# glibc's defaults: mappings allowed at all (DEFAULT_MMAP_MAX), and the mapping threshold's
# cap on 64-bit, to which its sliding threshold climbs as a process frees mapped chunks
MMAP_MAX_DEFAULT = 65536
MMAP_THRESHOLD_CAP = 32 << 20
# The heap's free top is never trimmed by a free (only by release_freed_memory): a prefill's
# 65 MB output freed beside the top would be handed back, and the next layer's faulted in.
TRIM_NEVER = 2**31 - 1

_lock = threading.Lock()
_depth = 0  # steps inside freed_memory_kept now, across threads
_settled = False  # the thresholds set (once per process)


@functools.cache
def _libc() -> Any | None:
    """The C library, where it has glibc's mallopt and malloc_trim; else None (musl, macOS,
    Windows)."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt, libc.malloc_trim  # noqa: B018 - both or neither
    except (OSError, AttributeError, TypeError):  # TypeError: CDLL(None) on some Windows
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return libc


def can_keep_freed_memory() -> bool:
    """Whether the C library has glibc's mallopt, which :func:`freed_memory_kept` sets (an
    allocator preloaded in malloc's place, jemalloc or tcmalloc, ignores it)."""
    return _libc() is not None


@contextmanager
def freed_memory_kept() -> Iterator[None]:
    """While the block runs, no request is served by a mapping of its own: every one comes
    from the heap, and what is freed stays there for the next (a no-op where the C library is
    not glibc). Process-wide, for every thread while any is inside; nests.

    The first use also fixes the thresholds glibc would otherwise slide (any mallopt call
    stops the sliding): requests under 32 MiB from the heap, as the sliding threshold ends up
    once a 32 MiB chunk has been freed, and the heap's free top never trimmed by a free. So a
    process keeps, at most, the largest heap its steps held; :func:`release_freed_memory`
    hands it back. Outside steps, requests of 32 MiB or more are mapped as before (a
    model's weights, its KV cache). These settings replace any the user gave glibc
    (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES``).
    """
    global _depth, _settled
    libc = _libc()
    if libc is None:
        yield
        return
    with _lock:
        if not _settled:
            libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_CAP)
            libc.mallopt(M_TRIM_THRESHOLD, TRIM_NEVER)
            _settled = True
        if _depth == 0:
            libc.mallopt(M_MMAP_MAX, 0)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                libc.mallopt(M_MMAP_MAX, MMAP_MAX_DEFAULT)


def share_main_heap() -> bool:
    """Threads started from now on allocate from the main heap, as the first thread does
    (glibc's M_ARENA_MAX=1); False where the C library is not glibc. For the server, whose
    engine steps on a thread of its own: a thread's own heap (an arena) cannot keep a freed
    chunk of 32-64 MiB, which takes a heap segment of its own, unmapped once empty (a
    2,000-token gate/up output, 65.5 MB, was faulted in anew at every layer). Call before the
    process starts a thread: an arena made before, or left by a thread that ended, is still
    handed to later threads. Every thread then takes the one heap's lock; the server's
    threads allocate little beside its steps."""
    libc = _libc()
    if libc is None:
        return False
    libc.mallopt(M_ARENA_MAX, 1)
    return True


def release_freed_memory() -> bool:
    """Hand the pages the C heap holds free back to the system (glibc's ``malloc_trim``). A
    start's trials and one-call check free tensors small enough for the heap, whose pages
    glibc keeps: 1.25 GB of a 7B-shaped model's uncached start stayed resident. False where
    the C library has no ``malloc_trim`` (not glibc); it frees nothing where another allocator
    is preloaded (jemalloc, tcmalloc), whose own heap it does not reach."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
