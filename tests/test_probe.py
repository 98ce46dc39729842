"""`pdscope probe`: the client adapters and the whole procedure over real HTTP.

The embedded server (`pdscope serve`) answers in both dialects. What cannot run here is replaced
by recorded-response fakes, each labelled as such: a llama.cpp server's `timings`, a server that
sends multi-token chunks, malformed streams and a stream that stops mid-way.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from typer.testing import CliRunner

from pdscope.cli import app as cli
from pdscope.client.adapters import openai_body, run_ollama, run_openai, session
from pdscope.client.trace import Chunk, Trace
from pdscope.commands.probe import ProbeSettings, probe
from pdscope.server.launch import free_port
from tests.conftest import Server

pytestmark = pytest.mark.slow


def settings(url: str, **kw) -> ProbeSettings:
    base = {
        "prompt_tokens": [100, 400, 1000],
        "output_tokens": 24,
        "repeats": 2,
        "context_tokens": 1500,
    }
    return ProbeSettings(url=url, **{**base, **kw})


def test_probe_openai_dialect(medium_server: Server) -> None:
    r = asyncio.run(probe(settings(medium_server.url)))
    assert r["runtime"]["name"] == "pdscope" and r["runtime"]["api"] == "openai-completions"
    assert r["settings"]["exact_prompt_tokens"]
    sweep = r["sweep"]
    assert [p["prompt_tokens"] for p in sweep] == [100, 400, 1000]  # exact, via /tokenize
    assert sweep[-1]["ttft_ms"] > 2 * sweep[0]["ttft_ms"]  # prefill grows with the prompt
    rates = [p["decode_tok_s"] for p in sweep]
    assert max(rates) / min(rates) < 2.5  # decode roughly flat
    pc = r["prefix_cache"]
    assert pc["cached_tokens"] >= 992 and pc["warm_over_cold"] < 0.7
    kinds = {f["finding"] for f in r["findings"]}
    assert "Prefix caching works" in kinds
    assert not r["failures"] and r["partial"] is None
    for t in r["traces"]:
        assert t["token_source"] == "server-usage"
        assert t["output_tokens"] == 24 and t["prompt_tokens"] == t["prompt_tokens_asked"]
        assert all(c["text"] for c in t["chunks"])
    assert r["ttft_fit"]["ms_per_token"] > 0


def test_probe_chat_ignores_the_role_chunk(medium_server: Server) -> None:
    async def one() -> Trace:
        async with session() as c:
            body = openai_body("openai-chat", "medium", "Say something", 8)
            return await run_openai(c, medium_server.url, "openai-chat", body)

    t = asyncio.run(one())
    assert t.ok and t.output_tokens == 8
    assert all(chunk.text for chunk in t.chunks)  # the role-only first chunk is not content


def test_probe_ollama_dialect(medium_server: Server) -> None:
    r = asyncio.run(probe(settings(medium_server.url, api="ollama")))
    assert r["runtime"]["api"] == "ollama" and not r["settings"]["exact_prompt_tokens"]
    sweep = r["sweep"]
    assert sweep[-1]["ttft_ms"] > 2 * sweep[0]["ttft_ms"]
    for t in r["traces"]:
        assert t["token_source"] == "ollama-counters"
        assert t["server"]["ollama"]["eval_count"] == t["output_tokens"]
    assert "server_prompt_eval_ms" in sweep[0]  # the server's own view, shown beside ours
    # The prefix check reports the TTFT drop even without a cached-token count.
    assert r["prefix_cache"]["warm_over_cold"] < 0.7


def test_probe_cli_json_and_plot(medium_server: Server, tmp_path: Path) -> None:
    out, png = tmp_path / "probe.json", tmp_path / "probe.png"
    result = CliRunner().invoke(
        cli,
        [
            "probe",
            medium_server.url,
            "--prompt-tokens",
            "64,256",
            "--repeats",
            "1",
            "--output-tokens",
            "8",
            "--json",
            str(out),
            "--plot",
            str(png),
            "--device",
            "a10g",
            "--plan-model",
            str(medium_server.log.parent),
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    for key in ("runtime", "model", "sweep", "prefill_tok_s", "decode_tok_s", "prefix_cache"):
        assert key in data
    assert {"prompt_tokens", "ttft_ms", "decode_tok_s"} <= set(data["sweep"][0])
    assert {"cold_ttft_ms", "warm_ttft_ms"} <= set(data["prefix_cache"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Findings" in result.output


def test_probe_errors(medium_server: Server) -> None:
    runner = CliRunner()
    port = free_port()  # nothing listens there
    r = runner.invoke(cli, ["probe", f"http://127.0.0.1:{port}"])
    assert r.exit_code == 1 and "cannot connect" in r.output
    r = runner.invoke(cli, ["probe", medium_server.url, "--model", "gpt-4"])
    assert r.exit_code == 1 and "does not serve model 'gpt-4'" in r.output
    r = runner.invoke(cli, ["probe", medium_server.url, "--api", "grpc"])
    assert r.exit_code == 2 and "--api" in r.output
    r = runner.invoke(cli, ["probe", medium_server.url, "--prompt-tokens", "a,b"])
    assert r.exit_code == 2


# --- recorded-response fakes (servers that cannot run here) ---------------------------------

LLAMACPP_FINAL = {
    "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
    "timings": {
        "cache_n": 12,
        "prompt_n": 88,
        "prompt_ms": 41.5,
        "prompt_per_second": 2120.5,
        "predicted_n": 6,
        "predicted_ms": 60.2,
        "predicted_per_second": 99.7,
    },
}


def fake_app() -> FastAPI:
    """Replays recorded response shapes, with timing controlled by the test."""
    app = FastAPI()

    def sse(events: list, gap_s: float = 0.02) -> StreamingResponse:
        async def gen():
            for e in events:
                await asyncio.sleep(gap_s)
                yield e if isinstance(e, str) else f"data: {json.dumps(e)}\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.post("/llamacpp/v1/completions")
    async def llamacpp() -> StreamingResponse:
        # Recorded shape of llama.cpp's server: no usage, `timings` on the last event.
        words = [
            {"choices": [{"index": 0, "text": w, "finish_reason": None}]}
            for w in ["a", " b", " c", " d", " e", " f"]
        ]
        return sse([*words, LLAMACPP_FINAL, "data: [DONE]\n\n"])

    @app.post("/multi/v1/completions")
    async def multi() -> StreamingResponse:
        # Three chunks carrying 2, 3 and 1 tokens; usage says 6.
        chunks = [
            {"choices": [{"index": 0, "text": t, "finish_reason": None}]}
            for t in ["ab", "cde", "f"]
        ]
        final = {
            "choices": [],
            "usage": {"prompt_tokens": 10, "completion_tokens": 6, "total_tokens": 16},
        }
        return sse([*chunks, final, "data: [DONE]\n\n"], gap_s=0.03)

    @app.post("/malformed/v1/completions")
    async def malformed() -> StreamingResponse:
        return sse(
            [{"choices": [{"index": 0, "text": "x", "finish_reason": None}]}, "data: {not json\n\n"]
        )

    @app.post("/cut/v1/completions")
    async def cut() -> StreamingResponse:
        return sse([{"choices": [{"index": 0, "text": "x", "finish_reason": None}]}])

    @app.get("/lc/v1/models")
    async def lc_models() -> dict:
        return {"data": [{"id": "m", "owned_by": "llamacpp"}]}

    @app.post("/lc/tokenize")
    async def lc_tokenize() -> dict:
        return {"tokens": []}  # llama.cpp reads "content"; a "prompt" gets nothing back

    @app.get("/lc/props")
    async def lc_props() -> dict:
        return {"default_generation_settings": {"n_ctx": 4096}}

    @app.post("/reasoning/v1/chat/completions")
    async def reasoning() -> StreamingResponse:
        # Recorded shape of a vLLM reasoning parser: reasoning_content first, then content.
        think = [{"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]}] * 4
        say = [{"choices": [{"index": 0, "delta": {"content": "ok"}}]}] * 2
        final = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 6}}
        return sse(["event: message\n", *think, *say, final, "data: [DONE]\n\n"])

    @app.post("/odd/v1/completions")
    async def odd() -> StreamingResponse:
        return sse(["data: 1\n\n"])

    @app.post("/onechunk/v1/completions")
    async def onechunk() -> StreamingResponse:
        body = "".join(
            f"data: {json.dumps({'choices': [{'index': 0, 'text': t}]})}\n\n" for t in "abc"
        )
        return sse(
            [
                body
                + 'data: {"choices": [], "usage": {"completion_tokens": 3}}\n\n'
                + "data: [DONE]\n\n"
            ]
        )

    @app.post("/ollama-cut/api/generate")
    async def ollama_cut() -> StreamingResponse:
        async def gen():
            yield json.dumps({"model": "m", "response": "x", "done": False}) + "\n"

        return StreamingResponse(gen(), media_type="application/x-ndjson")

    return app


@pytest.fixture(scope="module")
def fake() -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(fake_app(), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def run(url: str) -> Trace:
    async def go() -> Trace:
        async with session(timeout_s=10) as c:
            body = openai_body("openai-completions", "m", "hi", 6)
            return await run_openai(c, url, "openai-completions", body)

    return asyncio.run(go())


def test_llamacpp_timings_fake(fake: str) -> None:
    t = run(f"{fake}/llamacpp")
    assert t.ok and t.token_source == "llamacpp-timings"
    assert t.output_tokens == 6 and t.prompt_tokens == 100 and t.cached_tokens == 12
    assert t.server["llamacpp"]["prompt_ms"] == 41.5


def test_multi_token_chunks_fake(fake: str) -> None:
    t = run(f"{fake}/multi")
    assert t.ok and t.output_tokens == 6 and len(t.chunks) == 3
    samples = t.itl_samples_s()
    # 5 inter-token gaps for 6 tokens, spread over the 2 chunk gaps as 3 + 2.
    assert len(samples) == 5
    assert sum(samples) == pytest.approx(t.chunks[-1].t_s - t.chunks[0].t_s)
    assert t.tpot_s == pytest.approx((t.chunks[-1].t_s - t.chunks[0].t_s) / 5)


def test_itl_with_known_chunk_sizes() -> None:
    t = Trace(
        "openai-completions",
        "u",
        "m",
        start_s=0.0,
        end_s=1.0,
        output_tokens=4,
        chunks=[Chunk(0.1, "a", 1), Chunk(0.3, "bc", 2), Chunk(0.4, "d", 1)],
    )
    assert t.itl_samples_s() == pytest.approx([0.1, 0.1, 0.1])  # 0.2 / 2 twice, then 0.1
    assert t.ttft_s == pytest.approx(0.1) and t.tpot_s == pytest.approx(0.1)


def test_malformed_and_cut_streams_fake(fake: str) -> None:
    bad = run(f"{fake}/malformed")
    assert not bad.ok and "malformed" in bad.error and bad.ttft_s is None
    cut = run(f"{fake}/cut")
    assert not cut.ok and "before data: [DONE]" in cut.error and cut.e2e_s is None

    async def ollama() -> Trace:
        async with session(timeout_s=10) as c:
            return await run_ollama(c, f"{fake}/ollama-cut", "m", "hi", 4)

    t = asyncio.run(ollama())
    assert not t.ok and "done" in t.error


def test_failed_requests_never_become_numbers() -> None:
    from pdscope.analysis.probe import analyze

    good = Trace(
        "openai-completions",
        "u",
        "m",
        label="sweep",
        prompt_tokens_asked=100,
        start_s=0.0,
        end_s=0.5,
        output_tokens=3,
        prompt_tokens=100,
        chunks=[Chunk(0.1, "a"), Chunk(0.2, "b"), Chunk(0.3, "c")],
    )
    failed = Trace(
        "openai-completions",
        "u",
        "m",
        label="sweep",
        prompt_tokens_asked=100,
        start_s=0.0,
        error="HTTP 500: boom",
    )
    r = analyze([good, failed], "vllm")
    point = r["sweep"][0]
    assert point["failed"] == 1 and point["ttft_ms"] == pytest.approx(100)
    assert r["failures"] == [{"label": "sweep", "prompt_tokens": 100, "error": "HTTP 500: boom"}]


def test_llamacpp_detection_fake(fake: str) -> None:
    from pdscope.client.detect import detect

    async def go():
        async with httpx.AsyncClient() as c:
            return await detect(c, f"{fake}/lc")

    rt = asyncio.run(go())
    assert rt.name == "llama.cpp" and not rt.has_tokenize and rt.max_model_len == 4096


def test_reasoning_tokens_count_for_timing_fake(fake: str) -> None:
    async def go() -> Trace:
        async with session(timeout_s=10) as c:
            body = openai_body("openai-chat", "m", "hi", 6)
            return await run_openai(c, f"{fake}/reasoning", "openai-chat", body)

    t = asyncio.run(go())
    assert t.ok and len(t.chunks) == 6 and t.output_tokens == 6
    assert t.tpot_s == pytest.approx((t.chunks[-1].t_s - t.chunks[0].t_s) / 5)


def test_odd_events_and_single_read_fake(fake: str) -> None:
    bad = run(f"{fake}/odd")
    assert not bad.ok and "malformed" in bad.error  # an error trace, not an exception
    one = run(f"{fake}/onechunk")
    assert one.ok and one.output_tokens == 3
    assert one.tpot_s is None and one.itl_samples_s() == []  # no timing in a single read


def test_duration_bounds_a_closed_loop(fake: str) -> None:
    from pdscope.client.load import LoadPlan, run_load
    from pdscope.client.workloads import RequestSpec

    async def go():
        async with session(timeout_s=10) as c:
            specs = [RequestSpec("x", 3) for _ in range(40)]
            plan = LoadPlan(max_concurrency=1, duration_s=0.2)
            return await run_load(c, f"{fake}/multi", "openai-completions", "m", specs, plan)

    result = asyncio.run(go())
    assert len(result.traces) <= 3 and result.duration_s < 1.0
