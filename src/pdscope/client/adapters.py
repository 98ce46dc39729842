"""Protocol adapters: send one request, turn the response into a :class:`Trace`.

OpenAI-compatible servers stream Server-Sent Events (``data: {...}`` lines ending with
``data: [DONE]``); Ollama streams NDJSON (one JSON object per line, the last with ``done``).
Both record client timestamps on one monotonic clock through aiohttp's trace hooks: connection
ready, request written, headers received, every content chunk, last byte.

Streams go through aiohttp (its C HTTP parser keeps per-chunk timestamps within a few ms at 500
concurrent streams on 2 cores, where httpx lagged by ~90 ms at p99: bench/client_capacity.py);
plain request/response calls elsewhere use httpx.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import aiohttp

from pdscope.client.trace import Chunk, Trace

API_OPENAI_COMPLETIONS = "openai-completions"
API_OPENAI_CHAT = "openai-chat"
API_OLLAMA = "ollama"
OPENAI_APIS = (API_OPENAI_COMPLETIONS, API_OPENAI_CHAT)
# The dialects probe and bench speak (their --api values besides "auto"): each has a runner
# below that turns one response into a Trace, and detect.py recognises its server.
APIS = (*OPENAI_APIS, API_OLLAMA)
# Trace.token_source of a request whose server sent no token counts: one token a content chunk;
# and the start of one whose server counted fewer tokens than content chunks.
CHUNKS_ONLY = "chunks (server sent no token counts)"
CHUNKS_OVER_COUNT = "chunks (the server counted"


def _trace_config() -> aiohttp.TraceConfig:
    """Hooks that stamp the Trace passed as ``trace_request_ctx`` with connection events."""

    async def connected(_s: Any, ctx: SimpleNamespace, _p: Any) -> None:
        ctx.trace_request_ctx.connected_s = time.perf_counter()

    async def sent(_s: Any, ctx: SimpleNamespace, _p: Any) -> None:
        ctx.trace_request_ctx.sent_s = time.perf_counter()

    config = aiohttp.TraceConfig()
    config.on_connection_create_end.append(connected)
    config.on_request_chunk_sent.append(sent)
    return config


def session(
    timeout_s: float = 300.0, fresh_connections: bool = False, limit: int = 0
) -> aiohttp.ClientSession:
    """The session the adapters stream through. ``fresh_connections`` opens a new connection
    per request so connection setup shows in every trace (probe). ``limit`` bounds the pool
    (bench: the run's concurrency, as vllm bench serve's connector does; 0 = unbounded), so
    no more connections are opened, and left idle for the server to close, than can be used."""
    connector = aiohttp.TCPConnector(
        limit=limit,
        limit_per_host=limit,
        force_close=fresh_connections,
        enable_cleanup_closed=True,
    )
    return aiohttp.ClientSession(
        connector=connector,
        trace_configs=[_trace_config()],
        timeout=aiohttp.ClientTimeout(total=timeout_s, connect=10),
    )


async def _lines(response: aiohttp.ClientResponse) -> AsyncIterator[tuple[float, str]]:
    """Lines of a streamed body, each with the time its bytes arrived (all lines of one
    network read share that read's time)."""
    pending = b""
    async for data in response.content.iter_any():
        now = time.perf_counter()
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            yield now, line.decode("utf-8", errors="replace").rstrip("\r")
    if pending:
        yield time.perf_counter(), pending.decode("utf-8", errors="replace")


def _error_text(body: bytes) -> str:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        # An HTML error page: its text on one line (newlines broke the failure lists).
        return " ".join(body[:400].decode(errors="replace").split())[:200]
    error = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error)


def openai_body(
    api: str,
    model: str,
    prompt: str | list[int] | list[dict],
    max_tokens: int,
    ignore_eos: bool = True,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM/SGLang/pdscope extension; others ignore it
    if api == API_OPENAI_CHAT:
        body["messages"] = (
            prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)
            else [{"role": "user", "content": prompt}]
        )
    else:
        body["prompt"] = prompt
    return body


async def _stream(
    client: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None,
    trace: Trace,
    parse: Callable[[Trace, float, str], bool],
    ending: str,
    progress: Callable[[Trace], None] | None = None,
    timeout_s: float | None = None,
) -> Trace:
    """POST, then feed each line to ``parse`` (True once the stream says it is done) until it
    ends, fails or sets ``trace.error``. Never raises for server or network faults.
    ``progress`` sees the trace after each line (the chunks read so far). ``timeout_s``: the
    seconds this request is allowed in place of the session's total.

    A keep-alive connection the server closed while it sat idle in the pool fails the next
    request written on it before the server can have read it ("Can not write request body",
    "Server disconnected"). Only that case is sent again, on another connection, at most
    once more than the pool can hold stale connections, and the trace says so in `retried`:
    it is not a server failure."""
    retries = _stale_retries(client)
    for attempt in range(retries + 1):
        await _stream_once(client, url, body, headers, trace, parse, ending, progress, timeout_s)
        if not _stale_connection(trace) or attempt == retries:
            return trace
        reason = trace.error
        trace.error, trace.status, trace.connected_s, trace.sent_s = None, None, None, None
        trace.headers_s, trace.end_s = None, None
        trace.retried = f"{reason} on a reused keep-alive connection; sent again ({attempt + 1}x)"
    return trace


# A failed pooled connection is discarded, so each retry meets one stale connection fewer:
# after an idle gap longer than the server's keep-alive timeout every pooled connection is
# stale, and a pool of N needs N retries to reach a new one (3 retries lost a request in a
# loaded run of test_idle_keepalive_closes_lose_no_request; with 8 pooled connections all
# stale, test_a_pool_gone_wholly_stale_still_sends_the_request fails on 3).
_UNBOUNDED_POOL_RETRIES = 64


def _stale_retries(client: aiohttp.ClientSession) -> int:
    limit = getattr(client.connector, "limit", 0)
    return (limit or _UNBOUNDED_POOL_RETRIES) + 1


def _stale_connection(trace: Trace) -> bool:
    """A request that failed on a reused connection before any response arrived, the way a
    connection closed by the server's keep-alive timeout fails."""
    return (
        trace.error is not None
        and trace.connected_s is None  # no new connection was made: a pooled one was reused
        and trace.headers_s is None
        and not trace.chunks
        and trace.error.startswith(("ClientOSError", "ServerDisconnectedError"))
    )


def _timeout_text(exc: TimeoutError, limits: aiohttp.ClientTimeout, trace: Trace) -> str:
    """Which limit a request ran past, in seconds: the error a reader can act on."""
    # The connect timer raises ConnectionTimeoutError; the total timer, firing while the
    # connection is still being made (no new one made, nothing sent), a plain TimeoutError.
    never_connected = trace.connected_s is None and trace.sent_s is None
    if isinstance(exc, aiohttp.ConnectionTimeoutError) or never_connected:
        limit = min(x for x in (limits.connect, limits.total, math.inf) if x)
        return f"timeout: no connection within {limit:g} s"
    if limits.total:
        return f"timeout: no whole answer within {limits.total:g} s (--timeout)"
    return f"timeout: {type(exc).__name__}"


async def _stream_once(
    client: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None,
    trace: Trace,
    parse: Callable[[Trace, float, str], bool],
    ending: str,
    progress: Callable[[Trace], None] | None = None,
    timeout_s: float | None = None,
) -> Trace:
    limits = client.timeout
    if timeout_s is not None:
        limits = aiohttp.ClientTimeout(total=timeout_s, connect=limits.connect)
    trace.start_s = time.perf_counter()
    done = False
    try:
        async with client.post(
            url, json=body, headers=headers, trace_request_ctx=trace, timeout=limits
        ) as r:
            trace.headers_s = time.perf_counter()
            trace.status = r.status
            if r.status != 200:
                trace.error = f"HTTP {r.status}: {_error_text(await r.read())}"
                return trace
            async for now, line in _lines(r):
                done = parse(trace, now, line)
                if progress:
                    progress(trace)
                if trace.error:
                    return trace
                if done:
                    break
            trace.end_s = time.perf_counter()
            if done:
                # Read to the end of the body so the connection can be reused.
                async for _ in r.content.iter_any():
                    pass
    except TimeoutError as exc:
        trace.error = _timeout_text(exc, limits, trace)
        return trace
    except aiohttp.ClientError as exc:
        trace.error = f"{type(exc).__name__}: {exc}"
        return trace
    if not done:
        trace.error = f"stream ended before {ending}"
    elif not trace.chunks:
        trace.error = "no generated content in the response"
    elif trace.finish_reason == "abort":
        # The server stopped it (vLLM and pdscope serve shutting down): cut short, not served.
        trace.error = "the server aborted the request (finish_reason abort)"
    if trace.output_tokens is not None and trace.output_tokens < len(trace.chunks):
        # Trace.n_output counts the chunks then: the label says so.
        trace.token_source = f"{CHUNKS_OVER_COUNT} {trace.output_tokens})"
    return trace


async def run_openai(
    client: aiohttp.ClientSession,
    url: str,
    api: str,
    body: dict[str, Any],
    label: str = "",
    prompt_tokens_asked: int | None = None,
    headers: dict[str, str] | None = None,
    progress: Callable[[Trace], None] | None = None,
    timeout_s: float | None = None,
) -> Trace:
    """One streamed OpenAI completion or chat request (SSE)."""
    path = "/v1/chat/completions" if api == API_OPENAI_CHAT else "/v1/completions"
    trace = Trace(
        api=api,
        url=url,
        model=body.get("model", ""),
        label=label,
        prompt_tokens_asked=prompt_tokens_asked,
        max_tokens=body.get("max_tokens"),
    )

    finishing_s: list[float] = []  # when the first finishing chunk came, where it had no text

    def parse(trace: Trace, now: float, line: str) -> bool:
        if not line.strip() or line.startswith(":"):
            return False  # keep-alive comments and event separators
        if line.startswith(("event:", "id:", "retry:")):
            return False  # SSE fields a completion stream does not need
        if line.startswith("error:"):  # llama.cpp reports some failures this way
            trace.error = f"server error: {line[6:].strip()[:200]}"
            return False
        if not line.startswith("data:"):
            trace.error = f"malformed SSE line: {line[:80]!r}"
            return False
        data = line[5:].strip()
        if data == "[DONE]":
            _finishing_token(trace, finishing_s)
            return True
        try:
            event = json.loads(data)
        except ValueError:
            event = None
        if not isinstance(event, dict):
            trace.error = f"malformed SSE JSON: {data[:80]!r}"
            return False
        if "error" in event and not event.get("choices"):
            err = event["error"]
            trace.error = str(err.get("message", err) if isinstance(err, dict) else err)
            return False
        finished = trace.finish_reason is not None
        # only the first finish: a proxy may repeat it on its late usage event
        if _openai_event(trace, event, api, now) and not finished:
            finishing_s.append(now)
        return False

    url = url.rstrip("/") + path
    return await _stream(
        client, url, body, headers, trace, parse, "data: [DONE]", progress, timeout_s
    )


def _finishing_token(trace: Trace, finishing_s: list[float]) -> None:
    """A finishing chunk without text is counted as the last token's where the server's count
    exceeds the chunks (vLLM's EOS, whose text is empty, comes in it), not where every token had
    its chunk, so that E2E and TPOT end where vLLM's bench ends them (llama.cpp's last event,
    which carries the counts, never: :func:`_openai_event`).
    Where the count exceeds the chunks for another reason (several tokens in a chunk, text held
    back mid-stream) and the finishing chunk carried none, E2E gains the gap from the last
    chunk to it: the same step's, under a millisecond where measured. Not in a reply with no
    other chunk: its one arrival would read as its first token."""
    if (
        finishing_s
        and trace.chunks
        and trace.output_tokens is not None
        and trace.output_tokens > len(trace.chunks)
    ):
        trace.chunks.append(Chunk(finishing_s[0], ""))


def _openai_event(trace: Trace, event: dict[str, Any], api: str, now: float) -> bool:
    """Records ``event``'s tokens and counts in ``trace``; True where a choice finished in a
    chunk that carried no text (a token or none: :func:`_finishing_token` decides), unless the
    chunk also carries the counts: llama.cpp's last event, a summary after its last token (in
    the `medium` model's probe, 12 of 27 of its replies had fewer chunks than tokens)."""
    finished_bare = False
    for choice in event.get("choices") or []:
        if api == API_OPENAI_CHAT:
            delta = choice.get("delta") or {}
            # Reasoning tokens (vLLM/SGLang reasoning parsers) are generated output too: the
            # usage count includes them, so timing must see them or TPOT comes out too short.
            text = (
                delta.get("content")
                or delta.get("reasoning_content")
                or delta.get("reasoning")
                or ""
            )
            held = False
        else:
            text = choice.get("text") or ""
            # A completions chunk of empty text that ends nothing is a token whose text the
            # server held back (part of a UTF-8 character, a special token): vLLM sends one a
            # token, and its bench times them. A reply of such tokens alone has no other.
            held = choice.get("text") == "" and not choice.get("finish_reason")
        if text or held:  # chat's role-only and empty chunks are not tokens: never TTFT
            trace.chunks.append(Chunk(now, text))
        if choice.get("finish_reason"):
            trace.finish_reason = choice["finish_reason"]
            finished_bare = finished_bare or not text
    usage = event.get("usage")
    if usage:
        trace.prompt_tokens = usage.get("prompt_tokens")
        trace.output_tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            trace.cached_tokens = details["cached_tokens"]
            trace.cached_source = "server-usage"
        trace.token_source = "server-usage"
    timings = event.get("timings")  # llama.cpp's server
    if timings:
        trace.server["llamacpp"] = timings
        # Builds name the reused-prompt count differently: cache_n in timings, tokens_cached
        # or n_cache_tokens beside them.
        cache_n = next(
            (
                v
                for v in (
                    timings.get("cache_n"),
                    event.get("tokens_cached"),
                    timings.get("tokens_cached"),
                    event.get("n_cache_tokens"),
                    timings.get("n_cache_tokens"),
                )
                if isinstance(v, int)
            ),
            None,
        )
        if trace.token_source != "server-usage":
            trace.output_tokens = timings.get("predicted_n")
            prompt_n = timings.get("prompt_n")
            if prompt_n is not None:
                trace.prompt_tokens = prompt_n + (cache_n or 0)  # prompt_n: new tokens only
            trace.token_source = "llamacpp-timings"
        if cache_n is not None and trace.cached_source is None:
            trace.cached_tokens = cache_n
            trace.cached_source = "llamacpp-timings"
    return finished_bare and not (usage or timings)


async def run_ollama(
    client: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt: str,
    max_tokens: int,
    label: str = "",
    prompt_tokens_asked: int | None = None,
    raw: bool = True,
    headers: dict[str, str] | None = None,
    progress: Callable[[Trace], None] | None = None,
    timeout_s: float | None = None,
) -> Trace:
    """One streamed Ollama /api/generate request (NDJSON; raw prompt: no template)."""
    body = {
        "model": model,
        "prompt": prompt,
        "raw": raw,
        "stream": True,
        "options": {"num_predict": max_tokens, "temperature": 0},
    }
    trace = Trace(
        api=API_OLLAMA,
        url=url,
        model=model,
        label=label,
        prompt_tokens_asked=prompt_tokens_asked,
        max_tokens=max_tokens,
    )

    def parse(trace: Trace, now: float, line: str) -> bool:
        if not line.strip():
            return False
        try:
            event = json.loads(line)
        except ValueError:
            event = None
        if not isinstance(event, dict):
            trace.error = f"malformed NDJSON line: {line[:80]!r}"
            return False
        if "error" in event:
            trace.error = str(event["error"])
            return False
        # Thinking models stream reasoning first; it is generated output, so it counts for
        # timing (TTFT, ITL) like the answer does.
        text = (
            event.get("response")
            or event.get("thinking")
            or ((event.get("message") or {}).get("content"))
        )
        if text:
            trace.chunks.append(Chunk(now, text))
        if event.get("done"):
            _ollama_final(trace, event)
            return True
        return False

    url = url.rstrip("/") + "/api/generate"
    ending = "the done object"
    return await _stream(client, url, body, headers, trace, parse, ending, progress, timeout_s)


def _ollama_final(trace: Trace, event: dict[str, Any]) -> None:
    trace.finish_reason = event.get("done_reason")
    trace.prompt_tokens = event.get("prompt_eval_count")
    trace.output_tokens = event.get("eval_count")
    trace.token_source = "ollama-counters"
    trace.server["ollama"] = {
        k: event.get(k)
        for k in (
            "total_duration",
            "load_duration",
            "prompt_eval_count",
            "prompt_eval_duration",
            "eval_count",
            "eval_duration",
        )
        if k in event
    }


async def run_request(
    client: aiohttp.ClientSession,
    url: str,
    api: str,
    model: str,
    prompt: str | list[int] | list[dict],
    max_tokens: int,
    label: str = "",
    prompt_tokens_asked: int | None = None,
    headers: dict[str, str] | None = None,
    progress: Callable[[Trace], None] | None = None,
    timeout_s: float | None = None,
) -> Trace:
    """One streamed request in dialect ``api`` (one of APIS): the one dispatch that probe's and
    bench's requests go through. Ollama's raw prompt is text: chat messages are joined.
    ``progress`` sees the trace as each line of the stream is read; ``timeout_s`` bounds this
    request in place of the session's total."""
    if api == API_OLLAMA:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            prompt = "\n".join(str(m.get("content", "")) for m in prompt)
        trace = await run_ollama(
            client, url, model, str(prompt), max_tokens, label, prompt_tokens_asked,
            headers=headers, progress=progress, timeout_s=timeout_s,
        )  # fmt: skip
    else:
        body = openai_body(api, model, prompt, max_tokens)
        trace = await run_openai(
            client, url, api, body, label, prompt_tokens_asked, headers, progress, timeout_s
        )
    if trace.error is None and trace.token_source == "none":
        trace.token_source = CHUNKS_ONLY
    return trace
