"""One decoder layer's prefill glue, PyTorch ops vs the C kernels, interleaved in one process.

The glue is everything of a layer but its matmuls and attention: the residual adds and norms,
rope and the K/V write, silu(gate) * up. On the PyTorch path (decode_ops=torch) that is ~15
elementwise ops over the whole chunk; under decode_ops=c it is four C calls and one gather of
the chunk's keys back from the cache. Shapes are the ``small`` model's, a 2,000-token chunk.

    .venv/bin/python bench/prefill_glue_ab.py            # torch's thread count
    OMP_NUM_THREADS=1 .venv/bin/python bench/prefill_glue_ab.py --rounds 20
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from engine_bench import machine_line
from pdscope.checkpoint.make_model import default_cache_dir
from pdscope.engine import native
from pdscope.engine.model import _gather_blocks, apply_rope, block_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=2000)
    args = parser.parse_args()
    ops = native.load(default_cache_dir() / "native")
    if ops is None:
        raise SystemExit("the C kernels did not build (a C compiler on PATH or in $CC)")
    gen = torch.Generator().manual_seed(0)
    n, hidden, inter, heads, kvh, dim, bs = args.tokens, 1024, 2816, 16, 4, 64, 16
    bf = torch.bfloat16
    slots = -(-n // bs) * bs
    cache = torch.zeros(2, kvh, slots, dim, dtype=bf)
    qkv = torch.randn(n, (heads + 2 * kvh) * dim, generator=gen).to(bf)
    gate_up = torch.randn(n, 2 * inter, generator=gen).to(bf)
    h = torch.randn(n, hidden, generator=gen).to(bf)
    residual = torch.randn(n, hidden, generator=gen).to(bf)
    weight = torch.ones(hidden, dtype=bf)
    pos = torch.arange(n)
    angles = torch.outer(torch.arange(float(n)), torch.rand(dim // 2, generator=gen))
    cos_t = torch.cat((angles.cos(), angles.cos()), -1)
    sin_t = torch.cat((-angles.sin(), angles.sin()), -1)
    rows = block_rows(torch.arange(slots // bs), kvh, slots // bs)
    qk_width = (heads + kvh) * dim

    def torch_glue() -> None:
        x = residual + h
        F.rms_norm(x, (hidden,), weight, 1e-5)
        cos = cos_t[pos].to(bf).unsqueeze(1)
        sin = sin_t[pos].to(bf).unsqueeze(1)
        qk = apply_rope(qkv[:, :qk_width].view(n, heads + kvh, dim), cos, sin)
        k, v = qk[:, heads:], qkv[:, qk_width:].view(n, kvh, dim)
        cache[0].index_copy_(1, pos, k.transpose(0, 1))
        cache[1].index_copy_(1, pos, v.transpose(0, 1))
        k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
        F.rms_norm(x + h, (hidden,), weight, 1e-5)
        gate, up = gate_up.split(inter, -1)
        F.silu(gate).mul_(up)

    def c_glue() -> None:
        r = residual.clone()  # the C norm adds into the residual in place
        ops.rms_norm(h, weight, 1e-5, residual=r)
        ops.qkv_rope_store(qkv, cache, pos, pos, cos_t, sin_t, heads, None, None, 0.0)
        _gather_blocks(cache, rows, bs)
        ops.rms_norm(h, weight, 1e-5, residual=r)
        ops.silu_mul(gate_up)

    candidates = {"torch": torch_glue, "c": c_glue}
    times: dict[str, list[float]] = {k: [] for k in candidates}
    for fn in candidates.values():
        fn()
    for _ in range(args.rounds):
        for name, fn in candidates.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    print(machine_line())
    print(f"one layer's prefill glue, {n} tokens, {args.rounds} interleaved rounds, ms:")
    for name, ts in times.items():
        q1 = statistics.quantiles(ts, n=4)[0]
        print(
            f"  {name:6} median {statistics.median(ts) * 1e3:7.2f}  lower quartile "
            f"{q1 * 1e3:7.2f}  min {min(ts) * 1e3:7.2f}"
        )
    ratios = [t / c for t, c in zip(times["torch"], times["c"], strict=True)]
    print(f"  torch / c within rounds: median {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
