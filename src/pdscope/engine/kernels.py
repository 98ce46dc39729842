"""Which kernel each machine-dependent path of the model takes, chosen by a short timed trial.

The same engine runs on CPUs whose fastest kernels differ: on an AMD EPYC without AMX the
blocked prefill attention beat torch's SDPA by 2x, on an Intel Xeon with AMX SDPA wins. So
when the engine loads, each path with more than one implementation is timed on the model's own
shapes (about a second in all), interleaved and repeated so that a noisy neighbour hits both
candidates alike, and the faster one is kept. The choice is cached per CPU model, ISA flags,
torch version, thread count and shapes under the pdscope cache, so later starts skip the trial.

Paths (every candidate computes the same function; tests pin each against transformers):

* ``linear``: ``packed`` (weights pre-packed once in oneDNN's blocked layout), ``plain``
  (``F.linear``) or ``c`` (engine/native.py's kernel for single-row matmuls, reading the
  weights as stored with AVX-512 BF16 dot products where the CPU has them, else with AVX2
  FMAs on the bf16 weights widened in registers; larger matmuls then
  take the packed weights). Only bf16 on CPU has a packed form; ``c`` needs a C compiler.
  ``amx`` takes single rows through AMX tiles instead, reading the weight as stored; ``pairs``
  through a pair-interleaved copy of every weight ([out / 16, in / 2, 16, 2]: one 64-byte
  load feeds 16 outputs), eight blocks of it read side by side per thread, so that each core
  keeps eight streams from memory going where ``amx`` and ``c`` keep one or a few (bf16 with
  AVX-512 BF16, or in AVX2 FMAs with each 64-byte load split into its even and odd weights;
  the copy is offered only while it takes at most a quarter of the memory; where it does
  not, ``linear``, ``batch_linear``, ``big_batch_linear`` and ``prefill_linear`` take the
  copies without a trial, how "memory": every matmul then reads them, and each weight is
  held in its copy alone, once, where the other paths keep a second copy, oneDNN's packed
  weights or the copies beside the weight; where the C kernels have AMX tiles, the paths
  that read the weight as stored instead, ``amx``, ``c``, ``c`` and ``plain``: no copy).
  ``pairs2`` reads the same copy as two streams a thread, the same bits: on the AVX-512 AMD
  EPYCs two read
  faster than eight; on the AMX Xeon eight read faster than one, and two a little faster than
  eight (the trial's 49 one-row matmuls, two starts: 11.7 and 13.1 ms against 13.0 and 13.8);
  in AVX2 on an AMD EPYC Zen 2 eight read faster (1.07x two's batch-1 tokens/s). Where the
  trial times that rule's count (:func:`pairs_preferred`) within ``TIE`` of the fastest
  candidate, it keeps that count: in a slow phase of the host the two read alike, so a trial
  run then picks one by noise (an AVX-512 AMD EPYC Zen 4 picked ``pairs`` so, whose batch-1
  step then took 1.07x ``pairs2``'s time in a fast phase of 25 rounds). Where the C kernels
  have AMX tiles the trial keeps ``amx`` instead, within ``HELD_ONCE_TIE``: it reads the
  weight as stored, where the copies are one more copy of it (on the AMX Xeon, family 6 model
  207, the trial picked ``pairs2`` in 3 of 6 uncached starts, whose batch-1 decode then ran at
  0.85x ``amx``'s in the engine: bench/kernels_ab.py).
* ``batch_linear``: for matmuls of 2 to ``NATIVE_MANY_MAX_ROWS`` rows (a batched decode
  step): ``packed`` (whatever ``linear`` gives matmuls of several rows: the packed weights, or
  ``F.linear`` under ``linear=plain``), ``c`` (engine/native.py's many-row kernel: AMX tile
  multiplies reading each weight block once for all rows, where the CPU and Linux allow them,
  else ``linear``'s C kernel, four weight rows against up to three rows of x at a time)
  or ``pairs`` (the pair-interleaved copies of ``linear=pairs``, made for this path whatever
  ``linear`` is: tiles of up to 8 rows against 3 blocks of 16 outputs in AVX-512 BF16, of up
  to 5 rows against one block in AVX2 FMAs; each row the same bits as alone). bf16 on CPU with
  the C kernels only; ``pairs`` offered while the copy fits, as for ``linear``. Where single
  rows read the copies and ``big_batch_linear`` and ``prefill_linear`` may read them too,
  ``pairs`` is kept within ``HELD_ONCE_TIE``, the first of the three paths on which holding
  each weight once depends (should either of the others pick another path, the faster one).
* ``big_batch_linear``: for matmuls of ``NATIVE_MANY_MAX_ROWS`` + 1 to ``BIG_BATCH_MAX_ROWS``
  rows (a decode batch larger than ``batch_linear``'s kernels take, up to the default
  ``max_num_seqs``; or a short step with a prefill chunk): ``onednn`` (what ``linear`` gives
  matmuls of several rows: the packed weights, ``F.linear``, or widened to float32 under
  ``matmul_math=float32``) or ``pairs`` (the pairs copies' row tiles, as ``batch_linear=pairs``;
  a decodes-only step of these rows then runs in one C call too). On an AMD EPYC Zen 4 the
  copies took 0.85-0.93x oneDNN's time at 40-64 rows, and a decodes-only step of 33-64
  sequences 0.79-0.85x; kept to AVX2 there, where the other candidate widens every weight to
  float32 a step, 0.31-0.47x (docs/performance.md); on the AMX Xeon oneDNN's own AMX matmuls
  outran the many-row C kernel's tiles at 48 rows and more (why ``batch_linear`` stops at
  32), so a trial decides (where single rows and 2-32 rows read the copies and
  ``prefill_linear`` may read them too, it keeps ``pairs`` within ``HELD_ONCE_TIE``: with
  ``prefill_linear=pairs`` each weight is then held once; should ``prefill_linear`` pick
  another path, the faster one). bf16 on CPU with the pairs kernels, while the copy fits,
  only. ``c``: the many-row C kernel on the weight as stored, as ``batch_linear=c`` (on the
  AMX Xeon its tiles ran 48 and 64 rows at 0.87x and 0.89x oneDNN's packed rate:
  bench/linear_ab.py),
  offered where the C kernels have AMX tiles (model.stored_offered) and kept within
  ``HELD_ONCE_TIE`` where single rows and 2-32 rows read the weight as stored and
  ``prefill_linear`` may take ``plain`` (should it pick another path, the faster one); the
  memory rule's pick there.
* ``prefill_linear``: for matmuls of a prefill chunk's rows (``ROWS_SPLIT_MIN_ROWS`` or
  more; ``pairs``: past ``BIG_BATCH_MAX_ROWS``): ``onednn`` (``linear``'s path: the packed
  weights, or ``F.linear``), ``transposed``
  (``torch.mm`` on a transposed copy of each weight, [in, out]: oneDNN's matmul primitive on
  the plain layout, its threads splitting the work) or ``rows`` (the same copy, the rows split
  over the OpenMP team, each thread a one-thread matmul on its share into one output;
  engine/model.py's linear_by_rows; with the C kernels; forced only,
  never a trial's pick: its shares take the GIL on the team's threads). The last two keep a
  transposed copy of every layer weight, a third copy of them beside the weight and the packed
  one, so the trial offers ``transposed`` only while that copy takes at most a quarter of the
  memory available at start-up; the engine keeps ``onednn`` unless the copy is faster by more
  than ``TIE``. ``pairs``: every matmul past ``BIG_BATCH_MAX_ROWS`` rows (a prefill chunk, or
  a decode batch past 64) reads the pairs copies' row tiles, so that where ``batch_linear``
  and ``big_batch_linear`` read them too and single rows run on the C kernels or the copies
  (:func:`packed_unread`), no matmul is left to the packed weights, and none are kept;
  where single rows read the copies too, nor is the weight as stored: each is held once, in
  its copy (engine/model.py's Linear.hold_once; where the packed weights take the larger
  matmuls instead, the two copies and no weight). On an AMD EPYC Zen 4 the copies matched
  oneDNN at 128, 512 and 2,048 rows (the trial times the chunk size only); there the engine
  keeps ``pairs``
  within ``TIE`` of the fastest where the decode paths all read the copies (within
  ``HELD_ONCE_TIE`` where single rows do: each weight then held once), else
  ``onednn`` (a cached pick of either is weighed again from its cached times when those
  paths change). With the pairs kernels (AVX-512 BF16 or AVX2), while the copy fits. bf16
  only; the trial runs on CPU. ``plain``: ``F.linear`` on the weight as stored (oneDNN lays it
  out per call, which a prefill chunk's rows repay: on the AMX Xeon 1.58 and 1.94 TFLOP/s at
  512 and 2,048 rows, the packed weights 1.57 and 1.77); where the rows up to 64 take the
  C kernels too (``batch_linear`` and ``big_batch_linear`` ``c`` or ``pairs``, one row on
  ``c``, ``amx`` or the copies: :func:`stored_past_one`) no weight keeps a packed copy.
  Offered where the C kernels have AMX tiles, kept within ``HELD_ONCE_TIE`` where no smaller
  matmul reads the packed weights (:func:`stored_past_one`; with the paths before it on the
  weight as stored, no copy of it is left at all), else ``onednn`` within ``TIE``; the
  memory rule's pick there (on the copies' AVX-512 BF16 kernels, 158-181 GFLOP/s on that
  Xeon, a 2,000-token prefill took 6.7x as long: bench/kernels_ab.py).
* ``prefill_attention``: ``blocked`` (blocks of queries, each scored only against the keys it
  can see), ``sdpa`` (torch's fused kernel), ``amx`` (engine/native.py's causal attention on
  AMX tiles: bf16 scores and values on tiles, the softmax in AVX-512; chunks it does not take,
  float32 or a sliding window or a head size not a multiple of 32, go to SDPA) or ``c`` (the
  same kernel with its products in AVX-512 BF16, for CPUs without AMX). ``amx`` only where the
  C kernels built with AMX and Linux grants the tiles, ``c`` where they built with AVX-512
  BF16; both for a bf16 model. CPU only; CUDA always takes SDPA.
* ``matmul_math``: ``native`` (matmuls in the model dtype) or ``float32`` (a bf16 matmul of
  ``WIDEN_MIN_ROWS`` rows or more that no C kernel takes is widened to float32 for the call:
  weight, input and bias). Not a trial: a rule, ``float32`` for bf16 on a CPU where oneDNN has
  no bf16 path (neither AVX-512 BW/VL/DQ nor AVX-NE-CONVERT: model.onednn_bf16), where torch's
  bf16 matmul is a slow fallback. On an AVX2-only AMD EPYC, one layer of the small model at
  512 rows: 566 ms in bf16 against 80 ms widened (20 and 145 GFLOP/s; docs/performance.md).
* ``decode_math``: ``float32`` (small decode batches convert their context to float32 first)
  or ``native`` (the model dtype throughout). Only bf16 on CPU differs.
* ``decode_ops``: ``torch`` (the PyTorch ops: the reference) or ``c`` (engine/native.py's C
  kernels: rope and the K/V write in one call, paged attention over the block tables in place,
  each residual add fused into the next norm) for steps of decodes only. CPU only, and only
  where a C compiler built the kernels.
* ``decode_prefetch``: what the C decode attention asks memory for ahead of its tiles of 16
  keys (bf16, head size 64 with 1-4 query heads a KV head or 128 with 1-8:
  model.prefetch_applies; builds with AVX-512 BF16): ``jumps`` (the keys after the next tile
  into L2 only where the block table jumps to another block; a run of blocks is left to the
  hardware prefetcher) or ``every`` (those keys into L1 whether they continue the run or
  not). On an AMD EPYC (Zen 4) prefetching a run cost a quarter of the read rate; on the
  Intel Xeon with AMX, ``every`` took 0.77x the time at 4,000 keys (docs/performance.md).
  Timed on synthetic caches of 4,096 keys, one a layer up to 64 MB; one setting per process
  (native.set_decode_prefetch).
* ``threads``: ``free`` (the OS places torch's OpenMP threads) or ``bound`` (each thread of
  the team that runs the engine's steps pinned to its own core, as vLLM pins its CPU
  workers; engine/native.py's place_threads). CPU only, with the C kernels and more than one
  thread; only when forced (``--kernels threads=bound``): chosen by its trial, it stalled a live
  server's streams (engine/model.py's kernel_trials says how).
* ``step_rows``: ``padded`` (a step of ``PAD_MIN_ROWS`` rows or more, or under
  ``big_batch_linear=pairs`` of more than ``BIG_BATCH_MAX_ROWS``, runs its norms and matmuls
  at its row count rounded up to a multiple of ``ROW_BUCKET``, the padding rows dropped
  before the attention and from the result) or ``exact``. Not a trial: a rule,
  ``padded`` where those matmuls are oneDNN's in bf16 (on CPU, ``matmul_math=native``; not
  under ``big_batch_linear=pairs`` with ``prefill_linear=pairs``, where none past 32 is), which
  builds a primitive for each new row count: on the AMX Xeon 24-31 ms of them in the first
  prefill of each new length, where a repeated length's prefill took 1.005x the time padded
  (engine/model.py's ROW_BUCKET; docs/performance.md).
* ``heap``: ``settled`` (glibc's mapping and trim thresholds fixed once the weights are loaded,
  so a step's tensors under 32 MiB come from a heap that keeps their pages; engine/malloc.py)
  or ``default`` (the C library's malloc as it is). Not a trial: a rule, ``settled`` on CPU with
  glibc, where the 1.1B model's 2,000-token prefill took 51,000-165,000 minor faults without it
  and 15-1,600 with it (docs/performance.md). It holds for the whole process, whose threads
  started after it share one heap.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from pdscope.engine.native import MARCH_ENV, PAIR_STREAMS
from pdscope.specs.local import cpu_model, read_gb_s

log = logging.getLogger("pdscope.engine")

OPTIONS: dict[str, tuple[str, ...]] = {
    "linear": ("packed", "plain", "c", "amx", "pairs", "pairs2"),
    "batch_linear": ("packed", "c", "pairs"),
    "big_batch_linear": ("onednn", "pairs", "c"),
    "prefill_linear": ("onednn", "transposed", "rows", "pairs", "plain"),
    "matmul_math": ("native", "float32"),
    "prefill_attention": ("blocked", "sdpa", "amx", "c"),
    "decode_math": ("float32", "native"),
    "decode_ops": ("torch", "c"),
    "decode_prefetch": ("jumps", "every"),
    "threads": ("free", "bound"),
    "step_rows": ("padded", "exact"),
    "heap": ("settled", "default"),
}
# The options that run on the C kernels (engine/native.py): forcing one needs them built.
# (threads=bound too, checked with its own message.)
ON_C: dict[str, tuple[str, ...]] = {
    "linear": ("c", "amx", "pairs", "pairs2"),
    "batch_linear": ("c", "pairs"),
    "big_batch_linear": ("pairs", "c"),
    "prefill_linear": ("rows", "pairs"),
    "prefill_attention": ("amx", "c"),
    "decode_ops": ("c",),
    "decode_prefetch": ("every",),
}
# The linear options that read the pair-interleaved copies, and each one's streams a thread.
PAIRS_LINEAR: dict[str, int] = dict(zip(("pairs", "pairs2"), PAIR_STREAMS, strict=True))
# A trial that times a path's preferred candidate (choose's `prefer`) within this fraction of the
# fastest keeps the preferred one.
TIE = 0.03
# ... and this one where the preferred candidate lets every weight be held once, in its pairs
# copy (prefill_linear=pairs with the decode paths on the copies, and batch_linear=pairs and
# big_batch_linear=pairs on the way there): half the weights' memory; or, with AMX tiles, as
# stored with no copy (linear=amx against the copies, big_batch_linear=c, prefill_linear=plain).
# On an AMD EPYC Zen 4 the copies' prefill matched oneDNN's through HTTP (the servers' mean
# TTFT 0.98-1.01x oneDNN's) and took 1.03x its time in an engine's 2,048-row steps, while its
# start's trial, cut to 24 MB, picked oneDNN by noise in 2 of 3 uncached starts of a
# 1.1B-parameter model: 4.81 GB resident in place of 2.78 (and, once that was settled,
# batch_linear=packed in 2 of 3: 4.81-5.07 GB).
HELD_ONCE_TIE = 0.10
# A path with a preference is decided by a margin of a few percent: it is timed this many rounds
# at least, where two rounds' medians swung further (the 1.1B model's prefill_linear trial, two
# rounds of its cut layer, picked oneDNN past HELD_ONCE_TIE in one uncached start of three).
PREFERRED_ROUNDS = 5
# ISA flags that change which kernel wins (oneDNN dispatches on them).
_ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")
# Bump when a kernel or the trial changes, so stale cached choices are not reused.
_TRIAL_VERSION = 36


@dataclass(frozen=True)
class KernelChoice:
    """The path each machine-dependent part of the model takes, and how it was decided."""

    linear: str = "packed"
    batch_linear: str = "packed"
    big_batch_linear: str = "onednn"
    prefill_linear: str = "onednn"
    matmul_math: str = "native"
    prefill_attention: str = "blocked"
    decode_math: str = "float32"
    decode_ops: str = "torch"
    decode_prefetch: str = "jumps"
    threads: str = "free"
    step_rows: str = "exact"
    heap: str = "default"
    # per path: "measured", "cached", "forced", "fixed" (only one candidate applies here), or
    # "memory" (the pairs copies, untimed, where another copy of the weights does not fit)
    how: dict[str, str] = field(default_factory=dict, compare=False)
    # per candidate: median seconds of the trial (this start's, or the cached one's for a
    # cached pick), for the log and the cache file
    trial_s: dict[str, float] = field(default_factory=dict, compare=False)

    def summary(self) -> str:
        return ", ".join(
            f"{path}={getattr(self, path)} ({self.how.get(path, 'fixed')})" for path in OPTIONS
        )


def parse_kernels(spec: str) -> dict[str, str]:
    """``auto``, or ``path=option`` pairs joined by commas (paths not named are measured).

    >>> parse_kernels("linear=plain, prefill_attention=sdpa")
    {'linear': 'plain', 'prefill_attention': 'sdpa'}
    """
    forced: dict[str, str] = {}
    if spec.strip() in ("", "auto"):
        return forced
    for part in spec.split(","):
        path, sep, option = (s.strip() for s in part.partition("="))
        if not sep or path not in OPTIONS:
            raise ValueError(
                f"kernels: {part.strip()!r} is not path=option; paths: {', '.join(OPTIONS)}"
            )
        if option not in OPTIONS[path] and option != "auto":
            raise ValueError(
                f"kernels: {path} cannot be {option!r}; choose one of "
                f"{', '.join(OPTIONS[path])} or auto"
            )
        if option != "auto":
            forced[path] = option
    return forced


def cpu_flags() -> list[str]:
    """The ISA flags of :data:`_ISA_FLAGS` this CPU has."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in _ISA_FLAGS if f in have]
    except OSError:
        pass
    return []


@dataclass(frozen=True)
class TrialShapes:
    """What the trial's outcome depends on besides the CPU: the model's shapes and dtype."""

    dtype: str
    hidden: int
    intermediate: int
    vocab: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    prefill_tokens: int

    def cache_key(self) -> str:
        return machine_key(trial=_TRIAL_VERSION, shapes=asdict(self))


def machine_key(**parts: object) -> str:
    """A cache key for an outcome measured on this machine: its CPU, ISA flags, torch and
    thread count, the ISAs torch, oneDNN and the C kernels were told to keep to (what
    ``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA`` and ``$PDSCOPE_MARCH`` change: another
    CPU's winners), and ``parts`` (what else the outcome depends on)."""
    machine = {
        "cpu": cpu_model(),
        "flags": cpu_flags(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "isa": [
            torch.backends.cpu.get_cpu_capability(),
            *(os.environ.get(v, "") for v in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")),
            os.environ.get(MARCH_ENV, "").strip() or "native",
        ],
    }
    text = json.dumps({**machine, **parts}, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=10).hexdigest()


def write_cache(path: Path, text: str) -> OSError | None:
    """Write a cache file whole (a concurrent start reads the old file or this one); the error
    where it could not be (a read-only cache costs a measurement per start, nothing else)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(path)
    except OSError as exc:
        return exc
    return None


def median_times_s(
    candidates: dict[str, Callable[[], object]], rounds: int, budget_s: float, min_rounds: int = 2
) -> dict[str, float]:
    """Median wall time of each candidate, run interleaved (A, B, A, B, ...) after one warm-up
    each; stops early once ``budget_s`` is spent (at least ``min_rounds`` rounds, or
    ``rounds`` if fewer, are always timed)."""
    for fn in candidates.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    start = time.perf_counter()
    min_rounds = min(min_rounds, rounds)
    for i in range(rounds):
        for name, fn in candidates.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        if i + 1 >= min_rounds and time.perf_counter() - start > budget_s:
            break
    return {name: statistics.median(ts) for name, ts in times.items()}


Candidates = dict[str, Callable[[], object]]

# A cached choice is measured again when the host is this much quieter (1-minute load average
# per core) than when it was made: a trial on a busy host can invert a large gap (one on this
# project's 2-core Xeon under load 5 picked `linear=packed`, slower when quiet), and caching it
# would keep that choice for every later start.
QUIETER_BY = 0.5
# ... and when the host reads memory this many times faster than during the trial
# (specs.local.read_gb_s, the slower of the readings before and after it): a neighbour on the
# same physical host slows this one without raising its load average. On the AMX Xeon
# (family 6 model 207) a trial in such a stretch timed `amx` at 23.2 ms and `pairs2` at 20.0
# against their usual 12.0-12.6 and 13.8-16.0, and its cached pairs2 cost batch-1 decode 11%
# of its speed in every later start (docs/performance.md). The host's own readings swing
# ~25% within minutes: a cache made in one of its slow phases is measured again in a fast one
# (and records the slower of that trial's two readings again).
FASTER_BY = 1.25
# MiB read by that gauge: past the AMD EPYC hosts' 32 MB last-level cache; on the AMX Xeon's
# 300 MiB one its sum read 22.1 GB/s against 21.6 over 1,024 MiB (docs/performance.md).
_READ_GAUGE_MIB = 256


def read_gauge_gb_s() -> float | None:
    """The host's memory read rate now (GB/s), or None where torch could not allocate the
    gauge's array (the comparison is skipped, nothing else; under Linux's overcommit a host
    short of memory may fail later, as the array's pages are touched)."""
    try:
        return read_gb_s(_READ_GAUGE_MIB)
    except (RuntimeError, MemoryError):
        return None


def pairs_preferred(isa: str) -> str:
    """The ``linear`` candidate a trial keeps while it times within ``TIE`` of the fastest,
    by the pairs kernels' ISA (NativeOps.pairs_isa): ``pairs2`` in AVX-512 BF16, ``pairs`` in
    AVX2.

    On the AVX-512 AMD EPYC (Zen 4) the engine's one-call batch-1 step read its weights at the
    same rate with 2 streams a thread as with 8 in the host's slow phases (~33 GB/s: medians
    9.23 and 9.28 ms) and took 0.94x 8's time in a fast phase of 25 rounds (5.42 against 5.78
    ms; one bench/pair_streams_ab.py --rounds 600); two were also the faster on the AMX Xeon and the
    EPYC family 26. In AVX2 on an AMD EPYC Zen 2 eight gave 1.07x two's tokens/s."""
    return "pairs2" if isa == "avx512_bf16" else "pairs"


def packed_unread(picks: Mapping[str, str]) -> bool:
    """Whether, under ``picks`` (path: option), no matmul reads oneDNN's packed weights where
    a weight has a pairs copy: one row on the C kernels or the copies, every larger matmul on
    the copies (``prefill_linear=pairs`` past 64 rows), so that none need be kept."""
    return (
        picks.get("linear") not in ("packed", "plain")
        and picks.get("batch_linear") == "pairs"
        and picks.get("big_batch_linear") == "pairs"
        and picks.get("prefill_linear") == "pairs"
    )


def stored_past_one(picks: Mapping[str, str]) -> bool:
    """Whether, under ``picks``, no matmul reads oneDNN's packed weights, whatever copies a
    weight has: one row on the C kernels or the copies, 2 to ``BIG_BATCH_MAX_ROWS`` rows on the
    many-row kernel or the copies, more on ``F.linear`` over the weight as stored
    (``prefill_linear=plain``), so that none need be kept."""
    return (
        picks.get("prefill_linear") == "plain"
        and picks.get("linear") not in ("packed", "plain")
        and picks.get("batch_linear") in ("c", "pairs")
        and picks.get("big_batch_linear") in ("c", "pairs")
    )


OneLiked = str | tuple[str, float]  # a preferred candidate, or one and its own tie margin
Liked = OneLiked | list[OneLiked]  # ... or several, the first that qualifies kept


def _tie_pick(medians_s: Mapping[str, float], liked: Liked | None) -> str:
    """The fastest candidate, or ``liked`` where it times within :data:`TIE` (or the margin
    given with it) of it; of a list, the first that does."""
    pick = min(medians_s, key=medians_s.__getitem__)
    for one in liked if isinstance(liked, list) else [] if liked is None else [liked]:
        name, tie = one if isinstance(one, tuple) else (one, TIE)
        if name in medians_s and medians_s[name] <= medians_s[pick] * (1 + tie):
            return name
    return pick


def load_per_core() -> float:
    return os.getloadavg()[0] / (os.cpu_count() or 1)


def choose(
    applicable: dict[str, Callable[[], Candidates]],
    forced: dict[str, str],
    shapes: TrialShapes,
    cache_dir: Path | None,
    budget_s: float = 1.0,
    fixed: dict[str, str] | None = None,
    load: float | None = None,
    prefer: Mapping[str, Liked | Callable[[dict[str, str]], Liked | None]] | None = None,
    read_memory: Callable[[], float | None] | None = None,
) -> KernelChoice:
    """Pick every path: forced ones as given, the rest from the cache or a trial.

    ``applicable`` maps each path that has more than one candidate on this device to a
    factory of its candidates' trial functions (called only when that path is timed); paths
    missing from it take their entry in ``fixed`` (what this device and dtype always run), else
    the default. ``load``: the host's load per core now (default: read it); a cache entry
    made at a load higher by :data:`QUIETER_BY` or more is measured again. ``prefer``: per path,
    the candidate a trial keeps while it times within :data:`TIE` of the fastest candidate,
    whichever that is (two that differ only in the host's fast phases read alike in a slow
    one; a name may come with its own margin in place of TIE, or a list of them stand in
    order, the first within its margin kept; a path with a preference is
    timed :data:`PREFERRED_ROUNDS` rounds at least); a preferred name the trial did not run
    is ignored. A callable there names it, or None (no preference), from
    the picks of the paths before this one (in :data:`OPTIONS`' order). ``read_memory``: the
    host's memory read rate now (GB/s, None if unread; default :func:`read_gauge_gb_s`),
    called only with a cache and a path to decide: a cache entry made while the host read
    :data:`FASTER_BY` times slower is measured again, and a trial records the slower of its
    readings before and after (and of the kept paths' own, where some stay cached).
    """
    load = load_per_core() if load is None else load
    read_memory = read_memory or read_gauge_gb_s
    cache_file = cache_dir / f"{shapes.cache_key()}.json" if cache_dir else None
    cached: dict[str, object] = {}
    if cache_file is not None and cache_file.is_file():
        try:
            cached = json.loads(cache_file.read_text())
        except (OSError, json.JSONDecodeError):
            cached = {}  # a damaged cache file is measured again and rewritten
        cached_load = cached.get("load_per_core")
        if isinstance(cached_load, int | float) and load <= cached_load - QUIETER_BY:
            log.info(
                "kernel choice measured again: the host is quieter (load %.2f per core) than "
                "when it was cached (%.2f)",
                load,
                cached_load,
            )
            cached = {}
    to_measure = [p for p in applicable if p not in forced]
    read_now_gb_s = None
    cached_read = cached.get("read_gb_s")
    if to_measure and isinstance(cached_read, int | float) and cached_read > 0:
        read_now_gb_s = read_memory()
        if read_now_gb_s is not None and read_now_gb_s >= cached_read * FASTER_BY:
            log.info(
                "kernel choice measured again: the host reads memory at %.1f GB/s, %.2fx the "
                "%.1f GB/s it read when the choice was cached",
                read_now_gb_s,
                read_now_gb_s / cached_read,
                cached_read,
            )
            cached = {}
    picks: dict[str, str] = {}
    how: dict[str, str] = {}
    trial_s: dict[str, float] = {}
    kept_s = cached.get("trial_s")
    cached_s = {
        k: float(v)
        for k, v in (kept_s.items() if isinstance(kept_s, dict) else ())
        if isinstance(k, str) and isinstance(v, int | float)
    }
    measured_any = False
    per_path_s = budget_s / max(1, len(to_measure))

    def is_cached(path: str) -> bool:
        return isinstance(cached.get(path), str) and cached[path] in OPTIONS[path]

    if cache_file is not None and read_now_gb_s is None and not all(map(is_cached, to_measure)):
        read_now_gb_s = read_memory()  # before the trials that follow
    for path in OPTIONS:
        if path in forced:
            picks[path], how[path] = forced[path], "forced"
        elif path not in applicable:
            how[path] = "fixed"
            if fixed and path in fixed:
                picks[path] = fixed[path]
        elif is_cached(path):
            picks[path], how[path] = str(cached[path]), "cached"
            liked = (prefer or {}).get(path)
            times = {
                name: cached_s[f"{path}={name}"]
                for name in OPTIONS[path]
                if f"{path}={name}" in cached_s
            }
            if callable(liked) and times:
                # the preference follows the paths before this one, which may differ from
                # when the times were taken: weighed again (the pick stays "cached")
                picks[path] = _tie_pick(times, liked(dict(picks)))
            trial_s.update({f"{path}={name}": t for name, t in times.items()})
        else:
            liked = (prefer or {}).get(path)
            liked = liked(dict(picks)) if callable(liked) else liked
            rounds = PREFERRED_ROUNDS if liked is not None else 2
            medians = median_times_s(
                applicable[path](), rounds=7, budget_s=per_path_s, min_rounds=rounds
            )
            trial_s.update({f"{path}={name}": t for name, t in medians.items()})
            picks[path], how[path] = _tie_pick(medians, liked), "measured"
            measured_any = True
    choice = replace(KernelChoice(), **picks, how=how, trial_s=trial_s)
    if measured_any and cache_file is not None:
        record = {
            **{p: getattr(choice, p) for p in applicable if how[p] != "forced"},
            "cpu": cpu_model(),
            "flags": cpu_flags(),
            "shapes": asdict(shapes),
            # the times of the paths read from the cache are kept beside the new ones
            "trial_s": {k: v for k, v in cached_s.items() if how.get(k.split("=")[0]) == "cached"}
            | trial_s,
            "load_per_core": round(load, 2),
        }
        readings = [r for r in (read_now_gb_s, read_memory()) if r is not None]
        if "cached" in how.values() and isinstance(cached_read, int | float):
            readings.append(cached_read)  # the kept paths' own trial's
        if readings:
            record["read_gb_s"] = round(min(readings), 2)
        if (exc := write_cache(cache_file, json.dumps(record, indent=2))) is not None:
            log.warning("kernel choice not cached (%s)", exc)
    return choice
