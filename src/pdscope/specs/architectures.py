"""The decoder architectures pdscope's engine runs, in one registry that the engine's loader,
`make-model` and the specs share.

A new architecture is one model file in the engine plus one entry here. `specs/models.py`
also reads architectures the engine does not run (MoE, MLA, Gemma); their facts stay there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Architecture:
    name: str  # config.json's "architectures" entry, e.g. "Qwen2ForCausalLM"
    model_type: str  # config.json's "model_type", and make-model's --arch
    # True: q/k/v carry biases whatever "attention_bias" says (Qwen2's attention always has
    # them); False: only when "attention_bias" is true.
    qkv_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k (Qwen3)
    # How "sliding_window" applies: "none" (no window), "every_layer" (Mistral: one window on
    # all layers), "per_layer" (Qwen: switched on per layer by "use_sliding_window",
    # "max_window_layers" or "layer_types"; the engine refuses such layers).
    window: str = "none"
    # Fields a config.json of this architecture carries besides the common ones and the window
    # (make-model writes them).
    config_extras: tuple[tuple[str, Any], ...] = ()


ARCHITECTURES: dict[str, Architecture] = {
    a.model_type: a
    for a in (
        Architecture(
            "LlamaForCausalLM",
            "llama",
            config_extras=(("attention_bias", False), ("mlp_bias", False), ("pretraining_tp", 1)),
        ),
        Architecture("MistralForCausalLM", "mistral", window="every_layer"),
        Architecture("Qwen2ForCausalLM", "qwen2", qkv_bias=True, window="per_layer"),
        # Qwen2's q/k/v biases are implied by its architecture; Qwen3 says it has none.
        Architecture(
            "Qwen3ForCausalLM",
            "qwen3",
            qk_norm=True,
            window="per_layer",
            config_extras=(("attention_bias", False),),
        ),
    )
}
# Architectures only the specs read whose attention always has q/k/v biases.
_SPEC_ONLY_QKV_BIAS = frozenset({"qwen2_moe"})


def architecture_of(config: Mapping[str, Any]) -> Architecture | None:
    """The first of config.json's "architectures" that the engine runs, if any."""
    by_name = {a.name: a for a in ARCHITECTURES.values()}
    return next((by_name[n] for n in config.get("architectures") or [] if n in by_name), None)


def supported_names() -> list[str]:
    return [a.name for a in ARCHITECTURES.values()]


def has_qkv_bias(config: Mapping[str, Any]) -> bool:
    """Whether q/k/v projections carry biases, by the one rule the loader, make-model and the
    parameter count share."""
    model_type = str(config.get("model_type", ""))
    arch = architecture_of(config) or ARCHITECTURES.get(model_type)
    implied = arch.qkv_bias if arch is not None else model_type in _SPEC_ONLY_QKV_BIAS
    return implied or bool(config.get("attention_bias"))


def engine_window(config: Mapping[str, Any]) -> int | None:
    """The attention window the engine applies to every layer (None: full attention).

    Raises ValueError where the config switches a window on for some layers only: the engine
    would attend over the wrong keys."""
    arch = architecture_of(config)
    if arch is not None and arch.window == "every_layer":
        return config.get("sliding_window")
    # Qwen configs carry sliding_window but switch it on per layer; real Qwen2.5/3
    # checkpoints leave it off.
    sliding = config.get("use_sliding_window") or any(
        kind == "sliding_attention" for kind in config.get("layer_types") or []
    )
    if sliding:
        name = arch.name if arch is not None else config.get("model_type")
        raise ValueError(
            f"{name} with sliding-window layers is not supported (use_sliding_window / layer_types)"
        )
    return None


def head_dim(config: Mapping[str, Any]) -> int:
    """config.json's "head_dim", else hidden_size / num_attention_heads."""
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def num_kv_heads(config: Mapping[str, Any]) -> int:
    """config.json's "num_key_value_heads", else one per attention head (no GQA)."""
    return int(config.get("num_key_value_heads") or config["num_attention_heads"])
