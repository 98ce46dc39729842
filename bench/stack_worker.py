"""One stack of the engine benchmark, loaded once, answering rounds (workload.serve_rounds).

    .venv/bin/python bench/stack_worker.py pdscope MODEL_DIR
    .venv/bin/python bench/stack_worker.py transformers MODEL_DIR
    .venv-peers/bin/python bench/stack_worker.py vllm MODEL_DIR   # vLLM's own venv (make peers)

Only the chosen stack is imported, so vLLM's venv never needs pdscope and ours never needs vLLM.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from workload import Generate, serve_rounds

MAX_MODEL_LEN = 4096


def pdscope(model_dir: str) -> Generate:
    from pdscope import LLM, SamplingParams

    llm = LLM(
        model=model_dir,
        dtype="bfloat16",
        kv_cache_memory="2GiB",
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=2048,
        max_num_seqs=64,
        kernels=os.environ.get("PDSCOPE_BENCH_KERNELS", "auto"),  # engine_bench.py's
    )
    print(f"KERNELS {llm.engine.kernels.summary()}", flush=True)

    def generate(prompts: list[list[int]], max_tokens: int) -> None:
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))

    return generate


def transformers(model_dir: str) -> Generate:
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

    return generate


def vllm(model_dir: str) -> Generate:
    if os.environ.get("PDSCOPE_BENCH_NO_AVX512"):  # engine_bench.py --as-cpu avx2
        import torch

        # vLLM picks its kernel build (_C, _C_AVX512, _C_AVX2), attention and matmuls by
        # these questions, which read the CPU itself, not ATEN_CPU_CAPABILITY
        for name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported"):
            setattr(torch.cpu, name, lambda: False)
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(
        model=model_dir,
        dtype="bfloat16",
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=True,
        seed=0,
    )

    def generate(prompts: list[list[int]], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

    return generate


def main() -> None:
    stack, model_dir = sys.argv[1], sys.argv[2]
    loaders = {"pdscope": pdscope, "transformers": transformers, "vllm": vllm}
    if stack not in loaders:
        sys.exit(f"unknown stack {stack!r}; choose one of {', '.join(loaders)}")
    # transformers has no cross-request prefix cache: that figure is not comparable.
    serve_rounds(loaders[stack](model_dir), with_cached_prefix=stack != "transformers")


if __name__ == "__main__":
    main()
