"""pdscope's engine side by side with Hugging Face transformers and vLLM's CPU build, interleaved.

One machine, one checkpoint (the built-in `small`, bfloat16), the same protocol for every stack
(bench/workload.py). Every stack is loaded once in its own worker process (bench/stack_worker.py);
then, round after round, each stack runs the whole protocol once while the others sit idle, in
an order rotated every round. Figures are medians over rounds, ratios are taken within each
round (ours / peer) and given as median (min-max), and the memory bandwidth is measured just
before and just after each stack's batch-1 decode (the worker idle meanwhile), so that figure is
also a fraction of the ceiling of its own seconds. On a shared host whose speed swings
several-fold over minutes, only such interleaved medians and within-round ratios mean much.

    .venv/bin/python bench/engine_bench.py      # ours, HF, vLLM in one process; 5 rounds
    .venv/bin/python bench/engine_bench.py --stacks pdscope vllm-1p vllm --repeats 3
    .venv/bin/python bench/engine_bench.py --stacks pdscope --long-context   # decode vs context
    .venv/bin/python bench/engine_bench.py --quick --repeats 2                # smoke test
    .venv/bin/python bench/engine_bench.py --as-cpu avx2    # an AVX2-only CPU's paths, here

vLLM needs `make peers` (its CPU build in .venv-peers). `vllm-1p` keeps vLLM's engine core in
the caller's process (VLLM_ENABLE_V1_MULTIPROCESSING=0); `vllm` is vLLM as it ships (engine core
in a second process). Every stack gets both cores: torch's threads default to the core count,
vLLM's are bound with VLLM_CPU_OMP_THREADS_BIND.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdscope.engine.native import NativeOps
from typing import IO

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
STACKS = ("pdscope", "transformers", "vllm-1p", "vllm")
FIGURES = (
    "decode_b1_tok_s",
    "decode_b1_of_ceiling",
    "prefill_2000_tok_s",
    "batch32_decode_tok_s",
    "batch32_e2e_tok_s",
    "cached_prefix_ratio",
    "decode_ctx64_tok_s",
    "decode_ctx4000_tok_s",
)
RATIO_FIGURES = FIGURES[:5] + FIGURES[6:]
# --as-cpu: every stack (and the bandwidth reads) kept to another CPU's instruction sets on
# this one. avx2: torch dispatches its AVX2 kernels, oneDNN keeps to AVX2 (so no bf16 packing:
# torch's bf16 matmul is its slow fallback, as on such a CPU), pdscope's C kernels are built
# for x86-64-v3, and vLLM loads its AVX2 build (stack_worker.py reads the last variable). What
# stays this CPU's: its memory, caches, clock and core count.
AS_CPU = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "PDSCOPE_MARCH": "x86-64-v3",
        "PDSCOPE_BENCH_NO_AVX512": "1",
    }
}


def bytes_per_decode_token(model_dir: Path, context: int = 32) -> float:
    """Bytes a batch-1 decode step reads at ``context`` tokens: bf16 weights and bf16 KV
    (`pdscope plan`'s sums)."""
    from pdscope.roofline import arithmetic as rf
    from pdscope.specs import get_kv_precision, get_weight_precision, load_model

    spec = load_model(str(model_dir))
    return rf.decode_bytes_per_token(
        spec, get_weight_precision("bf16"), get_kv_precision("bf16"), context
    )


def bandwidth_gb_s() -> float:
    """This machine's memory bandwidth now, measured as `pdscope plan --device local` does
    (the higher of its read and triad rates), without its matmul timing."""
    from pdscope.specs import local

    return local.bandwidth_gb_s()


def machine_line() -> str:
    """The CPU model and the ISA flags that decide which kernels win, for every table."""
    import torch

    from pdscope.engine.kernels import cpu_flags, cpu_model

    line = (
        f"CPU: {cpu_model()} x {os.cpu_count()} ({' '.join(cpu_flags()) or 'no AVX2+ flags'}); "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    kept = [f"{k}={v}" for k, v in AS_CPU["avx2"].items() if os.environ.get(k) == v]
    if kept:  # --as-cpu
        line += (
            f"; run as another CPU: {' '.join(kept)} "
            f"(torch dispatching {torch.backends.cpu.get_cpu_capability()})"
        )
    return line


def build_ops(
    source: str | Path, *defines: str, what: str = "--ab-source", march: str | None = None
) -> NativeOps:
    """The engine's C kernels compiled from ``source`` with the engine's flags (and ``-D``
    ``defines``; ``-march`` set to ``march`` instead of native where given) into a temporary
    library, loaded beside the engine's own build."""
    import ctypes
    import tempfile

    from pdscope.engine import native

    cc = native.compiler()
    if cc is None:
        raise SystemExit(f"{what} needs a C compiler")
    target = Path(tempfile.mkdtemp(prefix="pdscope-ab-")) / "decode_ops_ab.so"
    flags = [f"-D{d}" for d in defines] + native.flag_sets(march or "native")[0]
    subprocess.run([cc, *flags, "-o", str(target), str(source), "-lm"], check=True)
    return native.NativeOps(ctypes.CDLL(str(target)))


def interleaved_times(
    candidates: dict[str, Callable[[], object]],
    rounds: int,
    before_each: Callable[[], object] | None = None,
    after_each: Callable[[str], object] | None = None,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each candidate once as a warm-up, then ``rounds`` rounds of every candidate in turn:
    wall and CPU seconds (``time.process_time``, every thread of the process) per run.
    ``before_each``/``after_each`` run around each timed call, outside its time."""
    for fn in candidates.values():
        fn()
    wall: dict[str, list[float]] = {name: [] for name in candidates}
    cpu: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            if before_each:
                before_each()
            c0, w0 = time.process_time(), time.perf_counter()
            fn()
            wall[name].append(time.perf_counter() - w0)
            cpu[name].append(time.process_time() - c0)
            if after_each:
                after_each(name)
    return wall, cpu


@dataclass
class Worker:
    """One stack's long-lived process, asked for one round at a time."""

    name: str
    proc: subprocess.Popen[str]
    log_path: Path
    notes: list[str] = field(default_factory=list)

    def read_until(self, prefix: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        stdout: IO[str] = self.proc.stdout  # type: ignore[assignment]
        while time.monotonic() < deadline:
            line = stdout.readline()
            if not line:
                raise RuntimeError(
                    f"{self.name} exited (code {self.proc.wait()}); see {self.log_path}"
                )
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
            if line.startswith("KERNELS "):
                self.notes.append(line.strip())
        raise TimeoutError(f"{self.name}: no {prefix.strip()} within {timeout_s:.0f} s")

    def round(self, ask: dict[str, object]) -> dict[str, float]:
        stdin: IO[str] = self.proc.stdin  # type: ignore[assignment]
        stdin.write(json.dumps(ask) + "\n")
        stdin.flush()
        return json.loads(self.read_until("RESULT ", 3600))

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start_worker(name: str, model_dir: Path, log_dir: Path) -> Worker | None:
    python, stack = sys.executable, name
    env = dict(os.environ)
    if name.startswith("vllm"):
        if not PEERS_PYTHON.exists():
            print(f"{name}: skipped (run `make peers` for vLLM's CPU build)", file=sys.stderr)
            return None
        python, stack = str(PEERS_PYTHON), "vllm"
        cores = os.cpu_count() or 1
        env |= {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}"}
        if name == "vllm-1p":
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    log_path = log_dir / f"{name}.log"
    proc = subprocess.Popen(
        [python, str(BENCH / "stack_worker.py"), stack, str(model_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log_path.open("w"),
        text=True,
        env=env,
        cwd=ROOT,
    )
    return Worker(name, proc, log_path)


def spread(values: list[float]) -> str:
    """median (min-max) of one figure over rounds."""
    if not values:
        return "-"
    med = statistics.median(values)
    digits = 3 if abs(med) < 10 else 1
    if len(values) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def summarize(
    rounds: list[dict[str, dict[str, float]]], ours: str = "pdscope"
) -> tuple[dict[str, dict[str, list[float]]], dict[str, dict[str, list[float]]]]:
    """Per stack and figure the values over rounds; per peer and figure our within-round
    ratios (ours / peer; for cached_prefix_ratio, lower is better, so it is left out)."""
    values: dict[str, dict[str, list[float]]] = {}
    ratios: dict[str, dict[str, list[float]]] = {}
    for per_stack in rounds:
        for stack, result in per_stack.items():
            for key, value in result.items():
                values.setdefault(stack, {}).setdefault(key, []).append(value)
        mine = per_stack.get(ours)
        if not mine:
            continue
        for stack, result in per_stack.items():
            if stack == ours:
                continue
            for key in RATIO_FIGURES:
                if key in mine and key in result and result[key]:
                    ratios.setdefault(stack, {}).setdefault(key, []).append(mine[key] / result[key])
    return values, ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--repeats", type=int, default=5, help="rounds (every stack once each)")
    parser.add_argument("--stacks", nargs="+", default=["pdscope", "transformers", "vllm-1p"])
    parser.add_argument("--quick", action="store_true", help="shorter figures (smoke test)")
    parser.add_argument(
        "--long-context",
        action="store_true",
        help="also decode at 64 and 4,000 tokens of context, against plan's bytes arithmetic",
    )
    parser.add_argument(
        "--as-cpu",
        choices=sorted(AS_CPU),
        help="keep every stack to another CPU's instruction sets (see AS_CPU)",
    )
    parser.add_argument(
        "--pdscope-kernels",
        default="auto",
        help="pdscope's --kernels (e.g. prefill_linear=onednn): a forced path against the peers",
    )
    parser.add_argument("--json", type=Path, help="also write every round here")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/pdscope-engine-bench"))
    args = parser.parse_args()
    os.environ["PDSCOPE_BENCH_KERNELS"] = args.pdscope_kernels  # read by stack_worker.py
    unknown = [s for s in args.stacks if s not in STACKS]
    if unknown or args.repeats < 1:
        parser.error(f"--stacks from {', '.join(STACKS)}; --repeats >= 1 (got {unknown})")

    if args.as_cpu:  # before torch loads here: the bandwidth reads keep to it too
        os.environ.update(AS_CPU[args.as_cpu])
    from pdscope.checkpoint.make_model import resolve_model_path

    model_dir = resolve_model_path(args.model)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    per_token = bytes_per_decode_token(model_dir)
    print(machine_line(), flush=True)
    workers: list[Worker] = []
    try:
        for name in args.stacks:
            worker = start_worker(name, model_dir, args.log_dir)
            if worker is not None:
                worker.read_until("READY", 1800)  # one at a time: loads fight for the cores
                workers.append(worker)
        for w in workers:
            for note in w.notes:
                print(f"{w.name}: {note}")
        rounds: list[dict[str, dict[str, float]]] = []
        bandwidths: list[dict[str, tuple[float, float]]] = []
        for r in range(args.repeats):
            order = workers[r % len(workers) :] + workers[: r % len(workers)]
            ask = {"seed": 1000 + r, "quick": args.quick, "long_context": args.long_context}
            per_stack: dict[str, dict[str, float]] = {}
            around: dict[str, tuple[float, float]] = {}
            for w in order:
                # The ceiling in the seconds around the figure it divides: this host's rate
                # flips between ~33 and ~60 GB/s from one minute to the next, and readings
                # taken around a stack's whole round paired decodes with other phases.
                before = bandwidth_gb_s()
                result = w.round(ask | {"part": "decode_b1"})
                after = bandwidth_gb_s()
                result |= w.round(ask | {"part": "rest"})
                ceiling_tok_s = (before + after) / 2 * 1e9 / per_token
                result["decode_b1_of_ceiling"] = result["decode_b1_tok_s"] / ceiling_tok_s
                per_stack[w.name], around[w.name] = result, (before, after)
            rounds.append(per_stack)
            bandwidths.append(around)
            print(
                f"round {r + 1}/{args.repeats}: "
                + ", ".join(
                    f"{n} decode {res['decode_b1_tok_s']:.0f} prefill "
                    f"{res['prefill_2000_tok_s']:.0f}"
                    for n, res in per_stack.items()
                ),
                flush=True,
            )
    finally:
        for w in workers:
            w.close()
    report(rounds, bandwidths, model_dir, per_token, args)


def report(
    rounds: list[dict[str, dict[str, float]]],
    bandwidths: list[dict[str, tuple[float, float]]],
    model_dir: Path,
    per_token: float,
    args: argparse.Namespace,
) -> None:
    values, ratios = summarize(rounds)
    stacks = list(values)
    width = 26
    print()
    print(machine_line())
    print(f"model {model_dir}, bf16; {len(rounds)} interleaved rounds; median (min-max)")
    print(f"{per_token / 1e6:.1f} MB read per decode token at 32 tokens of context; ")
    print("ceiling = bandwidth measured around each stack's batch-1 decode / that")
    print(f"{'':24}" + "".join(f"{s:>{width}}" for s in stacks))
    bw = {s: [sum(b[s]) / 2 for b in bandwidths if s in b] for s in stacks}
    print(f"{'bandwidth GB/s':24}" + "".join(f"{spread(bw[s]):>{width}}" for s in stacks))
    for key in FIGURES:
        if any(key in values[s] for s in stacks):
            row = "".join(f"{spread(values[s].get(key, [])):>{width}}" for s in stacks)
            print(f"{key:24}{row}")
    if ratios:
        print()
        print(machine_line())
        print("ours / peer, within each round: median (min-max)")
        peers = list(ratios)
        print(f"{'':24}" + "".join(f"{p:>{width}}" for p in peers))
        for key in RATIO_FIGURES:
            row = "".join(f"{spread(ratios[p].get(key, [])):>{width}}" for p in peers)
            print(f"{key:24}{row}")
    apart = {s: v for s in stacks if (v := values[s].get("batch32_prefill_apart"))}
    if apart:
        # a rough bound on the figure's error; round 1's may hold a first call's set-up
        print(
            "\nbatch-32 decode: its two prefill-only calls (before, after) differed by "
            + ", ".join(
                f"{statistics.median(v):.0%} (at most {max(v):.0%}) ({s})" for s, v in apart.items()
            )
            + " of the decode's time, median of the rounds"
        )
    mine = values.get("pdscope", {})
    if "batch32_decode_tok_s" in mine:
        b32 = [
            a / b
            for a, b in zip(mine["batch32_decode_tok_s"], mine["decode_b1_tok_s"], strict=True)
        ]
        print(f"\nbatch-32 decode / batch-1 decode (ours): {spread(b32)}")
    if args.long_context:
        predicted = bytes_per_decode_token(model_dir, 64) / bytes_per_decode_token(model_dir, 4000)
        print()
        print(machine_line())
        print(
            f"decode at 4,000 over decode at 64 tokens of context; plan's bytes (weights + KV) "
            f"predict {predicted:.3f}"
        )
        for stack in stacks:
            long_ctx = values[stack].get("decode_ctx4000_tok_s", [])
            short_ctx = values[stack].get("decode_ctx64_tok_s", [])
            measured = [a / b for a, b in zip(long_ctx, short_ctx, strict=True)]
            if measured:
                gap = (statistics.median(measured) - predicted) * 100
                print(f"{stack:24}{spread(measured):>{width}}   {gap:+.1f} points vs the bytes")
        past = [
            stack
            for stack in stacks
            if statistics.median(values[stack].get("decode_b1_of_ceiling") or [0.0]) > 1.0
        ]
        if past:
            # Bytes from a cache cost less than the ceiling's: the arithmetic then over-predicts
            # (on a Xeon with 300 MiB of L3 and the small model, a plain read fell 9 points too).
            print(
                f"({', '.join(past)}: batch-1 decode past the ceiling, so the caches likely hold "
                "part of the weights between steps and a long context's KV pushes them out: "
                "bench/ceiling_check.py --long-context reads the same bytes for this host's ratio)"
            )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": machine_line(),
                    "bytes_per_decode_token": per_token,
                    "bandwidth_gb_s_before_after": bandwidths,
                    "rounds": rounds,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
