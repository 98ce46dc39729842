"""The engine's decode step with two candidates of one kernel path, interleaved in one process.

Two engines on the same checkpoint, identical but for one kernel path (by default
``decode_ops``: torch / c; every other path forced alike), take turns: round after round each
runs every figure once, in an order alternated per round, and the figures are medians with
within-round ratios (second / first).
Each figure is the median duration of the engine's decode-only steps (its own step records,
``LLMEngine.steps``) while one generate call runs: scheduling, the model and sampling, with
prefill steps left out; a median over ~30 steps shrugs off a descheduled step on a busy host.

    .venv/bin/python bench/decode_ops_ab.py                     # small model, 5 rounds
    .venv/bin/python bench/decode_ops_ab.py --rounds 3 --threads 1
    .venv/bin/python bench/decode_ops_ab.py --path linear --candidates packed c \
        --others prefill_attention=sdpa,decode_math=native,decode_ops=c
    .venv/bin/python bench/decode_ops_ab.py --generic-attention --rounds 3 \
        --others linear=c,batch_linear=c,prefill_attention=sdpa,decode_math=native,decode_ops=c

``--generic-attention`` compares the C decode attention's generic loop (the library built with
``-DNEW_DECODE_ATTENTION=0``) with the build the engine uses, every path forced alike;
``--avx512-attention`` the head-64 kernel in AVX-512 only (``=1``, no AMX tiles for the scores).
``--one-call`` compares the C decode step as one call per kernel from Python (per-kernel) with
every layer in one call (one-call, NativeOps.decode_layers), every path forced alike.
``--ab-source FILE`` compares the engine with every C kernel taken from another build, compiled
from FILE (e.g. ``git show REV:src/pdscope/engine/csrc/decode_ops.c > /tmp/before.c``), with
this build (``source`` / ``this``), every path forced by ``--others`` for both:

    .venv/bin/python bench/decode_ops_ab.py --ab-source /tmp/before.c --threads 1 --cpu-time \
        --others linear=amx,batch_linear=c,prefill_attention=sdpa,decode_math=native,decode_ops=c

``--plain-pages`` compares the engine with the weights its C kernels stream copied back onto
ordinary 4 KiB pages (``plain``) with the engine as it loads them, on transparent huge pages
where Linux offers them (``huge``), every path forced by ``--others`` for both;
``--plain-cache`` the same for the KV cache (the runner's, on huge pages where offered).

``--block-order`` compares two engines whose block pools have wrapped (filled once by filler
prompts, so blocks come back from the free queue, where freed tables lie reversed): one takes
an allocation's blocks in the queue's order (``queue``, the engine before the fourteenth
session), the other in ascending order (``sorted``, the engine from then to the 58th session,
``BlockPool(grow_runs=False)``, as both pools here), every path forced by ``--others`` for
both:

    .venv/bin/python bench/decode_ops_ab.py --block-order \
        --others decode_ops=c  # the other paths as the trial picks them, alike for both

``--block-growth`` compares two such engines, prefix caching off, on a decode that grows its
table a block at a time: one takes each new block in the queue's order (``queue``, the engine
of the fourteenth session), the other the free block right after the table's last one where
it holds no hash (``run``, the engine from then on; both pools ``grow_runs=False``).
Figures: batch-1 decode at 64 tokens of context and over the last 500 of 2,000 generated
tokens.

    .venv/bin/python bench/decode_ops_ab.py --block-growth --others decode_ops=c

``--block-runs`` compares two engines whose pools two batches of 32 sequences decoding together
have just scattered (their tables grow a block at a time, interleaved), as engine_bench's
rounds do: a 4,000-token prompt's blocks taken as the least recently freed in order, sorted
(``lru``, the engine before the 58th session, ``BlockPool(grow_runs=False)``), or in runs grown
from the queue's oldest (``runs``, the engine now); a 64-token figure beside it, every path
forced by ``--others``:

    .venv/bin/python bench/decode_ops_ab.py --block-runs --model /tmp/m3b4 --others decode_ops=c

``--cpu-time`` times the steps by the process's CPU time instead of wall time: at
``--threads 1`` that is the step's own work, which other processes on a busy host inflate far
less than its wall time.

Figures: batch-1 decode at 64 and 4,000 tokens of context (their ratio against plan's bytes
arithmetic, issue 12 item 3) and batch-32 decode after 128-token prompts, in tokens/s.
``--batches N ...`` replaces them with decode at each batch of N sequences (up to 64) after
128-token prompts, e.g. the decode batches of 33-64 that ``big_batch_linear`` takes:

    .venv/bin/python bench/decode_ops_ab.py --path big_batch_linear --candidates onednn pairs \
        --batches 32 33 40 48 64 --others linear=pairs2,batch_linear=pairs,decode_ops=c
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
from dataclasses import replace

import torch

from engine_bench import build_ops, bytes_per_decode_token, machine_line
from pdscope import LLM, SamplingParams
from pdscope.checkpoint.make_model import resolve_model_path
from pdscope.engine import native
from pdscope.engine.model import apply_kernels, huge_pages_setting
from pdscope.engine.timeline import StepRecord


def generic_attention_ops(level: int = 0, march: str | None = None) -> native.NativeOps:
    """The C kernels built with only the generic decode attention loop (``level`` 0), or with
    the head-64 kernel in AVX-512 only, its scores off the AMX tiles (1); for ``-march=march``
    where given."""
    return build_ops(
        native.SOURCE, f"NEW_DECODE_ATTENTION={level}", what="--generic-attention", march=march
    )


def _point_at(llm: LLM, ops: native.NativeOps) -> None:
    """Run ``llm``'s kernel choice on another build of the C kernels; a build without
    decode_prefetch (the generic loop, or a source from before it) keeps its own prefetch."""
    kernels = llm.engine.kernels
    if not ops.has_decode_prefetch:
        kernels = replace(kernels, decode_prefetch="jumps")
    apply_kernels(llm.engine.runner.model, kernels, ops)
    llm.engine._native = ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--others",
        default="linear=packed,prefill_attention=sdpa,decode_math=native",
        help="the other kernel paths, forced the same for both engines",
    )
    parser.add_argument("--path", default="decode_ops", help="the kernel path compared")
    parser.add_argument("--candidates", nargs=2, default=["torch", "c"], metavar=("A", "B"))
    parser.add_argument("--threads", type=int, help="torch threads (default: all cores)")
    parser.add_argument(
        "--generic-attention",
        action="store_true",
        help="compare the decode attention's generic loop (generic) with the engine's (c)",
    )
    parser.add_argument(
        "--avx512-attention",
        action="store_true",
        help="compare the decode attention in AVX-512 only (avx512) with the engine's (c)",
    )
    parser.add_argument(
        "--one-call",
        action="store_true",
        help="compare the C decode step's per-kernel calls (per-kernel) with one call (one-call)",
    )
    parser.add_argument(
        "--ab-source", help="compare the C kernels built from this file (source) with ours (this)"
    )
    parser.add_argument(
        "--plain-pages",
        action="store_true",
        help="compare streamed weights on ordinary pages (plain) with huge pages (huge)",
    )
    parser.add_argument(
        "--plain-cache",
        action="store_true",
        help="compare the KV cache on ordinary pages (plain) with huge pages (huge)",
    )
    parser.add_argument(
        "--block-order",
        action="store_true",
        help="compare wrapped pools' blocks taken in queue order (queue) with ascending (sorted)",
    )
    parser.add_argument(
        "--block-growth",
        action="store_true",
        help="compare a growing table's blocks taken in queue order (queue) with the block "
        "after its last (run); prefix caching off",
    )
    parser.add_argument(
        "--block-runs",
        action="store_true",
        help="compare a prompt's blocks taken in LRU order, sorted (lru), with runs grown from "
        "the queue's oldest (runs), in a pool a batch's decodes scattered",
    )
    parser.add_argument(
        "--batches",
        type=int,
        nargs="+",
        help="decode at these batch sizes (1-64) in place of the default figures",
    )
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time each step by this process's CPU time (with --threads 1: the step's own work, "
        "which a busy host's other processes inflate far less than wall time)",
    )
    args = parser.parse_args()
    level = 0 if args.generic_attention else 1 if args.avx512_attention else None
    if level is not None:
        args.path, args.candidates = "decode_ops", ["generic" if level == 0 else "avx512", "c"]
    if args.one_call:
        args.path, args.candidates = "calls", ["per-kernel", "one-call"]
    if args.ab_source:
        args.path, args.candidates = "build", ["source", "this"]
    if args.plain_pages or args.plain_cache:
        args.path, args.candidates = "pages", ["plain", "huge"]
    if args.block_order:
        args.path, args.candidates = "blocks", ["queue", "sorted"]
    if args.block_growth:
        args.path, args.candidates = "growth", ["queue", "run"]
    if args.block_runs:
        args.path, args.candidates = "pool", ["lru", "runs"]
    wrapped = args.block_order or args.block_growth
    if args.batches and not all(1 <= n <= 64 for n in args.batches):
        parser.error("--batches: each batch from 1 to 64 (the engines' max_num_seqs)")
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model_path(args.model)
    engines = {
        cand: LLM(
            model=str(model_dir),
            dtype="bfloat16",
            # wrapped by filler prompts under --block-order: a pool the rounds still fit in;
            # under --block-runs engine_bench's on the 3B, 1,170 blocks, at 4 of its layers
            kv_cache_memory="256MiB" if wrapped else "293MiB" if args.block_runs else "1GiB",
            enable_prefix_caching=not args.block_growth,
            max_model_len=4096,
            max_num_batched_tokens=2048,
            max_num_seqs=64,
            kernels=f"{args.others},decode_ops=c"
            if args.one_call
            else args.others
            if args.ab_source or args.plain_pages or args.plain_cache or wrapped or args.block_runs
            else f"{args.others},{args.path}={'c' if level is not None else cand}",
        )
        for cand in args.candidates
    }
    if args.block_runs:
        engines["lru"].engine.scheduler.pool.grow_runs = False
    if level is not None:
        _point_at(engines[args.candidates[0]], generic_attention_ops(level))
    if args.ab_source:
        _point_at(engines["source"], build_ops(args.ab_source))
    if args.plain_pages:
        moved = 0
        for m in engines["plain"].engine.runner.model.modules():
            if getattr(m, "huge_pages", False):
                m.weight.data = m.weight.data.clone()  # torch's allocator: ordinary pages
                moved += 1
        if not moved or huge_pages_setting() != "madvise":
            raise SystemExit("--plain-pages: no weight on huge pages, or huge pages not madvise")
    if args.plain_cache:
        runner = engines["plain"].engine.runner
        if huge_pages_setting() != "madvise":  # under always, torch's clones are huge too
            raise SystemExit("--plain-cache: needs transparent huge pages set to madvise")
        # torch's allocator: ordinary pages (the model sees the new caches' addresses)
        runner.kv_caches = [c.clone() for c in runner.kv_caches]
    if wrapped:
        for llm in engines.values():  # the allocation these two compared: LRU order
            llm.engine.scheduler.pool.grow_runs = False
        pool = engines["queue"].engine.scheduler.pool
        taken_sorted = pool.allocate

        def in_queue_order(
            count: int, after: int | None = None, pool=pool, taken_sorted=taken_sorted
        ) -> list[int]:
            """A prompt's blocks sorted under --block-growth (the fourteenth session's
            engine), in queue order under --block-order; a growing table's never after its
            last block."""
            ids = list(itertools.islice(pool.free_queue, count))  # the blocks allocate() takes
            taken = taken_sorted(count)
            assert sorted(ids) == taken
            return taken if args.block_growth and after is None else ids

        pool.allocate = in_queue_order  # type: ignore[method-assign]
        filler = random.Random(1)
        for llm in engines.values():  # every block taken and freed once
            pool = llm.engine.scheduler.pool
            for _ in range(-(-pool.num_blocks * pool.block_size // 2000) + 1):
                prompt = [filler.randrange(100, 16000) for _ in range(2000)]
                llm.generate([prompt], SamplingParams(max_tokens=1))
    cpu_s: dict[StepRecord, float] = {}  # a step's record (its times: unique) -> CPU seconds
    if args.cpu_time:
        for llm in engines.values():
            engine, plain_step = llm.engine, llm.engine.step

            def timed_step(engine=engine, plain_step=plain_step) -> list:
                before, start = len(engine.steps), time.process_time()
                outputs = plain_step()
                if len(engine.steps) > before:
                    cpu_s[engine.steps[-1]] = time.process_time() - start
                return outputs

            engine.step = timed_step  # type: ignore[method-assign]
    first, second = args.candidates
    rng = random.Random(0)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(100, 16000) for _ in range(n)]

    def rate(llm: LLM, context: int, batch: int, tokens: int = 32) -> float:
        """Tokens/s of the median decode-only step; prompts end ``tokens / 2`` before
        ``context`` so the mean context is ``context``."""
        prompt_len = max(1, context - tokens // 2)
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        llm.engine.steps.clear()
        cpu_s.clear()
        llm.generate([fresh(prompt_len) for _ in range(batch)], params)
        steps = [
            cpu_s.pop(s) if args.cpu_time else s.end_s - s.start_s
            for s in llm.engine.steps
            if s.prefill_tokens == 0 and s.decode_tokens == batch
        ]
        return batch / statistics.median(steps)

    def timed(llm: LLM, prompts: list[list[int]], tokens: int) -> None:
        llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))

    def grown_rate(llm: LLM, tokens: int = 2000, last: int = 500) -> float:
        """Tokens/s of the median step over the last ``last`` of ``tokens`` decoded after a
        64-token prompt: a context the decode itself wrote, block by block."""
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        llm.engine.steps.clear()
        cpu_s.clear()
        llm.generate([fresh(64)], params)
        steps = [
            cpu_s.pop(s) if args.cpu_time else s.end_s - s.start_s
            for s in llm.engine.steps
            if s.prefill_tokens == 0
        ]
        return 1 / statistics.median(steps[-last:])

    figures = {
        "decode_b1_ctx64_tok_s": lambda llm: rate(llm, 64, 1),
        "decode_b1_ctx4000_tok_s": lambda llm: rate(llm, 4000, 1),
        "decode_b32_tok_s": lambda llm: rate(llm, 128 + 16, 32),
    }
    if args.batches:
        figures = {
            f"decode_b{n}_tok_s": lambda llm, n=n: rate(llm, 128 + 16, n) for n in args.batches
        }
    if args.block_runs:

        def scattered_rate(llm: LLM) -> float:
            for _ in range(2):  # as engine_bench's two batches: 32 tables growing interleaved
                timed(llm, [fresh(129) for _ in range(32)], 128)
            return rate(llm, 4000, 1)

        figures = {
            "decode_b1_ctx64_tok_s": lambda llm: rate(llm, 64, 1),
            "decode_b1_ctx4000_tok_s": scattered_rate,
        }
    if args.block_growth:
        figures = {
            "decode_b1_ctx64_tok_s": lambda llm: rate(llm, 64, 1),
            "decode_b1_grown_tok_s": grown_rate,
        }
    for llm in engines.values():  # warm-up
        timed(llm, [fresh(64)], 8)
    values: dict[str, dict[str, list[float]]] = {ops: {} for ops in engines}
    print(machine_line(), flush=True)
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for name, figure in figures.items():
            for ops in order:
                values[ops].setdefault(name, []).append(figure(engines[ops]))
        print(
            f"round {r + 1}: "
            + "; ".join(
                f"{name} " + " / ".join(f"{values[ops][name][-1]:.1f}" for ops in engines)
                for name in figures
            ),
            flush=True,
        )
    print()
    print(machine_line())
    print(
        f"{args.model}, bf16, {args.others}, {args.path} = {first} | {second}; "
        f"{args.rounds} rounds; median (min-max)"
    )
    print(f"tokens/s of the median decode-only step ({'CPU' if args.cpu_time else 'wall'} time)")
    print(f"{'':26}{first:>22}{second:>22}{second + ' / ' + first:>22}")
    for name in figures:
        cells = []
        for ops in engines:
            v = values[ops][name]
            cells.append(f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})")
        ratios = [b / a for a, b in zip(values[first][name], values[second][name], strict=True)]
        cells.append(f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
        print(f"{name:26}" + "".join(f"{c:>22}" for c in cells))
    if args.block_growth or args.batches:
        return
    predicted = bytes_per_decode_token(model_dir, 64) / bytes_per_decode_token(model_dir, 4000)
    print(f"\ndecode at 4,000 / at 64 tokens of context; plan's bytes predict {predicted:.3f}")
    for ops in engines:
        ratios = [
            long / short
            for long, short in zip(
                values[ops]["decode_b1_ctx4000_tok_s"],
                values[ops]["decode_b1_ctx64_tok_s"],
                strict=True,
            )
        ]
        med = statistics.median(ratios)
        print(
            f"{ops:26}{med:.3f} ({min(ratios):.3f}-{max(ratios):.3f})   "
            f"{(med - predicted) * 100:+.1f} points vs the bytes"
        )


if __name__ == "__main__":
    main()
