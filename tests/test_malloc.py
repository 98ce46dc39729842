"""The engine's settled C heap (engine/malloc.py), against glibc's real malloc: each case in a
fresh process, whose malloc settings and fault counts are its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdscope.checkpoint.make_model import make_model
from pdscope.engine import malloc
from tests.conftest import glibc_as_it_starts, prefill_faults

pytestmark = pytest.mark.skipif(
    not (malloc.is_glibc() and Path("/proc/self/status").is_file()),
    reason="needs glibc's malloc and Linux's per-process fault counts",
)

# Four 20 MiB requests made, written and freed, four times over, on this thread and then on one
# started after: the pages faulted in each round. glibc as it starts maps the first round's
# requests (its threshold is 128 KiB); once they are freed its mapping threshold slides past
# 20 MiB and its trim threshold to twice that, so later rounds come from the heap, whose 80 MiB
# free top is then past the trim threshold and handed back: every round faults its pages in. The
# process's transparent huge pages are off, so a page is a base page.
ROUNDS = """
import ctypes, os, resource, threading
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
libc.prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE
PAGES = 4 * (20 << 20) // os.sysconf("SC_PAGE_SIZE")

def rounds():
    faults = []
    for _ in range(4):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        blocks = [libc.malloc(20 << 20) for _ in range(4)]
        for b in blocks:
            libc.memset(b, 1, 20 << 20)
        for b in blocks:
            libc.free(b)
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
    return faults

def on_a_thread():
    out = []
    t = threading.Thread(target=lambda: out.append(rounds()))
    t.start()
    t.join()
    return out[0]

def share(faults):
    return [round(f / PAGES, 3) for f in faults]
"""


def _run(code: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", ROUNDS + code],
        capture_output=True,
        text=True,
        env=glibc_as_it_starts(),
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_settled_heap_keeps_what_was_freed_for_the_next_round() -> None:
    """Settled, the rounds after the first take their pages from the heap, on this thread and
    on one started after (which shares the main heap); as glibc starts, every round faults its
    80 MiB in again (20,480 pages of 4 KiB). Figures are shares of a round's pages."""
    got = _run(
        """
import json
from pdscope.engine import malloc
before = rounds()
assert not malloc.heap_settled()
settled = malloc.settle_heap()
print(json.dumps({"before": share(before), "settled": settled, "is": malloc.heap_settled(),
                  "after": share(rounds()), "thread": share(on_a_thread())}))
"""
    )
    assert got["settled"] is True and got["is"] is True, got
    assert all(f > 0.75 for f in got["before"][1:]), got  # what the settings are for
    assert max(got["after"][1:]) < 0.025, got
    assert max(got["thread"][1:]) < 0.025, got


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Hidden states of 2,000 x 2,048 bf16 (8.2 MB): under glibc's highest mapping line."""
    return make_model(
        tmp_path_factory.mktemp("four") / "m",
        "tiny",
        num_hidden_layers=4,
        hidden_size=2048,
        intermediate_size=2048,
        num_attention_heads=32,
        num_key_value_heads=8,
    )


ENGINE = (
    """
import json, resource, sys
from pdscope import LLM, SamplingParams
from pdscope.engine import malloc
llm = LLM(model=sys.argv[1], kv_cache_memory="64MiB", max_model_len=2048,
          max_num_batched_tokens=2048, enable_prefix_caching=False, kernels=sys.argv[2])
"""
    + prefill_faults(3)
    + """print(json.dumps({"heap": llm.engine.kernels.heap, "how": llm.engine.kernels.how["heap"],
                  "settled": malloc.heap_settled(), "faults": faults,
                  "rounds": share(rounds())}))
"""
)


def test_the_engine_settles_its_heap_on_cpu(four_layers: Path) -> None:
    """By rule on CPU with glibc the engine settles the process's heap once it is loaded: its
    2,000-token prefills then fault in few pages (this child on the AMX Xeon: 0-3,400 a
    prefill settled in four processes, and in 16 more 0-8,857 the first prefill after the
    warm-up, 0-3,000 the next two; as glibc starts, 2,000 to 65,000 from one prefill and
    process to the next), and the process's own rounds keep their pages too.
    ``heap=default`` leaves glibc as it is. The matmul path is forced to one that writes the
    MLP's widest outputs into the model's buffers."""
    code = ENGINE.replace("sys.argv[1]", repr(str(four_layers)))
    ruled = _run(code.replace("sys.argv[2]", repr("prefill_linear=transposed")))
    assert (ruled["heap"], ruled["how"], ruled["settled"]) == ("settled", "fixed", True), ruled
    # (glibc as it starts may fault as few in one process and 65,000 in the next: this bounds
    # the settled heap, the rounds below tell the settings apart; a clean-clone CI run once
    # read 8,042 for the first prefill after the warm-up, past the 8,000 this bound was)
    assert max(ruled["faults"]) < 12_000, ruled
    assert max(ruled["rounds"][1:]) < 0.025, ruled
    left = _run(code.replace("sys.argv[2]", repr("prefill_linear=transposed,heap=default")))
    assert (left["heap"], left["how"], left["settled"]) == ("default", "forced", False), left
    # glibc's lines slid during the prefills: some of the rounds' requests now fit under them
    assert sum(left["rounds"][1:]) > 1.0, left


def test_heap_default_is_refused_once_a_heap_is_settled(tmp_path: Path) -> None:
    """A second engine cannot ask for glibc as it starts in a process an engine settled: the
    settings cannot be taken back (glibc's thresholds no longer slide once set)."""
    model = make_model(tmp_path / "m", "tiny")
    got = _run(
        f"""
import json
from pdscope import LLM
LLM(model={str(model)!r}, kv_cache_memory="8MiB")
try:
    LLM(model={str(model)!r}, kv_cache_memory="8MiB", kernels="heap=default")
    print(json.dumps({{"error": None}}))
except ValueError as exc:
    print(json.dumps({{"error": str(exc)}}))
"""
    )
    assert "heap=default" in str(got["error"]) and "fresh process" in str(got["error"]), got


def test_a_server_steps_on_the_main_heap(four_layers: Path) -> None:
    """The server's engine thread takes its memory from the main heap, the one the engine
    settles: glibc's report then lists one heap after a request has run (nothing in the
    child starts a thread before the engine's); with ``heap=default`` the thread has one of
    its own."""
    code = f"""
import asyncio, ctypes, json, os, re, tempfile
from pdscope.engine.args import EngineArgs
from pdscope.engine.sampling_params import SamplingParams
from pdscope.server.run import start_engine

def heaps():
    libc = ctypes.CDLL(None)
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    path = os.path.join(tempfile.mkdtemp(), "info.xml")
    f = libc.fopen(path.encode(), b"w")
    libc.malloc_info(0, f)
    libc.fclose(f)
    return len(re.findall(r"<heap nr=", open(path).read()))

args = EngineArgs(model={str(four_layers)!r}, kv_cache_memory="64MiB", max_model_len=2048,
                  max_num_batched_tokens=2048, kernels=KERNELS)
running = start_engine(args, None)

async def one() -> None:
    async for _ in running.generate([5] * 500, SamplingParams(max_tokens=2, ignore_eos=True)):
        pass

asyncio.run(one())
print(json.dumps({{"heaps": heaps(), "heap": running.engine.kernels.heap}}))
running.shutdown()
"""
    ruled = _run(code.replace("KERNELS", repr("auto")))
    assert ruled == {"heaps": 1, "heap": "settled"}, ruled
    left = _run(code.replace("KERNELS", repr("heap=default")))
    assert left["heap"] == "default" and left["heaps"] >= 2, left


GROWTH = """
import json, sys
from pdscope import LLM, SamplingParams
def anon_mib():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) / 1024
llm = LLM(model=MODEL, kv_cache_memory="64MiB", max_model_len=2048,
          max_num_batched_tokens=2048, enable_prefix_caching=False, kernels=KERNELS)
one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
start = anon_mib()
grown = []
for i in range(12):
    llm.generate([[5 + i] * (2000 - 100 * (i % 3))], one)
    grown.append(anon_mib() - start)
print(json.dumps({"grown_mib": grown}))
"""


@pytest.mark.slow
def test_a_settled_heap_levels_off_where_outputs_past_32_mib_come_fresh(tmp_path: Path) -> None:
    """A settled heap may serve a request of 32 MiB or more from its kept free top, where
    torch's aligned requests do not always fit what a freed one left: the process holds more
    (on the AMX Xeon +267-279 MiB on this model after 12 prefills, +125-139 as glibc starts)
    but levels off: after the 7th prefill it grew only in rare steps of 10-14 MiB (24
    prefills, four processes). A 1-layer model whose q/k/v output (no buffer of the model's
    own) is 2,000 x 12,288 bf16, 49.2 MB; three prompt lengths in turn, four times: the
    prefills after the 7th add under 32 MiB (oneDNN has built its matmuls for the three
    lengths by then), and the whole stays within 256 MiB of glibc as it starts."""
    model = make_model(
        tmp_path / "m",
        "tiny",
        dtype="bfloat16",
        num_hidden_layers=1,
        hidden_size=4096,
        intermediate_size=1024,
        num_attention_heads=32,
        num_key_value_heads=32,
    )
    code = GROWTH.replace("MODEL", repr(str(model)))
    settled = _run(code.replace("KERNELS", repr("prefill_linear=transposed")))["grown_mib"]
    left = _run(code.replace("KERNELS", repr("prefill_linear=transposed,heap=default")))
    # after the 7th prefill (index 6): at most two steps of 10-14 MiB seen
    assert settled[11] - settled[6] < 32, settled
    assert settled[11] < left["grown_mib"][11] + 256, (settled, left)
