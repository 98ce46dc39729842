"""A Llama-family decoder in plain PyTorch with paged attention.

Covers LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (q/k/v bias) and Qwen3ForCausalLM
(per-head q/k RMSNorm). Projections are fused (qkv, gate_up) so a decode step launches few ops.

Tokens of one step arrive flattened: first one token per decoding sequence, then the chunks of
the prefilling sequences. K/V for every token is written into the paged cache first; attention
then reads keys and values from the cache through each sequence's block table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# Decode batches up to this many sequences do attention math in float32 on CPU (see _decode).
_FLOAT32_DECODE_MAX_SEQS = 4

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ModelConfig:
        archs = config.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or config.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ):
            if not config.get(key):
                raise ValueError(f"config.json lacks '{key}'")
        heads = config["num_attention_heads"]
        window = config.get("sliding_window")
        if config.get("use_sliding_window") is False:
            window = None
        return cls(
            architecture=arch,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=config.get("rope_theta", 10000.0),
            rope_scaling=config.get("rope_scaling"),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(config.get("attention_bias")),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=window if arch == "MistralForCausalLM" else None,
        )

    @property
    def kv_bytes_per_token_per_element(self) -> int:
        """KV elements one token adds across all layers (multiply by the dtype size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies, with Llama 3's frequency-dependent scaling when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


@dataclass
class AttentionBatch:
    """Where one step's tokens go in the cache and which keys each one sees.

    ``slot_mapping[t]`` is the flat cache slot (block * block_size + offset) for token ``t``.
    The first ``num_decode`` tokens are decodes (one per sequence): ``decode_slots`` [D, S] lists
    each one's context slots, padded, with ``decode_mask`` [D, S] True for real keys.
    ``prefills`` lists, per prefilling sequence, (first token index, chunk length, tokens already
    cached before the chunk, slots of the whole context [cached + chunk]).
    """

    slot_mapping: torch.Tensor
    num_decode: int
    decode_slots: torch.Tensor | None
    decode_mask: torch.Tensor | None
    prefills: list[tuple[int, int, int, torch.Tensor]]


class Linear(nn.Linear):
    """nn.Linear that can hold its weight pre-packed in oneDNN's blocked layout on CPU.

    Plain ``F.linear`` on a bf16 CPU tensor re-lays the weight out on every call, which halves
    the bandwidth a decode step gets (profiled: 25 GB/s plain vs 33 GB/s packed on 2 cores).
    """

    packed: torch.Tensor | None = None

    def pack(self) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def pack_linears(model: nn.Module) -> int:
    """Pack every :class:`Linear` of a bf16 CPU model; returns how many were packed."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.dtype == torch.bfloat16:
            module.pack()
            count += 1
    return count


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves (the Hugging Face layout): x [T, heads, dim], cos/sin [T, 1, dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.qkv_proj = Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.qkv_bias)
        self.o_proj = Linear(self.q_size, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.window = c.sliding_window
        self.scale = c.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: AttentionBatch,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        # kv_cache: [2, kv_heads, num_slots, head_dim]. Heads outermost, so a gather of slots is
        # already [kv_heads, tokens, dim]: the layout attention's batched matmuls take as is.
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        k_cache.index_copy_(1, batch.slot_mapping, k.transpose(0, 1))
        v_cache.index_copy_(1, batch.slot_mapping, v.transpose(0, 1))

        out = torch.empty_like(q)
        d = batch.num_decode
        if d:
            out[:d] = self._decode(q[:d], k_cache, v_cache, batch)
        for start, length, cached, slots in batch.prefills:
            out[start : start + length] = self._prefill(
                q[start : start + length],
                k[start : start + length],
                v[start : start + length],
                cached,
                slots,
                k_cache,
                v_cache,
            )
        return self.o_proj(out.view(tokens, self.q_size))

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        """All decoding sequences at once: one query each against its padded context.

        Queries are grouped by KV head ([kv_heads, D, group, dim]) so each KV head serves its
        whole query group in one matmul, never repeated in memory.
        """
        d, group = q.shape[0], self.num_heads // self.num_kv_heads
        width = batch.decode_slots.shape[1]
        # index_select on flat slots: advanced indexing with a 2-D index is ~20x slower on CPU.
        flat = batch.decode_slots.view(-1)
        shape = (self.num_kv_heads, d, width, self.head_dim)
        # On CPU, bf16 batched matmuls this small cost more in fixed overhead than converting a
        # few sequences' context to float32; past a few sequences the conversion costs more.
        dtype = k_cache.dtype
        if k_cache.device.type == "cpu" and d <= _FLOAT32_DECODE_MAX_SEQS:
            dtype = torch.float32
        keys = k_cache.index_select(1, flat).view(shape).to(dtype)  # [kvh, D, S, dim]
        values = v_cache.index_select(1, flat).view(shape).to(dtype)
        q = q.to(dtype).view(d, self.num_kv_heads, group, self.head_dim).transpose(0, 1)
        scores = torch.matmul(q, keys.transpose(-1, -2)).float() * self.scale  # [kvh, D, g, S]
        if batch.decode_mask is not None:
            scores.masked_fill_(~batch.decode_mask[None, :, None, :], float("-inf"))
        out = torch.matmul(scores.softmax(dim=-1).to(dtype), values)  # [kvh, D, group, dim]
        return out.transpose(0, 1).reshape(d, self.num_heads, self.head_dim).to(k_cache.dtype)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cached: int,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """One sequence's chunk: queries at positions cached..cached+n-1 see keys 0..own position.

        With no cached prefix the chunk's own K/V are the whole context and the causal mask is
        the usual one. With a prefix, a query at row i may see keys up to cached + i: a
        bottom-right aligned mask, which a plain ``is_causal`` (top-left) would get wrong.
        """
        n = q.shape[0]
        if cached == 0:
            keys, values = k.transpose(0, 1), v.transpose(0, 1)  # [kvh, n, dim]
        else:
            keys, values = k_cache.index_select(1, slots), v_cache.index_select(1, slots)
        total = keys.shape[1]
        mask = None
        if cached or self.window is not None:
            q_pos = torch.arange(cached, cached + n).unsqueeze(1)
            k_pos = torch.arange(total).unsqueeze(0)
            mask = k_pos <= q_pos
            if self.window is not None:
                mask &= k_pos > q_pos - self.window
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.intermediate = c.intermediate_size
        self.gate_up_proj = Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x, cos, sin, kv_cache, batch):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    def __init__(self, c: ModelConfig, max_positions: int):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.init_rope(max_positions, torch.get_default_device())

    def init_rope(self, max_positions: int, device: torch.device) -> None:
        """Rotary cos/sin tables for positions 0..max_positions-1, float32 like Hugging Face."""
        positions = torch.arange(max_positions, dtype=torch.float64)
        angles = torch.outer(positions, rope_inv_freq(self.config))
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("rope_cos", angles.cos().float().to(device), persistent=False)
        self.register_buffer("rope_sin", angles.sin().float().to(device), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        batch: AttentionBatch,
    ) -> torch.Tensor:
        """Hidden states [tokens, hidden] after the final norm (logits are the caller's choice)."""
        x = self.embed_tokens(input_ids)
        cos = self.rope_cos[positions].to(x.dtype).unsqueeze(1)
        sin = self.rope_sin[positions].to(x.dtype).unsqueeze(1)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, batch)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
