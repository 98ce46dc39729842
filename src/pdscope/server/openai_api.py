"""The OpenAI dialect: models, completions, chat completions (SSE streams), and vLLM's
tokenize pair. It owns every path no other dialect claims, /tokenize among them."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from pdscope.engine.async_engine import EngineDeadError, RequestStream
from pdscope.engine.llm_engine import RequestOutput
from pdscope.server.common import (
    APIError,
    Dialect,
    ServerState,
    TextDeltas,
    collect,
    sse,
    state_of,
    usage,
)
from pdscope.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChat,
    TokenizeRequest,
)

router = APIRouter()


def _card(s: ServerState) -> dict[str, Any]:
    return {
        "id": s.model_name,
        "object": "model",
        "created": s.created,
        "owned_by": "pdscope",
        "root": str(s.llm.path),
        "max_model_len": s.llm.max_model_len,
    }


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_card(state_of(request))]}


@router.get("/v1/models/{model:path}")
async def model(model: str, request: Request) -> dict[str, Any]:
    """OpenAI's retrieve: the served model's card, or a 404 naming what is served."""
    s = state_of(request)
    if not model:  # "/v1/models/": the list, as the redirect to /v1/models gave before
        return await models(request)
    s.check_model(model, exact=True)
    return _card(s)


async def _completion_prompt(s: ServerState, prompt: Any) -> list[int]:
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise APIError(
                400,
                f"{len(prompt)} prompts in one request are not supported; send "
                "one prompt per request",
                param="prompt",
            )
        prompt = prompt[0]
    ids = await s.encode(prompt, "prompt") if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise APIError(400, "prompt is empty", param="prompt")
    return ids


def _sse_response(
    stream: RequestStream,
    stop: list[str],
    piece: Callable[[str, str | None], dict[str, Any]],
    final: Callable[[RequestOutput], dict[str, Any]] | None,
    first: dict[str, Any] | None = None,
    every_token: bool = False,
) -> StreamingResponse:
    """Server-Sent Events for one request: ``piece`` per text delta (the last with its finish
    reason), then ``final`` (the usage chunk) if asked, then ``data: [DONE]``. With
    ``every_token``, also a ``piece`` of empty text for new tokens whose text is held back (part
    of a UTF-8 character, a stop string that may be forming), as vLLM's completions stream sends
    them: a client then times every token, not only those with text. Leaving early
    (the client went away) aborts the request."""

    async def events() -> AsyncIterator[str]:
        deltas = TextDeltas(stop)
        try:
            if first:
                yield sse(first)
            async for out in stream:
                if out.error:
                    yield sse(
                        {
                            "error": {
                                "message": out.error,
                                "type": "InternalServerError",
                                "code": 500,
                            }
                        }
                    )
                    return
                text = deltas(out)
                if text or out.finished or (every_token and out.new_token_ids):
                    yield sse(piece(text, out.finish_reason if out.finished else None))
                if out.finished and final:
                    yield sse(final(out))
            yield sse("[DONE]")
        except EngineDeadError as exc:
            yield sse(
                {"error": {"message": str(exc), "type": "ServiceUnavailableError", "code": 503}}
            )
        finally:
            await stream.aclose()

    return StreamingResponse(events(), media_type="text/event-stream")


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Any:
    s = state_of(request)
    s.check_model(body.model)
    ids = await _completion_prompt(s, body.prompt)
    limit = s.max_tokens_for(ids, body.max_tokens)
    params = s.sampling(lambda: body.sampling(limit))
    rid = f"cmpl-{uuid.uuid4().hex}"
    stream = await s.start(request, ids, params, rid)
    created = int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created, "model": s.model_name}

    if not body.stream:
        out = await collect(stream, request)
        return {
            **head,
            "choices": [
                {"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}
            ],
            "usage": usage(out),
        }

    def piece(text: str, finish: str | None) -> dict[str, Any]:
        return {
            **head,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
        }

    def final(out: RequestOutput) -> dict[str, Any]:
        return {**head, "choices": [], "usage": usage(out)}

    return _sse_response(
        stream, params.stop, piece, final if body.include_usage else None, every_token=True
    )


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    s = state_of(request)
    s.check_model(body.model)
    ids = await s.chat_prompt(body.messages)
    limit = s.llm.max_model_len
    for name in ("max_tokens", "max_completion_tokens"):
        # Both are checked, though the newer name wins: what the schema refuses, the server does.
        value = getattr(body, name)
        if value is not None and value >= limit:
            raise APIError(
                400,
                f"{name} must be less than the context length {limit} (the prompt takes at "
                f"least one token), got {value}",
                param=name,
            )
    asked = body.max_completion_tokens or body.max_tokens
    name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    limit = s.max_tokens_for(ids, asked, name, prompt_param="messages")
    params = s.sampling(lambda: body.sampling(limit))
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    stream = await s.start(request, ids, params, rid, prompt_param="messages")
    head = {"id": rid, "created": int(time.time()), "model": s.model_name}

    if not body.stream:
        out = await collect(stream, request)
        return {
            **head,
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": out.text},
                    "logprobs": None,
                    "finish_reason": out.finish_reason,
                }
            ],
            "usage": usage(out),
        }

    def piece(text: str, finish: str | None) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": text} if text else {}
        return {
            **head,
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }

    def final(out: RequestOutput) -> dict[str, Any]:
        return {**head, "object": "chat.completion.chunk", "choices": [], "usage": usage(out)}

    # Like vLLM: a first chunk that carries only the role. It holds no generated content, so a
    # client must not stop its TTFT clock here.
    role = {
        **head,
        "object": "chat.completion.chunk",
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
    }
    return _sse_response(
        stream, params.stop, piece, final if body.include_usage else None, first=role
    )


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    s = state_of(request)
    s.check_model(body.model)
    if isinstance(body, TokenizeChat):
        ids = await s.chat_prompt(body.messages, body.add_generation_prompt)
    else:
        ids = await s.encode(body.prompt, "prompt", add_special_tokens=body.add_special_tokens)
    return {"count": len(ids), "max_model_len": s.llm.max_model_len, "tokens": ids}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    s = state_of(request)
    s.check_model(body.model)
    vocab = s.llm.tokenizer.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(
            400, f"token ids outside the vocabulary (0..{vocab - 1}): {bad[:5]}", param="tokens"
        )
    return {"prompt": s.llm.tokenizer.decode(body.tokens, skip_special_tokens=False)}


def error_shape(status: int, message: str, kind: str, param: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "integer"},
            },
        }
    },
}

DIALECT = Dialect(
    name="openai",
    prefix="/",
    router=router,
    error_shape=error_shape,
    error_schema=ERROR_SCHEMA,
    stream_types={
        "/v1/completions": "text/event-stream",
        "/v1/chat/completions": "text/event-stream",
    },
)
