"""Measure this machine: streaming memory bandwidth and peak matmul throughput.

The seed article's CPU row, measured instead of assumed. Both kernels run on all cores that
torch uses, take the best of a few runs, and report decimal units (GB/s, TFLOP/s); the
device's memory is physical RAM in GiB, like the catalog's.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pdscope.specs.devices import Device

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class LocalMeasurement:
    read_gb_s: float  # sum over a large array: bytes read / s
    triad_gb_s: float  # a = b + s*c, STREAM accounting: 3 arrays x bytes / s
    matmul_tflops: float
    matmul_dtype: str
    threads: int
    array_bytes: int
    # The type the matmul ran in: ``matmul_dtype``, or float32 where that ran a narrow type's
    # matmul faster (an AVX2-only CPU runs torch's bf16 matmul ~100x slower than float32, and an
    # engine there converts bf16 weights to compute in float32).
    matmul_computed_in: str = ""

    @property
    def bandwidth_gb_s(self) -> float:
        """The higher of the read and triad rates: the best streaming rate this machine
        showed, taken as the rate decode's weight reads can reach."""
        return max(self.read_gb_s, self.triad_gb_s)


def _best_seconds(fn, repeats: int, warm: bool = True) -> float:
    if warm:
        fn()  # warm-up: page faults and thread-pool start are not bandwidth
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _stream_seconds(n: int, repeats: int) -> tuple[float, float]:
    """Best seconds of a read (sum) and a triad over float32 arrays of ``n`` elements."""
    import torch

    b = torch.ones(n, dtype=torch.float32)
    c = torch.ones(n, dtype=torch.float32)
    a = torch.empty(n, dtype=torch.float32)
    read_s = _best_seconds(lambda: b.sum(), repeats)
    triad_s = _best_seconds(lambda: torch.add(b, c, alpha=3.0, out=a), repeats)
    return read_s, triad_s


def stream_gb_s(array_mib: int = 512, repeats: int = 5) -> tuple[float, float]:
    """Read and triad rates (GB/s, STREAM accounting) over float32 arrays of ``array_mib``
    MiB, each the best of ``repeats`` after a warm-up: :func:`measure`'s stream part alone,
    for a ceiling read in the seconds around the figure it divides."""
    n = array_mib * 1024 * 1024 // 4
    read_s, triad_s = _stream_seconds(n, repeats)
    return n * 4 / read_s / 1e9, 3 * n * 4 / triad_s / 1e9


def read_gb_s(array_mib: int = 256, repeats: int = 3) -> float:
    """The read rate alone (GB/s) over one float32 array of ``array_mib`` MiB, the best of
    ``repeats`` after a warm-up: a quick gauge of how fast the host reads memory now (one
    array where :func:`stream_gb_s` holds three), for comparing two moments on one machine."""
    import torch

    b = torch.ones(array_mib * 1024 * 1024 // 4, dtype=torch.float32)
    return b.numel() * 4 / _best_seconds(lambda: b.sum(), repeats) / 1e9


def bandwidth_gb_s(array_mib: int = 512, repeats: int = 5) -> float:
    """This machine's streaming bandwidth now (GB/s): the higher of :func:`stream_gb_s`'s read
    and triad rates, as :attr:`LocalMeasurement.bandwidth_gb_s` takes it, without a matmul."""
    return max(stream_gb_s(array_mib, repeats))


MATMUL_SIZES = (1024, 2048)  # square matmuls timed for the peak; the faster one counts
# A size is tried only while the size before it ran in under this: a slow path (bf16 on an
# AVX2-only CPU, ~1.3 GFLOP/s) would take minutes at 2,048, and its rate is known by then.
MATMUL_SLOW_S = 0.25


def measure(dtype: str = "bf16", array_mib: int = 512, repeats: int = 5) -> LocalMeasurement:
    """Stream rates over float32 arrays of ``array_mib`` MiB and square ``dtype`` matmuls
    (the faster of ``MATMUL_SIZES``), each the best of ``repeats`` timed runs after a warm-up."""
    import torch

    if dtype not in _DTYPES:
        raise ValueError(f"local matmul dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    threads = torch.get_num_threads()
    read_gb_s, triad_gb_s = stream_gb_s(array_mib, repeats)

    # bf16 may run faster in float32 (converting costs O(n^2) against the product's O(n^3)),
    # as an engine without a bf16 matmul computes it, so its peak is the better of the two.
    types = (_DTYPES[dtype], "float32") if dtype == "bf16" else (_DTYPES[dtype],)
    flops_s, computed_in = max((_matmul_flops_s(name, repeats), name) for name in types)
    return LocalMeasurement(
        read_gb_s=read_gb_s,
        triad_gb_s=triad_gb_s,
        matmul_tflops=flops_s / 1e12,
        matmul_dtype=dtype,
        threads=threads,
        array_bytes=array_mib * 1024 * 1024,
        matmul_computed_in=computed_in,
    )


def _matmul_flops_s(torch_dtype: str, repeats: int) -> float:
    """The best FLOP/s of square ``torch_dtype`` matmuls over ``MATMUL_SIZES``."""
    import torch

    # The best of two sizes: which one a CPU's matmul runs fastest at depends on its caches
    # (AMX Xeon: 1.18 TFLOP/s at 1,024 against 0.67 at 2,048 one minute, 2.25 at 2,048 the
    # next), and a peak taken at one size and one minute put a real prefill above the floor.
    flops_s = 0.0
    small = torch.ones(64, 64, dtype=getattr(torch, torch_dtype))
    torch.mm(small, small)  # the library's first-call set-up, kept out of the slow check
    for size in MATMUL_SIZES:
        x = torch.randn(size, size).to(getattr(torch, torch_dtype))
        y = torch.randn(size, size).to(getattr(torch, torch_dtype))
        start = time.perf_counter()
        torch.mm(x, y)  # the warm-up, timed: a path this slow is not repeated
        warm_s = time.perf_counter() - start
        if warm_s > MATMUL_SLOW_S:
            return max(flops_s, 2 * size**3 / warm_s)
        mm_s = _best_seconds(lambda x=x, y=y: torch.mm(x, y), repeats, warm=False)
        flops_s = max(flops_s, 2 * size**3 / mm_s)
    return flops_s


def local_device(dtype: str = "bf16") -> tuple[Device, LocalMeasurement]:
    """This machine as a :class:`Device`: the measured bandwidth and matmul rate, and its
    physical RAM in GiB (``Device.memory_gb`` holds GiB, as the catalog's figures do)."""
    m = measure(dtype)
    try:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        memory_gib = None
    device = Device(
        name="local",
        label="this machine",
        bandwidth_gb_s=round(m.bandwidth_gb_s, 2),
        memory_gb=None if memory_gib is None else round(memory_gib, 1),
        tflops_bf16=round(m.matmul_tflops, 3),
        kind="cpu",
        source=(
            f"measured here: read {m.read_gb_s:.1f} GB/s, triad {m.triad_gb_s:.1f} GB/s over "
            f"{m.array_bytes / 2**20:.0f} MiB arrays, {m.matmul_dtype} matmul "
            f"{m.matmul_tflops:.2f} TFLOP/s{computed_in_note(m)}, {m.threads} threads, "
            "best of runs"
        ),
    )
    return device, m


def computed_in_note(m: LocalMeasurement | dict[str, object]) -> str:
    """' (computed in float32: faster here)' where the narrow type's peak came from float32;
    ``m`` a measurement or its JSON form (plan's ``local_measurement``)."""
    fields = m if isinstance(m, dict) else asdict(m)
    dtype, computed_in = fields["matmul_dtype"], fields.get("matmul_computed_in")
    if computed_in and computed_in != _DTYPES.get(str(dtype)):
        return f" (computed in {computed_in}: faster here)"
    return ""


def cpu_model() -> str:
    """The CPU's marketing name (``lscpu``'s Model name), or the platform's best guess."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


_SIZE_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}


def last_level_cache_bytes(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """The largest data or unified cache Linux lists for CPU 0 (its last level: in a VM the
    size the guest is shown, shared with whatever else runs on those cores), in bytes; None
    where sysfs does not say. A decode whose bytes a token are not many times this size reads
    part of them from the cache, faster than memory's ceiling. Where CPUs have L3s of their
    own (one per CCX on an AMD EPYC, one per socket) this is CPU 0's, less than all of them:
    the side on which a decode past the ceiling stays unexplained."""
    sizes: list[int] = []
    for index in sorted(root.glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        if kind == "Instruction" or not size:
            continue
        digits, unit = (size[:-1], size[-1]) if size[-1] in _SIZE_UNITS else (size, "")
        if digits.isdigit():
            sizes.append(int(digits) * _SIZE_UNITS[unit])
    return max(sizes) if sizes else None
