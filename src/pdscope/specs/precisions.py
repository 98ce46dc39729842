"""Weight and KV-cache precisions (``data/precisions.toml``)."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources

from pdscope.specs.errors import unknown_name


@dataclass(frozen=True)
class WeightPrecision:
    name: str
    bits_per_weight: float  # effective, scales and block headers included
    note: str
    compute: str = "bf16"  # which peak FLOP/s figure prefill runs at
    # The embedding's and LM head's bits where they stay unquantized (AWQ/GPTQ int4, int8 and
    # fp8 checkpoints keep them 16-bit; vLLM does not quantize its LM head); None: as the rest
    # (GGUF's figures are whole-file averages, those tensors included).
    head_bits: float | None = None
    # The bits of the weights outside the MoE routed experts (and the embedding and LM head)
    # where they differ from the experts' bits_per_weight: gpt-oss's MXFP4 experts beside bf16
    # attention, or a MoE GGUF's tensors as stored. None: every weight alike.
    rest_bits: float | None = None
    # A scheme that quantizes only the routed experts (mxfp4): a model without any has nothing
    # it describes, and is refused (roofline.arithmetic.check_weights).
    experts_only: bool = False
    # The input embedding's bits where they differ from the LM head's (a GGUF's token_embd is
    # often quantized further than its output tensor); None: as the head.
    embedding_bits: float | None = None

    def __post_init__(self) -> None:
        if self.experts_only and self.rest_bits is None:
            raise ValueError(f"weight precision {self.name}: experts_only needs rest_bits")

    @property
    def bytes_per_weight(self) -> float:
        return self.bits_per_weight / 8

    @property
    def head_bytes_per_weight(self) -> float:
        return (self.bits_per_weight if self.head_bits is None else self.head_bits) / 8

    @property
    def embedding_bytes_per_weight(self) -> float:
        return (
            self.embedding_bits / 8
            if self.embedding_bits is not None
            else self.head_bytes_per_weight
        )

    @property
    def rest_bytes_per_weight(self) -> float:
        """Bytes a weight outside the routed experts and the embedding and LM head."""
        return (self.bits_per_weight if self.rest_bits is None else self.rest_bits) / 8


@dataclass(frozen=True)
class KVPrecision:
    name: str
    bytes_per_element: int


@cache
def _table() -> dict[str, list[dict]]:
    text = resources.files("pdscope.specs").joinpath("data/precisions.toml").read_text()
    return tomllib.loads(text)


def weight_precisions() -> list[WeightPrecision]:
    return [WeightPrecision(**entry) for entry in _table()["weight"]]


def kv_precisions() -> list[KVPrecision]:
    return [KVPrecision(**entry) for entry in _table()["kv"]]


def get_weight_precision(name: str) -> WeightPrecision:
    aliases = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32"}
    wanted = aliases.get(name.lower(), name.lower())
    for precision in weight_precisions():
        if precision.name == wanted:
            return precision
    raise unknown_name("weight dtype", name, [p.name for p in weight_precisions()])


def get_kv_precision(name: str) -> KVPrecision:
    aliases = {
        "bfloat16": "bf16",
        "float16": "fp16",
        "half": "fp16",
        "float32": "fp32",
        "fp8_e4m3": "fp8",
        "fp8_e5m2": "fp8",
    }
    wanted = aliases.get(name.lower(), name.lower())
    for precision in kv_precisions():
        if precision.name == wanted:
            return precision
    raise unknown_name("KV cache dtype", name, [p.name for p in kv_precisions()])
