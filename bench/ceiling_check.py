"""How close can batch-1 decode get to the bandwidth ceiling here? The ceiling and what lies
under it, interleaved in one process.

engine_bench.py divides batch-1 decode by a ceiling: the best of five 512 MiB reads (or
triads), measured just before and just after each stack's batch-1 decode. This script takes,
round after round in one process, that ceiling and three figures beneath it, so that the gap
between decode and the ceiling can be split into what the host gives at all and what the
engine loses:

* ceiling: engine_bench's figure (``bandwidth_gb_s``: best of 5, the higher of read and triad);
* sustained: the same 512 MiB read repeated for as long as a decode figure takes (~5 s), its
  mean rate: what a burst-best ceiling concedes to a figure that is a mean;
* weights: a read (float32 sum, denormals flushed) of exactly the bytes a decode step streams:
  the engine's own weight tensors as it holds them (the pairs copies where single rows read
  them, huge pages, its layout), one after another, repeated for ~2 s; its rate, and as
  tokens/s (304 MB a token on the small model);
* decode: the engine's batch-1 decode as engine_bench takes it (a 32-token prompt, N = 256,
  N / (T(1 + N) - T(1))), and its median decode-only step from the engine's own records.

    .venv/bin/python bench/ceiling_check.py --rounds 7
    .venv/bin/python bench/ceiling_check.py --rounds 7 --long-context

``--long-context`` adds issue 12's item 3 and what lies under it: the engine's decode at 64 and
at 4,000 tokens of context (engine_bench's figures: 96 tokens around each context), and a read
of the bytes a step streams at each, layer by layer: every layer's weights as above, then that
layer's K and V at that context (bf16, plan's bytes: a tensor of its own per layer; a step
reads them between the layer's projections), the LM head last. plan's bytes arithmetic
predicts the ratio of the two decodes from the bytes alone; the read's ratio shows what the
host gives that arithmetic (on a CPU whose L3 holds much of the weights, less than the bytes
predict: 49 MB of KV a step pushes weights out), and the engine's over the read's what the
engine loses to it.

Every ratio is taken within a round and given as median (min-max).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path

import torch

from engine_bench import bandwidth_gb_s, bytes_per_decode_token, machine_line
from pdscope import LLM, SamplingParams
from pdscope.checkpoint.make_model import resolve_model_path
from pdscope.engine.model import CausalLM, Linear
from pdscope.roofline import arithmetic as rf
from pdscope.specs import get_kv_precision, load_model
from workload import CONTEXTS, decode_at_contexts

SUSTAINED_S = 5.0
WEIGHTS_S = 2.0


def read_rate_gb_s(tensors: list[torch.Tensor], seconds: float) -> float:
    """Bytes per second of summing ``tensors`` (viewed as float32) back to back, repeated for
    about ``seconds``; denormals are flushed so that bf16 bit patterns cost what floats do."""
    views = [t.view(torch.float32) for t in tensors]
    total_bytes = sum(v.numel() * 4 for v in views)
    was = torch.set_flush_denormal(True)
    try:
        for v in views:  # warm-up
            v.sum()
        passes, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            for v in views:
                v.sum()
            passes += 1
        elapsed = time.perf_counter() - start
    finally:
        torch.set_flush_denormal(was)
    return passes * total_bytes / elapsed / 1e9


def streamed(m: Linear) -> torch.Tensor:
    """What a batch-1 step reads of ``m``: its pairs copy where single rows read it, else the
    weight as stored (not ``.weight``, which would make a weight held once again: a second
    copy of it in memory, and a read of bytes no step reads). Under ``linear=packed`` the step
    reads oneDNN's packed copy, as many bytes in its own layout: the weight stands in for it."""
    if m.one_row_pairs and m.pairs is not None:
        return m.pairs
    weight = m.stored_weight()
    assert weight is not None  # held once only where its copy is read
    return weight.detach()


def step_reads(model: CausalLM, model_dir: Path) -> dict[int, list[torch.Tensor]]:
    """What a batch-1 step streams at each of CONTEXTS' lengths, in the step's order: each
    layer's weights (as ``streamed``), then that layer's K and V at that context (bf16, plan's
    bytes, a tensor of its own), then the weights after the layers (the LM head)."""
    layers = list(model.layers)
    in_layers = {id(m) for layer in layers for m in layer.modules()}
    after = [
        streamed(m) for m in model.modules() if isinstance(m, Linear) and id(m) not in in_layers
    ]
    spec = load_model(str(model_dir))
    reads: dict[int, list[torch.Tensor]] = {}
    for context in CONTEXTS.values():
        kv_bytes = rf.kv_bytes_at_context(spec, get_kv_precision("bf16"), context)
        per_layer = kv_bytes // len(layers) // 4 * 4  # whole float32 words
        tensors: list[torch.Tensor] = []
        for layer in layers:
            tensors += [streamed(m) for m in layer.modules() if isinstance(m, Linear)]
            tensors.append(torch.ones(per_layer // 4, dtype=torch.float32))
        reads[context] = tensors + after
    return reads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=256, help="decode tokens per figure")
    parser.add_argument(
        "--long-context",
        action="store_true",
        help="also decode at 64 and 4,000 tokens of context beside a read of each step's bytes",
    )
    args = parser.parse_args()
    model_dir = resolve_model_path(args.model)
    llm = LLM(
        model=str(model_dir),
        dtype="bfloat16",
        kv_cache_memory="2GiB",
        max_model_len=4096,
        max_num_batched_tokens=2048,
        max_num_seqs=64,
    )
    engine = llm.engine
    print(machine_line(), flush=True)
    print(f"kernels: {engine.kernels.summary()}", flush=True)
    if engine.kernels.linear == "packed":
        print("(linear=packed: the weights as stored stand in for oneDNN's packed copies)")
    model = engine.runner.model
    weights = [streamed(m) for m in model.modules() if isinstance(m, Linear)]
    per_token = bytes_per_decode_token(model_dir)
    weight_bytes = sum(t.numel() * t.element_size() for t in weights)
    big = torch.ones(512 * 1024 * 1024 // 4, dtype=torch.float32)
    rng = random.Random(0)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(100, 16000) for _ in range(n)]

    def generate(prompts: list[list[int]], tokens: int) -> None:
        llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))

    def timed(prompt: list[int], tokens: int) -> float:
        start = time.perf_counter()
        generate([prompt], tokens)
        return time.perf_counter() - start

    reads = step_reads(model, model_dir) if args.long_context else {}
    read_bytes = {n: sum(t.numel() * t.element_size() for t in ts) for n, ts in reads.items()}
    timed(fresh(64), 8)  # warm-up
    rows: list[dict[str, float]] = []
    for r in range(args.rounds):
        row = {"ceiling_gb_s": bandwidth_gb_s()}
        row["sustained_gb_s"] = read_rate_gb_s([big], SUSTAINED_S)
        row["weights_gb_s"] = read_rate_gb_s(weights, WEIGHTS_S)
        engine.steps.clear()
        short = timed(fresh(32), 1)
        row["decode_tok_s"] = args.tokens / (timed(fresh(32), 1 + args.tokens) - short)
        steps = [s.duration_s for s in engine.steps if s.prefill_tokens == 0]
        row["step_tok_s"] = 1 / statistics.median(steps)
        for context, tensors in reads.items():
            row[f"read_ctx{context}_tok_s"] = (
                read_rate_gb_s(tensors, WEIGHTS_S) * 1e9 / read_bytes[context]
            )
        if reads:  # engine_bench's figures, keyed decode_ctx64_tok_s and decode_ctx4000_tok_s
            row |= decode_at_contexts(generate, fresh)
        row["ceiling_after_gb_s"] = bandwidth_gb_s()
        rows.append(row)
        print(
            f"round {r + 1}: "
            + ", ".join(f"{k} {v:.3g}" for k, v in row.items())
            + f"  (load {os.getloadavg()[0]:.1f})",
            flush=True,
        )

    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"

    def ceiling_tok_s(row: dict[str, float]) -> float:
        return (row["ceiling_gb_s"] + row["ceiling_after_gb_s"]) / 2 * 1e9 / per_token

    print()
    print(machine_line())
    print(
        f"{args.model}, bf16; {per_token / 1e6:.1f} MB a decode token, of which "
        f"{weight_bytes / 1e6:.1f} MB the weights the step streams; {args.rounds} rounds; "
        "ratios within rounds, median (min-max)"
    )
    figures = {
        "ceiling GB/s (engine_bench's)": [r["ceiling_gb_s"] for r in rows],
        "sustained read GB/s": [r["sustained_gb_s"] for r in rows],
        "read of the weights GB/s": [r["weights_gb_s"] for r in rows],
        "decode tok/s (generate)": [r["decode_tok_s"] for r in rows],
        "decode tok/s (median step)": [r["step_tok_s"] for r in rows],
        "sustained / ceiling": [r["sustained_gb_s"] / r["ceiling_gb_s"] for r in rows],
        "weights read / ceiling": [r["weights_gb_s"] / r["ceiling_gb_s"] for r in rows],
        "decode / ceiling (the floor's figure)": [
            r["decode_tok_s"] / ceiling_tok_s(r) for r in rows
        ],
        "median step / ceiling": [r["step_tok_s"] / ceiling_tok_s(r) for r in rows],
        "decode / weights read": [
            r["decode_tok_s"] / (r["weights_gb_s"] * 1e9 / per_token) for r in rows
        ],
        "median step / weights read": [
            r["step_tok_s"] / (r["weights_gb_s"] * 1e9 / per_token) for r in rows
        ],
    }
    if reads:
        short, long = reads
        figures |= {
            f"read at {short} tok/s": [r[f"read_ctx{short}_tok_s"] for r in rows],
            f"read at {long:,} tok/s": [r[f"read_ctx{long}_tok_s"] for r in rows],
            f"decode at {short} tok/s": [r[f"decode_ctx{short}_tok_s"] for r in rows],
            f"decode at {long:,} tok/s": [r[f"decode_ctx{long}_tok_s"] for r in rows],
            f"read: {long:,} / {short}": [
                r[f"read_ctx{long}_tok_s"] / r[f"read_ctx{short}_tok_s"] for r in rows
            ],
            f"decode: {long:,} / {short} (item 3)": [
                r[f"decode_ctx{long}_tok_s"] / r[f"decode_ctx{short}_tok_s"] for r in rows
            ],
            "decode's ratio / read's ratio": [
                r[f"decode_ctx{long}_tok_s"]
                / r[f"decode_ctx{short}_tok_s"]
                / (r[f"read_ctx{long}_tok_s"] / r[f"read_ctx{short}_tok_s"])
                for r in rows
            ],
        }
    for name, values in figures.items():
        print(f"{name:40}{spread(values):>28}")
    if reads:
        predicted = bytes_per_decode_token(model_dir, short) / bytes_per_decode_token(
            model_dir, long
        )
        print(
            f"plan's bytes predict {long:,} / {short} = {predicted:.3f} "
            f"(read: {read_bytes[short] / 1e6:.1f} and {read_bytes[long] / 1e6:.1f} MB a step)"
        )


if __name__ == "__main__":
    main()
