"""The paper arithmetic: the seed's numbers and the properties the article states."""

import pytest

from pdscope.commands.plan import compare, round_half_up
from pdscope.roofline import arithmetic as rf
from pdscope.specs import SpecError, get_device, get_kv_precision, get_weight_precision, load_model

BF16, INT8 = get_weight_precision("bf16"), get_weight_precision("int8")
KV16 = get_kv_precision("bf16")


def test_seed_table() -> None:
    rows = compare(load_model("8b"), BF16, KV16)
    assert [r["decode_ceiling_tok_s"] for r in rows] == [6, 38, 54, 63, 127, 209]
    assert [r["mem_bandwidth_gb_s"] for r in rows] == [90, 600, 864, 1008, 2039, 3350]
    assert all(set(r) == {"device", "mem_bandwidth_gb_s", "decode_ceiling_tok_s"} for r in rows)
    assert rows[0]["device"] == "CPU, dual channel DDR5-5600"


def test_eight_bits_double_the_ceiling() -> None:
    model = load_model("8b")
    for device in ("a10g", "h100-sxm", "cpu"):
        d = get_device(device)
        assert rf.decode_ceiling_tok_s(model, d, INT8, KV16) == pytest.approx(
            2 * rf.decode_ceiling_tok_s(model, d, BF16, KV16)
        )
    rows = compare(model, INT8, KV16)
    assert [r["decode_ceiling_tok_s"] for r in rows] == [11, 75, 108, 126, 255, 419]


def test_round_half_up() -> None:
    assert round_half_up(37.5) == 38 and round_half_up(62.5) == 63 and round_half_up(5.49) == 5


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen2.5-0.5b", "mixtral-8x7b", "deepseek-v3"])
def test_doubling_bytes_per_weight_halves_the_ceiling(name: str) -> None:
    model, device = load_model(name), get_device("h100")
    fp32, fp16 = get_weight_precision("fp32"), get_weight_precision("fp16")
    assert rf.decode_ceiling_tok_s(model, device, fp32, KV16) == pytest.approx(
        rf.decode_ceiling_tok_s(model, device, fp16, KV16) / 2
    )


def test_kv_for_8b_layout() -> None:
    model = load_model("llama-3.1-8b")
    assert rf.kv_bytes_per_token(model, KV16) == 131072
    # ~1 GB for an 8,000-token conversation.
    assert rf.kv_bytes_at_context(model, KV16, 8000) == pytest.approx(1.05e9, rel=0.01)
    assert rf.kv_bytes_per_token(model, get_kv_precision("fp8")) == 65536


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-32b", "deepseek-v3"])
def test_kv_grows_linearly_without_a_window(name: str) -> None:
    model = load_model(name)
    per_token = rf.kv_bytes_per_token(model, KV16)
    for context in (1, 100, 4096, 100_000):
        assert rf.kv_bytes_at_context(model, KV16, context) == context * per_token


def test_sliding_window_caps_kv_growth() -> None:
    mistral = load_model("mistral-7b")  # window 4096 on every layer
    per_token = rf.kv_bytes_per_token(mistral, KV16)
    assert rf.kv_bytes_at_context(mistral, KV16, 4096) == 4096 * per_token
    assert rf.kv_bytes_at_context(mistral, KV16, 32_000) == 4096 * per_token
    gemma = load_model("gemma-2-9b")  # half the layers capped at 4096
    per_token = rf.kv_bytes_per_token(gemma, KV16)
    half = per_token * 21 // 42
    assert rf.kv_bytes_at_context(gemma, KV16, 8192) == 8192 * half + 4096 * half
    oss = load_model("gpt-oss-20b")  # window 128 on alternate layers
    grow = rf.kv_bytes_at_context(oss, KV16, 20_000) - rf.kv_bytes_at_context(oss, KV16, 10_000)
    assert grow == 10_000 * rf.kv_bytes_per_token(oss, KV16) // 2


@pytest.mark.parametrize(("name", "gib"), [("gpt-oss-20b", 12.8), ("gpt-oss-120b", 60.8)])
def test_mxfp4_counts_gpt_oss_as_its_model_card_does(name: str, gib: float) -> None:
    """gpt-oss ships its routed experts in MXFP4 (17 bytes a block of 32 weights) and the rest
    in bf16: its model card gives the checkpoints as 12.8 and 60.8 GiB. Every weight at 4.25
    bits would read ~30% low on the 20b, every weight at 16 ~3.2x high."""
    model, mx = load_model(name), get_weight_precision("mxfp4")
    assert rf.weight_bytes(model, mx) / 2**30 == pytest.approx(gib, rel=0.005)
    # one decode token reads its 4 experts a layer at 4.25 bits, everything else at 16
    experts = sum(4 * layer.expert_params for layer in model.layers)
    rest = model.params_read_per_token - experts
    assert rf.read_bytes(model, mx) == pytest.approx(experts * 17 / 32 + rest * 2)
    assert rf.read_bytes(model, mx) < 0.6 * rf.read_bytes(model, BF16)
    # a batch hits more distinct experts: only the experts' bytes grow with it
    grown = rf.read_bytes(model, mx, 64) - rf.read_bytes(model, mx)
    touched = rf.params_touched(model, 64) - rf.params_touched(model, 1)
    embedding_rows = 63 * model.hidden_size
    assert grown == pytest.approx((touched - embedding_rows) * 17 / 32 + embedding_rows * 2)
    with pytest.raises(SpecError, match=r"llama-3\.1-8b has no experts"):
        rf.weight_bytes(load_model("llama-3.1-8b"), mx)


def test_context_slows_decode() -> None:
    model, device = load_model("llama-3.1-8b"), get_device("h100")
    short = rf.decode_ceiling_tok_s(model, device, BF16, KV16, 0)
    long = rf.decode_ceiling_tok_s(model, device, BF16, KV16, 32_000)
    assert long < short
    bytes_long = rf.decode_bytes_per_token(model, BF16, KV16, 32_000)
    assert device.bandwidth_bytes_s / bytes_long == pytest.approx(long)


def test_prefill_flops_split() -> None:
    model = load_model("llama-3.1-8b")
    n = 2000
    flops = rf.prefill_flops(model, n)
    matmul = model.matmul_params_per_token
    assert flops.linear == 2 * n * matmul + 2 * model.lm_head_params
    assert flops.attention == 32 * 2 * 32 * (128 + 128) * n * (n + 1) // 2
    # Linear part doubles with the prompt, the attention part quadruples (roughly).
    double = rf.prefill_flops(model, 2 * n)
    assert double.linear / flops.linear == pytest.approx(2, rel=0.01)
    assert double.attention / flops.attention == pytest.approx(4, rel=0.01)
    assert double.total > 2 * flops.total


def test_attention_pairs() -> None:
    assert rf.attention_pairs(0, 4, None) == 1 + 2 + 3 + 4
    assert rf.attention_pairs(0, 4, 2) == 1 + 2 + 2 + 2
    assert rf.attention_pairs(4, 1, None) == 5  # a decode token sees itself and 4 cached
    assert rf.attention_pairs(2, 2, None) == 3 + 4


def test_prefill_is_compute_bound_and_decode_is_memory_bound() -> None:
    model, device = load_model("llama-3.1-8b"), get_device("h100")
    prefill = rf.prefill_step(model, device, BF16, KV16, 2000)
    decode = rf.decode_step(model, device, BF16, KV16, 2000)
    ridge = device.ridge_flops_per_byte()
    assert prefill.bound == "compute" and prefill.intensity_flops_per_byte > ridge
    assert decode.bound == "memory" and decode.intensity_flops_per_byte < 2
    assert prefill.seconds == pytest.approx(prefill.flops / 989e12)


def test_kv_pool() -> None:
    model, device = load_model("llama-3.1-8b"), get_device("h100")
    pool = rf.kv_pool(model, device, BF16, KV16, context_tokens=8000)
    expected = 80 * 1024**3 * 0.9 - model.total_params * 2
    assert pool.pool_bytes == pytest.approx(expected)
    assert pool.tokens == int(expected // 131072)
    assert pool.max_concurrent_requests == int(expected // (8000 * 131072))
    smaller = rf.kv_pool(model, device, BF16, KV16, 8000, gpu_memory_utilization=0.5)
    assert smaller.tokens < pool.tokens
    assert rf.kv_pool(model, get_device("cpu"), BF16, KV16, 8000) is None  # no memory size
    too_big = rf.kv_pool(load_model("llama-3.1-70b"), get_device("a10g"), BF16, KV16, 8000)
    assert too_big.pool_bytes < 0 and too_big.max_concurrent_requests == 0


def test_batched_decode_grows_until_compute_bound() -> None:
    model, device = load_model("llama-3.1-8b"), get_device("h100")
    # At 512 tokens one sequence's KV read (67 MB) already outlasts its FLOPs on an H100, so the
    # batch never turns compute-bound; at 64 tokens it does.
    assert rf.compute_bound_batch(model, device, BF16, KV16, 512) is None
    context = 64
    batch = rf.compute_bound_batch(model, device, BF16, KV16, context)
    assert batch is not None and batch > 1
    below = rf.decode_step(model, device, BF16, KV16, context, batch - 1)
    at = rf.decode_step(model, device, BF16, KV16, context, batch)
    assert below.bound == "memory" and at.bound == "compute"
    points = rf.batched_decode(model, device, BF16, KV16, context, [1, 2, 4, 8, 16])
    rates = [p.aggregate_tok_s for p in points]
    assert rates == sorted(rates)
    assert rates[1] / rates[0] > 1.9  # extra sequences are almost free while memory-bound
    assert points[-1].per_stream_tok_s < points[0].per_stream_tok_s


def test_moe_batches_touch_more_experts() -> None:
    model = load_model("mixtral-8x7b")
    one, many = rf.params_touched(model, 1), rf.params_touched(model, 64)
    assert one == pytest.approx(model.params_read_per_token)
    assert many > one
    assert many <= model.total_params


def test_nonsense_is_refused() -> None:
    model = load_model("llama-3.1-8b")
    with pytest.raises(ValueError, match="context"):
        rf.kv_bytes_at_context(model, KV16, -1)
    with pytest.raises(ValueError, match="prompt"):
        rf.prefill_flops(model, 0)
    with pytest.raises(ValueError, match="utilization"):
        rf.kv_pool(model, get_device("h100"), BF16, KV16, 100, gpu_memory_utilization=1.5)


def test_mla_decode_uses_absorbed_attention() -> None:
    model = load_model("deepseek-v3")
    layer = model.layers[0]
    assert (layer.decode_attention.qk_head_dim, layer.decode_attention.v_head_dim) == (576, 512)
    decode = rf.attention_flops(model, 8000, 1)
    assert decode == 61 * 2 * 128 * (576 + 512) * 8001
    prefill = rf.attention_flops(model, 0, 2)  # prefill keeps the naive 192/128 shapes
    assert prefill == 61 * 2 * 128 * (192 + 128) * 3
