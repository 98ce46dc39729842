"""Paper arithmetic of prefill and decode: pure functions over specs.

Conventions: bytes are plain bytes, rates are per second, FLOPs count a multiply-add as two.
A context of ``c`` tokens means ``c`` tokens already in the KV cache when a step runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdscope.specs import Device, KVPrecision, ModelSpec, SpecError, WeightPrecision
from pdscope.specs.models import LayerSpec


def _check_tokens(label: str, tokens: int, minimum: int = 0) -> None:
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < minimum:
        raise SpecError(f"{label} must be an integer >= {minimum}, got {tokens!r}")


# --- weights -------------------------------------------------------------------------------


def check_weights(model: ModelSpec, weights: WeightPrecision) -> None:
    """SpecError where the precision cannot describe the model: a scheme that quantizes only
    MoE experts (mxfp4) on a model without any, the seed article's round model included."""
    if weights.experts_only and (model.nominal_params is not None or not model.is_moe):
        raise SpecError(
            f"--dtype {weights.name} quantizes only MoE experts' weights and {model.name} has "
            "no experts: choose a precision that covers every linear layer (e.g. int4, fp8)"
        )


def weight_bytes(model: ModelSpec, weights: WeightPrecision) -> float:
    """Bytes of every stored weight: what the server holds in memory (the embedding and LM
    head at their own width, :func:`read_bytes`). gpt-oss at mxfp4: 12.8 GiB (20b) and
    60.8 GiB (120b), its model card's checkpoint sizes."""
    check_weights(model, weights)
    if model.nominal_params is not None:  # the seed article's model: every weight alike
        return model.total_params * weights.bytes_per_weight
    embedding = model.embedding_params
    head = 0 if model.tie_word_embeddings else model.lm_head_params
    body = _body_bytes(model, weights, model.total_params - embedding - head, model.expert_params)
    # tied, the one table is the LM head too: read at the head's width every token
    width = (
        head_width(model, weights)
        if model.tie_word_embeddings
        else weights.embedding_bytes_per_weight
    )
    return body + embedding * width + head * head_width(model, weights)


def head_width(model: ModelSpec, weights: WeightPrecision) -> float:
    """Bytes a weight of the embedding and LM head: 16-bit where quantization leaves them
    (int4/int8/fp8/mxfp4); the rest's width for GGUF's averages and the seed article's model."""
    if model.nominal_params is not None:
        return weights.bytes_per_weight
    return weights.head_bytes_per_weight


def _body_bytes(
    model: ModelSpec, weights: WeightPrecision, params: float, expert_params: float
) -> float:
    """Bytes of ``params`` parameters outside the LM head, ``expert_params`` of them routed
    experts' (a scheme that quantizes only the experts keeps the rest 16-bit)."""
    if weights.rest_bits is None:
        return params * weights.bytes_per_weight
    return expert_params * weights.bytes_per_weight + (params - expert_params) * (
        weights.rest_bytes_per_weight
    )


def read_bytes(model: ModelSpec, weights: WeightPrecision, tokens: int = 1) -> float:
    """Bytes of weights one forward pass over ``tokens`` tokens reads (:func:`params_touched`),
    the LM head among them (every decode and prefill pass reads it): quantized int4/int8/fp8
    checkpoints keep the head 16-bit. On Llama-3.1-8B at int4 the head holds 0.53 B of its
    8.03 B parameters and 23% of the weight bytes a decode step reads. The embedding's gathered
    rows count at the layers' width (a row a token: too few to matter)."""
    check_weights(model, weights)
    params = params_touched(model, tokens)
    if model.nominal_params is not None:
        return params * weights.bytes_per_weight
    head = model.lm_head_params
    body = _body_bytes(model, weights, params - head, expert_params_touched(model, tokens))
    return body + head * head_width(model, weights)


def _distinct_experts(layer: LayerSpec, tokens: int) -> float:
    """Expected distinct experts ``tokens`` independently, uniformly routed tokens hit:
    E * (1 - (1 - k/E)^tokens), k at one token, approaching E as the batch grows."""
    k, experts = layer.experts_per_token, layer.num_experts
    return experts * (1 - (1 - k / experts) ** tokens)


def expert_params_touched(model: ModelSpec, tokens: int) -> float:
    """The routed experts' parameters among :func:`params_touched` (0 for a dense model)."""
    _check_tokens("tokens", tokens, minimum=1)
    return sum(
        _distinct_experts(layer, tokens) * layer.expert_params
        for layer in model.layers
        if layer.num_experts
    )


def params_touched(model: ModelSpec, tokens: int) -> float:
    """Distinct parameters read by one forward pass over ``tokens`` tokens.

    Dense weights are read once however many tokens share the pass. A MoE layer reads the
    distinct experts its tokens hit (:func:`_distinct_experts`), not top-k per token. An untied
    input embedding is gathered one row per token.
    """
    _check_tokens("tokens", tokens, minimum=1)
    if model.nominal_params is not None:
        return model.nominal_params
    total = model.params_read_per_token
    for layer in model.layers:
        if layer.num_experts:
            total += (_distinct_experts(layer, tokens) - layer.experts_per_token) * (
                layer.expert_params
            )
    if not model.tie_word_embeddings:
        total += (min(tokens, model.vocab_size) - 1) * model.hidden_size
    return total


# --- KV cache ------------------------------------------------------------------------------


def kv_bytes_per_token(model: ModelSpec, kv: KVPrecision) -> int:
    """KV bytes one token adds across all layers (before any sliding window caps growth).

    2 x layers x kv_heads x head_dim x bytes for standard attention; (latent + rope) x layers x
    bytes for MLA.
    """
    return model.kv_values_per_token * kv.bytes_per_element


def kv_bytes_at_context(model: ModelSpec, kv: KVPrecision, context_tokens: int) -> int:
    """KV bytes one sequence holds at ``context_tokens`` tokens (sliding windows applied)."""
    _check_tokens("context", context_tokens)
    return model.kv_values_at_context(context_tokens) * kv.bytes_per_element


# --- decode --------------------------------------------------------------------------------


def decode_bytes_per_token(
    model: ModelSpec, weights: WeightPrecision, kv: KVPrecision, context_tokens: int
) -> float:
    """Bytes one batch-1 decode step reads: active weights plus the context's KV."""
    return read_bytes(model, weights) + kv_bytes_at_context(model, kv, context_tokens)


def decode_ceiling_tok_s(
    model: ModelSpec,
    device: Device,
    weights: WeightPrecision,
    kv: KVPrecision,
    context_tokens: int = 0,
) -> float:
    """Bandwidth ceiling for one stream: bandwidth / bytes read per token."""
    return device.bandwidth_bytes_s / decode_bytes_per_token(model, weights, kv, context_tokens)


def attention_pairs(query_start: int, query_tokens: int, window: int | None) -> int:
    """Query-key pairs scored when ``query_tokens`` new tokens follow ``query_start`` cached ones.

    Causal: the query at position p sees keys 0..p, capped at the last ``window`` keys.
    """

    def seen_up_to(n: int) -> int:  # sum over p < n of min(p + 1, window)
        if window is None or n <= window:
            return n * (n + 1) // 2
        return window * (window + 1) // 2 + (n - window) * window

    return seen_up_to(query_start + query_tokens) - seen_up_to(query_start)


def attention_flops(model: ModelSpec, query_start: int, query_tokens: int) -> float:
    """Score (QK^T) plus weighted-sum (AV) FLOPs over all layers (a single decoding token uses
    the layer's decode shape where it has one: MLA's absorbed attention)."""
    total = 0.0
    for layer in model.layers:
        shape = layer.attention
        if query_tokens == 1 and layer.decode_attention is not None:
            shape = layer.decode_attention
        pairs = attention_pairs(query_start, query_tokens, layer.window)
        total += 2 * shape.num_heads * (shape.qk_head_dim + shape.v_head_dim) * pairs
    return total


def decode_flops_per_token(model: ModelSpec, context_tokens: int) -> float:
    """FLOPs of one decode token at a context: matmuls + lm_head + attention over the context."""
    return 2 * (model.matmul_params_per_token + model.lm_head_params) + attention_flops(
        model, context_tokens, 1
    )


# --- prefill -------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillFlops:
    """FLOPs of prefilling ``prompt_tokens`` tokens, split by how they scale."""

    prompt_tokens: int
    linear: float  # 2 x tokens x matmul params, + lm_head for the last token only
    attention: float  # grows with tokens^2 (until a sliding window caps it)

    @property
    def total(self) -> float:
        return self.linear + self.attention


def prefill_flops(model: ModelSpec, prompt_tokens: int) -> PrefillFlops:
    _check_tokens("prompt tokens", prompt_tokens, minimum=1)
    linear = 2 * prompt_tokens * model.matmul_params_per_token + 2 * model.lm_head_params
    return PrefillFlops(prompt_tokens, linear, attention_flops(model, 0, prompt_tokens))


@dataclass(frozen=True)
class StepTime:
    """Roofline time of one step: the slower of moving its bytes and doing its FLOPs."""

    bytes_moved: float
    flops: float
    memory_s: float
    compute_s: float | None  # None when the device's peak FLOP/s is unknown

    @property
    def seconds(self) -> float:
        return max(self.memory_s, self.compute_s or 0.0)

    @property
    def bound(self) -> str:
        if self.compute_s is None:
            return "unknown (no peak FLOP/s)"
        return "compute" if self.compute_s >= self.memory_s else "memory"

    @property
    def intensity_flops_per_byte(self) -> float:
        return self.flops / self.bytes_moved


def _step(device: Device, weights: WeightPrecision, bytes_moved: float, flops: float) -> StepTime:
    peak = device.peak_flops(weights.compute)
    return StepTime(
        bytes_moved=bytes_moved,
        flops=flops,
        memory_s=bytes_moved / device.bandwidth_bytes_s,
        compute_s=None if peak is None else flops / peak,
    )


def prefill_step(
    model: ModelSpec,
    device: Device,
    weights: WeightPrecision,
    kv: KVPrecision,
    prompt_tokens: int,
) -> StepTime:
    """One whole-prompt prefill pass: its time is the compute-bound TTFT floor."""
    flops = prefill_flops(model, prompt_tokens).total
    moved = read_bytes(model, weights, prompt_tokens) + kv_bytes_at_context(
        model, kv, prompt_tokens
    )
    return _step(device, weights, moved, flops)


def decode_step(
    model: ModelSpec,
    device: Device,
    weights: WeightPrecision,
    kv: KVPrecision,
    context_tokens: int,
    batch: int = 1,
) -> StepTime:
    """One decode step producing a token for each of ``batch`` sequences at a context."""
    _check_tokens("batch size", batch, minimum=1)
    moved = read_bytes(model, weights, batch) + batch * kv_bytes_at_context(
        model, kv, context_tokens
    )
    return _step(device, weights, moved, batch * decode_flops_per_token(model, context_tokens))


# --- KV pool and batching ------------------------------------------------------------------


@dataclass(frozen=True)
class KVPool:
    """KV capacity left after the weights, as a server sizes it at start-up."""

    memory_bytes: float
    gpu_memory_utilization: float
    weight_bytes: float
    pool_bytes: float  # memory x utilization - weights (<= 0: the weights do not fit)
    tokens: int  # pool / KV bytes per token (full-attention rate)
    max_concurrent_requests: int  # pool / KV bytes of one request at the context


def kv_pool(
    model: ModelSpec,
    device: Device,
    weights: WeightPrecision,
    kv: KVPrecision,
    context_tokens: int,
    gpu_memory_utilization: float = 0.9,
) -> KVPool | None:
    """The KV pool for a device's memory, or None when the device's memory is unknown.

    Activation and CUDA-graph memory are not subtracted, so a real server's pool is smaller.
    """
    if not 0 < gpu_memory_utilization <= 1:
        raise SpecError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
    _check_tokens("context", context_tokens, minimum=1)
    if device.memory_bytes is None:
        return None
    budget = device.memory_bytes * gpu_memory_utilization
    held = weight_bytes(model, weights)
    pool = budget - held
    usable = max(pool, 0.0)
    return KVPool(
        memory_bytes=device.memory_bytes,
        gpu_memory_utilization=gpu_memory_utilization,
        weight_bytes=held,
        pool_bytes=pool,
        tokens=int(usable // kv_bytes_per_token(model, kv)),
        max_concurrent_requests=int(usable // kv_bytes_at_context(model, kv, context_tokens)),
    )


def compute_bound_batch(
    model: ModelSpec,
    device: Device,
    weights: WeightPrecision,
    kv: KVPrecision,
    context_tokens: int,
    limit: int = 1 << 20,
) -> int | None:
    """Smallest batch whose decode step is compute-bound, or None (never, up to ``limit``).

    Compute time minus memory time is convex in the batch (weights touched grow concavely), so
    once a batch is compute-bound every larger one is: a binary search is exact.
    """
    if device.peak_flops(weights.compute) is None:
        return None

    def is_compute_bound(batch: int) -> bool:
        return decode_step(model, device, weights, kv, context_tokens, batch).bound == "compute"

    if not is_compute_bound(limit):
        return None
    low, high = 1, limit
    while low < high:
        mid = (low + high) // 2
        if is_compute_bound(mid):
            high = mid
        else:
            low = mid + 1
    return low


@dataclass(frozen=True)
class BatchPoint:
    batch: int
    step_s: float
    aggregate_tok_s: float
    per_stream_tok_s: float
    bound: str


def batched_decode(
    model: ModelSpec,
    device: Device,
    weights: WeightPrecision,
    kv: KVPrecision,
    context_tokens: int,
    batches: list[int],
) -> list[BatchPoint]:
    """Aggregate and per-stream decode rate at each batch size (all sequences at one context)."""
    points = []
    for batch in batches:
        step = decode_step(model, device, weights, kv, context_tokens, batch)
        points.append(
            BatchPoint(batch, step.seconds, batch / step.seconds, 1 / step.seconds, step.bound)
        )
    return points


def batch_ladder(stop: int, extra: list[int]) -> list[int]:
    """Powers of two up to ``stop``, plus the ``extra`` sizes that fall within it, sorted."""
    sizes = {1 << i for i in range(int(math.log2(max(stop, 1))) + 1)}
    sizes.update(b for b in extra if 1 <= b <= stop)
    sizes.add(max(stop, 1))
    return sorted(sizes)
