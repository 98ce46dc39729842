"""The C heap (glibc's malloc) under the engine.

torch's CPU tensors are malloc's. glibc serves a request of 32 MiB or more (its largest
mapping threshold) with a fresh mapping and unmaps it when freed, so the next one is faulted
in and zeroed by the kernel page by page again: a 2,000-token prefill's gate/up output (65.5
MB on models with an intermediate size of 8,192) took 16,000 faults a layer. The engine does
not change glibc's settings for that: turning its mappings off while a step runs made such
tensors come from the heap, where torch's 64-byte aligned requests do not always fit the
chunk a freed one left, and the heap grew with every prefill (a 1-layer model whose qkv
output is 49.2 MB: +94 MiB over two prefills, docs/performance.md). The model keeps those
outputs in buffers of its own instead (model.Scratch). What is left here: handing freed
memory back at start.
"""

from __future__ import annotations

import ctypes


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
