"""Load a Hugging Face checkpoint directory: config, safetensors weights (sharded), tokenizer."""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import struct
import sys
from dataclasses import dataclass
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


# safetensors' names of the float dtypes a checkpoint's weights come in
_FILE_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
}


@dataclass(frozen=True)
class _Stored:
    """Where one tensor's bytes lie: ``start`` is the byte offset in ``file``; ``dtype`` is
    None where the file's (``dtype_name``) is none a weight comes in."""

    name: str
    file: Path
    dtype_name: str
    shape: tuple[int, ...]
    start: int

    @property
    def dtype(self) -> torch.dtype | None:
        return _FILE_DTYPES.get(self.dtype_name)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _index(path: Path) -> dict[str, _Stored]:
    """Every tensor's place in the weight files, from their headers alone: nothing is read."""
    if sys.byteorder != "little":  # safetensors stores little-endian bytes
        raise CheckpointError("reading safetensors needs a little-endian machine")
    stored: dict[str, _Stored] = {}
    for file in _weight_files(path):
        try:
            # safetensors checks the header against the file (offsets, sizes, its length)
            with safe_open(str(file), framework="pt") as f:
                names = sorted(f.keys())
            with open(file, "rb") as fh:
                (header_len,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(header_len))
        except (SafetensorError, OSError, ValueError) as exc:  # truncated, not safetensors
            raise CheckpointError(f"cannot read {file}: {exc}") from None
        for name in names:
            if name in stored:
                raise CheckpointError(
                    f"checkpoint {path}: tensor '{name}' is in both {stored[name].file.name} "
                    f"and {file.name}"
                )
            entry = header[name]
            start = 8 + header_len + entry["data_offsets"][0]
            stored[name] = _Stored(name, file, entry["dtype"], tuple(entry["shape"]), start)
    return stored


def _joined_shape(parts: list[_Stored]) -> tuple[int, ...] | None:
    """The shape of the parts joined along their first dimension; None where they do not join."""
    if len(parts) == 1:
        return parts[0].shape
    if not all(p.shape for p in parts) or len({p.shape[1:] for p in parts}) > 1:
        return None
    return (sum(p.shape[0] for p in parts), *parts[0].shape[1:])


def _read_into(fd: int, part: _Stored, out: torch.Tensor) -> None:
    """Copy ``part``'s values into ``out`` (contiguous, converted to its dtype) through a
    mapping of its bytes alone, unmapped once copied: its pages leave this process's memory
    with it. (Plain reads, one thread's copy, took 1.5x as long.)"""
    assert part.dtype is not None  # checked before any read
    nbytes = part.numel * part.dtype.itemsize
    # a file already short is refused here; one cut short during the copy would still raise
    # SIGBUS, as safetensors' own mapping would
    if part.start + nbytes > os.fstat(fd).st_size:
        raise CheckpointError(f"cannot read {part.file}: it ends inside a tensor")
    if nbytes == 0:
        return
    base = part.start - part.start % mmap.ALLOCATIONGRANULARITY
    try:
        # ACCESS_COPY: writable to torch (no warning), never written, so never copied
        mm = mmap.mmap(fd, part.start + nbytes - base, offset=base, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as exc:  # cannot map; no address space; cut short just now
        raise CheckpointError(f"cannot read {part.file}: {exc}") from None
    with mm:
        stored = torch.frombuffer(mm, dtype=part.dtype, count=part.numel, offset=part.start - base)
        try:
            out.view(-1).copy_(stored)
        finally:
            # closing unmaps whether or not a tensor still views the pages: none may outlive it
            del stored


def _read_tensor(
    fds: dict[Path, int], parts: list[_Stored], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The parts, concatenated along their first dimension, as one tensor of ``dtype``.

    Each part is copied straight into its place from a mapping of its own bytes: safe_open's
    one mapping of a whole file kept every page read resident beside the copies until the last
    tensor over it was let go (twice the weights at the load's peak), and a fused projection
    was one more copy of its parts (torch.cat).
    """
    shape = _joined_shape(parts)
    assert shape is not None  # checked before any read
    out = torch.empty(shape, dtype=dtype)
    flat = out.view(-1)
    at = 0
    for part in parts:
        _read_into(fds[part.file], part, flat[at : at + part.numel])
        at += part.numel
    return out.to(device)


def load_model(path: Path, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """Build the model and read checkpoint weights into it, fusing qkv and gate/up projections.

    Every parameter must be filled: a missing tensor is an error naming it, not a silent zero.
    Names and shapes are checked against config.json from the files' headers, before any
    weight is read. The weights are left as stored: apply_kernels packs or copies each for the
    paths chosen.
    """
    config = ModelConfig.from_hf(read_config(path))
    stored = _index(path)
    prefix = "model." if any(n.startswith("model.") for n in stored) else ""

    def take(*names: str) -> list[_Stored]:
        keys = [prefix + n if n != "lm_head.weight" else n for n in names]
        for key in keys:
            if key not in stored:
                raise CheckpointError(f"checkpoint {path} lacks tensor '{key}'")
        return [stored.pop(key) for key in keys]

    # each of the model's tensors from its checkpoint tensors, joined along the first dimension
    plan: dict[str, list[_Stored]] = {
        "embed_tokens.weight": take("embed_tokens.weight"),
        "norm.weight": take("norm.weight"),
    }
    if config.tie_word_embeddings:
        stored.pop("lm_head.weight", None)
    else:
        plan["lm_head.weight"] = take("lm_head.weight")
    for i in range(config.num_layers):
        p = f"layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        plan[attn + "qkv_proj.weight"] = take(*(attn + f"{n}_proj.weight" for n in "qkv"))
        if config.qkv_bias:
            plan[attn + "qkv_proj.bias"] = take(*(attn + f"{n}_proj.bias" for n in "qkv"))
        plan[attn + "o_proj.weight"] = take(attn + "o_proj.weight")
        if config.qk_norm:
            plan[attn + "q_norm.weight"] = take(attn + "q_norm.weight")
            plan[attn + "k_norm.weight"] = take(attn + "k_norm.weight")
        plan[mlp + "gate_up_proj.weight"] = take(mlp + "gate_proj.weight", mlp + "up_proj.weight")
        plan[mlp + "down_proj.weight"] = take(mlp + "down_proj.weight")
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            plan[p + norm] = take(p + norm)
    leftover = [n for n in stored if "rotary_emb" not in n]
    if leftover:
        raise CheckpointError(
            f"checkpoint {path} has tensors this model does not use: "
            f"{', '.join(sorted(leftover)[:5])}"
        )
    with torch.device("meta"):
        model = CausalLM(config, max_positions=config.max_position_embeddings)
    expected = model.state_dict()  # on meta: shapes from config.json, no memory
    for name, parts in plan.items():
        shape = _joined_shape(parts)
        if shape is None:
            raise CheckpointError(
                f"checkpoint {path}: the parts of '{name}' do not join: "
                f"{', '.join(str(list(p.shape)) for p in parts)}"
            )
        for part in parts:
            if part.dtype is None:
                raise CheckpointError(
                    f"{part.file}: tensor '{part.name}' is {part.dtype_name}, not one of "
                    f"{', '.join(_FILE_DTYPES)}"
                )
        if name in expected and shape != tuple(expected[name].shape):
            raise CheckpointError(
                f"checkpoint {path}: '{name}' is {list(shape)}, but config.json makes "
                f"it {list(expected[name].shape)} (a config that does not match the weights)"
            )
    with contextlib.ExitStack() as files:
        fds: dict[Path, int] = {}
        for file in sorted({p.file for parts in plan.values() for p in parts}):
            try:
                fds[file] = os.open(file, os.O_RDONLY)
            except OSError as exc:
                raise CheckpointError(f"cannot read {file}: {exc}") from None
            files.callback(os.close, fds[file])
        state = {name: _read_tensor(fds, parts, dtype, device) for name, parts in plan.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.init_rope(config.max_position_embeddings, device)  # buffers were built on meta
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    assert not missing, f"parameters left unloaded: {missing}"
    return model.eval()
