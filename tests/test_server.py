"""`pdscope serve` as a real process on loopback, driven by the official openai and ollama
clients and by raw HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import ollama
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from pdscope.cli import app as cli
from tests.conftest import Server, start_server

pytestmark = pytest.mark.slow

PROMPT = "Prefill reads the prompt; decode writes one token per step."
USER = {"role": "user", "content": "Hi"}


def metrics(url: str) -> dict[str, float]:
    """Every sample as 'name{label=value,...}' (model_name dropped) -> value."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_for(
    url: str, test: Callable[[dict[str, float]], bool], timeout_s: float = 20
) -> dict[str, float]:
    """The first scrape of `/metrics` that passes `test`, or the last one at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(url)
        if test(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_openai_completions(server: Server) -> None:
    c = client(server)
    assert [m.id for m in c.models.list().data] == [server.model]
    r = c.completions.create(
        model=server.model,
        prompt=PROMPT,
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 7
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()
    assert r.usage.prompt_tokens == tokens["count"] == len(tokens["tokens"])
    assert r.usage.total_tokens == tokens["count"] + 7

    chunks = list(
        c.completions.create(
            model=server.model,
            prompt=PROMPT,
            max_tokens=7,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == r.choices[0].text  # greedy: streaming and not agree
    assert chunks[-1].usage.completion_tokens == 7 and not chunks[-1].choices
    assert chunks[-2].choices[0].finish_reason == "length"


def test_openai_chat(server: Server) -> None:
    c = client(server)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = c.chat.completions.create(
        model=server.model,
        messages=messages,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 6
    counted = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["count"]
    assert r.usage.prompt_tokens == counted
    # Without the generation prompt (the assistant's header) the count is smaller.
    bare = {"messages": messages, "add_generation_prompt": False}
    assert httpx.post(f"{server.url}/tokenize", json=bare).json()["count"] < counted
    # OpenAI's "developer" role is read as "system".
    as_system = [{"role": "system", "content": "Be brief."}, *messages]
    as_developer = [{"role": "developer", "content": "Be brief."}, *messages]
    ids = [
        httpx.post(f"{server.url}/tokenize", json={"messages": m}).json()["tokens"]
        for m in (as_system, as_developer)
    ]
    assert ids[0] == ids[1]

    stream = list(
        c.chat.completions.create(
            model=server.model,
            messages=messages,
            max_completion_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    first = stream[0].choices[0].delta
    assert first.role == "assistant" and not first.content  # role-only chunk, no content
    content = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert content == r.choices[0].message.content
    assert stream[-1].usage.completion_tokens == 6


def test_sse_framing_raw(server: Server) -> None:
    body = {
        "model": server.model,
        "prompt": PROMPT,
        "max_tokens": 4,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def test_stop_string_is_never_streamed(server: Server) -> None:
    c = client(server)
    free = (
        c.completions.create(
            model=server.model,
            prompt=PROMPT,
            max_tokens=30,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    stop = free[5:8]
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(
            model=server.model,
            prompt=PROMPT,
            max_tokens=30,
            temperature=0,
            stop=[stop],
            stream=True,
            extra_body={"ignore_eos": True},
        )
        if ch.choices
    )
    assert streamed == free[: free.index(stop)]


def test_completions_stream_a_chunk_for_tokens_whose_text_is_held_back(server: Server) -> None:
    """While a 40-character stop string may be forming, the text of the first tokens is held
    back; the completions stream still sends a chunk of empty text for them, as vLLM does,
    so that a client's TTFT is the first token's, not the first released text's."""
    from pdscope.client.adapters import openai_body, run_openai, session

    c = client(server)
    kwargs = {"model": server.model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    free = c.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0].text
    stop = "Q" * 40
    assert stop not in free
    chunks = [
        ch
        for ch in c.completions.create(
            **kwargs, stop=[stop], stream=True, extra_body={"ignore_eos": True}
        )
        if ch.choices
    ]
    assert "".join(ch.choices[0].text for ch in chunks) == free  # held back, never lost
    assert chunks[0].choices[0].text == "" and chunks[0].choices[0].finish_reason is None
    assert 2 <= len(chunks) <= 8 and chunks[-1].choices[0].finish_reason == "length"

    async def probe_one():
        async with session() as s:
            body = openai_body("openai-completions", server.model, PROMPT, 8)
            body["stop"] = [stop]
            return await run_openai(s, server.url, "openai-completions", body)

    t = asyncio.run(probe_one())
    # the client times the first token's chunk, empty as it is
    assert t.ok and t.output_tokens == 8 and t.chunks[0].text == "" and len(t.chunks) <= 8


def test_ollama_client(server: Server) -> None:
    o = ollama.Client(host=server.url)
    names = [m.model for m in o.list().models]
    assert names == [server.model]
    shown = o.show(server.model)
    assert shown.modelinfo and shown.details.format == "safetensors"
    r = o.generate(model=server.model, prompt="Hi", options={"num_predict": 5, "temperature": 0})
    assert r.done and 1 <= r.eval_count <= 5
    assert r.eval_count == 5 or r.done_reason == "stop"
    assert r.prompt_eval_count > 0 and r.total_duration > r.prompt_eval_duration > 0
    assert r.total_duration >= r.eval_duration >= 0
    parts = list(
        o.generate(
            model=server.model,
            prompt="Hi",
            stream=True,
            options={"num_predict": 5, "temperature": 0},
        )
    )
    assert parts[-1].done and parts[-1].eval_count == r.eval_count
    assert "".join(p.response for p in parts) == r.response
    chat = o.chat(
        model=server.model,
        messages=[{"role": "user", "content": "Hi"}],
        options={"num_predict": 4, "temperature": 0},
    )
    assert chat.message.role == "assistant" and chat.done_reason in ("stop", "length")
    streamed = list(
        o.chat(
            model=server.model,
            messages=[{"role": "user", "content": "Hi"}],
            stream=True,
            options={"num_predict": 4, "temperature": 0},
        )
    )
    assert "".join(p.message.content for p in streamed) == chat.message.content
    assert httpx.get(f"{server.url}/api/version").json()["version"]


def test_ollama_counts_whole_prompt_when_cached(server: Server) -> None:
    o = ollama.Client(host=server.url)
    long = "The KV cache holds keys and values for every prompt token. " * 12
    first = o.generate(model=server.model, prompt=long, options={"num_predict": 2})
    second = o.generate(model=server.model, prompt=long, options={"num_predict": 2})
    assert second.prompt_eval_count == first.prompt_eval_count  # cached part included


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/v1/completions", "{not json", 400, "JSON"),
        ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
        # Python's json (and so the server) reads 1e400 as inf and takes NaN; neither samples.
        ("/v1/completions", '{"prompt": "x", "temperature": 1e400}', 400, "finite"),
        ("/v1/completions", '{"prompt": "x", "temperature": NaN}', 400, "finite"),
        ("/v1/completions", '{"prompt": "x", "top_p": NaN}', 400, "finite"),
        ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n=2"),
        ("/v1/completions", {"prompt": "word " * 2000}, 400, "maximum context length"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400, "maximum context"),
        ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "gpt-4"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
        ("/detokenize", {"tokens": [10**9]}, 400, "vocabulary"),
        ("/v1/completions", {"prompt": "x", "seed": 2**64}, 400, "seed"),
        ("/v1/completions", {"prompt": "x", "stop": ""}, 400, "stop"),
        ("/v1/completions", {"prompt": "x", "logprobs": 5}, 400, "logprobs"),
        # 0 asks for the sampled token's logprob (OpenAI, vLLM): refused, not answered null
        ("/v1/completions", {"prompt": "x", "logprobs": 0}, 400, "logprobs"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens"),
        ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
        (
            "/v1/completions",
            {"prompt": "x", "min_tokens": 2, "stop_token_ids": [10**9]},
            400,
            "stop_token_ids",
        ),
        ("/v1/nothing", {}, 404, "no route"),
    ],
)
def test_openai_errors(server: Server, path: str, body, status: int, needle: str) -> None:
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(
        f"{server.url}{path}",
        content=content,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == status
    error = r.json()["error"]
    assert needle in error["message"] and error["code"] == status
    assert httpx.get(f"{server.url}/health").status_code == 200  # the engine lives on


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [10**9]}, "stop_token_ids"),
        ("/v1/chat/completions", {"messages": [USER], "max_completion_tokens": 10**6},
         "max_completion_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 2000}]},
         "messages"),
        ("/v1/completions", "{not json", None),
        ("/v1/chat/completions", "", None),
        ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, "min_tokens"),
    ],
)  # fmt: skip
def test_openai_errors_name_the_field(server: Server, path: str, body, param: str | None) -> None:
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(
        f"{server.url}{path}", content=content, headers={"content-type": "application/json"}
    )
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param, error
    if not body:  # it read "invalid request: Field required", naming nothing
        assert error["message"] == "invalid request: no request body: send a JSON object"
    elif param is None:  # where the JSON breaks, not a path into it
        assert "not valid JSON" in error["message"] and "at character 1" in error["message"]


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/api/generate", "{bad", 400),
        ("/api/generate", {"prompt": "hi"}, 400),
        ("/api/generate", {"model": "llama3", "prompt": "hi"}, 404),
        ("/api/chat", {"model": "tiny", "messages": "hi"}, 400),
        (
            "/api/generate",
            '{"model": "tiny", "prompt": "hi", "options": {"temperature": 1e400}}',
            400,
        ),
        ("/api/nothing", {}, 404),
    ],
)
def test_ollama_errors(server: Server, path: str, body, status: int) -> None:
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(
        f"{server.url}{path}",
        content=content,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == status
    assert isinstance(r.json()["error"], str) and r.json()["error"]


@pytest.mark.parametrize(
    ("path", "extra", "neutral", "needle"),
    [
        ("/api/generate", {"format": "json"}, {"format": ""}, "'format'"),
        ("/api/generate", {"images": ["aGk="]}, {"images": []}, "'images'"),
        ("/api/generate", {"think": True}, {"think": False}, "'think'"),
        (
            "/api/generate",
            {"options": {"min_p": 0.1}},
            {"options": {"min_p": 0}},
            "'options.min_p'",
        ),
        ("/api/generate", {"options": {"num_ctx": "x"}}, {"options": {"num_ctx": 64}}, "num_ctx"),
        # a context smaller than the prompt: Ollama cuts the prompt; refused here
        ("/api/generate", {"options": {"num_ctx": 4}}, {"options": {"num_ctx": 4096}}, "num_ctx"),
        ("/api/chat", {"tools": [{"type": "function"}]}, {"tools": None}, "'tools'"),
        (
            "/api/chat",
            {"messages": [{**USER, "images": ["aGk="]}]},
            {"messages": [{**USER, "images": []}]},
            "'messages.0.images'",
        ),
    ],
)
def test_ollama_refuses_what_it_does_not_implement(
    server: Server, path: str, extra: dict, neutral: dict, needle: str
) -> None:
    """Refused, not ignored: Ollama itself refuses format, images, tools and think for a model
    without them, and an ignored sampling option would change the results unannounced. The
    neutral value is accepted."""
    body = {"model": server.model, "stream": False}
    body |= {"prompt": "Hi"} if path == "/api/generate" else {"messages": [USER]}
    r = httpx.post(f"{server.url}{path}", json=body | extra, timeout=30)
    assert r.status_code == 400 and needle in r.json()["error"], r.text
    neutral = {"options": {"num_predict": 2}} | neutral
    neutral["options"] = {"num_predict": 2} | neutral["options"]
    ok = httpx.post(f"{server.url}{path}", json=body | neutral, timeout=30)
    assert ok.status_code == 200, ok.text


def test_nulls_and_neutral_values_are_accepted(server: Server) -> None:
    body = {
        "prompt": "x",
        "max_tokens": 2,
        "temperature": None,
        "top_p": None,
        "n": None,
        "seed": None,
        "logprobs": None,
        "presence_penalty": 0,
        "echo": False,
    }
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    r = httpx.post(
        f"{server.url}/api/generate",
        timeout=30,
        json={
            "model": server.model,
            "prompt": "x",
            "stream": False,
            "options": {"num_predict": 2, "seed": 2**70},
        },
    )
    assert r.status_code == 400 and "seed" in r.json()["error"]
    # null for a boolean or an object reads as its default, as OpenAI's and Ollama's types take it
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={**body, "stream": None, "stream_options": None},
        timeout=30,
    )
    assert r.status_code == 200 and r.json()["object"] == "text_completion", r.text
    r = httpx.post(
        f"{server.url}/api/generate",
        json={"model": server.model, "prompt": "x", "stream": None, "raw": None, "options": None},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert len(lines) >= 2 and lines[-1]["done"]  # null stream: streamed, Ollama's default
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_ollama_chat_without_messages_loads_and_num_ctx_bounds_the_output(server: Server) -> None:
    """Ollama's ways a client loads a model and sizes its context: an empty message list
    answers a done object with done_reason "load" (it was a 400); options.num_ctx caps the
    output at the context's room (it was ignored), and num_predict 0 is no limit, as in
    Ollama's runners (it gave one token)."""
    o = ollama.Client(host=server.url)
    loaded = o.chat(model=server.model, messages=[])
    assert loaded.done and loaded.done_reason == "load" and loaded.message.content == ""
    room = 6
    for text in ("Hi", "Tell me a story", "Once upon a time"):  # one that runs past `room`
        full = o.generate(
            model=server.model, prompt=text, options={"num_predict": room + 4, "temperature": 0}
        )
        if full.eval_count > room:
            break
    else:
        pytest.fail("no prompt ran past 6 tokens")
    options = {"num_ctx": full.prompt_eval_count + room, "num_predict": 0, "temperature": 0}
    capped = o.generate(model=server.model, prompt=text, options=options)
    assert capped.eval_count == room and capped.done_reason == "length"
    null = httpx.post(f"{server.url}/api/chat", json={"model": server.model, "messages": None})
    assert null.json()["done_reason"] == "load"  # null reads as none, as Ollama's Go decoding
    unlimited = o.generate(model=server.model, prompt="Hi", options={"num_predict": 0})
    assert unlimited.eval_count > 1 or unlimited.done_reason == "stop"


def test_openai_retrieve_model(server: Server) -> None:
    c = client(server)
    card = c.models.retrieve(server.model)
    assert card.id == server.model and card.owned_by == "pdscope"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.models.retrieve("gpt-4")
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve(f"{server.model}:latest")  # Ollama's alias is not OpenAI's name
    listed = httpx.get(f"{server.url}/v1/models/").json()
    assert listed["object"] == "list" and listed["data"][0]["id"] == server.model


def test_tokenize_roundtrip(server: Server) -> None:
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "naïve café ☕"}).json()
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text["prompt"] == "naïve café ☕"
    assert tokens["max_model_len"] == 1024


def test_metrics_move_with_traffic(server: Server) -> None:
    before = metrics(server.url)
    names = {k.split("{")[0] for k in before}
    for name in (
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_sum",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_queue_time_seconds_count",
        "vllm:request_prefill_time_seconds_count",
        "vllm:num_requests_running",
        "vllm:request_decode_time_seconds_count",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "process_start_time_seconds",  # as vLLM's default registry: a reader sees restarts
    ):
        assert name in names, name
    assert abs(before["process_start_time_seconds"] - time.time()) < 24 * 3600
    c = client(server)
    prefix = "A long shared system prompt about prefill and decode. " * 10
    for suffix in ("one", "two"):
        c.completions.create(
            model=server.model,
            prompt=prefix + suffix,
            max_tokens=3,
            extra_body={"ignore_eos": True},
        )
    after = metrics(server.url)

    def delta(key: str) -> float:
        return after.get(key, 0) - before.get(key, 0)

    assert delta("vllm:prefix_cache_hits_total") >= 64  # the second request reused blocks
    assert delta("vllm:prefix_cache_queries_total") > delta("vllm:prefix_cache_hits_total")
    assert delta("vllm:generation_tokens_total") == 6
    assert delta("vllm:time_to_first_token_seconds_count") == 2
    assert delta("vllm:inter_token_latency_seconds_count") == 4
    assert delta("vllm:request_success_total{finished_reason=length}") == 2
    buckets = sorted(
        float(k.split("le=")[1].rstrip("}"))
        for k in after
        if k.startswith("vllm:time_to_first_token_seconds_bucket")
    )
    assert buckets[:3] == [0.001, 0.005, 0.01] and buckets[-2] == 2560.0


def finished_counts(m: dict[str, float]) -> tuple[float, float]:
    """Requests in vLLM's finished-request series: the success total over every reason, and
    the end-to-end latency histogram's count."""
    total = sum(v for k, v in m.items() if k.startswith("vllm:request_success_total{"))
    return total, m.get("vllm:e2e_request_latency_seconds_count", 0.0)


def test_disconnect_aborts_and_frees_blocks(server: Server) -> None:
    """A client that leaves mid-stream: its request is aborted and frees its blocks, long
    before its 900 tokens, and (as vLLM does for a request its client aborted) it is counted
    in no finished-request series, so it cannot pull e2e percentiles down."""
    before = metrics(server.url)
    body = {
        "model": server.model,
        "prompt": PROMPT,
        "max_tokens": 900,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        next(lines)
        assert metrics(server.url)["vllm:kv_cache_usage_perc"] > 0
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = metrics(server.url)
        if m["vllm:kv_cache_usage_perc"] == 0 and m["vllm:num_requests_running"] == 0:
            break
        time.sleep(0.1)
    assert m["vllm:kv_cache_usage_perc"] == 0 and m["vllm:num_requests_running"] == 0
    made = m["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert 1 <= made < 900
    assert finished_counts(m) == finished_counts(before)


def test_200_concurrent_streams(server: Server) -> None:
    async def main() -> list[int]:
        limits = httpx.Limits(max_connections=200)
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1",
            api_key="x",
            max_retries=0,
            http_client=openai.DefaultAsyncHttpxClient(limits=limits),
            timeout=120,
        ) as c:

            async def one(i: int) -> int:
                stream = await c.completions.create(
                    model=server.model,
                    prompt=f"{i} {PROMPT}",
                    max_tokens=8,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
                usage = None
                async for chunk in stream:
                    usage = chunk.usage or usage
                return usage.completion_tokens

            return await asyncio.gather(*(one(i) for i in range(200)))

    assert asyncio.run(main()) == [8] * 200


def test_the_start_up_heap_is_frozen(server: Server) -> None:
    """A full collection walked the ~340,000 objects the server holds once started (torch, the
    model, FastAPI), all alive for good, with the GIL held: ~200 ms in which every stream
    stalled, whenever one fell (bench/gc_pause.py). serve collects and freezes them once the
    engine and the app are built and before uvicorn listens, and says how many: the bulk of
    its heap, not a few."""
    log = server.log.read_text().splitlines()

    def first(text: str) -> int:
        return next(i for i, line in enumerate(log) if text in line)

    frozen = [line for line in log if "froze the start-up heap" in line]
    assert len(frozen) == 1, frozen
    found = re.search(r"(\d+) objects", frozen[0])
    assert found, frozen[0]
    assert int(found.group(1)) > 100_000
    assert first("serving ") < first("froze the start-up heap") < first("Uvicorn running on")


def test_the_log_says_how_long_openmp_workers_spin(server: Server) -> None:
    """serve sets libgomp's spin count from the model before torch loads (commands/serve.py):
    a test model's layers are under 2 M weights, so its workers keep the short count."""
    if {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & os.environ.keys():
        pytest.skip("this environment sets libgomp's spin itself, which serve leaves alone")
    lines = [ln for ln in server.log.read_text().splitlines() if "OpenMP workers spin" in ln]
    assert len(lines) == 1 and lines[0].endswith("GOMP_SPINCOUNT=1000"), lines


def test_tiny_pool_preempts_and_queues(tiny_model: Path, tmp_path: Path) -> None:
    # 80 KiB of KV at 256 bytes per token: 320 tokens for eight 40 + 100 token requests.
    srv = start_server(
        tiny_model,
        tmp_path,
        "--kv-cache-memory",
        "80KiB",
        "--max-model-len",
        "256",
        "--block-size",
        "16",
    )
    try:
        waiting_seen = 0.0

        async def main() -> list[int]:
            nonlocal waiting_seen
            async with httpx.AsyncClient(timeout=120) as http:

                async def one(i: int) -> int:
                    r = await http.post(
                        f"{srv.url}/v1/completions",
                        json={
                            "prompt": list(range(100 + i, 140 + i)),
                            "max_tokens": 100,
                            "ignore_eos": True,
                        },
                    )
                    return r.json()["usage"]["completion_tokens"]

                async def watch() -> None:
                    nonlocal waiting_seen
                    for _ in range(200):
                        text = (await http.get(f"{srv.url}/metrics")).text
                        for line in text.splitlines():
                            if line.startswith("vllm:num_requests_waiting{"):
                                waiting_seen = max(waiting_seen, float(line.split()[-1]))
                        await asyncio.sleep(0.02)

                watcher = asyncio.create_task(watch())
                counts = await asyncio.gather(*(one(i) for i in range(8)))
                watcher.cancel()
                return counts

        assert asyncio.run(main()) == [100] * 8
        m = metrics(srv.url)
        assert m["vllm:num_preemptions_total"] > 0
        assert waiting_seen > 0
        assert m["vllm:kv_cache_usage_perc"] == 0
    finally:
        assert srv.stop() == 0  # SIGTERM: clean exit


@pytest.mark.parametrize("second_signal", [False, True], ids=["timeout", "second-signal"])
def test_sigterm_drains_then_aborts_within_the_shutdown_timeout(
    tiny_model: Path, tmp_path: Path, second_signal: bool
) -> None:
    """SIGTERM with four streams in flight and --shutdown-timeout 1: the two 40-token streams
    finish ("length"), the two 2,000-token ones end with finish_reason "abort" and [DONE], and
    the process exits 0 soon after the timeout; a client that reads nothing holds nothing up.
    With a 600 s timeout, a second SIGTERM ends the wait. It used to wait for every stream
    without limit (77 s for 16 streams of 4,000 tokens), and a second SIGTERM did nothing."""
    import signal
    import socket

    timeout = "600" if second_signal else "1"
    srv = start_server(
        tiny_model, tmp_path, "--shutdown-timeout", timeout, "--max-model-len", "2048"
    )
    stalled = socket.create_connection(("127.0.0.1", int(srv.url.rsplit(":", 1)[1])))
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    body = json.dumps({"prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True})
    stalled.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
        f"\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode()
    )  # a client that never reads its stream
    # SIGTERM once every stream has its first line: one not yet taken in would be refused,
    # not finished or aborted (a loaded host can take the four requests in over a few steps).
    started, first_lines = asyncio.Event(), set()

    async def stream(
        http: httpx.AsyncClient, max_tokens: int, i: int
    ) -> tuple[str | None, int, bool]:
        reason, pieces, done = None, 0, False
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        async with http.stream("POST", f"{srv.url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    choice = json.loads(line[6:])["choices"][0]
                    pieces += 1
                    reason = choice["finish_reason"] or reason
                    first_lines.add(i)
                    if len(first_lines) == 4:
                        started.set()
        return reason, pieces, done

    async def main() -> tuple[list[tuple[str | None, int, bool]], float]:
        async with httpx.AsyncClient(timeout=120) as http:
            sizes = (40, 40, 2000, 2000)
            tasks = [asyncio.create_task(stream(http, n, i)) for i, n in enumerate(sizes)]
            await asyncio.wait_for(started.wait(), 60)
            srv.process.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            if second_signal:
                await asyncio.sleep(0.5)  # the short streams end meanwhile
                srv.process.send_signal(signal.SIGTERM)
            results = await asyncio.gather(*tasks)
            return results, t0

    try:
        results, t0 = asyncio.run(main())
        code = srv.process.wait(timeout=60)
        exited_s = time.monotonic() - t0
    finally:
        stalled.close()
        srv.stop()
    assert code == 0
    assert [r[0] for r in results] == ["length", "length", "abort", "abort"], results
    assert all(done for _, _, done in results)  # every stream ended properly
    assert (0.4 if second_signal else 0.8) < exited_s < 20, exited_s  # then a prompt exit


def test_max_queue_refuses_with_503(tiny_model: Path, tmp_path: Path) -> None:
    srv = start_server(
        tiny_model, tmp_path, "--max-num-seqs", "1", "--max-queue", "2", "--kv-cache-memory", "8MiB"
    )

    async def main() -> list[tuple[int, dict, httpx.Headers]]:
        async with httpx.AsyncClient(timeout=120) as http:

            async def one(i: int) -> tuple[int, dict, httpx.Headers]:
                r = await http.post(
                    f"{srv.url}/v1/completions",
                    json={"prompt": f"{i} {PROMPT}", "max_tokens": 60, "ignore_eos": True},
                )
                return r.status_code, r.json(), r.headers

            return await asyncio.gather(*(one(i) for i in range(8)))

    try:
        results = asyncio.run(main())
        statuses = [s for s, _, _ in results]
        assert 503 in statuses and 200 in statuses
        for status, body, headers in results:
            if status == 503:
                assert "--max-queue" in body["error"]["message"]
                assert int(headers["retry-after"]) >= 1
            else:
                assert status == 200 and body["usage"]["completion_tokens"] == 60
    finally:
        srv.stop()


def test_api_key(tiny_model: Path, tmp_path: Path) -> None:
    srv = start_server(tiny_model, tmp_path, "--api-key", "s3cret", "--kv-cache-memory", "8MiB")
    try:
        assert httpx.get(f"{srv.url}/health").status_code == 200
        assert httpx.get(f"{srv.url}/metrics").status_code == 200
        r = httpx.get(f"{srv.url}/v1/models")
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        bad = httpx.post(
            f"{srv.url}/api/generate",
            json={"model": "tiny", "prompt": "x"},
            headers={"Authorization": "Bearer wrong"},
        )
        assert bad.status_code == 401 and isinstance(bad.json()["error"], str)
        ok = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="s3cret", max_retries=0)
        assert ok.models.list().data[0].id == "tiny"
        # probe says which: no key, or a key the server refused
        for key, needle in ((None, "pass --api-key"), ("wrong", "refused the API key given")):
            extra = ["--api-key", key] if key else []
            result = CliRunner().invoke(cli, ["probe", srv.url, *extra])
            assert result.exit_code == 1 and needle in " ".join(result.output.split())
    finally:
        srv.stop()
