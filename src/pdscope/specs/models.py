"""Model specs: the shape facts of a transformer, read from a Hugging Face ``config.json``.

A :class:`ModelSpec` is built from a config dict (a user's file or a built-in preset, both through
:func:`spec_from_config`) and knows, per layer, how many parameters it holds, how many of them a
single token touches (MoE), how many KV-cache values a token adds, and whether a sliding window
caps that growth. The roofline module turns these counts into bytes, FLOPs and seconds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from pdscope.specs.architectures import has_qkv_bias, num_kv_heads
from pdscope.specs.architectures import head_dim as config_head_dim
from pdscope.specs.errors import SpecError, unknown_name
from pdscope.specs.gguf import is_gguf, read_gguf
from pdscope.specs.precisions import WeightPrecision

# model_type values whose config omits tie_word_embeddings but whose HF class ties by default.
_TIED_BY_DEFAULT = {"gemma", "gemma2", "gemma3_text"}
# model_types that interleave sliding-window and full layers when the config lists neither
# layer_types nor sliding_window_pattern: of every n layers, the last attends in full (Gemma 2
# and gpt-oss alternate; Gemma 3 has five local layers to one global). transformers and
# llama.cpp place them alike.
_WINDOW_PATTERN = {"gemma2": 2, "gpt_oss": 2, "gemma3_text": 6}


@dataclass(frozen=True)
class AttentionShape:
    """Per-layer attention dimensions that set attention FLOPs."""

    num_heads: int
    qk_head_dim: int  # width of one query/key dot product
    v_head_dim: int  # width of one value vector


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer.

    ``kv_values_per_token`` is the number of cache elements one token adds to this layer
    (2 x kv_heads x head_dim for K and V; kv_lora_rank + rope dim for MLA).
    ``window`` is the sliding-window length in tokens, or None for full attention.
    """

    attn_params: int
    mlp_params: int  # all experts, shared experts and router
    mlp_active_params: int  # what one token touches: shared part + top-k experts
    norm_params: int
    kv_values_per_token: int
    window: int | None
    attention: AttentionShape
    # How a single decoding token attends, when that differs: MLA decode runs "absorbed"
    # attention over the latent (query/key width kv_lora_rank + rope, value width kv_lora_rank).
    decode_attention: AttentionShape | None = None
    num_experts: int = 0  # routed experts (0 = dense layer)
    experts_per_token: int = 0
    expert_params: int = 0  # one routed expert

    @property
    def params(self) -> int:
        return self.attn_params + self.mlp_params + self.norm_params

    @property
    def active_params(self) -> int:
        return self.attn_params + self.mlp_active_params + self.norm_params


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    layers: tuple[LayerSpec, ...]
    tie_word_embeddings: bool
    max_position_embeddings: int | None = None
    nominal_params: float | None = None  # a round figure that overrides the weight count
    description: str = ""
    # The checkpoint's own quantization, from config.json's quantization_config: its method
    # (lower case) and weight bits where the config states them; None: stored as torch_dtype.
    quant_method: str | None = None
    quant_bits: int | None = None
    quant_float: bool = False  # compressed-tensors' weights "type": "float" (fp8, not int8)
    # A GGUF's own widths, from the bytes its tensors take (specs/gguf.py): what plan counts
    # where no --dtype is given. None for a config.json or a preset.
    file_weights: WeightPrecision | None = None

    @property
    def quantization(self) -> str | None:
        """The quantization as a reader sees it: "awq, 4 bits"; None when there is none."""
        if self.quant_method is None:
            return None
        return self.quant_method + (f", {self.quant_bits} bits" if self.quant_bits else "")

    @property
    def shipped_dtype(self) -> str | None:
        """The --dtype that counts this checkpoint's weights as it ships them, where one does
        (fp8; AWQ/GPTQ or compressed-tensors at 4 or 8 bits; gpt-oss's MXFP4 experts beside bf16
        attention); None otherwise (unquantized, or a scheme no --dtype states)."""
        method, bits = self.quant_method, self.quant_bits
        if method in ("fp8", "fbgemm_fp8") or (method == "compressed-tensors" and self.quant_float):
            return "fp8" if bits in (None, 8) else None
        if method in ("awq", "gptq", "awq_marlin", "gptq_marlin", "compressed-tensors"):
            return {4: "int4", 8: "int8"}.get(bits or 0)
        if method == "mxfp4" and self.is_moe:
            return "mxfp4"
        return None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """Output projection; shares storage with the embedding when tied."""
        return self.vocab_size * self.hidden_size

    @property
    def is_moe(self) -> bool:
        return any(layer.num_experts for layer in self.layers)

    @property
    def total_params(self) -> float:
        """Every stored parameter (the weights a server must hold in memory)."""
        if self.nominal_params is not None:
            return self.nominal_params
        count = self.embedding_params + sum(layer.params for layer in self.layers)
        count += self.hidden_size  # final norm
        if not self.tie_word_embeddings:
            count += self.lm_head_params
        return count

    @property
    def active_params(self) -> float:
        """Parameters per token by the usual MoE convention (embeddings included, top-k experts)."""
        if self.nominal_params is not None:
            return self.nominal_params
        return self.total_params - sum(layer.params - layer.active_params for layer in self.layers)

    @property
    def params_read_per_token(self) -> float:
        """Parameters one decode step at batch 1 reads from memory.

        All active weights, except that an untied input embedding contributes one row (a gather),
        not the whole table. A nominal model counts all its weights, as the seed article does.
        """
        if self.nominal_params is not None:
            return self.nominal_params
        if self.tie_word_embeddings:
            return self.active_params
        return self.active_params - self.embedding_params + self.hidden_size

    @property
    def expert_params(self) -> float:
        """Parameters of every routed expert (what MXFP4 quantizes in gpt-oss)."""
        return sum(layer.num_experts * layer.expert_params for layer in self.layers)

    @property
    def matmul_params_per_token(self) -> float:
        """Parameters in the matmuls one token runs through (layers only, no embedding/lm_head)."""
        if self.nominal_params is not None:
            head = self.lm_head_params + (0 if self.tie_word_embeddings else self.embedding_params)
            return self.nominal_params - head
        return sum(layer.attn_params + layer.mlp_active_params for layer in self.layers)

    @property
    def kv_values_per_token(self) -> int:
        """KV elements one token adds across all layers, before any window caps growth."""
        return sum(layer.kv_values_per_token for layer in self.layers)

    def kv_values_at_context(self, context_tokens: int) -> int:
        """KV elements held for one sequence of ``context_tokens`` tokens (windows applied)."""
        total = 0
        for layer in self.layers:
            held = context_tokens if layer.window is None else min(context_tokens, layer.window)
            total += layer.kv_values_per_token * held
        return total

    @property
    def sliding_window_layers(self) -> int:
        return sum(1 for layer in self.layers if layer.window is not None)


def _require(config: dict[str, Any], key: str, source: str, purpose: str) -> Any:
    value = config.get(key)
    if value is None:
        raise SpecError(f"{source} lacks '{key}', needed for {purpose}")
    return value


def _positive_int(config: dict[str, Any], key: str, source: str, purpose: str) -> int:
    value = _require(config, key, source, purpose)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SpecError(f"{source}: '{key}' must be a positive integer, got {value!r}")
    return value


def _layer_windows(
    config: dict[str, Any], num_layers: int, model_type: str, source: str
) -> list[int | None]:
    window = config.get("sliding_window")
    if not window or config.get("use_sliding_window") is False:
        return [None] * num_layers
    layer_types = config.get("layer_types")
    if layer_types:
        if len(layer_types) != num_layers:
            raise SpecError(
                f"{source}: 'layer_types' has {len(layer_types)} entries for {num_layers} layers"
            )
        return [window if kind == "sliding_attention" else None for kind in layer_types]
    pattern = config.get("sliding_window_pattern")
    if pattern is None:
        pattern = _WINDOW_PATTERN.get(model_type)
    if pattern is not None:
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 0:
            raise SpecError(
                f"{source}: 'sliding_window_pattern' must be a whole number, got {pattern!r}"
            )
        # 0, as llama.cpp reads it: every layer slides (transformers has no meaning for it)
        return [window if not pattern or (i + 1) % pattern else None for i in range(num_layers)]
    if config.get("use_sliding_window") and config.get("max_window_layers") is not None:
        # Qwen2: layers at index >= max_window_layers use the window.
        first = int(config["max_window_layers"])
        return [window if i >= first else None for i in range(num_layers)]
    return [window] * num_layers


def spec_from_config(
    config: dict[str, Any],
    name: str,
    source: str = "config.json",
    nominal_params: float | None = None,
    description: str = "",
) -> ModelSpec:
    """Build a :class:`ModelSpec` from a Hugging Face config dict.

    Raises :class:`SpecError` naming the missing field when the arithmetic needs one.
    """
    if "text_config" in config and "num_hidden_layers" not in config:
        # A multimodal model's language model, by its own type where it states one (Gemma 3's
        # text_config is a "gemma3_text": its norms, q/k norms and windows are that type's).
        text = config["text_config"]
        config = {**text, "model_type": text.get("model_type") or config.get("model_type", "")}
    model_type = str(config.get("model_type", ""))
    hidden = _positive_int(config, "hidden_size", source, "weight and FLOP counts")
    num_layers = _positive_int(config, "num_hidden_layers", source, "weight and KV counts")
    vocab = _positive_int(config, "vocab_size", source, "embedding size")
    heads = _positive_int(config, "num_attention_heads", source, "attention shape")
    kv_heads = num_kv_heads(config)
    head_dim = config_head_dim(config)
    if hidden % heads and not config.get("head_dim"):
        raise SpecError(
            f"{source}: hidden_size {hidden} is not divisible by {heads} heads and "
            "there is no 'head_dim'"
        )
    tie = config.get("tie_word_embeddings")
    if tie is None:
        tie = model_type in _TIED_BY_DEFAULT
    windows = _layer_windows(config, num_layers, model_type, source)
    norms_per_layer = 4 if model_type.startswith("gemma2") or model_type == "gemma3_text" else 2

    # Attention.
    if config.get("kv_lora_rank"):  # MLA (DeepSeek-V2/V3): the cache holds a compressed latent.
        kv_rank = int(config["kv_lora_rank"])
        q_rank = config.get("q_lora_rank")
        rope = _positive_int(config, "qk_rope_head_dim", source, "MLA KV size")
        nope = _positive_int(config, "qk_nope_head_dim", source, "MLA attention shape")
        v_dim = _positive_int(config, "v_head_dim", source, "MLA attention shape")
        q_width = heads * (nope + rope)
        q_params = hidden * q_width if not q_rank else hidden * q_rank + q_rank + q_rank * q_width
        attn_params = (
            q_params
            + hidden * (kv_rank + rope)  # kv_a_proj_with_mqa
            + kv_rank  # kv_a_layernorm
            + kv_rank * heads * (nope + v_dim)  # kv_b_proj
            + heads * v_dim * hidden  # o_proj
        )
        kv_values = kv_rank + rope
        attention = AttentionShape(heads, nope + rope, v_dim)
        decode_attention = AttentionShape(heads, kv_rank + rope, kv_rank)
    else:
        q_width, kv_width = heads * head_dim, kv_heads * head_dim
        attn_params = hidden * q_width + 2 * hidden * kv_width + q_width * hidden
        decode_attention = None
        if has_qkv_bias(config):
            attn_params += q_width + 2 * kv_width
            if model_type == "gpt_oss":
                attn_params += hidden  # o_proj bias
        if model_type in {"qwen3", "qwen3_moe", "gemma3_text"}:
            attn_params += 2 * head_dim  # q_norm and k_norm
        if model_type == "gpt_oss":
            attn_params += heads  # attention sinks
        kv_values = 2 * kv_heads * head_dim
        attention = AttentionShape(heads, head_dim, head_dim)

    # MLP: dense or mixture of experts.
    inter = config.get("intermediate_size")
    routed = (
        config.get("num_local_experts")
        or config.get("n_routed_experts")
        or config.get("num_experts")
        or 0
    )
    top_k = config.get("num_experts_per_tok") or config.get("experts_per_token") or 0
    moe_inter = config.get("moe_intermediate_size") or inter
    shared = config.get("n_shared_experts") or 0
    # Qwen2-MoE: one shared expert of its own width, behind a sigmoid gate (hidden -> 1).
    shared_inter = config.get("shared_expert_intermediate_size") or 0
    first_dense = config.get("first_k_dense_replace") or 0
    moe_freq = config.get("moe_layer_freq") or config.get("decoder_sparse_step") or 1
    mlp_only = set(config.get("mlp_only_layers") or [])
    if routed and not top_k:
        raise SpecError(f"{source} lacks 'num_experts_per_tok', needed for MoE active parameters")

    layers = []
    for index in range(num_layers):
        is_moe = bool(routed) and index >= first_dense and index % moe_freq == 0
        is_moe = is_moe and index not in mlp_only
        if is_moe:
            if not moe_inter:
                raise SpecError(f"{source} lacks 'moe_intermediate_size', needed for expert size")
            expert = 3 * hidden * moe_inter
            router = hidden * routed
            if model_type == "gpt_oss":
                expert += 2 * moe_inter + hidden  # gate_up's and down's biases
                router += routed  # and the router's
            always = shared * expert + (3 * hidden * shared_inter + hidden if shared_inter else 0)
            mlp_params = routed * expert + always + router
            mlp_active = top_k * expert + always + router
            moe_fields = {
                "num_experts": routed,
                "experts_per_token": top_k,
                "expert_params": expert,
            }
        else:
            if not inter:
                raise SpecError(f"{source} lacks 'intermediate_size', needed for MLP weights")
            mlp_params = mlp_active = 3 * hidden * inter  # gate, up, down
            moe_fields = {}
        layers.append(
            LayerSpec(
                attn_params=attn_params,
                mlp_params=mlp_params,
                mlp_active_params=mlp_active,
                norm_params=norms_per_layer * hidden,
                kv_values_per_token=kv_values,
                window=windows[index],
                attention=attention,
                decode_attention=decode_attention,
                **moe_fields,
            )
        )
    return ModelSpec(
        name=name,
        model_type=model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        layers=tuple(layers),
        tie_word_embeddings=bool(tie),
        max_position_embeddings=config.get("max_position_embeddings"),
        nominal_params=nominal_params,
        description=description,
        **_quantization(config),
    )


def _quantization(config: dict[str, Any]) -> dict[str, Any]:
    """ModelSpec's quant_* fields from a config's quantization_config (empty without one).
    AWQ/GPTQ give "bits" (or "w_bit"); compressed-tensors, vLLM's own format, gives each
    group's weights' "num_bits" and "type"."""
    q = config.get("quantization_config")
    if not isinstance(q, dict) or not isinstance(q.get("quant_method"), str):
        return {}
    bits: Any = q.get("bits", q.get("w_bit"))
    is_float = False
    groups = q.get("config_groups")
    if isinstance(groups, dict):
        weights = [g.get("weights") for g in groups.values() if isinstance(g, dict)]
        weights = [w for w in weights if isinstance(w, dict)]
        if weights:
            bits = weights[0].get("num_bits")
            is_float = weights[0].get("type") == "float"
    if isinstance(bits, str) and bits.isdigit():
        bits = int(bits)
    return {
        "quant_method": q["quant_method"].lower(),
        "quant_bits": bits if isinstance(bits, int) and not isinstance(bits, bool) else None,
        "quant_float": is_float,
    }


@cache
def _presets() -> dict[str, dict[str, Any]]:
    text = resources.files("pdscope.specs").joinpath("data/models.json").read_text()
    return {key: value for key, value in json.loads(text).items() if not key.startswith("_")}


def preset_names() -> list[str]:
    return list(_presets())


def _preset_index() -> dict[str, str]:
    index: dict[str, str] = {}
    for key, entry in _presets().items():
        for alias in [key, *entry.get("aliases", [])]:
            index[alias.lower()] = key
    return index


def load_model(name_or_path: str) -> ModelSpec:
    """A preset by name or alias, a ``config.json`` file, a checkpoint directory, or a GGUF file
    (llama.cpp's and Ollama's format: its shape from its metadata, :mod:`pdscope.specs.gguf`)."""
    key = _preset_index().get(name_or_path.lower())
    if key is not None:
        entry = _presets()[key]
        return spec_from_config(
            entry["config"],
            name=key,
            source=f"preset {key}",
            nominal_params=entry.get("nominal_params"),
            description=entry.get("description", ""),
        )
    path = Path(name_or_path).expanduser()
    if path.is_file() and is_gguf(path):
        found = read_gguf(path)
        spec = spec_from_config(found.config, name=found.name, source=str(path))
        # The metadata must account for the tensors: a key llama.cpp treats as optional (an
        # expert width, biases it infers from the tensors) would otherwise size it wrong.
        if abs(spec.total_params - found.elements) > 1e-3 * found.elements:
            raise SpecError(
                f"{path}: its metadata describes {spec.total_params:,.0f} parameters and its "
                f"tensors hold {found.elements:,}: plan cannot read this file's shape; pass "
                "the model's config.json with --model"
            )
        return replace(spec, file_weights=found.weights)
    if path.is_dir() or path.is_file():
        config = read_config(path)
        path = path / "config.json" if path.is_dir() else path
        return spec_from_config(config, name=path.parent.name or str(path), source=str(path))
    # A path, not a Hugging Face id (org/name), which gets the closest presets below
    if (
        name_or_path.startswith((".", "~", "/"))
        or name_or_path.endswith("/")
        or name_or_path.count("/") > 1
    ):
        raise SpecError(
            f"model {name_or_path!r} is neither a preset nor an existing config.json or "
            "checkpoint directory (pdscope plan --list-models lists the presets)"
        )
    raise unknown_name("model", name_or_path, list(_preset_index()))


def read_config(path: Path) -> dict[str, Any]:
    """A Hugging Face config.json, given the file or its checkpoint directory: the one reader
    of config.json (the engine's loader, make-model and plan all come here)."""
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise SpecError(f"checkpoint directory {path.parent} has no config.json")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecError(f"cannot read {path} as JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise SpecError(f"{path} is not a JSON object")
    return config
