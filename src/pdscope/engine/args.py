"""EngineArgs: the engine's knobs, named as vLLM names them. No torch import.

A field with a ``help`` in its metadata is also a `pdscope serve` flag (the field's name with
dashes; ``flags`` gives other spellings, ``cli_type`` the type the flag parses), so a new knob is
one line here. Fields without ``help`` are not offered on the command line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def knob(default: Any, help: str, **cli: Any) -> Any:
    """A field that `pdscope serve` offers as a flag with this help text."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class EngineArgs:
    """Engine settings, named as vLLM names them (plus ``kv_cache_memory`` for CPU)."""

    model: str = knob(
        "small", "Checkpoint directory, or a built-in model: tiny, small (created on first use)."
    )
    max_num_batched_tokens: int = knob(2048, "Token budget of one engine step.")
    max_num_seqs: int = knob(64, "Most requests running at once.")
    max_model_len: int | None = knob(  # default: the model's max_position_embeddings
        None, "Prompt + output tokens per request."
    )
    block_size: int = knob(16, "Tokens per KV block.")
    enable_prefix_caching: bool = knob(
        True,
        "Reuse KV of shared prefixes.",
        flags=("--enable-prefix-caching/--no-enable-prefix-caching",),
    )
    enable_chunked_prefill: bool = knob(
        True,
        "Split long prompts across steps, mixed with decodes.",
        flags=("--enable-chunked-prefill/--no-chunked-prefill",),
    )
    # auto: the checkpoint's torch_dtype (float32 or bfloat16)
    dtype: str = knob("auto", "auto, float32 or bfloat16.")
    kv_cache_memory: int | str = knob(  # KV pool size on CPU
        "1GiB", "KV pool size on CPU, e.g. 2GiB.", cli_type=str
    )
    # KV pool on CUDA: this fraction of memory minus use
    gpu_memory_utilization: float = knob(
        0.9, "Fraction of GPU memory for weights + KV pool (CUDA)."
    )
    device: str = "auto"  # auto: cuda when torch sees one, else cpu
    seed: int = knob(0, "Engine seed.")
    # auto: each machine-dependent path timed at load (cached); or force some, e.g.
    # "linear=c,prefill_attention=sdpa,decode_math=native,decode_ops=c,threads=bound"
    # (engine/kernels.py)
    kernels: str = knob(
        "auto",
        "auto (timed at start-up, cached per CPU), or force paths, e.g. "
        "linear=c,prefill_attention=sdpa,decode_math=native,decode_ops=c,threads=bound.",
    )

    def __post_init__(self) -> None:
        """Refuse what no engine can run, before a model is loaded."""
        problems = [
            f"{name} must be >= 1, got {value}"
            for name in ("max_num_batched_tokens", "max_num_seqs", "block_size")
            if (value := getattr(self, name)) < 1
        ]
        if self.max_model_len is not None and self.max_model_len < 1:
            problems.append(f"max_model_len must be >= 1 (or unset), got {self.max_model_len}")
        if not 0 < self.gpu_memory_utilization <= 1:
            problems.append(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if problems:
            raise ValueError("; ".join(problems))
