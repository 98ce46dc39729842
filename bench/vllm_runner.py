"""Run the engine benchmark protocol on vLLM's offline API; prints one JSON line.

Run with vLLM's own venv (make peers): .venv-peers/bin/python bench/vllm_runner.py MODEL_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from workload import run_protocol


def main() -> None:
    from vllm import LLM, SamplingParams, TokensPrompt

    model, quick = sys.argv[1], "--quick" in sys.argv
    llm = LLM(model=model, dtype="bfloat16", max_model_len=4096, enable_prefix_caching=True, seed=0)

    def generate(prompts: list[list[int]], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

    result = run_protocol(generate, quick=quick)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
