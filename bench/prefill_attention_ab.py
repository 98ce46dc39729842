"""One layer's causal prefill attention: the C kernels beside torch's SDPA and the engine's
blocked attention, interleaved.

The ``small`` model's shapes (16 query heads over 4 KV heads, head 64) by default, bf16, a
fresh chunk of ``--tokens`` queries (``--cached`` keys before it): the C kernel
(engine/csrc/decode_ops.c) with its products on AMX tiles (``amx``, prefill_attention=amx, where
the CPU and Linux grant the tiles) and in AVX-512 BF16 (``c``, prefill_attention=c, where the
build has it), ``F.scaled_dot_product_attention`` as the engine calls it (head-major queries,
GQA, is_causal or a bottom-right mask) and the engine's ``blocked`` attention
(prefill_attention=blocked), each followed by the [tokens, heads * dim] layout o_proj reads.
Reports the median CPU time (``time.process_time``: at one thread the work itself, which a
loaded neighbour inflates far less than wall time) and wall time, and each C kernel over SDPA
and over blocked within rounds.

    .venv/bin/python bench/prefill_attention_ab.py --threads 1 --rounds 10

``--ab-source FILE`` adds the same kernels built from another ``decode_ops.c`` (e.g. an earlier
commit's, from ``git show REV:src/pdscope/engine/csrc/decode_ops.c``), interleaved with the
rest, and reports the current kernel over it within rounds: a kernel change's before/after.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from engine_bench import build_ops, interleaved_times, machine_line
from pdscope.engine import native
from pdscope.engine.model import Attention, ModelConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--cached", type=int, default=0)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as is)")
    parser.add_argument("--ab-source", help="also the kernel built from this C file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ops = native.load(Path(tempfile.gettempdir()) / "pdscope-bench-native")
    kernels = {} if ops is None else {"amx": ops.prefill_amx, "c": ops.prefill_vec}
    kernels = {name: name == "amx" for name, usable in kernels.items() if usable}  # name: tiles
    if not kernels:
        raise SystemExit("neither AMX tiles nor AVX-512 BF16 here: no C kernel to compare")
    n, cached, dim = args.tokens, args.cached, args.head_dim
    total, scale = cached + n, dim**-0.5
    gen = torch.Generator().manual_seed(0)
    q = (torch.randn(args.heads, n, dim, generator=gen) * 0.3).to(torch.bfloat16).transpose(0, 1)
    kv = torch.randn(2, args.kv_heads, total, dim, generator=gen).to(torch.bfloat16)
    keys, values = kv[0], kv[1]
    mask = None
    if cached:
        mask = torch.arange(total)[None] <= torch.arange(cached, total)[:, None]

    def sdpa() -> None:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[0].transpose(0, 1).reshape(n, -1)

    attn = Attention(
        ModelConfig.from_hf(
            {
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 1024,
                "hidden_size": args.heads * dim,
                "intermediate_size": 4 * args.heads * dim,
                "num_hidden_layers": 1,
                "num_attention_heads": args.heads,
                "num_key_value_heads": args.kv_heads,
                "head_dim": dim,
            }
        )
    )

    def blocked() -> None:
        attn._prefill_cpu(q, keys, values, cached).reshape(n, -1)

    def kernel(o: native.NativeOps, tiles: bool) -> Callable[[], None]:
        def run() -> None:
            out = o.prefill_attention(q, keys, values, cached, scale, tiles)
            assert out is not None
            out.view(n, -1)

        return run

    candidates: dict[str, Callable[[], None]] = {"sdpa": sdpa, "blocked": blocked}
    assert ops is not None
    for name, tiles in kernels.items():
        candidates[name] = kernel(ops, tiles)
    if args.ab_source:
        other = build_ops(args.ab_source)
        for name, tiles in kernels.items():
            if other.prefill_amx if tiles else getattr(other, "prefill_vec", False):
                candidates[f"{name}-ab-source"] = kernel(other, tiles)
    wall, cpu = interleaved_times(candidates, args.rounds)
    print(machine_line())
    flop = 4 * args.heads * dim * (n * cached + n * (n + 1) / 2)  # scores and values, causal
    print(
        f"{n} queries after {cached} cached, {args.heads}/{args.kv_heads} heads, dim {dim}, "
        f"{flop / 1e9:.1f} GFLOP; {args.rounds} interleaved rounds, medians:"
    )
    for name in candidates:
        c = statistics.median(cpu[name])
        print(
            f"  {name:16} CPU {c * 1e3:7.1f} ms ({min(cpu[name]) * 1e3:.1f}-"
            f"{max(cpu[name]) * 1e3:.1f}), {flop / c / 1e12:.2f} TFLOP/s of CPU time; "
            f"wall {statistics.median(wall[name]) * 1e3:7.1f} ms"
        )
    for name in kernels:
        for base in ("sdpa", "blocked", f"{name}-ab-source"):
            if base not in candidates:
                continue
            by_cpu = [a / b for a, b in zip(cpu[name], cpu[base], strict=True)]
            by_wall = [a / b for a, b in zip(wall[name], wall[base], strict=True)]
            print(
                f"  {name} over {base} within rounds: CPU {statistics.median(by_cpu):.3f}x "
                f"({min(by_cpu):.3f}-{max(by_cpu):.3f}), wall {statistics.median(by_wall):.3f}x"
            )


if __name__ == "__main__":
    main()
