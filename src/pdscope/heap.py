"""Keep Python's cyclic garbage collector from pausing a process that is timing or serving.

A full collection walks every tracked object. After start-up a server holds ~350,000 of them
(torch, the model's modules, FastAPI, tokenizers) and nearly all live as long as the process,
yet each full collection walked them again: 150-240 ms with the GIL held (AMD EPYC family 26,
tiny model), so every stream stalled that long, one benchmark run in three or four. A measuring
client holds ~70,000, and a pause there is read as server latency. ``gc.freeze()`` moves what
is alive into a permanent generation that collections skip; what is allocated later is still
collected as before. vLLM freezes its heap the same way once its server has started.
"""

from __future__ import annotations

import gc
import time

_frozen = False


def freeze_startup_heap() -> tuple[int, float]:
    """Collect every generation, then freeze what survives; returns the number of objects
    now frozen and the seconds it took. Call where start-up ends and the timed or served work
    begins: collecting first matters, for garbage frozen could never be reclaimed. Only the
    first call in a process freezes (a later one returns the count and 0 s): a caller that
    runs several commands in one process (a test, a notebook) keeps its later objects
    collectable."""
    global _frozen
    if _frozen:
        return gc.get_freeze_count(), 0.0
    _frozen = True
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count(), time.perf_counter() - start
