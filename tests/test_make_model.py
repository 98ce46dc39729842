"""Tests for the random-weight checkpoint writer (pdscope.checkpoint.make_model)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pdscope.checkpoint import make_model as mm

transformers = pytest.importorskip("transformers")

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


def _expected_params(config: dict) -> int:
    """Parameter count written out from the config, independently of mm.tensor_shapes."""
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or h // heads
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    if config["model_type"] == "qwen2":
        attn += heads * hd + 2 * kv * hd
    if config["model_type"] == "qwen3":
        attn += 2 * hd
    layer = attn + 3 * h * inter + 2 * h
    embeddings = vocab * h * (1 if config["tie_word_embeddings"] else 2)
    return config["num_hidden_layers"] * layer + embeddings + h


def _tensor_names(path: Path) -> list[str]:
    with safe_open(path / "model.safetensors", "pt") as f:
        return list(f.keys())


def _load_model(path: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    return model.eval(), info


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: mm.make_model(root / arch, "tiny", arch=arch) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_loads_in_transformers(tiny_dirs: dict[str, Path], arch: str) -> None:
    path = tiny_dirs[arch]
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == mm.ARCHITECTURES[arch]["architectures"]
    assert config["model_type"] == arch
    model, info = _load_model(path)
    # Every tensor in the file is used and every parameter comes from the file.
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert type(model).__name__ == mm.ARCHITECTURES[arch]["architectures"][0]
    assert model.dtype == torch.bfloat16

    with torch.no_grad():
        logits = model(torch.tensor([[5, 17, 300, 2, 999, 42]])).logits
    assert logits.shape == (1, 6, config["vocab_size"])
    assert torch.isfinite(logits.float()).all()

    n = sum(p.numel() for p in model.parameters())
    assert n == _expected_params(config) == mm.num_parameters(config)


def test_arch_specific_tensors(tiny_dirs: dict[str, Path]) -> None:
    def keys(arch: str) -> set[str]:
        return set(_tensor_names(tiny_dirs[arch]))

    head_dim = mm.PRESETS["tiny"]["hidden_size"] // mm.PRESETS["tiny"]["num_attention_heads"]
    assert "model.layers.1.self_attn.q_proj.bias" in keys("qwen2")
    assert not any(k.endswith(".bias") for k in keys("llama") | keys("mistral") | keys("qwen3"))
    assert "model.layers.0.self_attn.k_norm.weight" in keys("qwen3")
    with safe_open(tiny_dirs["qwen3"] / "model.safetensors", "pt") as f:
        assert tuple(f.get_tensor("model.layers.0.self_attn.q_norm.weight").shape) == (head_dim,)
    qwen3 = json.loads((tiny_dirs["qwen3"] / "config.json").read_text())
    assert qwen3["head_dim"] == head_dim
    mistral = json.loads((tiny_dirs["mistral"] / "config.json").read_text())
    assert "sliding_window" in mistral and mistral["sliding_window"] is None
    llama = json.loads((tiny_dirs["llama"] / "config.json").read_text())
    for key in ("torch_dtype", "bos_token_id", "eos_token_id", "rms_norm_eps", "rope_theta"):
        assert key in llama
    assert llama["hidden_act"] == "silu"
    assert "lm_head.weight" in keys("llama")


def test_overrides_tied_rope_scaling_float32(tmp_path: Path) -> None:
    rope_scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512,
    }
    path = mm.make_model(
        tmp_path / "m",
        "tiny",
        arch="llama",
        dtype="float32",
        tie_word_embeddings=True,
        rope_scaling=rope_scaling,
        num_hidden_layers=3,
        vocab_size=1500,
    )
    config = json.loads((path / "config.json").read_text())
    assert "lm_head.weight" not in _tensor_names(path)
    assert config["rope_scaling"] == rope_scaling
    assert config["torch_dtype"] == "float32"
    with safe_open(path / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    model, info = _load_model(path)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert sum(p.numel() for p in model.parameters()) == _expected_params(config)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 1500) and torch.isfinite(logits).all()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert len(tok) == 1500


def test_sliding_window_override(tmp_path: Path) -> None:
    path = mm.make_model(tmp_path / "m", "tiny", arch="mistral", sliding_window=128)
    assert json.loads((path / "config.json").read_text())["sliding_window"] == 128
    model, _ = _load_model(path)
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits.float()).all()


def test_tokenizer(tiny_dirs: dict[str, Path]) -> None:
    path = tiny_dirs["llama"]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert len(tok) == mm.PRESETS["tiny"]["vocab_size"]
    assert tok.eos_token == tok.bos_token == tok.pad_token == "<|endoftext|>"
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]

    for text in [
        "The quick brown fox jumps over the lazy dog.",
        "  leading and trailing spaces \n\n\ttabs ",
        "naïve café — Ünïcödé, 日本語のテキスト, Ελληνικά, emoji 🤖🎉",
        "def f(x):\n    return x ** 2  # comment\n",
        "\x00\x01 control \u200b zero-width",
    ]:
        ids = tok.encode(text, add_special_tokens=True)
        assert all(0 <= i < len(tok) for i in ids)
        assert tok.decode(ids) == text
    # Trained merges: common English words are single tokens, not bytes.
    assert len(tok.encode(" the function returns")) <= 4

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello!"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHello!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not no_prompt.endswith("assistant\n")
    encoded = tok.apply_chat_template(messages, add_generation_prompt=True)
    ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded
    assert ids[0] == 1 and ids.count(2) == 2

    config = json.loads((path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["model_max_length"] == mm.PRESETS["tiny"]["max_position_embeddings"]


def test_tokenizer_fills_to_vocab_size() -> None:
    from tokenizers import Tokenizer

    # The corpus runs out of merges well before this, so reserved tokens pad the rest.
    tok = Tokenizer.from_str(mm.train_tokenizer(40000))
    assert tok.get_vocab_size(with_added_tokens=True) == 40000
    assert tok.id_to_token(39999).startswith("<|reserved_")


def test_tokenizer_training_is_deterministic() -> None:
    # train_tokenizer is the uncached trainer, so this really trains twice.
    assert mm.train_tokenizer(1024) == mm.train_tokenizer(1024)


def test_weights_deterministic_by_seed(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    again = mm.make_model(tmp_path / "again", "tiny", arch="llama", seed=0)
    other = mm.make_model(tmp_path / "other", "tiny", arch="llama", seed=1)
    first = tiny_dirs["llama"]
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (first / name).read_bytes() == (again / name).read_bytes(), name
    assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()
    assert (first / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()
    with (
        safe_open(first / "model.safetensors", "pt") as a,
        safe_open(other / "model.safetensors", "pt") as b,
    ):
        for key in _tensor_names(first):
            ta, tb = a.get_tensor(key), b.get_tensor(key)
            if key.endswith("norm.weight"):
                assert torch.equal(ta, torch.ones_like(ta))
            else:
                assert not torch.equal(ta, tb), key
                assert 0.01 < ta.float().std().item() < 0.03, key


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"preset": "huge"}, "preset"),
        ({"arch": "gpt2"}, "architecture"),
        ({"dtype": "int8"}, "dtype"),
        ({"num_attention_heads": 4, "num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_size": 66}, "divisible"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"vocab_size": 100}, "vocab_size"),
        ({"arch": "qwen2", "head_dim": 32}, "head_dim"),
        ({"sliding_window": 64}, "sliding window"),
        ({"hidden_layers": 3}, "override"),
        # Refused before anything is written (it left a config without weights, after minutes)
        ({"num_hidden_layers": 10**8}, "GB free"),
    ],
)
def test_bad_inputs_raise(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        mm.make_model(tmp_path / "bad", **kwargs)
    assert not (tmp_path / "bad").exists()


def test_ensure_model_uses_cache_and_is_idempotent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSCOPE_CACHE", str(tmp_path / "cache"))
    assert mm.default_cache_dir() == tmp_path / "cache"
    path = mm.ensure_model("tiny")
    assert path == tmp_path / "cache" / "models" / f"tiny-v{mm._FORMAT_VERSION}"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (path / name).is_file()
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert mm.ensure_model("tiny") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    # No temporary directories left behind.
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    assert mm.resolve_model_path("tiny") == path


def test_ensure_model_replaces_incomplete_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSCOPE_CACHE", str(tmp_path))
    broken = tmp_path / "models" / f"tiny-v{mm._FORMAT_VERSION}"
    broken.mkdir(parents=True)
    (broken / "config.json").write_text("{}")
    path = mm.ensure_model("tiny")
    assert path == broken
    assert (path / "model.safetensors").is_file()
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"


def test_default_cache_dir_without_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSCOPE_CACHE", raising=False)
    assert mm.default_cache_dir() == Path.home() / ".cache" / "pdscope"


def test_resolve_model_path(tmp_path: Path) -> None:
    assert mm.resolve_model_path(str(tmp_path)) == tmp_path
    with pytest.raises(FileNotFoundError, match=r"nope.*tiny.*small"):
        mm.resolve_model_path(str(tmp_path / "nope"))


@pytest.mark.slow
def test_small_preset(tmp_path: Path) -> None:
    path = mm.make_model(tmp_path / "small", "small")
    config = json.loads((path / "config.json").read_text())
    n = _expected_params(config)
    assert math.isclose(n, 168e6, rel_tol=0.01)
    with safe_open(path / "model.safetensors", "pt") as f:
        stored = sum(math.prod(f.get_slice(k).get_shape()) for k in _tensor_names(path))
    assert stored == n
    assert (path / "model.safetensors").stat().st_size > 2 * n  # bfloat16 + header
    model, info = _load_model(path)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert sum(p.numel() for p in model.parameters()) == n
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape == (1, 4, 16384) and torch.isfinite(logits.float()).all()
    assert len(transformers.AutoTokenizer.from_pretrained(path)) == 16384


def test_a_path_that_cannot_be_a_checkpoint_directory_is_refused(tmp_path: Path) -> None:
    file = tmp_path / "taken.json"
    file.write_text("{}")
    with pytest.raises(ValueError, match="is not a directory"):
        mm.make_model(file)
    with pytest.raises(ValueError, match="cannot create"):
        mm.make_model(file / "below")
