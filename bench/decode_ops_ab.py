"""The engine's decode step through PyTorch ops vs the C kernels, interleaved in one process.

Two engines on the same checkpoint, identical but for ``decode_ops`` (torch / c; every other
kernel path forced alike), take turns: round after round each runs every figure once, in an
order alternated per round, and the figures are medians with within-round ratios (c / torch).
Decode rates use the engine bench's difference protocol (bench/workload.py): N / (T(1 + N
tokens) - T(1 token)), so prefill is excluded.

    .venv/bin/python bench/decode_ops_ab.py                     # small model, 5 rounds
    .venv/bin/python bench/decode_ops_ab.py --rounds 3 --others linear=packed,decode_math=native

Figures: batch-1 decode at 64 and 4,000 tokens of context (their ratio against plan's bytes
arithmetic, issue 12 item 3) and batch-32 decode at 128 tokens of prompt.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from engine_bench import bytes_per_decode_token, machine_line
from pdscope import LLM, SamplingParams
from pdscope.engine.make_model import resolve_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--others",
        default="linear=packed,prefill_attention=sdpa,decode_math=native",
        help="the other kernel paths, forced the same for both engines",
    )
    args = parser.parse_args()
    model_dir = resolve_model_path(args.model)
    engines = {
        ops: LLM(
            model=str(model_dir),
            dtype="bfloat16",
            kv_cache_memory="1GiB",
            max_model_len=4096,
            max_num_batched_tokens=2048,
            max_num_seqs=64,
            kernels=f"{args.others},decode_ops={ops}",
        )
        for ops in ("torch", "c")
    }
    rng = random.Random(0)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(100, 16000) for _ in range(n)]

    def timed(llm: LLM, prompts: list[list[int]], tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - start

    def rate(llm: LLM, prompt_len: int, batch: int, tokens: int) -> float:
        first = timed(llm, [fresh(prompt_len) for _ in range(batch)], 1)
        whole = timed(llm, [fresh(prompt_len) for _ in range(batch)], 1 + tokens)
        return batch * tokens / (whole - first)

    figures = {
        "decode_b1_ctx64_tok_s": lambda llm: rate(llm, 64 - 48, 1, 96),
        "decode_b1_ctx4000_tok_s": lambda llm: rate(llm, 4000 - 48, 1, 96),
        "decode_b32_tok_s": lambda llm: rate(llm, 128, 32, 64),
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
    print(f"{args.model}, bf16, {args.others}; {args.rounds} rounds; median (min-max)")
    print(f"{'':26}{'torch':>22}{'c':>22}{'c / torch':>22}")
    for name in figures:
        cells = []
        for ops in engines:
            v = values[ops][name]
            cells.append(f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})")
        ratios = [c / t for c, t in zip(values["c"][name], values["torch"][name], strict=True)]
        cells.append(f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
        print(f"{name:26}" + "".join(f"{c:>22}" for c in cells))
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
