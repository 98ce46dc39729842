"""The engine's C decode-step kernels (``csrc/decode_ops.c``): built on first use, via ctypes.

Plain C with no torch headers, so it compiles in about a second with the C compiler a fresh
machine has (``$CC``, else ``cc`` or ``gcc``) and needs no ninja or build step at install. The
shared library is cached under the pdscope cache, keyed by the source, the compiler and its
flags, the CPU's flags (it is built with ``-march=native``, or the target ``$PDSCOPE_MARCH``
names) and the torch version; a start that finds it loads it in milliseconds. It links libgomp
by soname, which torch has already loaded, so its OpenMP regions run on torch's thread pool
rather than a second one fighting it for the cores.

When no compiler works, :func:`load` returns None and the engine keeps the pure-PyTorch path,
which stays the tested reference for every kernel here.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("pdscope.engine")

SOURCE = Path(__file__).with_name("csrc") / "decode_ops.c"
# Tried in order: OpenMP on torch's pool, then single-threaded if -fopenmp is unavailable.
_FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"],
    ["-O3", "-march=native", "-fPIC", "-shared"],
)
#: Where set, the ``-march`` target the kernels are built for in place of this CPU's own:
#: ``x86-64-v3`` runs the kernels an AVX2-only CPU builds, ``x86-64`` the portable loops (the
#: branches any other CPU compiles). A way round a build that misbehaves on some CPU, and how
#: bench/engine_bench.py --as-cpu runs another CPU's engine on this one.
MARCH_ENV = "PDSCOPE_MARCH"
_SUPPORTED = (torch.float32, torch.bfloat16)
# linear_pairs' streams a thread at one row (decode_ops.c's pairs_one_row compiles these two;
# kernels.PAIRS_LINEAR names them)
PAIR_STREAMS = (8, 2)

_loaded: dict[tuple[Path, str], NativeOps | None] = {}


def march() -> str:
    """The target the kernels are built for: ``$PDSCOPE_MARCH``, else ``native``. Raises
    ValueError for a value that cannot be a ``-march`` target."""
    target = os.environ.get(MARCH_ENV, "").strip() or "native"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", target):
        raise ValueError(
            f"{MARCH_ENV}={target!r} is not a -march target (e.g. native, x86-64-v3, x86-64)"
        )
    return target


# The compiler's macro for each instruction set a -march target may switch on, and the flag
# /proc/cpuinfo names it by: a target whose code would meet an instruction this CPU lacks is
# refused before it is built (it would load, then die of SIGILL in the first kernel).
_TARGET_FEATURES = {
    "__AVX__": "avx",
    "__AVX2__": "avx2",
    "__FMA__": "fma",
    "__F16C__": "f16c",
    "__BMI2__": "bmi2",
    "__AVXVNNI__": "avx_vnni",
    "__AVX512F__": "avx512f",
    "__AVX512BW__": "avx512bw",
    "__AVX512VL__": "avx512vl",
    "__AVX512DQ__": "avx512dq",
    "__AVX512CD__": "avx512cd",
    "__AVX512VNNI__": "avx512_vnni",
    "__AVX512BF16__": "avx512_bf16",
    "__AVX512FP16__": "avx512_fp16",
    "__AMX_TILE__": "amx_tile",
    "__AMX_BF16__": "amx_bf16",
}


def missing_features(target: str) -> list[str]:
    """The instruction sets ``-march=target`` switches on that this CPU's flags lack (by the
    compiler's predefined macros); empty where it fits, or where either cannot be read."""
    cc, line = compiler(), _cpu_flags_line()
    if cc is None or not line:
        return []
    try:
        macros = subprocess.run(
            [cc, f"-march={target}", "-dM", "-E", "-x", "c", os.devnull],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return []
    have = set(line.split(":", 1)[-1].split())
    return [
        flag for macro, flag in _TARGET_FEATURES.items() if macro in macros and flag not in have
    ]


def flag_sets(target: str = "native") -> list[list[str]]:
    """The compiler's flag sets, tried in order, for ``-march=target``."""
    return [[f"-march={target}" if f == "-march=native" else f for f in fs] for fs in _FLAG_SETS]


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_flags_line() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def build(cache_dir: Path, arch: str = "native") -> Path:
    """Compile the library for ``-march=arch`` into ``cache_dir`` unless a build for this
    source, compiler, flags, CPU and torch is there already; returns its path. Raises
    RuntimeError naming what failed."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found ($CC, cc or gcc)")
    source = SOURCE.read_bytes()
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30
        ).stdout.split("\n", 1)[0]
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"{cc} --version failed: {exc}") from exc
    sets = flag_sets(arch)
    key = hashlib.blake2b(
        b"\0".join(
            [
                source,
                version.encode(),
                repr(sets).encode(),
                _cpu_flags_line().encode(),
                torch.__version__.encode(),
            ]
        ),
        digest_size=10,
    ).hexdigest()
    target = cache_dir / f"decode_ops-{key}.so"
    if target.is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".tmp{os.getpid()}.so")
    errors = []
    for flags in sets:
        start = time.perf_counter()
        proc = subprocess.run(
            [cc, *flags, "-o", str(tmp), str(SOURCE), "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode == 0:
            tmp.replace(target)  # atomic: concurrent starts each build, one file survives
            log.info(
                "built %s with %s %s in %.1f s",
                target.name,
                cc,
                " ".join(flags),
                time.perf_counter() - start,
            )
            return target
        lines = proc.stderr.strip().splitlines()
        errors.append(
            [line for line in lines if "error" in line][:1]
            or lines[-1:]
            or [f"exit {proc.returncode}"]
        )
        if "-fopenmp" in flags:  # the next set drops it: every kernel then runs on one thread
            log.warning("%s -fopenmp failed (%s); building without OpenMP", cc, errors[-1][0])
    tmp.unlink(missing_ok=True)
    raise RuntimeError(f"{cc} could not build {SOURCE.name}: {errors[0][0]}")


def load(cache_dir: Path) -> NativeOps | None:
    """The kernels, built and loaded once per process and target; None (logged) when they
    cannot be. A target asked for by ``$PDSCOPE_MARCH`` that does not build raises
    ValueError: the PyTorch path in its place would not be what was asked for."""
    target = march()
    if (cache_dir, target) in _loaded:
        return _loaded[cache_dir, target]
    if target != "native" and (lacking := missing_features(target)):
        raise ValueError(
            f"{MARCH_ENV}={target} needs {', '.join(lacking)}, which this CPU lacks: its "
            "kernels would stop the process at their first call"
        )
    ops: NativeOps | None = None
    try:
        ops = NativeOps(ctypes.CDLL(str(build(cache_dir, target))), march=target)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        if target != "native":
            raise ValueError(f"{MARCH_ENV}={target}: {exc}") from exc
        log.warning("C decode kernels unavailable, using the PyTorch path: %s", exc)
    else:
        if target != "native":
            log.info("C kernels built for -march=%s (%s), not this CPU's own", target, MARCH_ENV)
    _loaded[cache_dir, target] = ops
    return ops


def supports(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the C kernels apply to a model of this dtype on this device."""
    return device.type == "cpu" and dtype in _SUPPORTED


_P, _I, _F, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
# decode_ops.c's team_share_fn: share(i, n) on thread i of the team's n
_SHARE_FN = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_int)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class DecodeLayer(ctypes.Structure):
    """One decoder layer for :meth:`NativeOps.decode_layers`: weight pointers (None where a
    bias or q/k norm is absent), the layer's KV cache, and its matmul weights' pack_pairs
    copies (None unless ``linear=pairs``). decode_ops.c's ``decode_layer``."""

    _fields_ = [
        (name, _P)
        for name in (
            "input_norm",
            "qkv_w",
            "qkv_b",
            "q_norm",
            "k_norm",
            "o_w",
            "post_norm",
            "gate_up_w",
            "down_w",
            "kv",
            "qkv_p",
            "o_p",
            "gate_up_p",
            "down_p",
        )
    ]


class DecodeStep(ctypes.Structure):
    """A decodes-only step's shapes, batch and kernel settings for
    :meth:`NativeOps.decode_layers`. decode_ops.c's ``decode_step``."""

    _fields_ = [
        *[
            (name, _I)
            for name in (
                "layers",
                "rows",
                "hidden",
                "heads",
                "kv_heads",
                "dim",
                "inter",
                "slots",
                "block_size",
                "table_width",
            )
        ],
        *[(name, _P) for name in ("positions", "slot_mapping", "tables", "bounds")],
        ("cos_table", _P),
        ("sin_table", _P),
        ("final_norm", _P),
        ("eps", ctypes.c_double),
        ("qk_eps", ctypes.c_double),
        ("scale", ctypes.c_double),
        *[(name, _I) for name in ("bf", "threads", "many_rows", "wide_glue")],
        # decode_logits only: the LM head's weight [vocab, hidden]; the token ids [rows] and
        # the embedding to copy the residual from, and where each row's argmax goes
        ("lm_head", _P),
        ("vocab", _I),
        ("ids", _P),
        ("embed", _P),
        ("argmax", _P),
        # linear=pairs: one-row matmuls read the pack_pairs copies, the LM head's here
        ("lm_head_p", _P),
        ("pairs", _I),
        ("pair_streams", _I),  # one-row matmuls over the copies: streams a thread (2, else 8)
    ]


@dataclass
class NativeOps:
    """Typed wrappers over the library's functions; each takes and returns tensors in
    the engine's layouts (see decode_ops.c) and checks what the C side cannot."""

    lib: ctypes.CDLL
    # the -march target the library was built for ("native": this CPU's own)
    march: str = "native"
    # bf16 norms and silu_mul take the AVX-512 BF16 forms (rms_norm_bf16, silu_mul_bf16) when
    # the build has them; tests turn it off to pin the portable forms too.
    wide_glue: bool = False

    def __post_init__(self) -> None:
        self.lib.paged_decode_attention.argtypes = [_P, _P, _P, _P, _P] + [_I] * 7 + [_F, _C, _C]
        self.lib.qkv_rope_store.argtypes = [_P] * 9 + [_F] + [_I] * 5 + [_C, _C]
        self.lib.qkv_rope_store_heads.argtypes = self.lib.qkv_rope_store.argtypes
        self.lib.qkv_rope_store_heads.restype = None
        self.lib.rms_norm.argtypes = [_P] * 4 + [_I, _I, _F, _C, _C]
        self.lib.linear_rows.argtypes = [_P] * 4 + [_I] * 3 + [_C, _C]
        self.lib.linear_rows_isa.argtypes = []
        self.lib.linear_many_rows.argtypes = [_P] * 4 + [_I] * 3 + [_C, _C]
        self.lib.linear_many_rows.restype = ctypes.c_int
        self.lib.linear_many_rows_amx.argtypes = []
        self.lib.linear_many_rows_amx.restype = ctypes.c_int
        self.lib.silu_mul.argtypes = [_P, _P, _I, _I, _C, _C]
        self.lib.silu_mul.restype = None
        self.lib.rms_norm_bf16.argtypes = [_P] * 4 + [_I, _I, _F, _C]
        self.lib.rms_norm_bf16.restype = None
        self.lib.silu_mul_bf16.argtypes = [_P, _P, _I, _I, _C]
        self.lib.silu_mul_bf16.restype = None
        self.lib.prefill_glue_isa.argtypes = []
        self.lib.prefill_glue_isa.restype = ctypes.c_int
        self.wide_glue = bool(self.lib.prefill_glue_isa())
        self.lib.prefill_attention_amx.argtypes = [_P] * 4 + [_I] * 8 + [_F, _C]
        self.lib.prefill_attention_amx.restype = ctypes.c_int
        # absent from a library built from an older source (bench/prefill_ab.py --ab-source)
        self.paged_prefill = hasattr(self.lib, "prefill_attention_amx_paged")
        if self.paged_prefill:
            paged = self.lib.prefill_attention_amx_paged
            paged.argtypes = [_P] * 3 + [_I] * 8 + [_P, _I, _F, _C]
            paged.restype = ctypes.c_int
        self.lib.prefill_attention_amx_usable.argtypes = []
        self.lib.prefill_attention_amx_usable.restype = ctypes.c_int
        # the same kernel in AVX-512 BF16 (absent from a library built from an older source)
        self.prefill_vec = hasattr(self.lib, "prefill_attention_vec_usable") and bool(
            self.lib.prefill_attention_vec_usable()
        )
        if self.prefill_vec:
            self.lib.prefill_attention_vec.argtypes = self.lib.prefill_attention_amx.argtypes
            self.lib.prefill_attention_vec.restype = ctypes.c_int
            paged = self.lib.prefill_attention_vec_paged
            paged.argtypes = [_P] * 3 + [_I] * 8 + [_P, _I, _F, _C]
            paged.restype = ctypes.c_int
        # absent from a library built from an older source (--ab-source benches)
        self.openmp = hasattr(self.lib, "built_with_openmp") and bool(self.lib.built_with_openmp())
        self.lib.place_threads.argtypes = [_P, _C, _C, _C]
        self.lib.place_threads.restype = ctypes.c_int
        self.lib.paged_decode_attention.restype = ctypes.c_int
        self.lib.linear_rows_isa.restype = ctypes.c_int
        for fn in (self.lib.qkv_rope_store, self.lib.rms_norm, self.lib.linear_rows):
            fn.restype = None
        # absent from a library built from an older source too (--ab-source benches)
        self.team = hasattr(self.lib, "run_on_team")
        if self.team:
            self.lib.run_on_team.argtypes = [_SHARE_FN, _C]
            self.lib.run_on_team.restype = ctypes.c_int
        self.one_call = hasattr(self.lib, "decode_layers")
        if self.one_call:
            self.lib.decode_layers.argtypes = [_P, ctypes.POINTER(DecodeStep), _P, _P, _P]
            self.lib.decode_layers.restype = ctypes.c_int
            self.lib.decode_layers_scratch.argtypes = [ctypes.POINTER(DecodeStep)]
            self.lib.decode_layers_scratch.restype = ctypes.c_int64
            if hasattr(self.lib, "decode_team_steps"):
                self.lib.decode_team_steps.argtypes = []
                self.lib.decode_team_steps.restype = ctypes.c_int64
        # newer still: the LM head in the same call (decode_logits)
        self.one_call_logits = self.one_call and hasattr(self.lib, "decode_logits")
        if self.one_call_logits:
            self.lib.decode_logits.argtypes = self.lib.decode_layers.argtypes
            self.lib.decode_logits.restype = ctypes.c_int
            self.lib.decode_logits_scratch.argtypes = [ctypes.POINTER(DecodeStep)]
            self.lib.decode_logits_scratch.restype = ctypes.c_int64
            self.lib.argmax_rows.argtypes = [_P, _I, _I, _P]
            self.lib.argmax_rows.restype = None
        # newer still: one-row matmuls over pair-interleaved weight copies (linear=pairs), in
        # AVX-512 BF16 (1) or AVX2 (2)
        pairs_isa = self.lib.linear_pairs_isa() if hasattr(self.lib, "linear_pairs") else 0
        self.pairs = bool(pairs_isa)
        self.pairs_isa = {1: "avx512_bf16", 2: "avx2"}.get(pairs_isa, "")
        if self.pairs:
            self.lib.pack_pairs.argtypes = [_P, _P, _I, _I, _C]
            self.lib.pack_pairs.restype = None
            self.lib.linear_pairs.argtypes = [_P] * 5 + [_I, _I, _C, _C]
            self.lib.linear_pairs.restype = ctypes.c_int
        # newer still: the decode attention's prefetch, chosen per machine (decode_prefetch);
        # False where no decode attention of this build takes it (no AVX-512 BF16)
        self.has_decode_prefetch = hasattr(self.lib, "set_decode_prefetch")
        if self.has_decode_prefetch:
            self.lib.set_decode_prefetch.argtypes = [_C]
            self.lib.set_decode_prefetch.restype = ctypes.c_int
            self.lib.decode_prefetch_every.argtypes = []
            self.lib.decode_prefetch_every.restype = ctypes.c_int
            self.has_decode_prefetch = bool(self.lib.set_decode_prefetch(0))
        # newer still: several rows through the same copies (batch_linear=pairs), in AVX-512
        # BF16 and, newer again, AVX2 (a library built from an older source, as a bench's
        # --ab-source may be, exports linear_pairs_rows with no AVX2 tiles behind it)
        if hasattr(self.lib, "linear_pairs_rows_isa"):
            self.lib.linear_pairs_rows_isa.argtypes = []
            self.lib.linear_pairs_rows_isa.restype = ctypes.c_int
            rows_isa = self.lib.linear_pairs_rows_isa()
        else:
            rows_isa = 1 if pairs_isa == 1 and hasattr(self.lib, "linear_pairs_rows") else 0
        self.pairs_rows = bool(rows_isa)
        if self.pairs_rows:
            self.lib.linear_pairs_rows.argtypes = [_P] * 5 + [_I, _I, _I, _C, _C]
            self.lib.linear_pairs_rows.restype = ctypes.c_int

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """silu(gate) * up from the fused projection's output [rows, 2 n] → [rows, n], into
        ``out`` where given."""
        _check(gate_up)
        rows, width = gate_up.shape
        if width % 2:
            raise ValueError(f"silu_mul: width {width} is not gate and up halves")
        out = _output(out, rows, width // 2, gate_up.dtype, "silu_mul", gate_up)
        if self.wide_glue and gate_up.dtype == torch.bfloat16:
            threads = torch.get_num_threads()
            self.lib.silu_mul_bf16(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, threads)
            return out
        self.lib.silu_mul(
            gate_up.data_ptr(),
            out.data_ptr(),
            rows,
            width // 2,
            gate_up.dtype == torch.bfloat16,
            torch.get_num_threads(),
        )
        return out

    def place_threads(self, cpus: list[int], bind: bool) -> int:
        """Pin (``bind``) or free the calling thread's OpenMP team of torch's thread count:
        thread i to ``cpus[i % len(cpus)]``, or each to any of ``cpus``. The team is the one
        torch's and these kernels' parallel regions run on when called from this thread, and
        threads this thread starts later inherit its own placement. Returns threads placed."""
        if not cpus:
            raise ValueError("place_threads: no CPUs given")
        ids = (ctypes.c_int32 * len(cpus))(*cpus)
        return self.lib.place_threads(
            ctypes.cast(ids, ctypes.c_void_p), len(cpus), torch.get_num_threads(), int(bind)
        )

    def run_on_team(self, share: Callable[[int, int], None]) -> int:
        """Call ``share(i, n)`` on every thread i of the calling thread's OpenMP team of
        torch's thread count (n threads), all at once, and return n. Torch ops inside run on
        their own thread alone (a nested parallel region is serial) and release the GIL while
        they compute, so the shares' matmuls run side by side. The first exception a share
        raised is raised here, after every share has returned."""
        if not self.team:
            raise RuntimeError("run_on_team: this build of the C kernels lacks it")
        errors: list[BaseException] = []

        def call(i: int, n: int) -> None:
            try:
                share(i, n)
            except BaseException as exc:  # a ctypes callback cannot raise into C
                errors.append(exc)

        shares = self.lib.run_on_team(_SHARE_FN(call), torch.get_num_threads())
        if errors:
            raise errors[0]
        return shares

    @property
    def team_steps(self) -> int:
        """One-call decode steps this library has run on a team of two threads or more (every
        kernel of the step inside one OpenMP region); 0 from a build without the count."""
        if not self.one_call or not hasattr(self.lib, "decode_team_steps"):
            return 0
        return int(self.lib.decode_team_steps())

    @property
    def linear_isa(self) -> str:
        """How :meth:`linear` computes bf16 dot products on this build: ``avx512_bf16``
        (``vdpbf16ps``), ``avx2`` (weights widened to float32 in registers, FMAs) or
        ``portable`` (a float32 loop)."""
        return {1: "avx512_bf16", 2: "avx2"}.get(self.lib.linear_rows_isa(), "portable")

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [rows, in] @ weight [out, in]^T (+ bias [out]) in the model dtype, reading the
        weight as stored: for the few rows of a decode step, where a matmul is one stream over
        its weight. float32 accumulation, one rounding at the end."""
        y, bias = self._linear_args(x, weight, bias)
        self._run_linear(self.lib.linear_rows, x, weight, bias, y)
        return y

    @property
    def linear_many_isa(self) -> str:
        """How :meth:`linear_many` computes bf16 matmuls here: ``amx`` (tile multiplies; the
        CPU, compiler and kernel all allow them) or what :meth:`linear` uses."""
        return "amx" if self.lib.linear_many_rows_amx() else self.linear_isa

    def linear_many(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """:meth:`linear` for the dozens of rows of a batched decode step: on AMX, each block
        of weights is read from memory once and all rows of x run past it in tiles (bf16,
        ``in`` a multiple of 32, ``out`` of 16); elsewhere the same kernel as :meth:`linear`.
        float32 accumulation, one rounding at the end."""
        y, bias = self._linear_args(x, weight, bias)
        status = self._run_linear(self.lib.linear_many_rows, x, weight, bias, y)
        if status < 0:
            raise MemoryError("linear_many_rows: no memory for its copy of x")
        return y

    def pack_pairs(self, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``weight`` [out, in] (bf16, ``out`` a multiple of 16, ``in`` of 2) laid out for
        :meth:`linear_pairs`: [out / 16, in / 2, 16, 2] (decode_ops.c's pack_pairs), written
        into ``out`` (contiguous, as many bf16 as ``weight``) when given."""
        _check(weight)
        rows, cols = weight.shape
        if weight.dtype != torch.bfloat16 or rows % 16 or cols % 2:
            raise ValueError(
                f"pack_pairs: weight {tuple(weight.shape)} {weight.dtype} is not bf16 with "
                "rows a multiple of 16 and columns of 2"
            )
        if out is None:
            out = torch.empty(rows // 16, cols // 2, 16, 2, dtype=torch.bfloat16)
        if out.dtype != weight.dtype or out.numel() != weight.numel() or not out.is_contiguous():
            raise ValueError("pack_pairs: out does not fit the weight")
        out = out.view(rows // 16, cols // 2, 16, 2)
        self.lib.pack_pairs(weight.data_ptr(), out.data_ptr(), cols, rows, torch.get_num_threads())
        return out

    def linear_pairs(
        self,
        x: torch.Tensor,
        pairs: torch.Tensor,
        bias: torch.Tensor | None = None,
        streams: int = 8,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [rows, in] @ weight^T (+ bias) in bf16 from ``pairs`` (into ``out`` where given),
        the weight's :meth:`pack_pairs` copy: 16 outputs per 64-byte load. One row reads
        ``streams`` (8 or 2) blocks side by side per thread (decode_ops.c's linear_pairs; the
        same bits either way); several (where the build has
        linear_pairs_rows) run in tiles of up to 8 rows against 3 blocks at a time (AVX-512
        BF16) or of up to 5 rows against one block (AVX2), each row the same bits as alone.
        float32 accumulation, one rounding at the end."""
        _check(x, pairs, bias)
        blocks, half, sixteen, two = pairs.shape
        in_features, out_features = 2 * half, 16 * blocks
        rows = x.shape[0] if x.dim() == 2 else 0
        if rows > 1 and not self.pairs_rows:
            raise RuntimeError("linear_pairs: this build of the C kernels takes one row only")
        if (
            x.dim() != 2
            or x.shape[1] != in_features
            or rows < 1
            or x.dtype != torch.bfloat16
            or pairs.dtype != torch.bfloat16
            or (sixteen, two) != (16, 2)
        ):
            raise ValueError(
                f"linear_pairs: x {tuple(x.shape)} {x.dtype} does not fit pairs "
                f"{tuple(pairs.shape)} {pairs.dtype}"
            )
        if bias is not None and (bias.shape != (out_features,) or bias.dtype != x.dtype):
            raise ValueError(f"linear_pairs: bias {tuple(bias.shape)} does not fit {out_features}")
        if streams not in PAIR_STREAMS:
            raise ValueError(f"linear_pairs: streams must be one of {PAIR_STREAMS}, got {streams}")
        y = _output(out, rows, out_features, x.dtype, "linear_pairs", x, pairs, bias)
        threads = torch.get_num_threads()
        args = (x.data_ptr(), pairs.data_ptr(), _ptr(bias), y.data_ptr(), None)
        if rows == 1:
            ran = self.lib.linear_pairs(*args, in_features, out_features, threads, streams)
        else:
            ran = self.lib.linear_pairs_rows(
                *args, rows, in_features, out_features, threads, streams
            )
        if ran < 0:
            raise MemoryError("linear_pairs_rows: no memory for its float32 copy of x")
        if not ran:
            raise RuntimeError(
                "linear_pairs: this build of the C kernels has no kernel for "
                f"{rows} row{'s' if rows > 1 else ''} (it needs AVX-512 BF16 or AVX2)"
            )
        return y

    @staticmethod
    def _run_linear(
        fn: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor
    ) -> int:
        """Call a C matmul (linear_rows or linear_many_rows: one signature) on checked tensors."""
        return fn(
            x.data_ptr(),
            weight.data_ptr(),
            _ptr(bias),
            y.data_ptr(),
            x.shape[0],
            x.shape[1],
            weight.shape[0],
            x.dtype == torch.bfloat16,
            torch.get_num_threads(),
        )

    def _linear_args(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Checks x [rows, in], weight [out, in] and bias [out]; returns the empty output."""
        _check(x, weight, bias)
        rows, in_features = x.shape
        out_features = weight.shape[0]
        if weight.shape[1] != in_features or weight.dtype != x.dtype:
            raise ValueError(
                f"linear: x {tuple(x.shape)} {x.dtype} does not fit weight "
                f"{tuple(weight.shape)} {weight.dtype}"
            )
        if bias is not None and (bias.shape != (out_features,) or bias.dtype != x.dtype):
            raise ValueError(f"linear: bias {tuple(bias.shape)} does not fit {out_features} rows")
        return torch.empty(rows, out_features, dtype=x.dtype), bias

    def set_decode_prefetch(self, mode: str) -> None:
        """The decode attention's prefetch (engine/kernels.py's ``decode_prefetch``): ``jumps``
        or ``every``. One setting for the process: the library is loaded once, so the last
        engine to apply a choice it timed or was given sets it for every engine in the
        process. ``jumps`` is a no-op, and ``every`` refused, where the build lacks it."""
        if mode not in ("jumps", "every"):
            raise ValueError(f"decode_prefetch must be 'jumps' or 'every', got {mode!r}")
        if self.has_decode_prefetch:
            self.lib.set_decode_prefetch(mode == "every")
        elif mode == "every":
            raise ValueError("decode_prefetch=every: this build's decode attention lacks it")

    @property
    def prefetch_mode(self) -> str:
        """The library's setting, read back from it (``jumps`` where the build lacks it)."""
        every = self.has_decode_prefetch and self.lib.decode_prefetch_every()
        return "every" if every else "jumps"

    def decode_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        tables: torch.Tensor,
        bounds: torch.Tensor,
        block_size: int,
        scale: float,
    ) -> torch.Tensor:
        """q [seqs, heads, dim]; kv_cache [2, kv_heads, slots, dim]; tables [seqs, width] int64
        block ids; bounds [seqs, 2] int64 key positions [lo, hi). Returns [seqs, heads, dim]."""
        _check(q, kv_cache, tables, bounds)
        seqs, heads, dim = q.shape
        _, kv_heads, slots, _ = kv_cache.shape
        out = torch.empty_like(q)
        status = self.lib.paged_decode_attention(
            q.data_ptr(),
            kv_cache.data_ptr(),
            out.data_ptr(),
            tables.data_ptr(),
            bounds.data_ptr(),
            seqs,
            heads,
            kv_heads,
            dim,
            slots,
            block_size,
            tables.shape[1],
            scale,
            q.dtype == torch.bfloat16,
            torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError("paged_decode_attention: no memory for its scratch space")
        return out

    def qkv_rope_store(
        self,
        qkv: torch.Tensor,
        kv_cache: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        heads: int,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        eps: float,
        heads_major: bool = False,
    ) -> torch.Tensor:
        """qkv [tokens, (heads + 2 kv_heads) dim] → rotated q [tokens, heads, dim]; rotated K
        and V written into ``kv_cache`` at ``slot_mapping``. cos/sin: float32 tables indexed by
        ``positions``. With ``heads_major``, q is laid out [heads, tokens, dim] in memory (what
        SDPA reads fastest) and returned as its [tokens, heads, dim] view."""
        _check(qkv, kv_cache, positions, slot_mapping, cos, sin, q_norm, k_norm)
        _, kv_heads, slots, dim = kv_cache.shape
        tokens = qkv.shape[0]
        if qkv.shape[1] != (heads + 2 * kv_heads) * dim or cos.dtype != torch.float32:
            raise ValueError(f"qkv_rope_store: qkv {tuple(qkv.shape)} or cos {cos.dtype} is off")
        if heads_major:
            q = torch.empty(heads, tokens, dim, dtype=qkv.dtype).transpose(0, 1)
        else:
            q = torch.empty(tokens, heads, dim, dtype=qkv.dtype)
        store = self.lib.qkv_rope_store_heads if heads_major else self.lib.qkv_rope_store
        store(
            qkv.data_ptr(),
            q.data_ptr(),
            kv_cache.data_ptr(),
            positions.data_ptr(),
            slot_mapping.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            _ptr(q_norm),
            _ptr(k_norm),
            eps,
            tokens,
            heads,
            kv_heads,
            dim,
            slots,
            qkv.dtype == torch.bfloat16,
            torch.get_num_threads(),
        )
        return q

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """rms_norm(x) * weight; with ``residual``, first ``residual += x`` in place and the
        sum is normalized (a decoder layer's residual add and next norm in one call)."""
        _check(x, weight, residual)
        if weight.dtype != x.dtype or (residual is not None and residual.shape != x.shape):
            raise ValueError("rms_norm: weight dtype or residual shape differs from x")
        n = x.shape[-1]
        out = torch.empty_like(x)
        args = (x.data_ptr(), _ptr(residual), weight.data_ptr(), out.data_ptr(), x.numel() // n, n)
        if self.wide_glue and x.dtype == torch.bfloat16:
            self.lib.rms_norm_bf16(*args, eps, torch.get_num_threads())
            return out
        self.lib.rms_norm(
            *args,
            eps,
            x.dtype == torch.bfloat16,
            torch.get_num_threads(),
        )
        return out

    def decode_layers(
        self, layers: ctypes.Array[DecodeLayer], step: DecodeStep, residual: torch.Tensor
    ) -> torch.Tensor:
        """Every decoder layer of a decodes-only step in one C call (decode_ops.c's
        decode_layers): the same kernels, in the same order, as the per-kernel calls, so the
        same bits. ``residual`` [rows, hidden] (the embedded tokens) is updated in place;
        returns the final norm's output. The caller vouches for the pointers and shapes in
        ``layers`` and ``step``: they come from the model's own tensors."""
        _check(residual)
        if residual.shape != (step.rows, step.hidden):
            raise ValueError(f"decode_layers: residual {tuple(residual.shape)} does not fit")
        out = torch.empty_like(residual)
        scratch = torch.empty(self.lib.decode_layers_scratch(ctypes.byref(step)), dtype=torch.uint8)
        status = self.lib.decode_layers(
            ctypes.addressof(layers),
            ctypes.byref(step),
            residual.data_ptr(),
            out.data_ptr(),
            scratch.data_ptr(),
        )
        if status != 0:
            raise MemoryError("decode_layers: a kernel found no memory for its scratch space")
        return out

    def decode_logits(
        self,
        layers: ctypes.Array[DecodeLayer],
        step: DecodeStep,
        ids: torch.Tensor,
        embed: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's tokens ``ids`` [rows] (int64) embedded from ``embed`` [vocab, hidden],
        :meth:`decode_layers` and then the LM head (``step.lm_head``, or where it is held once
        its pairs copy ``step.lm_head_p``; ``step.vocab``), all in
        one call (decode_ops.c's decode_logits). Returns float32 logits [rows, vocab], the same
        bits as the per-kernel path's ``lm_head(hidden).float()``, and each row's argmax
        [rows] (int64, as ``logits.argmax(-1)``). The caller vouches for ``embed`` and ids
        inside it, as for the pointers in ``step``; this sets ``step``'s ids, embedding and
        argmax fields."""
        if ids.shape != (step.rows,) or ids.dtype != torch.int64 or not ids.is_contiguous():
            raise ValueError(f"decode_logits: ids {ids.dtype} {tuple(ids.shape)} do not fit")
        dtype = torch.bfloat16 if step.bf else torch.float32
        if (
            not (step.lm_head or step.lm_head_p)  # held once: the copy alone
            or step.vocab <= 0
            or embed.shape != (step.vocab, step.hidden)  # the C side reads ids < vocab rows
            or embed.dtype != dtype
            or not embed.is_contiguous()
        ):
            raise ValueError("decode_logits: the LM head or the embedding does not fit")
        logits = torch.empty(step.rows, step.vocab, dtype=torch.float32)
        argmax = torch.empty(step.rows, dtype=torch.int64)
        step.ids, step.embed, step.argmax = ids.data_ptr(), embed.data_ptr(), argmax.data_ptr()
        scratch = torch.empty(self.lib.decode_logits_scratch(ctypes.byref(step)), dtype=torch.uint8)
        status = self.lib.decode_logits(
            ctypes.addressof(layers),
            ctypes.byref(step),
            None,
            logits.data_ptr(),
            scratch.data_ptr(),
        )
        if status == -2:
            raise ValueError(f"decode_logits: a token id outside 0..{step.vocab - 1}")
        if status == -3:
            raise RuntimeError(
                f"decode_logits: pairs is set but this build has no pairs kernel for {step.rows} "
                "rows"
            )
        if status != 0:
            raise MemoryError("decode_logits: a kernel found no memory for its scratch space")
        return logits, argmax

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x.argmax(-1)`` of float32 ``x`` [rows, n] (the first of equal maxima, the first
        NaN where a row has one): the greedy tokens :meth:`decode_logits` gives."""
        _check(x)
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] == 0:
            raise ValueError(f"argmax_rows: float32 [rows, n>0] only, got {x.dtype} {x.shape}")
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self.lib.argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
        return out

    @property
    def prefill_amx(self) -> bool:
        """Whether :meth:`prefill_attention` runs here: the CPU and compiler have AMX tiles and
        Linux granted this process their registers (asked on the first call)."""
        return bool(self.lib.prefill_attention_amx_usable())

    def prefill_attention(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        cached: int,
        scale: float,
        tiles: bool = True,
        room: int = 0,
    ) -> torch.Tensor | None:
        """Causal attention of one chunk on AMX tiles (bf16), or with ``tiles=False`` the same
        kernel's products in AVX-512 BF16 (:attr:`prefill_vec`): q [n, heads, dim] at positions
        ``cached``..``cached + n - 1`` (any token/head strides, each row contiguous) over keys
        and values [kv_heads, cached + n, dim] (any head stride); returns [n, heads, dim],
        contiguous, the first rows of storage for ``room`` rows where ``room`` > n (a padded
        step's o_proj reads them all). None when the kernel cannot run here (no AMX tiles or
        no AVX-512 BF16, refused by the kernel, or a head size that is not a multiple of 32 up
        to 256): the caller takes SDPA."""
        n, heads, dim = q.shape
        kv_heads, total, _ = keys.shape
        if q.dtype != torch.bfloat16 or keys.dtype != q.dtype or values.dtype != q.dtype:
            raise ValueError(f"prefill_attention: bf16 only, got {q.dtype} {keys.dtype}")
        if keys.shape != values.shape or total != cached + n or keys.shape[2] != dim:
            raise ValueError(
                f"prefill_attention: q {tuple(q.shape)} at {cached} does not fit keys "
                f"{tuple(keys.shape)} / values {tuple(values.shape)}"
            )
        if (
            q.stride(2) != 1
            or keys.stride()[1:] != (dim, 1)
            or values.stride() != keys.stride()
            or q.device.type != "cpu"
        ):
            raise ValueError(
                f"prefill_attention: rows must be contiguous, got q {q.stride()} "
                f"keys {keys.stride()} values {values.stride()}"
            )
        out = torch.empty(max(n, room), heads, dim, dtype=q.dtype)[:n]
        entry = self.lib.prefill_attention_amx if tiles else self._prefill_vec_entry()
        status = entry(
            q.data_ptr(),
            keys.data_ptr(),
            values.data_ptr(),
            out.data_ptr(),
            n,
            cached,
            heads,
            kv_heads,
            dim,
            q.stride(0),
            q.stride(1),
            keys.stride(0),
            scale,
            torch.get_num_threads(),
        )
        if status < 0:
            raise MemoryError("prefill_attention: no memory for its packed K/V")
        return out if status else None

    def _prefill_vec_entry(self, paged: bool = False) -> Any:
        if not self.prefill_vec:
            raise RuntimeError("prefill_attention(tiles=False): this build lacks AVX-512 BF16")
        return self.lib.prefill_attention_vec_paged if paged else self.lib.prefill_attention_vec

    def prefill_attention_paged(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        blocks: torch.Tensor,
        block_size: int,
        cached: int,
        scale: float,
        tiles: bool = True,
        room: int = 0,
    ) -> torch.Tensor | None:
        """:meth:`prefill_attention` with keys and values read in place from a layer's paged
        cache [2, kv_heads, slots, dim]: key i of the chunk's context (positions 0 ..
        ``cached + n - 1``) at slot ``blocks[i // block_size] * block_size + i % block_size``.
        The kernel packs K/V for its tiles in one pass anyway; reading them through the block
        table there replaces the gather copy :meth:`prefill_attention` needs. None when the
        kernel cannot run here."""
        n, heads, dim = q.shape
        _, kv_heads, slots, _ = kv_cache.shape
        if q.dtype != torch.bfloat16 or kv_cache.dtype != q.dtype:
            raise ValueError(f"prefill_attention_paged: bf16 only, got {q.dtype} {kv_cache.dtype}")
        _check(kv_cache, blocks)
        if blocks.dtype != torch.int64 or blocks.dim() != 1 or kv_cache.shape[3] != dim:
            raise ValueError(
                f"prefill_attention_paged: blocks {blocks.dtype} {tuple(blocks.shape)} or cache "
                f"{tuple(kv_cache.shape)} does not fit q {tuple(q.shape)}"
            )
        needed = -(-(cached + n) // block_size)  # blocks holding positions 0 .. cached + n - 1
        if blocks.numel() < needed or slots % block_size:
            raise ValueError(
                f"prefill_attention_paged: {blocks.numel()} blocks of {block_size} slots cannot "
                f"hold {cached + n} positions in a cache of {slots} slots"
            )
        if needed and not 0 <= int(blocks[:needed].min()) <= int(blocks[:needed].max()) < (
            slots // block_size
        ):
            raise ValueError("prefill_attention_paged: a block id lies outside the cache")
        if q.stride(2) != 1 or q.device.type != "cpu":
            raise ValueError(
                f"prefill_attention_paged: q rows must be contiguous, got {q.stride()}"
            )
        out = torch.empty(max(n, room), heads, dim, dtype=q.dtype)[:n]
        entry = self.lib.prefill_attention_amx_paged if tiles else self._prefill_vec_entry(True)
        status = entry(
            q.data_ptr(),
            kv_cache.data_ptr(),
            out.data_ptr(),
            n,
            cached,
            heads,
            kv_heads,
            dim,
            q.stride(0),
            q.stride(1),
            slots,
            blocks.data_ptr(),
            block_size,
            scale,
            torch.get_num_threads(),
        )
        if status < 0:
            raise MemoryError("prefill_attention_paged: no memory for its packed K/V")
        return out if status else None


def _check(*tensors: torch.Tensor | None) -> None:
    """The C side reads raw memory: every tensor must be contiguous on CPU; the model-dtype
    ones share one dtype, index tensors are int64."""
    for t in tensors:
        if t is None:
            continue
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"C kernels need contiguous CPU tensors, got {t.device} {t.stride()}")
        if t.dtype not in (*_SUPPORTED, torch.int64):
            raise ValueError(f"C kernels take float32, bfloat16 or int64, got {t.dtype}")


def _output(
    out: torch.Tensor | None,
    rows: int,
    width: int,
    dtype: torch.dtype,
    name: str,
    *inputs: torch.Tensor | None,
) -> torch.Tensor:
    """``out`` checked to take a kernel's [rows, width] result (the C side writes raw memory,
    while it still reads ``inputs``: they may not share a byte), or a new tensor where none
    is given."""
    if out is None:
        return torch.empty(rows, width, dtype=dtype)
    _check(out)
    if out.shape != (rows, width) or out.dtype != dtype:
        raise ValueError(
            f"{name}: out {tuple(out.shape)} {out.dtype} is not ({rows}, {width}) {dtype}"
        )
    lo = out.data_ptr()
    hi = lo + out.numel() * out.element_size()
    for t in inputs:
        if t is not None and t.data_ptr() < hi and lo < t.data_ptr() + t.nbytes:
            raise ValueError(f"{name}: out overlaps an input the kernel reads")
    return out
