"""plan (and probe, and simulate) on a GGUF file: the model's shape from its metadata, the
weights' bytes from its tensors. The files are written here with the `gguf` library, with the
K-quant mix llama.cpp's Q4_K_M uses; tests/test_llamacpp_peer.py checks the count against a real
llama-server's account of the file it loaded."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from pdscope.cli import app
from pdscope.roofline import arithmetic as rf
from pdscope.specs import SpecError, get_kv_precision, get_weight_precision, load_model

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 256, 2, 4, 2, 512, 512
runner = CliRunner()


def write_file(path: Path, arch: str, meta: dict[str, Any], shapes: dict[str, Any]) -> dict:
    """A GGUF of these metadata keys ("{arch}" in a key is the architecture) and tensors
    (name: (shape, type), all zeros: their bytes are counted, not their values); returns each
    tensor's bytes."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        key = key.format(arch=arch)
        if isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_uint32(key, value)
    sizes = {}
    for name, (shape, qtype) in shapes.items():
        packed = np.zeros(gguf.quants.quant_shape_to_byte_shape(shape, qtype), np.uint8)
        writer.add_tensor(name, packed, raw_dtype=qtype)
        sizes[name] = packed.nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sizes


def write_gguf(
    path: Path,
    arch: str = "llama",
    tied: bool = False,
    ffn_meta: int | list[int] = FFN,
    split_count: int | None = None,
) -> int:
    """A llama-shaped GGUF with Q4_K_M's mix (Q4_K layers and embedding, Q6_K ffn_down and LM
    head, f32 norms); returns the bytes its tensors take."""
    from gguf import GGMLQuantizationType as q

    meta: dict[str, Any] = {
        "{arch}.block_count": LAYERS,
        "{arch}.context_length": 2048,
        "{arch}.embedding_length": HIDDEN,
        "{arch}.feed_forward_length": ffn_meta,
        "{arch}.attention.head_count": HEADS,
        "{arch}.attention.head_count_kv": KV_HEADS,
        "general.file_type": q.Q4_K,
    }
    if split_count is not None:
        meta["split.count"] = split_count
    head_dim = HIDDEN // HEADS
    shapes = {
        "token_embd.weight": ((VOCAB, HIDDEN), q.Q4_K),
        "output_norm.weight": ((HIDDEN,), q.F32),
    }
    if not tied:
        shapes["output.weight"] = ((VOCAB, HIDDEN), q.Q6_K)
    for i in range(LAYERS):
        b = f"blk.{i}."
        shapes |= {
            b + "attn_norm.weight": ((HIDDEN,), q.F32),
            b + "attn_q.weight": ((HIDDEN, HIDDEN), q.Q4_K),
            b + "attn_k.weight": ((KV_HEADS * head_dim, HIDDEN), q.Q4_K),
            b + "attn_v.weight": ((KV_HEADS * head_dim, HIDDEN), q.Q6_K),
            b + "attn_output.weight": ((HIDDEN, HIDDEN), q.Q4_K),
            b + "ffn_norm.weight": ((HIDDEN,), q.F32),
            b + "ffn_gate.weight": ((FFN, HIDDEN), q.Q4_K),
            b + "ffn_up.weight": ((FFN, HIDDEN), q.Q4_K),
            b + "ffn_down.weight": ((HIDDEN, FFN), q.Q6_K),
        }
    return sum(write_file(path, arch, meta, shapes).values())


@pytest.fixture(scope="module")
def q4km(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-q4_k_m.gguf"
    return path, write_gguf(path)


def test_a_gguf_is_counted_by_its_tensors_bytes(q4km: tuple[Path, int]) -> None:
    """Q4_K_M is a mix whose average depends on the model (plan's q4_k_m preset, 4.85 bits, is a
    7-8B Llama's): read from the file, the weights are the bytes its tensors take, exactly."""
    path, tensor_bytes = q4km
    spec = load_model(str(path))
    assert (spec.num_layers, spec.hidden_size, spec.vocab_size) == (LAYERS, HIDDEN, VOCAB)
    assert not spec.tie_word_embeddings and spec.max_position_embeddings == 2048
    w = spec.file_weights
    assert w is not None and w.name == "gguf q4_k"
    assert rf.weight_bytes(spec, w) == pytest.approx(tensor_bytes, rel=1e-12)
    assert tensor_bytes < path.stat().st_size < tensor_bytes + 64 * 1024  # + header, padding
    # the LM head (Q6_K, 6.5625 bits) and the embedding (Q4_K, 4.5) at their own widths
    assert w.head_bits == pytest.approx(6.5625) and w.embedding_bits == pytest.approx(4.5)
    assert 4.5 < w.bits_per_weight < 6.5625  # the layers' Q4_K and Q6_K, mixed
    # a decode token reads the layers and the head, and one row of the embedding
    head = spec.lm_head_params * 6.5625 / 8
    assert rf.read_bytes(spec, w) == pytest.approx(
        (spec.params_read_per_token - spec.lm_head_params) * w.bits_per_weight / 8 + head
    )
    # this machine's matmul is timed in the type the file computes in: bf16 for quantized
    # weights, a float file's own type (it was bf16 for an f16 file, labelled fp16)
    from pdscope.commands.plan import local_compute
    from pdscope.specs.gguf import read_gguf

    assert local_compute(w) == "bf16"
    assert local_compute(replace(read_gguf(path), file_type="F16").weights) == "fp16"
    kv = rf.kv_bytes_per_token(spec, get_kv_precision("fp16"))
    assert kv == 2 * LAYERS * KV_HEADS * (HIDDEN // HEADS) * 2


def test_plan_takes_a_gguf_and_its_own_widths_unless_told(q4km: tuple[Path, int]) -> None:
    path, tensor_bytes = q4km
    result = runner.invoke(app, ["plan", "--model", str(path), "--device", "h100", "--json"])
    assert result.exit_code == 0, result.output
    r = json.loads(result.stdout)
    assert r["dtype"] == "gguf q4_k" and r["weight_bytes"] == pytest.approx(tensor_bytes)
    assert "as stored in the GGUF" in r["dtype_note"]
    told = runner.invoke(app, ["plan", "--model", str(path), "--dtype", "bf16", "--json"])
    assert told.exit_code == 0, told.output
    spec = load_model(str(path))
    bf16 = json.loads(told.stdout)["weight_bytes"]
    assert bf16 == pytest.approx(rf.weight_bytes(spec, get_weight_precision("bf16")))
    assert bf16 > 2.5 * tensor_bytes


def test_a_tied_gguf_reads_its_embedding_as_the_head(tmp_path: Path) -> None:
    path = tmp_path / "tied.gguf"
    tensor_bytes = write_gguf(path, tied=True)
    spec = load_model(str(path))
    assert spec.tie_word_embeddings
    assert rf.weight_bytes(spec, spec.file_weights) == pytest.approx(tensor_bytes, rel=1e-12)


def test_a_gguf_plan_cannot_map_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "other.gguf"
    write_gguf(path, arch="rwkv6")
    with pytest.raises(SpecError, match="GGUF architecture 'rwkv6' is not one plan maps"):
        load_model(str(path))
    result = runner.invoke(app, ["plan", "--model", str(path)])
    assert result.exit_code == 2 and "rwkv6" in result.output
    # truncated anywhere, a header fails inside gguf in several ways (IndexError too): each a
    # clear refusal, never a traceback
    whole = tmp_path / "whole.gguf"
    write_gguf(whole)
    for cut in (4, 24, 40, 200, 1000, whole.stat().st_size // 2):
        broken = tmp_path / f"broken-{cut}.gguf"
        broken.write_bytes(whole.read_bytes()[:cut])
        result = runner.invoke(app, ["plan", "--model", str(broken)])
        assert result.exit_code == 2 and "cannot read" in result.output, (cut, result.output)
    # shapes plan cannot read right are refused by name, not counted wrong
    cases = {
        "split": ({"split_count": 3}, "one part of a split GGUF"),
        "layers": ({"ffn_meta": [FFN, 2 * FFN]}, "feed_forward_length differs by layer"),
        "mismatch": ({"ffn_meta": 2 * FFN}, "its tensors hold"),
    }
    for name, (kwargs, needle) in cases.items():
        path = tmp_path / f"{name}.gguf"
        write_gguf(path, **kwargs)  # type: ignore[arg-type]
        result = runner.invoke(app, ["plan", "--model", str(path)])
        assert result.exit_code == 2 and needle in " ".join(result.output.split()), result.output
    # a per-layer array whose entries agree is that one value
    same = tmp_path / "same.gguf"
    write_gguf(same, ffn_meta=[FFN, FFN])
    assert load_model(str(same)).layers[0].mlp_params == 3 * HIDDEN * FFN


def test_probe_takes_the_gguf_an_ollama_server_names(q4km: tuple[Path, int]) -> None:
    """Ollama cannot run here: its /api/show, whose modelfile's FROM line names the GGUF blob
    it loaded, is served by a small HTTP server on 127.0.0.1. Where that file is readable here,
    probe's arithmetic counts it by its tensors, as plan does, with no --plan-model."""
    import asyncio
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import httpx

    from pdscope.client.detect import detect
    from pdscope.commands.probe import ProbeSettings, _served_model, model_bytes_for

    path, _ = q4km
    answers = {
        "/api/tags": {"models": [{"name": "tiny:latest", "model": "tiny:latest"}]},
        "/api/show": {
            "modelfile": f'# Modelfile generated by "ollama show"\nFROM {path}\nPARAMETER x 1\n',
            "model_info": {"general.architecture": "llama", "general.parameter_count": 1},
        },
    }

    class Handler(BaseHTTPRequestHandler):
        def answer(self) -> None:
            body = answers.get(self.path)
            data = json.dumps(body).encode() if body else b"{}"
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = answer

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"

    async def served() -> dict:
        async with httpx.AsyncClient() as client:
            runtime = await detect(client, url)
            assert runtime.name == "ollama"
            return await _served_model(client, runtime, "tiny:latest", None)

    try:
        found = asyncio.run(served())
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert found["root"] == str(path)
    spec = load_model(found["root"])
    counted = model_bytes_for(ProbeSettings(url=url), found["root"])
    assert counted is not None
    assert counted.weight_bytes == pytest.approx(rf.read_bytes(spec, spec.file_weights))
    # a --dtype still says what to count
    told = model_bytes_for(ProbeSettings(url=url, device="h100", dtype="bf16"), found["root"])
    assert told is not None
    assert told.weight_bytes == pytest.approx(rf.read_bytes(spec, get_weight_precision("bf16")))


def test_a_moe_gguf_reads_its_experts_and_the_rest_at_their_own_widths(tmp_path: Path) -> None:
    """A token reads k of E experts but every attention weight: where the two are stored
    differently (gpt-oss's MXFP4 experts beside bf16 attention), one mean width for the layers
    puts the read of a token far off. The experts' tensors (*_exps) and the rest are counted
    apart."""
    from gguf import GGMLQuantizationType as q

    experts, used, moe_ffn, hidden, heads, kv_heads, vocab = 8, 2, 256, 256, 4, 2, 512
    head_dim = hidden // heads
    path = tmp_path / "moe.gguf"
    meta = {
        "{arch}.block_count": LAYERS,
        "{arch}.context_length": 4096,
        "{arch}.embedding_length": hidden,
        "{arch}.feed_forward_length": 4 * hidden,
        "{arch}.attention.head_count": heads,
        "{arch}.attention.head_count_kv": kv_heads,
        "{arch}.attention.key_length": head_dim,
        "{arch}.expert_count": experts,
        "{arch}.expert_used_count": used,
        "{arch}.expert_feed_forward_length": moe_ffn,
    }
    shapes = {
        "token_embd.weight": ((vocab, hidden), q.BF16),
        "output_norm.weight": ((hidden,), q.F32),
        "output.weight": ((vocab, hidden), q.BF16),
    }
    for i in range(LAYERS):
        b = f"blk.{i}."
        shapes |= {
            b + "attn_norm.weight": ((hidden,), q.F32),
            b + "attn_q.weight": ((heads * head_dim, hidden), q.BF16),
            b + "attn_k.weight": ((kv_heads * head_dim, hidden), q.BF16),
            b + "attn_v.weight": ((kv_heads * head_dim, hidden), q.BF16),
            b + "attn_output.weight": ((hidden, heads * head_dim), q.BF16),
            b + "attn_q_norm.weight": ((head_dim,), q.F32),
            b + "attn_k_norm.weight": ((head_dim,), q.F32),
            b + "ffn_norm.weight": ((hidden,), q.F32),
            b + "ffn_gate_inp.weight": ((experts, hidden), q.F32),
            b + "ffn_gate_exps.weight": ((experts, moe_ffn, hidden), q.MXFP4),
            b + "ffn_up_exps.weight": ((experts, moe_ffn, hidden), q.MXFP4),
            b + "ffn_down_exps.weight": ((experts, hidden, moe_ffn), q.MXFP4),
        }
    sizes = write_file(path, "qwen3moe", meta, shapes)

    spec = load_model(str(path))
    w = spec.file_weights
    assert spec.is_moe and w is not None
    assert w.bits_per_weight == pytest.approx(4.25) and w.rest_bits is not None
    assert rf.weight_bytes(spec, w) == pytest.approx(sum(sizes.values()), rel=1e-12)
    # one token: every non-expert layer tensor, k of E of each expert tensor, the LM head, and
    # one embedding row (counted at the layers' rest width, as plan counts a gathered row)
    exps = sum(v for k, v in sizes.items() if "_exps." in k)
    rest = sum(v for k, v in sizes.items() if k.startswith("blk.") and "_exps." not in k)
    rest += sizes["output_norm.weight"]
    expected = rest + exps * used / experts + sizes["output.weight"] + hidden * w.rest_bits / 8
    assert rf.read_bytes(spec, w) == pytest.approx(expected, rel=1e-9)
    # one mean width for all the layers put that read over a quarter lower (the LM head,
    # counted apart in both, is most of this small model's read)
    mean = replace(
        w,
        bits_per_weight=8 * (exps + rest) / (spec.total_params - 2 * vocab * hidden),
        rest_bits=None,
    )
    assert rf.read_bytes(spec, mean) < 0.8 * expected


def test_a_served_gguf_path_counts_only_if_it_holds_what_the_server_loaded(
    q4km: tuple[Path, int],
) -> None:
    """llama.cpp's /props names its model's path on its own machine: a file at that path here
    is its model only if it holds the bytes the server says it loaded."""
    from pdscope.commands.probe import _same_file

    path, tensor_bytes = q4km
    assert _same_file(str(path), float(tensor_bytes))
    assert not _same_file(str(path), float(tensor_bytes + 1))
    assert not _same_file(str(path), None)
    assert not _same_file(str(path.with_name("absent.gguf")), float(tensor_bytes))


def gemma3_shapes(layers: int, tower: bool, qk_norm: bool = True) -> dict[str, Any]:
    """Gemma 3's tensors as Ollama's converter names them (q/k norms, four norms a layer, tied
    head), with its vision encoder ("v.*") and projector ("mm.*") in the same file; without
    the q/k norms, Gemma 2's."""
    from gguf import GGMLQuantizationType as q

    head_dim = 64
    shapes: dict[str, Any] = {
        "token_embd.weight": ((VOCAB, HIDDEN), q.Q6_K),
        "output_norm.weight": ((HIDDEN,), q.F32),
    }
    for i in range(layers):
        b = f"blk.{i}."
        shapes |= {
            b + "attn_q.weight": ((HEADS * head_dim, HIDDEN), q.Q4_K),
            b + "attn_k.weight": ((KV_HEADS * head_dim, HIDDEN), q.Q4_K),
            b + "attn_v.weight": ((KV_HEADS * head_dim, HIDDEN), q.Q6_K),
            b + "attn_output.weight": ((HIDDEN, HEADS * head_dim), q.Q4_K),
            b + "ffn_gate.weight": ((FFN, HIDDEN), q.Q4_K),
            b + "ffn_up.weight": ((FFN, HIDDEN), q.Q4_K),
            b + "ffn_down.weight": ((HIDDEN, FFN), q.Q6_K),
        }
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            shapes[f"{b}{norm}.weight"] = ((HIDDEN,), q.F32)
        if qk_norm:
            shapes[b + "attn_q_norm.weight"] = ((head_dim,), q.F32)
            shapes[b + "attn_k_norm.weight"] = ((head_dim,), q.F32)
    if tower:
        shapes |= {
            "v.patch_embd.weight": ((HIDDEN, 3 * 14 * 14), q.F16),
            "v.blk.0.attn_q.weight": ((HIDDEN, HIDDEN), q.F16),
            "v.blk.0.ffn_up.weight": ((FFN, HIDDEN), q.F16),
            "mm.mm_input_projection.weight": ((HIDDEN, HIDDEN), q.F16),
        }
    return shapes


def gemma3_config(layers: int, **window: Any) -> dict[str, Any]:
    """The same model as Hugging Face's config.json states it."""
    return {
        "model_type": "gemma3_text",
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": 64,
        "vocab_size": VOCAB,
        **window,
    }


def test_a_gemma3_gguf_windows_five_layers_in_six_and_leaves_its_vision_tower_out(
    tmp_path: Path,
) -> None:
    """Gemma 3 attends over a window in five layers of every six: its KV at long context is a
    fraction of a full-attention model's. The layers come from the file's pattern (Ollama writes
    one flag a layer) or, as llama.cpp reads a file without one, five in six; without a window
    length, no layer slides. Ollama packs the vision encoder into the same file: a text token
    does not read it, so it is left out of the weights and said in the note."""
    from pdscope.specs.models import spec_from_config

    layers = 7
    flags = [(i + 1) % 6 != 0 for i in range(layers)]
    meta: dict[str, Any] = {
        "{arch}.block_count": layers,
        "{arch}.context_length": 32768,
        "{arch}.embedding_length": HIDDEN,
        "{arch}.feed_forward_length": FFN,
        "{arch}.attention.head_count": HEADS,
        "{arch}.attention.head_count_kv": KV_HEADS,
        "{arch}.attention.key_length": 64,
        "{arch}.attention.sliding_window": 512,
    }
    cases = {
        "flags": {**meta, "{arch}.attention.sliding_window_pattern": flags},
        "default": meta,
        "none": {k: v for k, v in meta.items() if "sliding_window" not in k},
    }
    specs = {}
    for name, case in cases.items():
        path = tmp_path / f"gemma3-{name}.gguf"
        sizes = write_file(path, "gemma3", case, gemma3_shapes(layers, tower=True))
        specs[name] = load_model(str(path))
    windows = [512, 512, 512, 512, 512, None, 512]
    assert [layer.window for layer in specs["flags"].layers] == windows
    assert [layer.window for layer in specs["default"].layers] == windows
    assert all(layer.window is None for layer in specs["none"].layers)
    # the same shape as from config.json: parameters, and the KV a 32k context holds
    config = spec_from_config(gemma3_config(layers, sliding_window=512), "gemma3")
    spec, kv = specs["flags"], get_kv_precision("bf16")
    assert spec.total_params == config.total_params and spec.tie_word_embeddings
    assert rf.kv_bytes_at_context(spec, kv, 32768) == rf.kv_bytes_at_context(config, kv, 32768)
    assert rf.kv_bytes_at_context(spec, kv, 32768) < 0.2 * rf.kv_bytes_at_context(
        specs["none"], kv, 32768
    )
    # the weights are the language model's tensors; the vision tower's are named in the note
    tower = sum(v for k, v in sizes.items() if k.startswith(("v.", "mm.")))
    w = spec.file_weights
    assert w is not None and tower > 0
    assert rf.weight_bytes(spec, w) == pytest.approx(sum(sizes.values()) - tower, rel=1e-12)
    assert f"{tower / 1e9:.3g} GB of a vision or audio tower" in w.note


def test_an_ollama_gpt_oss_gguf_reads_as_the_model_card_counts_it(tmp_path: Path) -> None:
    """Ollama's own converter names gpt-oss "gptoss", fuses q/k/v (with their biases) and gate
    with up in OpenAI's layout, and keeps the experts in MXFP4: read as the config counts it
    (biases of attention, experts and router, attention sinks), windows on every other layer."""
    from gguf import GGMLQuantizationType as q

    from pdscope.specs.models import spec_from_config

    experts, used, inter, head_dim = 4, 2, 256, 64
    qkv = (HEADS + 2 * KV_HEADS) * head_dim
    meta: dict[str, Any] = {
        "{arch}.block_count": LAYERS,
        "{arch}.context_length": 131072,
        "{arch}.embedding_length": HIDDEN,
        "{arch}.feed_forward_length": inter,
        "{arch}.expert_count": experts,
        "{arch}.expert_used_count": used,
        "{arch}.attention.head_count": HEADS,
        "{arch}.attention.head_count_kv": KV_HEADS,
        "{arch}.attention.key_length": head_dim,
        "{arch}.attention.sliding_window": 128,
    }
    shapes: dict[str, Any] = {
        "token_embd.weight": ((VOCAB, HIDDEN), q.BF16),
        "output_norm.weight": ((HIDDEN,), q.F32),
        "output.weight": ((VOCAB, HIDDEN), q.BF16),
    }
    for i in range(LAYERS):
        b = f"blk.{i}."
        shapes |= {
            b + "attn_norm.weight": ((HIDDEN,), q.F32),
            b + "attn_qkv.weight": ((qkv, HIDDEN), q.BF16),
            b + "attn_qkv.bias": ((qkv,), q.F32),
            b + "attn_out.weight": ((HIDDEN, HEADS * head_dim), q.BF16),
            b + "attn_out.bias": ((HIDDEN,), q.F32),
            b + "attn_sinks.weight": ((HEADS,), q.F32),
            b + "ffn_norm.weight": ((HIDDEN,), q.F32),
            b + "ffn_gate_inp.weight": ((experts, HIDDEN), q.F32),
            b + "ffn_gate_inp.bias": ((experts,), q.F32),
            b + "ffn_gate_up_exps.weight": ((experts, 2 * inter, HIDDEN), q.MXFP4),
            b + "ffn_gate_up_exps.bias": ((experts, 2 * inter), q.F32),
            b + "ffn_down_exps.weight": ((experts, HIDDEN, inter), q.MXFP4),
            b + "ffn_down_exps.bias": ((experts, HIDDEN), q.F32),
        }
    path = tmp_path / "gptoss.gguf"
    sizes = write_file(path, "gptoss", meta, shapes)
    spec = load_model(str(path))
    config = spec_from_config(
        {
            "model_type": "gpt_oss",
            "hidden_size": HIDDEN,
            "intermediate_size": inter,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS,
            "head_dim": head_dim,
            "num_local_experts": experts,
            "num_experts_per_tok": used,
            "vocab_size": VOCAB,
            "sliding_window": 128,
            "attention_bias": True,
            "tie_word_embeddings": False,
        },
        "gpt-oss",
    )
    # exactly: the 0.1% check would let a bias or two through, the count does not
    assert (
        spec.total_params
        == config.total_params
        == sum(int(np.prod(shape)) for shape, _ in shapes.values())
    )
    assert [layer.window for layer in spec.layers] == [128, None]
    w = spec.file_weights
    # the experts at their bytes: MXFP4's 4.25 bits and their f32 biases, which a token reads
    # k of E of too
    exps = [k for k in shapes if "_exps." in k]
    elements = sum(int(np.prod(shapes[k][0])) for k in exps)
    assert w is not None and 4.25 < w.bits_per_weight < 4.5
    assert w.bits_per_weight == pytest.approx(8 * sum(sizes[k] for k in exps) / elements)
    assert rf.weight_bytes(spec, w) == pytest.approx(sum(sizes.values()), rel=1e-12)


def gemma_meta(layers: int, **keys: Any) -> dict[str, Any]:
    return {
        "{arch}.block_count": layers,
        "{arch}.context_length": 8192,
        "{arch}.embedding_length": HIDDEN,
        "{arch}.feed_forward_length": FFN,
        "{arch}.attention.head_count": HEADS,
        "{arch}.attention.head_count_kv": KV_HEADS,
        "{arch}.attention.key_length": 64,
        **{f"{{arch}}.attention.{k}": v for k, v in keys.items()},
    }


W, F = 512, None  # a windowed layer, a full one
WINDOW_CASES = {
    # Gemma 2 windows 4,096 tokens on every other layer where the file gives no length
    "gemma2 default": ("gemma2", {}, [4096, F, 4096, F]),
    "gemma3 pattern 2": ("gemma3", {"sliding_window": W, "sliding_window_pattern": 2}, [W, F] * 2),
    # 0, as llama.cpp reads it: every layer slides
    "gemma3 pattern 0": ("gemma3", {"sliding_window": W, "sliding_window_pattern": 0}, [W] * 4),
    "gemma3 one length a layer": ("gemma3", {"sliding_window": [W] * 4}, [W, W, W, W]),
}


@pytest.mark.parametrize("case", sorted(WINDOW_CASES))
def test_window_patterns_read_as_llamacpp_reads_them(case: str, tmp_path: Path) -> None:
    arch, keys, windows = WINDOW_CASES[case]
    path = tmp_path / "w.gguf"
    write_file(path, arch, gemma_meta(4, **keys), gemma3_shapes(4, False, arch == "gemma3"))
    assert [layer.window for layer in load_model(str(path)).layers] == windows


def test_window_patterns_plan_cannot_read_are_refused_by_name(tmp_path: Path) -> None:
    cases = {
        "short": ({"sliding_window_pattern": [True, False]}, "'layer_types' has 2 entries"),
        "lengths": ({"sliding_window": [W, W, 2 * W, W]}, "sliding_window differs by layer"),
    }
    for name, (keys, needle) in cases.items():
        path = tmp_path / f"{name}.gguf"
        write_file(
            path, "gemma3", gemma_meta(4, **{"sliding_window": W, **keys}), gemma3_shapes(4, False)
        )
        result = runner.invoke(app, ["plan", "--model", str(path)])
        out = " ".join(result.output.split())
        assert result.exit_code == 2 and needle in out and str(path) in out, result.output


def test_phi3s_window_is_off_in_a_gguf_as_llamacpp_runs_it(tmp_path: Path) -> None:
    """Phi-3-mini's config.json has a 2,047-token window on every layer; llama.cpp switches
    Phi-3's window off, so a GGUF it serves holds the whole context's KV. Fused q/k/v and
    gate/up count as the config's separate ones."""
    from gguf import GGMLQuantizationType as q

    from pdscope.specs.models import spec_from_config

    shapes: dict[str, Any] = {
        "token_embd.weight": ((VOCAB, HIDDEN), q.BF16),
        "output_norm.weight": ((HIDDEN,), q.F32),
        "output.weight": ((VOCAB, HIDDEN), q.BF16),
    }
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        b = f"blk.{i}."
        shapes |= {
            b + "attn_norm.weight": ((HIDDEN,), q.F32),
            b + "attn_qkv.weight": (((HEADS + 2 * KV_HEADS) * head_dim, HIDDEN), q.BF16),
            b + "attn_output.weight": ((HIDDEN, HIDDEN), q.BF16),
            b + "ffn_norm.weight": ((HIDDEN,), q.F32),
            b + "ffn_up.weight": ((2 * FFN, HIDDEN), q.BF16),
            b + "ffn_down.weight": ((HIDDEN, FFN), q.BF16),
        }
    path = tmp_path / "phi3.gguf"
    meta = {k: v for k, v in gemma_meta(LAYERS, sliding_window=2047).items() if "key_len" not in k}
    write_file(path, "phi3", meta, shapes)
    spec = load_model(str(path))
    assert all(layer.window is None for layer in spec.layers)
    config = {
        "model_type": "phi3",
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "sliding_window": 2047,
        "tie_word_embeddings": False,
    }
    from_config = spec_from_config(config, "phi-3")
    assert spec.total_params == from_config.total_params
    assert all(layer.window == 2047 for layer in from_config.layers)
