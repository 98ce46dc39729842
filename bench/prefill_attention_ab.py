"""One layer's causal prefill attention: the AMX tile kernel beside torch's SDPA, interleaved.

The ``small`` model's shapes (16 query heads over 4 KV heads, head 64) by default, bf16, a
fresh chunk of ``--tokens`` queries (``--cached`` keys before it): the C kernel
(``prefill_attention=amx``, engine/csrc/decode_ops.c) and ``F.scaled_dot_product_attention``
as the engine calls it (head-major queries, GQA, is_causal or a bottom-right mask), each
followed by the [tokens, heads * dim] layout o_proj reads. Reports the median CPU time
(``time.process_time``: at one thread the work itself, which a loaded neighbour inflates far
less than wall time) and wall time, and amx over SDPA within rounds.

    .venv/bin/python bench/prefill_attention_ab.py --threads 1 --rounds 10

``--ab-source FILE`` adds the same kernel built from another ``decode_ops.c`` (e.g. an earlier
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
    if ops is None or not ops.prefill_amx:
        raise SystemExit("no AMX tiles here (CPU, compiler or kernel): nothing to compare")
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

    def amx() -> None:
        out = ops.prefill_attention(q, keys, values, cached, scale)
        assert out is not None
        out.view(n, -1)

    candidates: dict[str, Callable[[], None]] = {"sdpa": sdpa, "amx": amx}
    if args.ab_source:
        other = _build(args.ab_source)

        def amx_ab() -> None:
            out = other.prefill_attention(q, keys, values, cached, scale)
            assert out is not None
            out.view(n, -1)

        candidates["amx-ab-source"] = amx_ab
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
            f"  {name:5} CPU {c * 1e3:7.1f} ms ({min(cpu[name]) * 1e3:.1f}-"
            f"{max(cpu[name]) * 1e3:.1f}), {flop / c / 1e12:.2f} TFLOP/s of CPU time; "
            f"wall {statistics.median(wall[name]) * 1e3:7.1f} ms"
        )
    by_cpu = [a / s for a, s in zip(cpu["amx"], cpu["sdpa"], strict=True)]
    by_wall = [a / s for a, s in zip(wall["amx"], wall["sdpa"], strict=True)]
    print(
        f"  amx over sdpa within rounds: CPU {statistics.median(by_cpu):.3f}x "
        f"({min(by_cpu):.3f}-{max(by_cpu):.3f}), wall {statistics.median(by_wall):.3f}x"
    )
    if args.ab_source:
        by_cpu = [a / b for a, b in zip(cpu["amx"], cpu["amx-ab-source"], strict=True)]
        print(
            f"  amx over amx-ab-source within rounds: CPU {statistics.median(by_cpu):.3f}x "
            f"({min(by_cpu):.3f}-{max(by_cpu):.3f})"
        )


def _build(source: str) -> native.NativeOps:
    """The C kernels compiled from ``source``; they must have the AMX prefill attention."""
    ops = build_ops(source)
    if not ops.prefill_amx:
        raise SystemExit("--ab-source: that build has no AMX prefill attention here")
    return ops


if __name__ == "__main__":
    main()
