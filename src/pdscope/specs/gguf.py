"""A GGUF file (llama.cpp's and Ollama's format) as plan's arithmetic reads it.

The model's shape comes from the file's metadata, mapped onto the Hugging Face config fields
:func:`~pdscope.specs.models.spec_from_config` reads; the weights' widths come from the bytes
its tensors actually occupy, not from a quantization's nominal average (Q4_K_M's mix of Q4_K and
Q6_K differs from model to model). Only the header is read: the file is memory-mapped by the
`gguf` library, the tensors' data never touched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from pdscope.specs.errors import SpecError
from pdscope.specs.precisions import WeightPrecision

# GGUF architecture -> the config's model_type whose parameter count matches its tensors.
MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
    "gpt-oss": "gpt_oss",
    "gptoss": "gpt_oss",  # Ollama's own converter's name for it
}
# Architectures whose attention llama.cpp windows on some layers (its load_swa_pattern): which
# layers, from the file's pattern, else from the model type's default (specs.models: of every
# n layers the last attends in full, the n transformers uses too). Gemma 2 windows 4,096 tokens
# where the file gives no length; the others only where it gives one. Phi-3's window llama.cpp
# switches off, so there its KV grows with the whole context.
WINDOWED = {"gemma2", "gemma3", "gpt-oss", "gptoss"}
DEFAULT_WINDOW = {"gemma2": 4096}
EMBEDDING, LM_HEAD = "token_embd.weight", "output.weight"
# Tensors of another tower packed into the same file (Ollama's Gemma 3 carries its vision
# encoder, "v.*", and projector, "mm.*"): not the language model a token's decode reads.
TOWER_PREFIXES = ("v.", "mm.", "a.")


@dataclass(frozen=True)
class GgufFile:
    """What a GGUF holds: a config for the model's shape, and each part's bytes and values."""

    config: dict[str, Any]
    name: str  # general.name, else the file's stem
    elements: int  # every tensor's values: the parameters the metadata must account for
    file_type: str  # the dominant tensor type, as llama.cpp names it ("Q4_K", "BF16", ...)
    body_bytes: int  # every tensor but the embedding and the LM head
    body_elements: int
    expert_bytes: int  # the routed experts' tensors among them (*_exps), 0 for a dense model
    expert_elements: int
    embedding_bytes: int
    embedding_elements: int
    head_bytes: int  # the LM head, or the embedding where they are tied
    head_elements: int
    tower_bytes: int = 0  # another tower's tensors in the file (vision, audio): not counted

    @property
    def weights(self) -> WeightPrecision:
        """The file's own widths, each from the bytes its tensors occupy: the layers' mean bits
        per weight (a MoE's routed experts' and the rest's apart: a token reads only some
        experts, and every attention weight), the head's and the embedding's."""
        moe = self.expert_elements > 0 and self.expert_elements < self.body_elements
        rest_bytes = self.body_bytes - self.expert_bytes
        rest_elements = self.body_elements - self.expert_elements
        return WeightPrecision(
            name=f"gguf {self.file_type.lower()}",
            bits_per_weight=8
            * (
                self.expert_bytes / self.expert_elements
                if moe
                else self.body_bytes / self.body_elements
            ),
            rest_bits=8 * rest_bytes / rest_elements if moe else None,
            note=(
                f"as stored in the GGUF: {self.file_type} mostly, {self.total_bytes / 1e9:.3g} GB "
                "in all, each part at the bits its tensors take"
                + (
                    f" (and {self.tower_bytes / 1e9:.3g} GB of a vision or audio tower, not "
                    "counted: a text token does not read it)"
                    if self.tower_bytes
                    else ""
                )
            ),
            head_bits=8 * self.head_bytes / self.head_elements,
            compute={"F32": "fp32", "F16": "fp16"}.get(self.file_type, "bf16"),
            embedding_bits=8 * self.embedding_bytes / self.embedding_elements,
        )

    @property
    def total_bytes(self) -> int:
        tied = self.config.get("tie_word_embeddings")
        return self.body_bytes + self.embedding_bytes + (0 if tied else self.head_bytes)


def is_gguf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def read_gguf(path: Path) -> GgufFile:
    """The model in a GGUF file; SpecError naming what is missing or not understood. Cached
    per file version: parsing a header with a large vocabulary takes seconds."""
    stat = path.stat()
    return _read_gguf(path.resolve(), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=8)
def _read_gguf(path: Path, size: int, mtime_ns: int) -> GgufFile:
    try:
        return _parse(path)
    except SpecError:
        raise
    except Exception as exc:  # a truncated or corrupt header fails in many ways inside gguf
        raise SpecError(f"cannot read {path} as GGUF: {type(exc).__name__}: {exc}") from None


def _one(path: Path, key: str, value: Any) -> Any:
    """A metadata value plan needs as one number: a per-layer array whose entries agree gives
    that entry; one whose entries differ is a shape plan does not model."""
    if not isinstance(value, list):
        return value
    if value and all(v == value[0] for v in value):
        return value[0]
    raise SpecError(f"{path}: {key} differs by layer, which plan does not model")


def _parse(path: Path) -> GgufFile:
    from gguf import GGUFReader  # the format's own reader, from llama.cpp's gguf-py

    reader = GGUFReader(path)

    def field(key: str) -> Any:
        found = reader.get_field(key)
        return None if found is None else _one(path, key, found.contents())

    if (field("split.count") or 1) > 1:
        raise SpecError(
            f"{path} is one part of a split GGUF ({field('split.count')} files): plan reads a "
            "whole file; merge it (llama-gguf-split --merge) or pass its config.json"
        )

    arch = field("general.architecture")
    model_type = MODEL_TYPES.get(str(arch))
    if model_type is None:
        raise SpecError(
            f"{path}: GGUF architecture {arch!r} is not one plan maps "
            f"({', '.join(MODEL_TYPES)}); pass a preset or config.json with --model instead"
        )
    towers = [t for t in reader.tensors if t.name.startswith(TOWER_PREFIXES)]
    tensors = {t.name: t for t in reader.tensors if not t.name.startswith(TOWER_PREFIXES)}
    if EMBEDDING not in tensors:
        raise SpecError(f"{path}: no {EMBEDDING} tensor")
    embedding = tensors[EMBEDDING]
    head = tensors.get(LM_HEAD, embedding)
    config: dict[str, Any] = {
        "model_type": model_type,
        "hidden_size": field(f"{arch}.embedding_length"),
        "num_hidden_layers": field(f"{arch}.block_count"),
        "intermediate_size": field(f"{arch}.feed_forward_length"),
        "num_attention_heads": field(f"{arch}.attention.head_count"),
        "num_key_value_heads": field(f"{arch}.attention.head_count_kv"),
        "head_dim": field(f"{arch}.attention.key_length"),
        "max_position_embeddings": field(f"{arch}.context_length"),
        # the embedding's rows: the vocabulary the model computes over
        "vocab_size": int(embedding.n_elements) // int(field(f"{arch}.embedding_length") or 1),
        "tie_word_embeddings": LM_HEAD not in tensors,
        # q/k/v biases, apart or fused (Ollama's gpt-oss from OpenAI's own checkpoint)
        "attention_bias": bool({"blk.0.attn_q.bias", "blk.0.attn_qkv.bias"} & tensors.keys())
        or None,
        "num_experts": field(f"{arch}.expert_count"),
        "num_local_experts": field(f"{arch}.expert_count"),
        "num_experts_per_tok": field(f"{arch}.expert_used_count"),
        "moe_intermediate_size": field(f"{arch}.expert_feed_forward_length"),
        "shared_expert_intermediate_size": field(f"{arch}.expert_shared_feed_forward_length"),
    }
    config |= _windows(path, reader, str(arch), field)
    config = {k: v for k, v in config.items() if v is not None}
    by_type: dict[str, int] = {}
    body_bytes = body_elements = expert_bytes = expert_elements = 0
    for name, t in tensors.items():
        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + int(t.n_bytes)
        if name not in (EMBEDDING, LM_HEAD):
            body_bytes += int(t.n_bytes)
            body_elements += int(t.n_elements)
        if "_exps." in name:  # ffn_{gate,up,down}_exps: every routed expert's one tensor
            expert_bytes += int(t.n_bytes)
            expert_elements += int(t.n_elements)
    if not body_elements:
        raise SpecError(f"{path}: no layer tensors")
    return GgufFile(
        config=config,
        name=str(field("general.name") or path.stem),
        elements=sum(int(t.n_elements) for t in tensors.values()),
        file_type=max(by_type, key=lambda k: by_type[k]),
        body_bytes=body_bytes,
        body_elements=body_elements,
        expert_bytes=expert_bytes,
        expert_elements=expert_elements,
        embedding_bytes=int(embedding.n_bytes),
        embedding_elements=int(embedding.n_elements),
        head_bytes=int(head.n_bytes),
        head_elements=int(head.n_elements),
        tower_bytes=sum(int(t.n_bytes) for t in towers),
    )


def _windows(path: Path, reader: Any, arch: str, field: Callable[[str], Any]) -> dict[str, Any]:
    """The window and the layers it applies to as config fields, as llama.cpp reads them: the
    file's pattern as one flag a layer (Ollama writes these) or as n, else the default."""
    window = field(f"{arch}.attention.sliding_window") if arch in WINDOWED else None
    if window is None:
        window = DEFAULT_WINDOW.get(arch)
    if not window:
        return {}
    out: dict[str, Any] = {"sliding_window": int(window)}
    found = reader.get_field(f"{arch}.attention.sliding_window_pattern")
    pattern = None if found is None else found.contents()
    if isinstance(pattern, list):
        if not all(isinstance(v, bool | int) for v in pattern):
            raise SpecError(f"{path}: sliding_window_pattern is not one flag a layer")
        out["layer_types"] = ["sliding_attention" if v else "full_attention" for v in pattern]
    elif pattern is not None:
        out["sliding_window_pattern"] = pattern
    return out
