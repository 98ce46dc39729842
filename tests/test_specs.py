"""Facts: presets match published parameter counts and KV layouts; configs parse correctly."""

import json

import pytest

from pdscope.specs import (
    SpecError,
    catalog,
    get_device,
    get_kv_precision,
    get_weight_precision,
    load_model,
    resolve_device,
    spec_from_config,
)

# BRIEF.md section 5: total parameters (billions).
PUBLISHED_PARAMS_B = {
    "llama-3.1-8b": 8.03,
    "llama-3.1-70b": 70.6,
    "llama-3.2-1b": 1.24,
    "qwen2.5-0.5b": 0.49,
    "qwen2.5-7b": 7.62,
    "qwen2.5-72b": 72.7,
    "qwen3-8b": 8.19,
    "qwen3-32b": 32.8,
    "mistral-7b": 7.24,
    "mixtral-8x7b": 46.7,
    "gemma-2-9b": 9.24,
    "deepseek-v3": 671,
    "gpt-oss-20b": 20.9,
    "gpt-oss-120b": 116.8,
    "llama-3.2-3b": 3.21,  # Meta's model card
}

# KV bytes per token at 16 bits: 2 x layers x kv_heads x head_dim x 2 (MLA: 576 x layers x 2).
KV_BYTES_PER_TOKEN_16BIT = {
    "llama-3.1-8b": 2 * 32 * 8 * 128 * 2,
    "llama-3.1-70b": 2 * 80 * 8 * 128 * 2,
    "llama-3.2-1b": 2 * 16 * 8 * 64 * 2,
    "llama-3.2-3b": 2 * 28 * 8 * 128 * 2,
    "qwen2.5-0.5b": 2 * 24 * 2 * 64 * 2,
    "qwen2.5-7b": 2 * 28 * 4 * 128 * 2,
    "qwen2.5-72b": 2 * 80 * 8 * 128 * 2,
    "qwen3-8b": 2 * 36 * 8 * 128 * 2,
    "qwen3-32b": 2 * 64 * 8 * 128 * 2,
    "mistral-7b": 2 * 32 * 8 * 128 * 2,
    "mixtral-8x7b": 2 * 32 * 8 * 128 * 2,
    "gemma-2-9b": 2 * 42 * 8 * 256 * 2,
    "deepseek-v3": 61 * (512 + 64) * 2,
    "gpt-oss-20b": 2 * 24 * 8 * 64 * 2,
    "gpt-oss-120b": 2 * 36 * 8 * 64 * 2,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS_B))
def test_preset_params_within_one_percent(name: str) -> None:
    spec = load_model(name)
    published = PUBLISHED_PARAMS_B[name] * 1e9
    assert abs(spec.total_params - published) / published < 0.01


@pytest.mark.parametrize("name", sorted(KV_BYTES_PER_TOKEN_16BIT))
def test_preset_kv_per_token(name: str) -> None:
    assert load_model(name).kv_values_per_token * 2 == KV_BYTES_PER_TOKEN_16BIT[name]


def test_deepseek_mla_kv_is_about_68_6_kib_per_token() -> None:
    kib = load_model("deepseek-v3").kv_values_per_token * 2 / 1024
    assert kib == pytest.approx(68.6, abs=0.05)


@pytest.mark.parametrize(
    ("name", "active_b"),
    [("mixtral-8x7b", 12.9), ("deepseek-v3", 37.6)],
)
def test_moe_active_params(name: str, active_b: float) -> None:
    spec = load_model(name)
    assert spec.is_moe
    assert abs(spec.active_params - active_b * 1e9) / (active_b * 1e9) < 0.01
    assert spec.active_params < spec.total_params


@pytest.mark.parametrize(("name", "active_b"), [("gpt-oss-20b", 3.6), ("gpt-oss-120b", 5.1)])
def test_gpt_oss_active_excludes_input_embedding(name: str, active_b: float) -> None:
    # OpenAI's "active" count leaves out the embedding table, as params_read_per_token does.
    spec = load_model(name)
    assert abs(spec.params_read_per_token - active_b * 1e9) / (active_b * 1e9) < 0.01


def test_gpt_oss_counts_to_the_parameter() -> None:
    """The model cards' exact counts (Hugging Face's safetensors total, which Ollama's
    /api/show repeats): every bias (attention's, the experts' gate_up and down, the router's)
    and the attention sinks."""
    assert load_model("gpt-oss-20b").total_params == 20_914_757_184
    assert load_model("gpt-oss-120b").total_params == 116_829_156_672


# google/gemma-3-1b-it's config.json: no layer_types, a sliding_window_pattern instead.
GEMMA3_1B = {
    "model_type": "gemma3_text",
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "num_hidden_layers": 26,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "vocab_size": 262144,
    "max_position_embeddings": 32768,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
}


def test_gemma3_windows_five_layers_in_six() -> None:
    """Gemma 3's global layers are every sixth (5, 11, ...): the rest attend over the window,
    so at 32k tokens its KV is about a sixth of what full attention in every layer holds. Read
    as one window on every layer, plan put it at 1/64 of that."""
    spec = spec_from_config(GEMMA3_1B, "gemma-3-1b")
    assert spec.total_params == 999_885_952  # the model card's count
    assert [i for i, layer in enumerate(spec.layers) if layer.window is None] == [5, 11, 17, 23]
    # the pattern's default, as transformers and llama.cpp take it, and an explicit list agree
    no_pattern = {k: v for k, v in GEMMA3_1B.items() if k != "sliding_window_pattern"}
    kinds = [
        "full_attention" if layer.window is None else "sliding_attention" for layer in spec.layers
    ]
    for config in (no_pattern, {**no_pattern, "layer_types": kinds}):
        assert [x.window for x in spec_from_config(config, "g").layers] == [
            x.window for x in spec.layers
        ]
    kv = get_kv_precision("bf16")
    from pdscope.roofline.arithmetic import kv_bytes_at_context

    per_layer = 2 * 256 * 2  # K and V, one KV head of 256, two bytes
    held = 4 * 32768 + 22 * 512
    assert kv_bytes_at_context(spec, kv, 32768) == per_layer * held
    # a multimodal config's language model is read as its own type (four norms a layer, q/k
    # norms): the outer "gemma3" counted it as a plain decoder
    wrapped = {"model_type": "gemma3", "text_config": GEMMA3_1B}
    assert spec_from_config(wrapped, "gemma-3").total_params == spec.total_params
    with pytest.raises(SpecError, match="'sliding_window_pattern' must be a whole number"):
        spec_from_config({**GEMMA3_1B, "sliding_window_pattern": [True, False]}, "g")


def test_tied_embeddings_are_counted_once() -> None:
    tied = load_model("llama-3.2-1b")
    untied_config = {
        **json.loads(json.dumps(_config("llama-3.2-1b"))),
        "tie_word_embeddings": False,
    }
    untied = spec_from_config(untied_config, "untied")
    assert untied.total_params - tied.total_params == 128256 * 2048


def test_explicit_head_dim_beats_hidden_over_heads() -> None:
    # Qwen3-32B: 64 heads x head_dim 128 = 8192 != hidden 5120.
    spec = load_model("qwen3-32b")
    assert spec.layers[0].attention.qk_head_dim == 128
    config = {**_config("qwen3-32b")}
    del config["head_dim"]
    derived = spec_from_config(config, "derived")
    assert derived.layers[0].attention.qk_head_dim == 5120 // 64


def test_gqa_kv_heads_set_kv_size() -> None:
    config = {**_config("llama-3.1-8b")}
    mha = spec_from_config({**config, "num_key_value_heads": 32}, "mha")
    assert mha.kv_values_per_token == 4 * load_model("llama-3.1-8b").kv_values_per_token
    no_kv_key = {k: v for k, v in config.items() if k != "num_key_value_heads"}
    assert spec_from_config(no_kv_key, "x").kv_values_per_token == mha.kv_values_per_token


def test_sliding_windows() -> None:
    assert load_model("mistral-7b").sliding_window_layers == 32
    assert load_model("gemma-2-9b").sliding_window_layers == 21
    assert load_model("gpt-oss-20b").sliding_window_layers == 12
    assert load_model("gpt-oss-120b").sliding_window_layers == 18
    # Qwen2.5 configs carry sliding_window but use_sliding_window is false.
    assert load_model("qwen2.5-7b").sliding_window_layers == 0


def test_missing_field_is_named(tmp_path) -> None:
    config = {k: v for k, v in _config("llama-3.1-8b").items() if k != "num_hidden_layers"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(SpecError, match="num_hidden_layers"):
        load_model(str(path))
    with pytest.raises(SpecError, match="num_hidden_layers"):
        load_model(str(tmp_path))  # a checkpoint directory


def test_bad_config_files(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SpecError, match="JSON"):
        load_model(str(tmp_path))
    with pytest.raises(SpecError, match=r"no config\.json"):
        load_model(str(tmp_path / ".."))  # a directory without one
    bad = {**_config("llama-3.1-8b"), "hidden_size": -1}
    with pytest.raises(SpecError, match="hidden_size"):
        spec_from_config(bad, "bad")


def test_a_path_that_is_not_there_says_so() -> None:
    """A checkpoint path that does not exist was "unknown model './x/'", as for a misspelt
    preset; it now says it is no directory or config.json."""
    for path in ("./no-such-checkpoint/", "~/nowhere", "/tmp/pdscope-none/a/b"):
        with pytest.raises(SpecError, match=r"neither a preset nor an existing config\.json"):
            load_model(path)


def test_unknown_model_names_closest() -> None:
    with pytest.raises(SpecError, match=r"closest: .*llama-3.1-8b"):
        load_model("lama-3.1-8b")


def test_catalog_holds_the_seed_table_exactly() -> None:
    seed = {
        "cpu-ddr5-5600x2": 90,
        "a10g": 600,
        "l40s": 864,
        "rtx-4090": 1008,
        "a100-80gb-sxm": 2039,
        "h100-sxm": 3350,
    }
    for name, bandwidth in seed.items():
        assert get_device(name).bandwidth_gb_s == bandwidth
    names = {d.name for d in catalog()}
    for name in (
        "t4",
        "l4",
        "rtx-3090",
        "rtx-5090",
        "a100-40gb",
        "a100-80gb-pcie",
        "h100-pcie",
        "h200",
        "b200",
        "mi300x",
        "mi325x",
        "gaudi3",
        "m2-ultra",
        "m3-max",
        "m4-max",
        "cpu-ddr4-3200x2",
        "cpu-ddr5-4800x2",
        "cpu-ddr5-6400x2",
    ):
        assert name in names
    assert all(d.source for d in catalog())


def test_device_aliases_and_errors() -> None:
    assert get_device("H100").name == "h100-sxm"
    with pytest.raises(SpecError, match="closest"):
        get_device("h10")
    with pytest.raises(SpecError, match="bandwidth"):
        resolve_device(None, bandwidth_gb_s=0)
    with pytest.raises(SpecError, match="--bandwidth"):
        resolve_device(None)
    custom = resolve_device(None, bandwidth_gb_s=100, tflops=50, memory_gb=32)
    assert custom.peak_flops() == 50e12 and custom.memory_bytes == 32 * 1024**3
    overridden = resolve_device("a10g", bandwidth_gb_s=300)
    assert overridden.bandwidth_gb_s == 300 and overridden.memory_gb == 24


def test_precisions() -> None:
    assert get_weight_precision("bf16").bytes_per_weight == 2
    assert get_weight_precision("int8").bytes_per_weight == 1
    assert get_weight_precision("int4").bits_per_weight == pytest.approx(4 + 16 / 128)
    assert get_weight_precision("Q8_0").bits_per_weight == 8.5
    assert get_weight_precision("q6_k").bits_per_weight == 6.5625
    for name in ("q5_k_m", "q4_k_m", "q4_0", "fp8", "fp32", "fp16"):
        assert get_weight_precision(name).note
    assert get_kv_precision("fp8").bytes_per_element == 1
    with pytest.raises(SpecError, match="closest"):
        get_weight_precision("int3")


def _config(name: str) -> dict:
    from pdscope.specs.models import _presets

    return dict(_presets()[name]["config"])


def test_qwen2_moe_shared_expert_and_bias() -> None:
    config = {
        "model_type": "qwen2_moe",
        "vocab_size": 151936,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "moe_intermediate_size": 2560,
        "shared_expert_intermediate_size": 20480,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "tie_word_embeddings": False,
    }
    spec = spec_from_config(config, "qwen2-57b-a14b")
    assert abs(spec.total_params - 57.4e9) / 57.4e9 < 0.01  # Qwen's model card
    assert abs(spec.active_params - 14.2e9) / 14.2e9 < 0.01


def test_architecture_registry_rules_shared_by_engine_and_specs() -> None:
    from pdscope.checkpoint.make_model import build_config
    from pdscope.engine.model import ModelConfig
    from pdscope.specs import spec_from_config
    from pdscope.specs.architectures import engine_window, has_qkv_bias

    qwen2 = build_config("tiny", "qwen2")
    # Qwen2's attention always has q/k/v biases, whatever attention_bias says: the engine's
    # loader and the parameter count agree.
    assert has_qkv_bias({**qwen2, "attention_bias": False})
    assert ModelConfig.from_hf({**qwen2, "attention_bias": False}).qkv_bias
    with_bias = spec_from_config(qwen2, name="qwen2")
    without = spec_from_config({**qwen2, "architectures": ["LlamaForCausalLM"]}, name="llama")
    assert with_bias.total_params > without.total_params
    unflagged = spec_from_config({**qwen2, "attention_bias": False}, name="qwen2")
    assert unflagged.total_params == with_bias.total_params
    assert not has_qkv_bias(build_config("tiny", "qwen3"))
    assert ModelConfig.from_hf(build_config("tiny", "qwen3")).qk_norm
    # Windows: Mistral's applies to every layer; a per-layer window is refused, not ignored.
    assert engine_window(build_config("tiny", "mistral", sliding_window=64)) == 64
    assert engine_window(build_config("tiny", "qwen2")) is None
    with pytest.raises(ValueError, match="sliding-window layers"):
        ModelConfig.from_hf(build_config("tiny", "qwen2", sliding_window=64))
    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelConfig.from_hf({**qwen2, "architectures": ["GemmaForCausalLM"]})
