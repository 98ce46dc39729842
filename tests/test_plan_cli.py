"""`pdscope plan` through its command line: JSON fields, errors and exit codes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdscope.cli import app

runner = CliRunner()


def run_json(*args: str):
    result = runner.invoke(app, ["plan", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_compare_json_is_the_seed_table() -> None:
    rows = run_json("--compare")
    assert [r["decode_ceiling_tok_s"] for r in rows] == [6, 38, 54, 63, 127, 209]
    assert [list(r) for r in rows] == [["device", "mem_bandwidth_gb_s", "decode_ceiling_tok_s"]] * 6
    int8 = run_json("--compare", "--dtype", "int8")
    for a, b in zip(rows, int8, strict=True):
        assert abs(b["decode_ceiling_tok_s"] - 2 * a["decode_ceiling_tok_s"]) <= 1


def test_compare_all_lists_the_catalog() -> None:
    rows = run_json("--compare", "--all")
    assert len(rows) > 20
    assert {"NVIDIA H200", "AMD Instinct MI300X", "Apple M4 Max"} <= {r["device"] for r in rows}


def test_plan_json_fields_for_llama_8b() -> None:
    r = run_json("--model", "llama-3.1-8b")
    for key in (
        "weight_bytes",
        "kv_bytes_per_token",
        "decode_ceiling_tok_s",
        "kv_bytes_at_context",
        "max_concurrent_requests",
        "prefill_flops",
        "ttft_floor_s",
    ):
        assert key in r
    assert r["kv_bytes_per_token"] == 131072
    assert r["weight_bytes"] == pytest.approx(8.03e9 * 2, rel=0.001)
    assert r["kv_bytes_at_context"] == 131072 * r["context_tokens"]
    assert r["prefill_flops"] == pytest.approx(
        r["prefill_flops_linear"] + r["prefill_flops_attention"]
    )


def test_flags_change_what_they_name() -> None:
    base = run_json("--model", "llama-3.1-8b")
    a10g = run_json("--model", "llama-3.1-8b", "--device", "a10g")
    assert a10g["decode_ceiling_tok_s"] < base["decode_ceiling_tok_s"]
    longer = run_json("--model", "llama-3.1-8b", "--context", "16000")
    assert longer["kv_bytes_at_context"] == 131072 * 16000
    assert longer["max_concurrent_requests"] < base["max_concurrent_requests"]
    prompt = run_json("--model", "llama-3.1-8b", "--prompt-tokens", "4000")
    assert prompt["prefill_flops"] > 2 * base["prefill_flops"]
    assert prompt["ttft_floor_s"] > 2 * base["ttft_floor_s"]
    int8 = run_json("--model", "llama-3.1-8b", "--dtype", "int8")
    # the embedding and LM head (128,256 x 4,096 each) stay 16-bit, as int8/int4/fp8 checkpoints
    # keep them: 6,979,588,096 B of layers + 2 x 1,050,673,152 B (it read half the bf16 bytes)
    table = 128_256 * 4096
    assert int8["weight_bytes"] == (8_030_261_248 - 2 * table) * 1 + 2 * table * 2
    int4 = run_json("--model", "llama-3.1-8b", "--dtype", "int4", "--context", "1")
    # a decode step reads 7,504,928,768 parameters: the LM head's 525,336,576 at 2 bytes, the
    # rest at 4.125 bits (3.87 GB if the head were int4 too: a ceiling 20% high); one token of
    # bf16 KV, 131,072 B
    layers = 6_979_592_192 * 4.125 / 8
    assert int4["decode_bytes_per_token"] == pytest.approx(layers + table * 2 + 131_072)


def test_a_checkpoint_that_ships_quantized_is_named(tmp_path: Path) -> None:
    """DeepSeek-V3 ships fp8 and an AWQ checkpoint 4-bit weights under torch_dtype float16: a
    bf16 count halves or quarters their decode ceiling unannounced. plan says what the
    checkpoint's quantization_config holds, and probe counts a served one so."""
    notes = run_json("--model", "deepseek-v3")["notes"]
    assert any("ships quantized (fp8" in n and "--dtype fp8 counts it so" in n for n in notes)
    assert not any(
        "ships" in n for n in run_json("--model", "deepseek-v3", "--dtype", "fp8")["notes"]
    )
    gpt = run_json("--model", "gpt-oss-20b")["notes"]
    assert any("(mxfp4, its quantization_config): --dtype mxfp4 counts it so" in n for n in gpt)
    mx = run_json("--model", "gpt-oss-20b", "--dtype", "mxfp4")
    assert not any("ships" in n for n in mx["notes"]) and mx["experts_only"]
    from pdscope.commands.probe import ProbeSettings, _dtype_of
    from pdscope.specs.models import _presets

    config = {**_presets()["llama-3.2-1b"]["config"], "torch_dtype": "float16"}
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert _dtype_of(ProbeSettings(url="u"), str(tmp_path)) == "int4"  # it read fp16
    assert _dtype_of(ProbeSettings(url="u", dtype="bf16"), str(tmp_path)) == "bf16"  # given
    # --plan-model's quantization counts too (an Ollama server gives no checkpoint)
    assert _dtype_of(ProbeSettings(url="u", plan_model="deepseek-v3"), None) == "fp8"
    assert _dtype_of(ProbeSettings(url="u", plan_model="gpt-oss-120b"), None) == "mxfp4"
    # compressed-tensors, vLLM's own format: each group's weights say their bits and type
    for weights, dtype in (
        ({"num_bits": 8, "type": "float"}, "fp8"),
        ({"num_bits": 4, "type": "int"}, "int4"),
    ):
        groups = {"group_0": {"weights": weights}}
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "config_groups": groups,
        }
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert _dtype_of(ProbeSettings(url="u"), str(tmp_path)) == dtype
    config["quantization_config"] = {"quant_method": "AWQ", "bits": "4"}  # capitals, a string
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert _dtype_of(ProbeSettings(url="u"), str(tmp_path)) == "int4"
    # plan says what it counted: int4 keeps the embedding and LM head 16-bit
    gpt4 = run_json("--model", "gpt-oss-20b", "--dtype", "int4")["notes"]
    assert any("count it as int4 (embedding and LM head 16-bit)" in n for n in gpt4), gpt4
    fp8kv = run_json("--model", "llama-3.1-8b", "--kv-dtype", "fp8")
    assert fp8kv["kv_bytes_per_token"] == 65536


def test_custom_device_from_flags() -> None:
    r = run_json(
        "--model", "llama-3.2-1b", "--bandwidth", "100", "--tflops", "10", "--memory", "16"
    )
    assert r["device"]["name"] == "custom"
    assert r["decode_ceiling_weights_only_tok_s"] == pytest.approx(
        100e9 / (r["model"]["params_read_per_token"] * 2)
    )
    assert r["max_concurrent_requests"] > 0
    assert r["compute_bound_batch"] is None or r["compute_bound_batch"] > 1


def test_config_json_path(tmp_path: Path) -> None:
    config = {
        "model_type": "llama",
        "hidden_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 1024,
        "vocab_size": 1000,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    r = run_json("--model", str(tmp_path))
    assert r["kv_bytes_per_token"] == 2 * 4 * 2 * 64 * 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device", "h10"], "closest"),
        (["--model", "lama-3.1-8b"], "llama-3.1-8b"),
        (["--context", "-5"], "--context"),
        (["--bandwidth", "0"], "--bandwidth"),
        (["--gpu-memory-utilization", "1.5"], "utilization"),
        (["--dtype", "int3"], "weight dtype"),
        (["--model", "llama-3.1-8b", "--dtype", "mxfp4"], "llama-3.1-8b has no experts"),
        (["--dtype", "mxfp4"], "8b has no experts"),  # the default, nominal model too
        (["--compare", "--dtype", "mxfp4"], "8b has no experts"),
        (["--prompt-tokens", "0"], "--prompt-tokens"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["plan", *args])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())  # wherever the terminal wraps it


def test_missing_config_field_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    result = runner.invoke(app, ["plan", "--model", str(tmp_path)])
    assert result.exit_code == 2
    assert "num_hidden_layers" in result.output


def test_tables_render() -> None:
    result = runner.invoke(app, ["plan", "--model", "mixtral-8x7b", "--device", "a100-80gb"])
    assert result.exit_code == 0
    assert "TTFT floor" in result.output and "Batched decode" in result.output
    result = runner.invoke(app, ["plan", "--list-devices"])
    assert "h100-sxm" in result.output
    result = runner.invoke(app, ["plan", "--list-models"])
    assert "deepseek-v3" in result.output


def test_console_script_help() -> None:
    bin_dir = Path(sys.executable).parent
    for args in (["--help"], ["plan", "--help"]):
        out = subprocess.run(
            [bin_dir / "pdscope", *args], capture_output=True, text=True, check=True
        ).stdout
        assert "prefill" in out.lower() or "decode" in out.lower()


@pytest.mark.slow
def test_device_local_measures_this_machine() -> None:
    r = run_json("--device", "local", "--model", "llama-3.2-1b")
    measured = r["local_measurement"]
    # A memory bus between a laptop's DDR4 and a many-channel server socket.
    assert 1 < measured["read_gb_s"] < 1000
    assert 1 < measured["triad_gb_s"] < 1000
    assert 0.001 < measured["matmul_tflops"] < 1000
    # bf16's peak is the faster of bf16 and float32 matmuls (an AVX2-only CPU: float32)
    assert measured["matmul_computed_in"] in ("bfloat16", "float32")
    assert r["device"]["bandwidth_gb_s"] == pytest.approx(
        max(measured["read_gb_s"], measured["triad_gb_s"]), rel=0.01
    )
    assert r["decode_ceiling_tok_s"] > 0


def test_a_matmul_path_slower_than_its_limit_is_timed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A matmul whose warm-up takes longer than MATMUL_SLOW_S (torch's bf16 fallback on an
    AVX2-only CPU: ~13 s at 2,048) is not timed again, nor at the larger size: one call a
    type. The rate is the warm-up's, and float32 stands in for bf16 where it was faster."""
    import torch

    from pdscope.specs import local

    monkeypatch.setattr(local, "MATMUL_SLOW_S", 0.0)
    calls: list[torch.dtype] = []
    mm = torch.mm

    def counted(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if a.shape[0] in local.MATMUL_SIZES:  # not the small first call that sets up
            calls.append(a.dtype)
        return mm(a, b)

    monkeypatch.setattr(torch, "mm", counted)
    m = local.measure("bf16", array_mib=8, repeats=3)
    assert calls == [torch.bfloat16, torch.float32]
    assert m.matmul_tflops > 0 and m.matmul_computed_in in ("bfloat16", "float32")
    note = local.computed_in_note(m)
    assert ("float32" in note) == (m.matmul_computed_in == "float32")


def test_make_model_command(tmp_path: Path) -> None:
    result = runner.invoke(
        app,
        ["make-model", str(tmp_path / "m"), "--preset", "tiny", "--arch", "qwen2", "--layers", "3"],
    )
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["num_hidden_layers"] == 3
    # The checkpoint is one `plan` can read too.
    plan = run_json("--model", str(tmp_path / "m"))
    assert plan["model"]["num_layers"] == 3
    bad = runner.invoke(app, ["make-model", str(tmp_path / "x"), "--arch", "gpt2"])
    assert bad.exit_code == 2 and "gpt2" in bad.output


def test_weights_that_do_not_fit_are_said_first_and_the_pool_is_none() -> None:
    """A 70B model in bf16 on a 24 GB card printed 'KV pool -117.91 GB' and its decode ceiling
    as a plain figure, the misfit only in a note at the bottom."""
    result = runner.invoke(app, ["plan", "--model", "llama-3.1-70b", "--device", "rtx-4090"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.replace("│", " ").split())
    assert text.index("do not fit 90% of this device's 24 GB") < text.index("decode ceiling")
    assert "KV pool none the weights need" in text and "-1" not in text
    fits = runner.invoke(app, ["plan", "--model", "llama-3.1-8b", "--device", "h100"])
    assert "do not fit" not in fits.output and "KV pool none" not in fits.output
