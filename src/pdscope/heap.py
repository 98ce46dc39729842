"""Keep Python's cyclic garbage collector from pausing a process that is timing or serving.

A full collection walks every tracked object. After start-up a server holds ~340,000 of them
(torch, the model's modules, FastAPI, tokenizers) and nearly all live as long as the process,
yet each full collection walked them again: ~190-250 ms with the GIL held (AMD EPYC family
26, CPython 3.11; bench/gc_pause.py), in which every stream stalled. A measuring client holds
~70,000 at start, and a pause there is read as server latency. ``gc.freeze()`` moves what is
alive into a permanent generation that collections skip; what is allocated later is still
collected as before. vLLM freezes its heap the same way once its server has started.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager


def freeze_startup_heap() -> tuple[int, float]:
    """Collect every generation, then freeze what survives, for the rest of the process;
    returns the number of objects now frozen and the seconds it took. Call where start-up
    ends and the served work begins: collecting first matters, for garbage frozen could
    never be reclaimed."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count(), time.perf_counter() - start


@contextmanager
def startup_heap_frozen() -> Iterator[None]:
    """The heap as it is on entry frozen while the block runs, then handed back to the
    collector: for a measuring command, which may run inside a caller's process (a test, a
    notebook) whose objects must stay collectable after it. Where a heap is frozen already,
    it is left as it is."""
    if gc.get_freeze_count():
        yield
        return
    try:  # an interrupt between the freeze and the block must not leave the heap frozen
        freeze_startup_heap()
        yield
    finally:
        gc.unfreeze()
