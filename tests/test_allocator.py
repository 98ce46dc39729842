"""engine/allocator.py: freed activations stay mapped, so the next step faults in no pages.

Each case runs in a fresh interpreter: the setting is process-wide, and this test process has
engines (which set it) in it already."""

from __future__ import annotations

import subprocess
import sys

import pytest

# A 48 MiB activation (a 2,000-token prefill's gate_up output on the small model is 45 MB:
# above the 32 MiB where glibc's own threshold stops rising) written, freed and allocated again
# 30 times; prints the minor page faults the last 10 cycles took. (Kept, the heap first grows by
# a few blocks: torch's 64-byte aligned allocations do not fit the block just freed until the
# freed ones coalesce; measured, 7 cycles.)
CYCLES = """
import resource, sys, torch
from pdscope.engine.allocator import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
for _ in range(20):
    torch.empty(12 << 20).fill_(1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.empty(12 << 20).fill_(1.0)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", CYCLES, mode], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_kept_memory_is_reused_without_faulting_pages_in() -> None:
    pages = 10 * (48 << 20) // 4096  # what fresh mappings fault in: every page, every cycle
    assert _faults("default") > 0.9 * pages
    assert _faults("keep") < 0.05 * pages


def test_the_engine_keeps_freed_memory_unless_told_not_to(tmp_path) -> None:
    """The knob reaches the engine: off, a fresh process's engine leaves malloc as it was."""
    script = f"""
import sys
from pdscope import LLM
from pdscope.checkpoint.make_model import make_model
from pdscope.engine import allocator
path = make_model({str(tmp_path / "m")!r}, "tiny", dtype="float32")
LLM(model=str(path), kv_cache_memory="8MiB", keep_freed_memory=sys.argv[1] == "on")
print(allocator._kept)
"""
    for mode, expected in (("on", str(1 << 30)), ("off", "None")):
        out = subprocess.run(
            [sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.split()[-1] == expected
