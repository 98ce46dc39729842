"""A fresh 2,000-token prefill, pdscope beside transformers, interleaved in one process.

The engine_bench protocol's prefill figure (a fresh prompt, one output token, prefix caching
on, one step of 2,048 tokens) for: pdscope with the kernels its trial chose; pdscope with its
bf16 norms and silu_mul in their portable C form (``--portable-glue``, the form before the
AVX-512 BF16 ones); and transformers' LlamaForCausalLM (torch's SDPA) on the same checkpoint.
Besides the wall time it reports CPU time (``time.process_time``, every thread of the process),
which a shared host inflates far less than wall time: with one thread (``--threads 1``) it is
the work a prefill costs, whatever the neighbours do. With ``--parts``, the CPU time of each
part of one pdscope prefill (matmuls, attention, the C glue) beside transformers' matmuls and
SDPA: CPU time at one thread (``time.thread_time`` on the calling thread), wall time
(``time.perf_counter`` around each call, which blocks until its threads are done) at any
count; what is not listed is the rest: glue in torch ops, Python. With ``--one-thread`` as
well, every stack also runs at one thread in the same rounds, so each part's 1- to 2-thread
speed-up is read from interleaved runs (wall: on a busy host it counts the neighbours too).

    .venv/bin/python bench/prefill_ab.py --rounds 5
    .venv/bin/python bench/prefill_ab.py --rounds 5 --threads 1 --parts
    .venv/bin/python bench/prefill_ab.py --rounds 5 --one-thread   # 2 threads vs 1, wall
    .venv/bin/python bench/prefill_ab.py --rounds 5 --threads 2 --one-thread --parts
    .venv/bin/python bench/prefill_ab.py --rounds 5 --kernels prefill_attention=amx --sdpa-ab

``--sdpa-ab`` adds pdscope with its prefill attention switched to torch's SDPA in the same
process (the same engine, only each layer's attention call changes): the AMX tile kernel's
before/after when the trial (or ``--kernels``) chose ``prefill_attention=amx``.
``--gather-ab`` adds pdscope with the AMX kernel reading a gathered copy of each chunk's K/V
(the path before it read them through the block table). ``--ab-source FILE`` adds pdscope
with its AMX prefill attention and its prefill matmuls on the pairs copies
(``prefill_linear=pairs``), whichever the engine runs, taken from another build of the C
kernels, compiled from FILE (e.g. an earlier commit's ``decode_ops.c``, written out with ``git
show REV:src/pdscope/engine/csrc/decode_ops.c``): a kernel change's before/after in one process,
beside transformers.

    git show HEAD~1:src/pdscope/engine/csrc/decode_ops.c > /tmp/before.c
    .venv/bin/python bench/prefill_ab.py --rounds 8 --threads 1 --ab-source /tmp/before.c

``--rows-ab`` (with ``prefill_linear=transposed`` or ``rows``, chosen or forced) adds pdscope
with its prefill matmuls through ``linear``'s path instead (``prefill_linear=onednn``: the
weights packed for many rows), and under ``rows`` also unsplit on the transposed copy
(``transposed``); with ``--ab-source`` as well, also both before at once (``pdscope-before``).
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from engine_bench import interleaved_times, machine_line

TOKENS = 2000
QUIET_OTHERS = 0.1  # cores other processes may use during a run still called quiet


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as is)")
    parser.add_argument("--model", default="small")
    parser.add_argument("--portable-glue", action="store_true")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument(
        "--one-thread", action="store_true", help="also pdscope at one thread, same process"
    )
    parser.add_argument("--parts", action="store_true")
    parser.add_argument("--kernels", default="auto", help="as the engine's --kernels")
    parser.add_argument("--sdpa-ab", action="store_true", help="also pdscope with SDPA prefill")
    parser.add_argument(
        "--gather-ab",
        action="store_true",
        help="also pdscope with its AMX prefill attention on a gathered copy of K/V",
    )
    parser.add_argument(
        "--ab-source",
        help="also pdscope with its AMX prefill attention and pairs matmuls built from this C file",
    )
    parser.add_argument(
        "--rows-ab",
        action="store_true",
        help="also pdscope with its prefill matmuls on oneDNN's threads (prefill_linear=onednn)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from pdscope import LLM, SamplingParams
    from pdscope.checkpoint.make_model import resolve_model_path

    model_dir = str(resolve_model_path(args.model))
    llm = LLM(
        model=model_dir,
        dtype="bfloat16",
        kv_cache_memory="2GiB",
        max_model_len=4096,
        max_num_batched_tokens=2048,
        max_num_seqs=64,
        kernels=args.kernels,
    )
    rng = random.Random(0)

    def fresh() -> list[int]:
        return [rng.randrange(100, 16000) for _ in range(TOKENS)]

    def pdscope() -> None:
        llm.generate([fresh()], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))

    candidates: dict[str, Callable[[], None]] = {"pdscope": pdscope}
    ops = llm.engine.model.native
    if args.portable_glue and ops is not None and ops.wide_glue:

        def portable() -> None:
            ops.wide_glue = False
            try:
                pdscope()
            finally:
                ops.wide_glue = True

        candidates["pdscope-portable-glue"] = portable
    threads = torch.get_num_threads()
    if args.one_thread and threads > 1:
        candidates["pdscope-1-thread"] = _at_one_thread(pdscope, threads)
    if args.sdpa_ab:
        from pdscope.engine.model import Attention

        attns = [m for m in llm.engine.runner.model.modules() if isinstance(m, Attention)]
        if not any(m.prefill_native is not None for m in attns):
            raise SystemExit("--sdpa-ab: the engine does not run prefill_attention=amx here")

        def sdpa_attention() -> None:
            saved = [(m.prefill_native, m.prefill_sdpa) for m in attns]
            for m in attns:
                m.prefill_native, m.prefill_sdpa = None, True
            try:
                pdscope()
            finally:
                for m, (native, sdpa) in zip(attns, saved, strict=True):
                    m.prefill_native, m.prefill_sdpa = native, sdpa

        candidates["pdscope-sdpa-attention"] = sdpa_attention
    if args.gather_ab:
        from pdscope.engine.model import Attention

        attns = [m for m in llm.engine.runner.model.modules() if isinstance(m, Attention)]
        if not any(m.prefill_native is not None for m in attns):
            raise SystemExit("--gather-ab: the engine does not run prefill_attention=amx here")

        def gathered() -> None:
            for m in attns:
                m.prefill_paged = False
            try:
                pdscope()
            finally:
                for m in attns:
                    m.prefill_paged = True

        candidates["pdscope-gather"] = gathered
        if args.one_thread and threads > 1:
            candidates["pdscope-gather-1-thread"] = _at_one_thread(gathered, threads)
    if args.ab_source:
        candidates["pdscope-ab-source"] = _ab_source_candidate(llm, pdscope, args.ab_source)
    if args.rows_ab:
        onednn = _prefill_linear_candidate(llm, pdscope, unsplit=False)
        candidates["pdscope-onednn-linear"] = onednn
        if llm.engine.kernels.prefill_linear == "rows":
            unsplit = _prefill_linear_candidate(llm, pdscope, unsplit=True)
            candidates["pdscope-transposed-linear"] = unsplit
        if args.ab_source:
            candidates["pdscope-before"] = _ab_source_candidate(llm, onednn, args.ab_source)
    if not args.no_transformers:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()

        @torch.inference_mode()
        def transformers() -> None:
            ids = torch.tensor([fresh()])
            hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=1,
                min_new_tokens=1,
                do_sample=False,
                pad_token_id=0,
            )

        candidates["transformers"] = transformers
        if args.one_thread and threads > 1:
            candidates["transformers-1-thread"] = _at_one_thread(transformers, threads)

    # part -> [CPU s of the calling thread, wall s] per timed run
    parts: dict[str, dict[str, list[tuple[float, float]]]] = {name: {} for name in candidates}
    current: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    if args.parts:
        _time_parts(current)

    def keep_parts(name: str) -> None:
        for part, (cpu_s, wall_s) in current.items():
            parts[name].setdefault(part, []).append((cpu_s, wall_s))

    # Other processes' CPU during each run (host busy time from /proc/stat less our own): on
    # a shared 2-core host one busy neighbour thread halves a 2-thread run, so every figure
    # is printed beside it and the rounds where no neighbour ran are summarised apart.
    others: dict[str, list[float]] = {name: [] for name in candidates}
    last_others: dict[str, float] = {}

    def watched(name: str, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            busy0, own0 = _host_busy_s(), time.process_time()
            fn()
            last_others[name] = max(0.0, _host_busy_s() - busy0 - (time.process_time() - own0))

        return run

    def after_run(name: str) -> None:
        keep_parts(name)
        others[name].append(last_others[name])

    timed = {name: watched(name, fn) for name, fn in candidates.items()}
    # the parts of each timed run only: cleared before it, kept after it
    wall, cpu = interleaved_times(timed, args.rounds, current.clear, after_run)

    print(machine_line())
    print(f"kernels: {llm.engine.kernels.summary()}")
    print(f"fresh {TOKENS}-token prefill, {args.rounds} interleaved rounds; median (min-max):")
    for name in candidates:
        w, c = wall[name], cpu[name]
        print(
            f"  {name:22} {TOKENS / statistics.median(w):6.0f} tok/s wall "
            f"({TOKENS / max(w):.0f}-{TOKENS / min(w):.0f}), "
            f"CPU {statistics.median(c) * 1e3:6.0f} ms "
            f"({min(c) * 1e3:.0f}-{max(c) * 1e3:.0f}); other processes "
            f"{statistics.median(o / w for o, w in zip(others[name], wall[name], strict=True)):.2f}"
            " cores"
        )
        by_wall_s = sorted(parts[name].items(), key=lambda kv: -_median(kv[1], 1))
        for part, runs in by_wall_s:
            print(
                f"      {part:20} wall {_median(runs, 1) * 1e3:6.0f} ms, "
                f"CPU of the calling thread {_median(runs, 0) * 1e3:6.0f} ms"
            )
        if by_wall_s:
            rest = [
                w - sum(runs[i][1] for runs in parts[name].values())
                for i, w in enumerate(wall[name])
            ]
            print(f"      {'the rest':20} wall {statistics.median(rest) * 1e3:6.0f} ms")
    quiet = [
        i
        for i in range(args.rounds)
        if all(others[name][i] < QUIET_OTHERS * wall[name][i] for name in candidates)
    ]
    print(
        f"  rounds where other processes used < {QUIET_OTHERS:.2f} cores during every run: "
        f"{len(quiet)} of {args.rounds}"
    )
    for name in candidates if quiet else ():
        w = [wall[name][i] for i in quiet]
        line = f"      {name:22} {TOKENS / statistics.median(w):6.0f} tok/s wall"
        if name != "pdscope":
            ratios = [wall[name][i] / wall["pdscope"][i] for i in quiet]
            line += f", pdscope over it {statistics.median(ratios):.3f}x"
            line += f" ({min(ratios):.3f}-{max(ratios):.3f})"
        print(line)
    for base in ("pdscope", "transformers"):
        one = f"{base}-1-thread"
        if args.parts and base in parts and one in parts:
            which = quiet or list(range(args.rounds))
            print(
                f"  {base}, 1- over 2-thread wall within the {'quiet ' if quiet else ''}rounds, "
                "per part: median (min-max)"
            )
            for part, runs in [*parts[base].items(), ("whole prefill", None)]:
                if runs is None:
                    gains = [wall[one][i] / wall[base][i] for i in which]
                else:
                    mine = parts[one].get(part, [])
                    gains = [mine[i][1] / runs[i][1] for i in which if i < len(mine) and runs[i][1]]
                if gains:
                    print(
                        f"      {part:20} {statistics.median(gains):.2f}x "
                        f"({min(gains):.2f}-{max(gains):.2f})"
                    )
    pairs = [("pdscope", name) for name in candidates if name != "pdscope"]
    # and at one thread, ours against the others at one thread
    one = "pdscope-1-thread"
    if one in candidates:
        pairs += [(one, n) for n in candidates if n.endswith("-1-thread") and n != one]
    for ours, name in pairs:
        by_wall = [o / p for p, o in zip(wall[ours], wall[name], strict=True)]
        by_cpu = [o / p for p, o in zip(cpu[ours], cpu[name], strict=True)]
        print(
            f"  {ours} over {name} within rounds: wall {statistics.median(by_wall):.3f}x "
            f"({min(by_wall):.3f}-{max(by_wall):.3f}), CPU {statistics.median(by_cpu):.3f}x "
            f"({min(by_cpu):.3f}-{max(by_cpu):.3f})"
        )


def _host_busy_s() -> float:
    """CPU seconds every process on the host has run since boot (/proc/stat, all CPUs)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    ticks = [int(f) for f in fields]
    idle = ticks[3] + ticks[4]  # idle, iowait
    # guest time is already counted in user time
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _median(runs: list[tuple[float, float]], index: int) -> float:
    return statistics.median(run[index] for run in runs)


def _at_one_thread(fn: Callable[[], None], threads: int) -> Callable[[], None]:
    """``fn`` with torch (and so the C kernels, which take torch's count) at one thread."""

    def run() -> None:
        torch.set_num_threads(1)
        try:
            fn()
        finally:
            torch.set_num_threads(threads)

    return run


def _ab_source_candidate(
    llm: object, pdscope: Callable[[], None], source: str
) -> Callable[[], None]:
    """pdscope with every layer's AMX prefill attention and every prefill matmul on the pairs
    copies run by the C kernels built from ``source`` (everything else, glue included,
    unchanged)."""
    import ctypes
    import subprocess
    import tempfile

    from pdscope.engine.model import Attention, Linear
    from pdscope.engine.native import NativeOps, compiler

    cc = compiler()
    if cc is None:
        raise SystemExit("--ab-source: no C compiler")
    lib = Path(tempfile.mkdtemp()) / "ab_source.so"
    flags = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]
    subprocess.run([cc, *flags, "-o", str(lib), source, "-lm"], check=True)
    other = NativeOps(ctypes.CDLL(str(lib)))
    modules = list(llm.engine.runner.model.modules())  # type: ignore[attr-defined]
    swapped: list[tuple[object, str]] = []
    if other.prefill_amx:
        attns = [m for m in modules if isinstance(m, Attention)]
        swapped += [(m, "prefill_native") for m in attns if m.prefill_native is not None]
    swapped += [
        (m, "many_rows") for m in modules if isinstance(m, Linear) and m.many_rows is not None
    ]
    if not swapped:
        raise SystemExit(
            "--ab-source: the engine runs neither prefill_attention=amx nor prefill_linear=pairs"
        )
    names = sorted({name for _, name in swapped})
    print(f"--ab-source: {len(swapped)} modules' {' and '.join(names)} from {source}")

    def run() -> None:
        saved = [getattr(m, name) for m, name in swapped]
        for m, name in swapped:
            setattr(m, name, other)
        try:
            pdscope()
        finally:
            for (m, name), ops in zip(swapped, saved, strict=True):
                setattr(m, name, ops)

    return run


def _prefill_linear_candidate(
    llm: object, pdscope: Callable[[], None], unsplit: bool
) -> Callable[[], None]:
    """pdscope with its prefill matmuls through ``linear``'s path (prefill_linear=onednn: the
    packed weights, or F.linear), or with ``unsplit`` on the transposed copy without the split
    by rows (prefill_linear=transposed)."""
    from pdscope.engine.model import Linear

    model = llm.engine.runner.model  # type: ignore[attr-defined]
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.weight_t is not None]
    if not linears:
        raise SystemExit("--rows-ab: the engine does not run prefill_linear=transposed or rows")

    def run() -> None:
        saved = [(m.team, m.weight_t) for m in linears]
        for m in linears:
            m.team = None
            if not unsplit:
                m.weight_t = None
        try:
            pdscope()
        finally:
            for m, (team, weight_t) in zip(linears, saved, strict=True):
                m.team, m.weight_t = team, weight_t

    return run


def _time_parts(acc: dict[str, list[float]]) -> None:
    """Wrap the parts of both models' prefill so each adds [CPU s of the calling thread, wall
    s] to ``acc``."""
    import pdscope.engine.model as model
    from pdscope.engine.native import NativeOps

    def wrap(owner: object, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def timed(*a: object, **k: object) -> object:
            t0, w0 = time.thread_time(), time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                spent = acc[label]
                spent[0] += time.thread_time() - t0
                spent[1] += time.perf_counter() - w0

        setattr(owner, name, timed)

    wrap(model.Linear, "forward", "matmuls (Linear)")
    wrap(model.Attention, "_prefill_cpu", "attention (blocked)")
    wrap(NativeOps, "prefill_attention", "attention (C, AMX)")
    wrap(NativeOps, "prefill_attention_paged", "attention (C, AMX)")
    wrap(model, "_gather_blocks", "key gather")
    for fn in ("rms_norm", "qkv_rope_store", "silu_mul"):
        wrap(NativeOps, fn, f"C {fn}")
    # Both models' SDPA, and transformers' matmuls, are looked up on F at call time.
    wrap(F, "linear", "matmuls (F.linear)")
    wrap(F, "scaled_dot_product_attention", "attention (sdpa)")


if __name__ == "__main__":
    main()
