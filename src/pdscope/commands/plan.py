"""`pdscope plan`: resolve facts, run the roofline arithmetic, return plain dicts.

The dicts are the JSON output as is; the terminal report renders the same dicts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from pdscope.roofline import arithmetic as rf
from pdscope.specs import (
    SEED_DEVICES,
    Device,
    KVPrecision,
    ModelSpec,
    SpecError,
    WeightPrecision,
    catalog,
    get_kv_precision,
    get_weight_precision,
    load_model,
    resolve_device,
)

DEFAULT_MODEL = "8b"
DEFAULT_DEVICE = "h100-sxm"
DEFAULT_CONTEXT = 4096
DEFAULT_PROMPT_TOKENS = 2000


@dataclass(frozen=True)
class PlanInputs:
    model: ModelSpec
    device: Device
    weights: WeightPrecision
    kv: KVPrecision
    context_tokens: int
    prompt_tokens: int
    gpu_memory_utilization: float
    local: dict[str, Any] | None = None  # the measurement, when --device local


def round_half_up(value: float) -> int:
    """Round as the seed article does (37.5 -> 38), not to even."""
    return math.floor(value + 0.5)


def local_compute(weights: WeightPrecision) -> str:
    """The matmul type a measurement of this machine times for these weights: a float type's
    own (fp32, fp16, bf16, or a GGUF of such tensors, by its compute type), else bf16
    (quantized weights run their matmuls in bf16)."""
    floats = ("fp32", "bf16", "fp16")
    return next((t for t in (weights.name, weights.compute) if t in floats), "bf16")


def weights_for(spec: ModelSpec, dtype: str | None) -> WeightPrecision:
    """The widths plan counts: --dtype's where given, else a GGUF's own (its tensors' bytes),
    else bf16."""
    if dtype is None:
        return spec.file_weights or get_weight_precision("bf16")
    return get_weight_precision(dtype)


def resolve(
    model: str = DEFAULT_MODEL,
    device: str | None = DEFAULT_DEVICE,
    dtype: str | None = None,
    kv_dtype: str | None = None,
    context_tokens: int = DEFAULT_CONTEXT,
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
    gpu_memory_utilization: float = 0.9,
    bandwidth_gb_s: float | None = None,
    tflops: float | None = None,
    memory_gb: float | None = None,
) -> PlanInputs:
    """Turn names and flags into facts, refusing nonsense with a :class:`SpecError`."""
    if context_tokens < 1:
        raise SpecError(f"--context must be a positive number of tokens, got {context_tokens}")
    if prompt_tokens < 1:
        raise SpecError(f"--prompt-tokens must be a positive number of tokens, got {prompt_tokens}")
    if not 0 < gpu_memory_utilization <= 1:
        raise SpecError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
    spec = load_model(model)
    weights = weights_for(spec, dtype)
    rf.check_weights(spec, weights)
    # KV follows the weights' float type; quantized weights keep a 16-bit cache, as servers do.
    kv = get_kv_precision(
        kv_dtype or (weights.name if weights.name in ("fp32", "bf16", "fp16") else "bf16")
    )
    local = None
    if device is not None and device.lower() == "local":
        from pdscope.specs.local import local_device

        measured, measurement = local_device(local_compute(weights))
        local = asdict(measurement)
        flags = resolve_device(  # the measurement, with any figure the flags override
            None,
            bandwidth_gb_s or measured.bandwidth_gb_s,
            tflops or measured.tflops_bf16,
            memory_gb or measured.memory_gb,
        )
        device_spec = replace(
            measured,
            bandwidth_gb_s=flags.bandwidth_gb_s,
            tflops_bf16=flags.tflops_bf16,
            memory_gb=flags.memory_gb,
        )
    else:
        device_spec = resolve_device(device, bandwidth_gb_s, tflops, memory_gb)
    return PlanInputs(
        spec, device_spec, weights, kv, context_tokens, prompt_tokens, gpu_memory_utilization, local
    )


def _model_dict(m: ModelSpec) -> dict[str, Any]:
    return {
        "name": m.name,
        "description": m.description,
        "model_type": m.model_type,
        "num_layers": m.num_layers,
        "total_params": m.total_params,
        "active_params": m.active_params,
        "params_read_per_token": m.params_read_per_token,
        "tie_word_embeddings": m.tie_word_embeddings,
        "moe": m.is_moe,
        "sliding_window_layers": m.sliding_window_layers,
    }


def _device_dict(d: Device, weights: WeightPrecision) -> dict[str, Any]:
    return {
        "name": d.name,
        "label": d.label,
        "bandwidth_gb_s": d.bandwidth_gb_s,
        "memory_gb": d.memory_gb,
        "tflops_bf16": d.tflops_bf16,
        "tflops_fp8": d.tflops_fp8,
        "peak_tflops_used": None
        if d.peak_flops(weights.compute) is None
        else d.peak_flops(weights.compute) / 1e12,
        "ridge_flops_per_byte": d.ridge_flops_per_byte(weights.compute),
        "source": d.source,
    }


def plan(p: PlanInputs, max_batch_rows: int = 4096) -> dict[str, Any]:
    """Every answer of `pdscope plan` for one model on one device, as one JSON-ready dict."""
    m, d, w, kv = p.model, p.device, p.weights, p.kv
    c, n = p.context_tokens, p.prompt_tokens
    notes: list[str] = []
    if m.max_position_embeddings and c > m.max_position_embeddings:
        notes.append(
            f"context {c} exceeds the model's max_position_embeddings {m.max_position_embeddings}"
        )

    prefill = rf.prefill_flops(m, n)
    pstep = rf.prefill_step(m, d, w, kv, n)
    dstep = rf.decode_step(m, d, w, kv, c)
    pool = rf.kv_pool(m, d, w, kv, c, p.gpu_memory_utilization)
    if pool is None:
        notes.append(f"device {d.name} has no memory size: KV pool not computed (pass --memory)")
    elif pool.pool_bytes <= 0:
        notes.append(
            f"weights ({pool.weight_bytes / 1e9:.1f} GB) do not fit in "
            f"{p.gpu_memory_utilization:.0%} of {d.memory_gb} GB"
        )
    if d.peak_flops(w.compute) is None:
        notes.append(
            f"device {d.name} has no peak FLOP/s: compute-bound figures not computed "
            "(pass --tflops)"
        )
    if m.nominal_params is not None:
        notes.append("nominal model: weights counted as a round parameter figure")
    if m.quantization is not None and w.name != m.shipped_dtype:
        # A bf16 count of an fp8 or 4-bit checkpoint halves (or quarters) its decode ceiling.
        how = (
            f"--dtype {m.shipped_dtype} counts it so" if m.shipped_dtype else "no --dtype states it"
        )
        notes.append(
            f"the checkpoint ships quantized ({m.quantization}, its quantization_config): {how}; "
            f"these figures count it as {w.name}"
            + (
                " (everything but the routed experts 16-bit)"
                if w.experts_only
                else " (embedding and LM head 16-bit)"
                if w.head_bits
                else ""
            )
        )

    compute_batch = rf.compute_bound_batch(m, d, w, kv, c)
    pool_batch = pool.max_concurrent_requests if pool is not None else None
    stop = min(b for b in (compute_batch, pool_batch, max_batch_rows) if b is not None)
    extras = [b for b in (compute_batch, pool_batch) if b is not None]
    points = rf.batched_decode(m, d, w, kv, c, rf.batch_ladder(max(stop, 1), extras))

    return {
        "model": _model_dict(m),
        "device": _device_dict(d, w),
        **({"local_measurement": p.local} if p.local else {}),
        "dtype": w.name,
        "bits_per_weight": w.bits_per_weight,
        "experts_only": w.experts_only,
        "dtype_note": w.note,
        "kv_dtype": kv.name,
        "context_tokens": c,
        "prompt_tokens": n,
        "gpu_memory_utilization": p.gpu_memory_utilization,
        "weight_bytes": rf.weight_bytes(m, w),
        "decode_bytes_per_token": rf.decode_bytes_per_token(m, w, kv, c),
        "decode_ceiling_tok_s": rf.decode_ceiling_tok_s(m, d, w, kv, c),
        "decode_ceiling_weights_only_tok_s": rf.decode_ceiling_tok_s(m, d, w, kv, 0),
        "kv_bytes_per_token": rf.kv_bytes_per_token(m, kv),
        "kv_bytes_at_context": rf.kv_bytes_at_context(m, kv, c),
        "kv_pool_bytes": None if pool is None else pool.pool_bytes,
        "kv_pool_tokens": None if pool is None else pool.tokens,
        "max_concurrent_requests": pool_batch,
        "prefill_flops": prefill.total,
        "prefill_flops_linear": prefill.linear,
        "prefill_flops_attention": prefill.attention,
        "ttft_floor_s": pstep.seconds,
        "ttft_floor_bound": pstep.bound,
        "prefill_ceiling_tok_s": n / pstep.seconds,
        "prefill_intensity_flops_per_byte": pstep.intensity_flops_per_byte,
        "decode_intensity_flops_per_byte": dstep.intensity_flops_per_byte,
        "ridge_flops_per_byte": d.ridge_flops_per_byte(w.compute),
        "compute_bound_batch": compute_batch,
        "pool_limited_batch": pool_batch,
        "batched_decode": [point.__dict__ for point in points],
        "notes": notes,
    }


def _plain_number(x: float) -> float | int:
    """90.0 -> 90, so JSON shows the article's integers; 51.2 stays 51.2."""
    return int(x) if float(x).is_integer() else x


def compare(
    model: ModelSpec,
    weights: WeightPrecision,
    kv: KVPrecision,
    context_tokens: int = 0,
    devices: list[Device] | None = None,
) -> list[dict[str, Any]]:
    """The seed article's table: one row per device with exactly its three keys."""
    if devices is None:
        devices = [d for d in catalog() if d.name in SEED_DEVICES]
    return [
        {
            "device": d.label,
            "mem_bandwidth_gb_s": _plain_number(d.bandwidth_gb_s),
            "decode_ceiling_tok_s": round_half_up(
                rf.decode_ceiling_tok_s(model, d, weights, kv, context_tokens)
            ),
        }
        for d in devices
    ]


def seed_table(
    model: str,
    device: str | None,
    dtype: str | None,
    kv_dtype: str | None,
    context_tokens: int | None,
    prompt_tokens: int,
    all_devices: bool,
) -> tuple[list[dict[str, Any]], str]:
    """`plan --compare`: the article's six devices (every catalog device with ``all_devices``;
    plus this machine with ``device`` "local"), as rows and a title."""
    if device is not None and device.lower() != "local":
        raise SpecError(
            "--compare runs over the catalog's devices (--all: every one); --device there "
            f"takes only 'local', to add this machine, got {device!r}"
        )
    inputs = resolve(
        model=model,
        device=DEFAULT_DEVICE,
        dtype=dtype,
        kv_dtype=kv_dtype,
        context_tokens=max(context_tokens or 1, 1),
        prompt_tokens=prompt_tokens,
    )
    if context_tokens is not None and context_tokens < 0:
        raise SpecError(f"--context must be >= 0, got {context_tokens}")
    devices = list(catalog()) if all_devices else None
    if device is not None:  # --compare --device local: the article's six plus this one
        devices = [
            *(devices or [d for d in catalog() if d.name in SEED_DEVICES]),
            resolve(model=model, device="local", dtype=dtype).device,
        ]
    context = context_tokens or 0
    rows = compare(inputs.model, inputs.weights, inputs.kv, context, devices)
    title = (
        f"Decode ceiling for one stream: {inputs.model.name} at {inputs.weights.name}, "
        f"context {context}"
    )
    return rows, title


def device_rows(devices: list[Device]) -> list[dict[str, Any]]:
    """`plan --list-devices --json`."""
    return [d.__dict__ | {"aliases": list(d.aliases)} for d in devices]


def model_rows(specs: list[ModelSpec]) -> list[dict[str, Any]]:
    """`plan --list-models --json`."""
    return [
        {
            "name": s.name,
            "description": s.description,
            "total_params": s.total_params,
            "active_params": s.active_params,
            "kv_values_per_token": s.kv_values_per_token,
        }
        for s in specs
    ]
