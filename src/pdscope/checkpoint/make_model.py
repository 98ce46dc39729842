"""Write deterministic random-weight Hugging Face checkpoints with a real byte-level BPE tokenizer.

The embedded server needs a model on a fresh machine with no download. This module builds one:
a Llama-family decoder (llama, mistral, qwen2 or qwen3 layout) whose weights are random but fixed
by a seed, saved in the exact file layout `transformers` and vLLM load (config.json,
generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
special_tokens_map.json).

The weights carry no knowledge, so the model "says" nothing useful; what matters for latency work
is that its shapes, bytes and FLOPs are those of a real model of that size, and that its tokenizer
splits real text the way a real tokenizer does. The tokenizer is therefore trained (offline, in
well under a second) on English text that every Python 3.11 ships with: the documentation topics
in `pydoc_data.topics`, plus the words of the Unicode character names from `unicodedata`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import shutil
import struct
import sys
import tempfile
import unicodedata
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from pdscope.checkpoint.presets import PRESETS
from pdscope.specs import architectures as registry

__all__ = [
    "ARCHITECTURES",
    "BOS_TOKEN",
    "CHAT_TEMPLATE",
    "DTYPES",
    "EOS_TOKEN",
    "IM_END_TOKEN",
    "IM_START_TOKEN",
    "OVERRIDABLE",
    "PAD_TOKEN",
    "PRESETS",
    "SPECIAL_TOKENS",
    "build_config",
    "default_cache_dir",
    "ensure_model",
    "make_model",
    "num_parameters",
    "resolve_model_path",
    "tensor_shapes",
    "train_tokenizer",
]

# --------------------------------------------------------------------------------------------
# Presets (checkpoint/presets.py) and architectures


# --arch -> the config.json fields naming it, from the registry the engine's loader reads.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    model_type: {"architectures": [a.name], "model_type": model_type}
    for model_type, a in registry.ARCHITECTURES.items()
}

#: Keyword overrides `make_model` accepts on top of a preset.
OVERRIDABLE: frozenset[str] = frozenset(
    {
        "num_hidden_layers",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
        "rope_scaling",
        "rope_theta",
        "sliding_window",
    }
)

#: Supported weight dtypes: name as written in config.json `torch_dtype` -> (torch, safetensors).
DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "float32": (torch.float32, "F32"),
    "bfloat16": (torch.bfloat16, "BF16"),
    "float16": (torch.float16, "F16"),
}

# Special tokens; the trainer places them first, so their ids are 0, 1, 2 in this order.
EOS_TOKEN = "<|endoftext|>"
BOS_TOKEN = EOS_TOKEN
PAD_TOKEN = EOS_TOKEN
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
_EOS_ID = 0
_IM_END_ID = 2

# ChatML. Content may be a string or a list of OpenAI-style parts (only text parts are kept), so
# the template works for both content formats vLLM's chat front end may hand it.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_INIT_STD = 0.02
# Mixed into every tensor seed; changing it changes every weight of every model.
_FORMAT_VERSION = 2
_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json")

# --------------------------------------------------------------------------------------------
# Config


def build_config(
    preset: str = "tiny", arch: str = "llama", dtype: str = "bfloat16", **overrides: Any
) -> dict[str, Any]:
    """Return the complete Hugging Face config.json dict for a preset, arch and overrides.

    Raises ValueError for an unknown preset, arch, dtype or override, and for shapes that do
    not fit together (heads that do not divide, non-positive sizes, a tiny vocabulary).
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; known presets: {', '.join(PRESETS)}")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"unknown model architecture {arch!r}; known architectures: {', '.join(ARCHITECTURES)}"
        )
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    unknown = sorted(set(overrides) - OVERRIDABLE)
    if unknown:
        raise ValueError(
            f"unknown model override(s) {', '.join(unknown)}; "
            f"allowed: {', '.join(sorted(OVERRIDABLE))}"
        )

    p: dict[str, Any] = {**PRESETS[preset], **overrides}
    for key in (
        "num_hidden_layers",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "max_position_embeddings",
    ):
        value = p[key]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")

    hidden, heads, kv_heads = p["hidden_size"], p["num_attention_heads"], p["num_key_value_heads"]
    if heads % kv_heads != 0:
        raise ValueError(
            f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )
    head_dim = p.get("head_dim")
    if head_dim is None:
        if hidden % heads != 0:
            raise ValueError(
                f"hidden_size ({hidden}) must be divisible by num_attention_heads ({heads}) "
                "when head_dim is not given"
            )
        head_dim = hidden // heads
    elif isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
        raise ValueError(f"head_dim must be a positive integer, got {head_dim!r}")
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim ({head_dim}) must be even for rotary embeddings")
    # transformers' LlamaConfig insists on this even when head_dim is explicit.
    if arch == "llama" and hidden % heads != 0:
        raise ValueError(
            f"llama: hidden_size ({hidden}) must be divisible by num_attention_heads ({heads})"
        )
    # Qwen2 loaders (vLLM in particular) derive head_dim from hidden_size / heads.
    if arch == "qwen2" and head_dim * heads != hidden:
        raise ValueError(
            f"qwen2: head_dim ({head_dim}) must equal hidden_size / num_attention_heads "
            f"({hidden} / {heads})"
        )
    min_vocab = 256 + len(SPECIAL_TOKENS)
    if p["vocab_size"] < min_vocab:
        raise ValueError(
            f"vocab_size ({p['vocab_size']}) must be at least {min_vocab} "
            "(256 byte tokens plus the special tokens)"
        )
    sliding_window = p.get("sliding_window")
    spec = registry.ARCHITECTURES[arch]
    if sliding_window is not None:
        if spec.window == "none":
            *others, last = [t for t, a in registry.ARCHITECTURES.items() if a.window != "none"]
            raise ValueError(
                f"{arch} has no sliding window; use arch {', '.join(others)} or {last}"
            )
        if (
            isinstance(sliding_window, bool)
            or not isinstance(sliding_window, int)
            or sliding_window <= 0
        ):
            raise ValueError(f"sliding_window must be a positive integer, got {sliding_window!r}")
    rope_scaling = p.get("rope_scaling")
    if rope_scaling is not None and not isinstance(rope_scaling, Mapping):
        raise ValueError(f"rope_scaling must be a dict or None, got {rope_scaling!r}")

    config: dict[str, Any] = {
        **ARCHITECTURES[arch],
        "vocab_size": p["vocab_size"],
        "hidden_size": hidden,
        "intermediate_size": p["intermediate_size"],
        "num_hidden_layers": p["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": p["max_position_embeddings"],
        "initializer_range": _INIT_STD,
        "rms_norm_eps": float(p["rms_norm_eps"]),
        "rope_theta": float(p["rope_theta"]),
        "rope_scaling": dict(rope_scaling) if rope_scaling is not None else None,
        "attention_dropout": 0.0,
        "tie_word_embeddings": bool(p["tie_word_embeddings"]),
        "bos_token_id": _EOS_ID,
        "eos_token_id": _EOS_ID,
        "pad_token_id": _EOS_ID,
        "use_cache": True,
        "torch_dtype": dtype,
    }
    if spec.window == "every_layer":
        config["sliding_window"] = sliding_window
    elif spec.window == "per_layer":
        # Layers at index >= max_window_layers use the window, so 0 means "all of them".
        config |= {
            "use_sliding_window": sliding_window is not None,
            "sliding_window": sliding_window,
            "max_window_layers": 0 if sliding_window is not None else p["num_hidden_layers"],
        }
    config |= dict(spec.config_extras)
    return config


def tensor_shapes(config: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Return (HF tensor name, shape) for every tensor of the checkpoint, in file order."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config["num_key_value_heads"]
    head_dim = registry.head_dim(config)
    inter = config["intermediate_size"]
    vocab = config["vocab_size"]
    arch = registry.ARCHITECTURES.get(config["model_type"])
    qkv_bias = registry.has_qkv_bias(config)
    qk_norm = arch is not None and arch.qk_norm

    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(config["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        shapes += [
            (pre + "input_layernorm.weight", (hidden,)),
            (pre + "self_attn.q_proj.weight", (heads * head_dim, hidden)),
            (pre + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
            (pre + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
        ]
        if qkv_bias:
            shapes += [
                (pre + "self_attn.q_proj.bias", (heads * head_dim,)),
                (pre + "self_attn.k_proj.bias", (kv_heads * head_dim,)),
                (pre + "self_attn.v_proj.bias", (kv_heads * head_dim,)),
            ]
        if qk_norm:
            shapes += [
                (pre + "self_attn.q_norm.weight", (head_dim,)),
                (pre + "self_attn.k_norm.weight", (head_dim,)),
            ]
        shapes += [
            (pre + "self_attn.o_proj.weight", (hidden, heads * head_dim)),
            (pre + "post_attention_layernorm.weight", (hidden,)),
            (pre + "mlp.gate_proj.weight", (inter, hidden)),
            (pre + "mlp.up_proj.weight", (inter, hidden)),
            (pre + "mlp.down_proj.weight", (hidden, inter)),
        ]
    shapes.append(("model.norm.weight", (hidden,)))
    if not config.get("tie_word_embeddings", False):
        shapes.append(("lm_head.weight", (vocab, hidden)))
    return shapes


def num_parameters(config: Mapping[str, Any]) -> int:
    """Number of stored parameters (tied embeddings counted once) the config implies."""
    return sum(math.prod(shape) for _, shape in tensor_shapes(config))


# --------------------------------------------------------------------------------------------
# Weights


def _tensor_seed(seed: int, name: str) -> int:
    # One generator per tensor, seeded from (seed, name): a tensor's values do not depend on
    # which other tensors exist, e.g. layer 0 is the same whether the model has 2 or 12 layers.
    digest = hashlib.sha256(f"pdscope/{_FORMAT_VERSION}/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _init_tensor(name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    gen = torch.Generator(device="cpu")
    gen.manual_seed(_tensor_seed(seed, name))
    # Sample in float32 then round, so bf16/fp16 weights are the float32 ones rounded.
    values = torch.empty(shape, dtype=torch.float32).normal_(0.0, _INIT_STD, generator=gen)
    if name in ("lm_head.weight", "model.embed_tokens.weight"):
        # Zero output rows for the special tokens: their logit is exactly 0 while the best of
        # thousands of random logits is always above 0, so greedy decoding never emits EOS or a
        # chat marker and streams carry text, as a real model's mostly do. (With tied
        # embeddings this also zeroes their input embedding, which nothing relies on.)
        values[: len(SPECIAL_TOKENS)] = 0
    return values.to(dtype)


def _write_safetensors(
    path: Path,
    shapes: list[tuple[str, tuple[int, ...]]],
    make: Callable[[str, tuple[int, ...]], torch.Tensor],
    dtype: str,
) -> None:
    """Stream tensors into a safetensors file, holding one tensor in memory at a time.

    The format is an 8-byte little-endian header length, a JSON header of dtype, shape and byte
    offsets per tensor, then the raw little-endian tensor bytes back to back. Offsets depend
    only on shapes, so the header is written first and each tensor is made just before its bytes.
    """
    torch_dtype, st_dtype = DTYPES[dtype]
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes:
        nbytes = math.prod(shape) * itemsize
        header[name] = {
            "dtype": st_dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    # Pad with spaces to 8 bytes so the data section starts aligned (what safetensors does too).
    header_bytes += b" " * (-len(header_bytes) % 8)
    if sys.byteorder != "little":
        raise RuntimeError("writing safetensors requires a little-endian machine")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for name, shape in shapes:
            tensor = make(name, shape)
            if tensor.dtype != torch_dtype or tuple(tensor.shape) != shape:
                raise AssertionError(f"{name}: made {tensor.dtype} {tuple(tensor.shape)}")
            f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)


# --------------------------------------------------------------------------------------------
# Tokenizer

_HEX_SUFFIX = re.compile(r"-[0-9A-F]{4,6}$")


def _training_corpus() -> Iterator[str]:
    """Text every Python 3.11 has on disk: no download, same on each machine with that Python.

    pydoc's topics are real English prose and code about Python. They run out of new words at
    ~9k BPE tokens, so the distinct words of the Unicode character names (fixed by the Unicode
    version of the interpreter, 14.0.0 for all 3.11.x) come after, once each, so they only fill
    the tail of larger vocabularies.
    """
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield topics[key]
    words: set[str] = set()
    for cp in range(0x110000):
        name = unicodedata.name(chr(cp), "")
        # Skip the ~100k generated names like "CJK UNIFIED IDEOGRAPH-4E00": hex noise, no words.
        if name and not _HEX_SUFFIX.search(name):
            words.update(name.lower().split())
    yield " ".join(sorted(words))


def train_tokenizer(vocab_size: int) -> str:
    """Train a byte-level BPE tokenizer with exactly `vocab_size` tokens; return tokenizer.json.

    Special tokens take ids 0..2 (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`). If the corpus
    runs out of merges before `vocab_size`, the rest is filled with `<|reserved_N|>` special
    tokens, so `len(tokenizer) == vocab_size` always. Deterministic: the same vocab_size gives
    the same JSON text. Uncached; see `_cached_tokenizer_json`.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=0,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_training_corpus(), trainer=trainer)
    missing = vocab_size - tokenizer.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        tokenizer.add_special_tokens(
            [AddedToken(f"<|reserved_{i}|>", special=True) for i in range(missing)]
        )
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != vocab_size:
        raise AssertionError(f"trained tokenizer has {size} tokens, wanted {vocab_size}")
    ids = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
    if ids != [0, 1, 2]:
        raise AssertionError(f"special token ids are {ids}, expected [0, 1, 2]")
    return tokenizer.to_str()


@functools.lru_cache(maxsize=8)
def _cached_tokenizer_json(vocab_size: int) -> str:
    return train_tokenizer(vocab_size)


def _tokenizer_config(model_max_length: int) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
        "add_bos_token": False,
        "add_eos_token": False,
        # Byte-level BPE decodes exactly; HF's space clean-up would break the round trip.
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }


def _special_tokens_map() -> dict[str, Any]:
    return {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
    }


# --------------------------------------------------------------------------------------------
# Public entry points


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def make_model(
    out_dir: str | Path,
    preset: str = "tiny",
    arch: str = "llama",
    dtype: str = "bfloat16",
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Write a random-weight checkpoint into `out_dir` (created if missing) and return its path.

    `overrides` replace preset fields; allowed keys are in `OVERRIDABLE`. The output is a pure
    function of the arguments: the same arguments give byte-identical files. Peak memory is
    about one tensor (the embedding: vocab × hidden × 4 bytes), not the whole model.
    """
    config = build_config(preset, arch, dtype, **overrides)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    torch_dtype = DTYPES[dtype][0]
    # Refused before anything is written: a shape too large for the disk would leave a
    # config without its weights.
    one, two = ({**config, "num_hidden_layers": n} for n in (1, 2))  # O(1) in the layers
    per_layer = num_parameters(two) - num_parameters(one)
    params = num_parameters(one) + per_layer * (config["num_hidden_layers"] - 1)
    weight_bytes = params * torch_dtype.itemsize
    existing = next(p for p in (out, *out.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    if weight_bytes > free:
        raise ValueError(
            f"the weights would take {weight_bytes / 1e9:,.1f} GB; {existing} has "
            f"{free / 1e9:,.1f} GB free"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cannot create {out}: {exc.strerror or exc}") from None

    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": _EOS_ID,
            # Stop on the end of a ChatML turn as well as on end of text.
            "eos_token_id": [_EOS_ID, _IM_END_ID],
            "pad_token_id": _EOS_ID,
        },
    )
    _write_safetensors(
        out / "model.safetensors",
        tensor_shapes(config),
        lambda name, shape: _init_tensor(name, shape, seed, torch_dtype),
        dtype,
    )
    (out / "tokenizer.json").write_text(
        _cached_tokenizer_json(config["vocab_size"]), encoding="utf-8"
    )
    _write_json(out / "tokenizer_config.json", _tokenizer_config(config["max_position_embeddings"]))
    _write_json(out / "special_tokens_map.json", _special_tokens_map())
    return out


def default_cache_dir() -> Path:
    """`$PDSCOPE_CACHE` if set (and non-empty), else `~/.cache/pdscope`."""
    env = os.environ.get("PDSCOPE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pdscope"


def _is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in _MODEL_FILES)


def ensure_model(preset: str) -> Path:
    """Return `<cache>/models/<preset>-v<format>`, built (llama, bf16, seed 0) on first use.

    The model is written into a temporary sibling directory and renamed into place, so an
    interrupted build never leaves a half-written model at the final path. Concurrent callers
    may both build; the first rename wins and the loser's copy is discarded.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; known presets: {', '.join(PRESETS)}")
    models_dir = default_cache_dir() / "models"
    # The format version is in the name, so a changed generator never reuses a stale build.
    final = models_dir / f"{preset}-v{_FORMAT_VERSION}"
    if _is_complete(final):
        return final
    models_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{preset}.tmp-", dir=models_dir))
    try:
        make_model(tmp, preset=preset)
        if final.exists() and not _is_complete(final):
            # Not something we wrote (our renames are atomic): a stray or damaged directory.
            shutil.rmtree(final)
        try:
            tmp.rename(final)
        except OSError:
            if not _is_complete(final):
                raise
            # Another process finished first; its copy is byte-identical to ours.
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def resolve_model_path(name_or_path: str) -> Path:
    """Map a preset name ("tiny", "small") or an existing checkpoint directory to a path.

    Raises FileNotFoundError when it is neither.
    """
    if name_or_path in PRESETS:
        return ensure_model(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    raise FileNotFoundError(
        f"model {name_or_path!r} is neither a preset nor an existing directory "
        f"(presets: {', '.join(PRESETS)})"
    )
