"""Load a Hugging Face checkpoint directory: config, safetensors weights (sharded), tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from pdscope.engine.model import CausalLM, ModelConfig
from pdscope.specs.models import read_config as specs_read_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file or field."""


def resolve_dtype(name: str) -> torch.dtype:
    key = DTYPE_ALIASES.get(name, name)
    if key not in DTYPES:
        raise CheckpointError(f"unsupported dtype {name!r}; use float32 or bfloat16")
    return DTYPES[key]


def read_config(path: Path) -> dict[str, Any]:
    """The checkpoint's config.json, read by the specs' one reader (a ``SpecError``, which is
    a ``ValueError``, names what is wrong)."""
    return specs_read_config(path)


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise CheckpointError(f"{path} is missing shard(s) {', '.join(missing)}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} has no *.safetensors weights")
    return files


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in _weight_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    tensors[name] = f.get_tensor(name)
        except (SafetensorError, OSError) as exc:  # truncated, not safetensors, unreadable
            raise CheckpointError(f"cannot read {file}: {exc}") from None
    return tensors


def load_model(path: Path, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """Build the model and copy checkpoint weights into it, fusing qkv and gate/up projections.

    Every parameter must be filled: a missing tensor is an error naming it, not a silent zero.
    The weights are left as stored: apply_kernels packs or copies each for the paths chosen
    (packed here, they were packed again there whenever the weights moved to huge pages or
    a path wanted another layout).
    """
    config = ModelConfig.from_hf(read_config(path))
    tensors = _read_tensors(path)
    # safetensors hands out tensors over one mapping of each file, which any one of them keeps
    # whole and resident (the 1.1B-parameter model's 2.2 GB stayed mapped for its embedding and
    # norms after every other weight had been copied), and whose pages the kernel may drop
    # and read back from disk mid-step: each one kept as read is copied into memory of its own
    mapped = {t.data_ptr() for t in tensors.values()}
    prefix = "model." if any(n.startswith("model.") for n in tensors) else ""

    def take(name: str) -> torch.Tensor:
        key = prefix + name if name != "lm_head.weight" else name
        if key not in tensors:
            raise CheckpointError(f"checkpoint {path} lacks tensor '{key}'")
        return tensors.pop(key)

    with torch.device("meta"):
        model = CausalLM(config, max_positions=config.max_position_embeddings)
    state: dict[str, torch.Tensor] = {
        "embed_tokens.weight": take("embed_tokens.weight"),
        "norm.weight": take("norm.weight"),
    }
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    else:
        state["lm_head.weight"] = take("lm_head.weight")
    for i in range(config.num_layers):
        p = f"layers.{i}."
        state[p + "self_attn.qkv_proj.weight"] = torch.cat(
            [take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
        )
        if config.qkv_bias:
            state[p + "self_attn.qkv_proj.bias"] = torch.cat(
                [take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
            )
        state[p + "self_attn.o_proj.weight"] = take(p + "self_attn.o_proj.weight")
        if config.qk_norm:
            state[p + "self_attn.q_norm.weight"] = take(p + "self_attn.q_norm.weight")
            state[p + "self_attn.k_norm.weight"] = take(p + "self_attn.k_norm.weight")
        state[p + "mlp.gate_up_proj.weight"] = torch.cat(
            [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
        )
        state[p + "mlp.down_proj.weight"] = take(p + "mlp.down_proj.weight")
        state[p + "input_layernorm.weight"] = take(p + "input_layernorm.weight")
        state[p + "post_attention_layernorm.weight"] = take(p + "post_attention_layernorm.weight")
    leftover = [n for n in tensors if "rotary_emb" not in n]
    if leftover:
        raise CheckpointError(
            f"checkpoint {path} has tensors this model does not use: "
            f"{', '.join(sorted(leftover)[:5])}"
        )
    expected = model.state_dict()  # on meta: shapes from config.json, no memory
    for name, tensor in state.items():
        if name in expected and tensor.shape != expected[name].shape:
            raise CheckpointError(
                f"checkpoint {path}: '{name}' is {list(tensor.shape)}, but config.json makes "
                f"it {list(expected[name].shape)} (a config that does not match the weights)"
            )
    state = {k: v.to(dtype=dtype, device=device) for k, v in state.items()}
    state = {k: v.clone() if v.data_ptr() in mapped else v for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.init_rope(config.max_position_embeddings, device)  # buffers were built on meta
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    assert not missing, f"parameters left unloaded: {missing}"
    return model.eval()
