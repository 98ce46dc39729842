"""What every API dialect's routes share: the server's state, client errors, text deltas,
stream framing (SSE, NDJSON) and running a request to its end.

A dialect (``openai_api``, ``ollama_api``) is one module exporting a :class:`Dialect`: its
router, the path prefix it owns, and the shape of its errors; ``dialects.py`` lists them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pdscope.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    QueueFullError,
    RequestStream,
)
from pdscope.engine.llm_engine import LLMEngine, RequestOutput
from pdscope.engine.sampling_params import SamplingParams
from pdscope.server.guard import GuardConfig, error_json
from pdscope.server.protocol import ChatMessage

# Texts shorter than this are tokenized on the event loop: a thread hop would cost more than
# the few milliseconds they take.
INLINE_TOKENIZE_CHARS = 2000
RETRY_AFTER_S = 1  # what a 503 from --max-queue tells clients to wait

# (status, message, kind, param) -> the JSON body of an error in one dialect
ErrorShape = Callable[[int, str, str, "str | None"], dict[str, Any]]


@dataclass(frozen=True)
class Dialect:
    """One API a client may speak to the server, as a unit the app factory loops over."""

    name: str
    prefix: str  # the paths whose errors take this dialect's shape ("/" for the rest)
    router: APIRouter
    error_shape: ErrorShape
    error_schema: dict[str, Any]  # the error shape as JSON schema, for the OpenAPI document
    stream_types: dict[str, str]  # path of a streaming route -> its media type


class APIError(Exception):
    """An error a client caused (4xx) or a capacity limit (503), with a message naming it."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "BadRequestError",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param
        self.headers = headers


class ErrorResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return error_json(content)


@dataclass
class ServerState:
    engine: AsyncEngine
    model_name: str
    guard: GuardConfig = field(default_factory=GuardConfig)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def llm(self) -> LLMEngine:
        return self.engine.engine

    def check_model(self, name: str | None, exact: bool = False) -> None:
        """Requests may name the served model (Ollama clients may add ":latest") or omit it;
        ``exact``: only its own name (OpenAI's retrieve)."""
        named = (
            (self.model_name,)
            if exact
            else (None, "", self.model_name, f"{self.model_name}:latest")
        )
        if name in named:
            return
        raise APIError(
            404,
            f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
            "NotFoundError",
            "model",
        )

    async def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a client's text. A text certainly too long for the context is refused
        by its length alone; a long one is split on a worker thread, so the streams in flight
        keep their pace while it is tokenized."""
        self.refuse_overlong(text, param)
        tok = self.llm.tokenizer
        if len(text) < INLINE_TOKENIZE_CHARS:
            return tok.encode(text, add_special_tokens=add_special_tokens)
        return await asyncio.to_thread(tok.encode_releasing_gil, text, add_special_tokens)

    def refuse_overlong(self, text: str, param: str) -> None:
        per_token = self.llm.tokenizer.max_chars_per_token
        limit = self.llm.max_model_len
        if per_token is not None and len(text) > limit * per_token:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your "
                f"{param} has {len(text):,} characters, more than {limit} tokens can hold "
                f"(one token covers at most {per_token} characters).",
                param=param,
            )

    async def chat_prompt(
        self, messages: list[ChatMessage], add_generation_prompt: bool = True
    ) -> list[int]:
        plain = [
            {
                "role": "system" if m.role == "developer" else m.role,
                "content": _content_text(m.content),
            }
            for m in messages
        ]
        chars = sum(len(m["content"]) for m in plain)

        def render() -> str:
            return self.llm.tokenizer.apply_chat_template(
                plain, add_generation_prompt=add_generation_prompt
            )

        try:
            text = render() if chars < INLINE_TOKENIZE_CHARS else await asyncio.to_thread(render)
        except Exception as exc:
            raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from exc
        return await self.encode(text, "messages", add_special_tokens=False)

    @staticmethod
    def sampling(build: Callable[[], SamplingParams]) -> SamplingParams:
        """Sampling parameters from a request body; a bad combination is the client's 400."""
        try:
            return build()
        except ValueError as exc:  # a FieldError names its field
            raise APIError(
                400, f"invalid sampling parameters: {exc}", param=getattr(exc, "param", None)
            ) from exc

    def max_tokens_for(
        self,
        prompt_ids: list[int],
        asked: int | None,
        name: str = "max_tokens",
        prompt_param: str = "prompt",
    ) -> int:
        """Output budget: what was asked, or the rest of the context; refuse if it cannot fit.
        ``name`` and ``prompt_param``: the body's fields a refusal names."""
        limit = self.llm.max_model_len
        room = limit - len(prompt_ids)
        if room < 1:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. "
                f"However, your prompt has {len(prompt_ids)} tokens.",
                param=prompt_param,
            )
        if asked is None:
            return room
        if asked > room:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. "
                f"However, you requested {len(prompt_ids) + asked} tokens "
                f"({len(prompt_ids)} in the prompt, {asked} in the completion).",
                param=name,
            )
        return asked

    async def start(
        self,
        request: Request,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        prompt_param: str = "prompt",
    ) -> RequestStream:
        try:
            arrival = getattr(request.state, "arrival_s", None)
            return await self.engine.add(prompt_ids, params, request_id, arrival)
        except QueueFullError as exc:
            retry = {"Retry-After": str(RETRY_AFTER_S)}
            raise APIError(503, str(exc), "ServiceUnavailableError", headers=retry) from exc
        except EngineDeadError as exc:
            raise APIError(503, str(exc), "ServiceUnavailableError") from exc
        except ValueError as exc:  # the engine's message starts with the field it refuses
            param = "stop_token_ids" if str(exc).startswith("stop_token_ids") else prompt_param
            raise APIError(400, str(exc), param=param) from exc


def state_of(request: Request) -> ServerState:
    """The ServerState every route works with (set by build_app)."""
    return request.app.state.pdscope


def _content_text(content: str | list[Any] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.text for part in content)


class TextDeltas:
    """Turns the growing output text into deltas, holding back the last few characters while a
    stop string could still be forming (the engine cuts the text at a stop string, and a
    streamed character cannot be taken back)."""

    def __init__(self, stop: list[str]):
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.sent = 0

    def __call__(self, out: RequestOutput) -> str:
        text = out.text
        upto = len(text) if out.finished else max(self.sent, len(text) - self.holdback)
        delta, self.sent = text[self.sent : upto], upto
        return delta


async def collect(stream: RequestStream, request: Request) -> RequestOutput:
    """Run a non-streaming request to its end; a client that leaves aborts it at once (it was
    noticed by polling every 0.5 s, ~600 tokens of the tiny model made for nobody)."""

    async def last() -> RequestOutput:
        final = None
        async for out in stream:
            final = out
        assert final is not None
        return final

    async def gone() -> None:
        # The body is read: the next message the server has for this request is its end.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, left = asyncio.ensure_future(last()), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, left}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            raise APIError(499, "client disconnected")
        out = task.result()
        if out.error:  # this request alone failed inside the engine
            raise APIError(500, f"request failed: {out.error}", "InternalServerError")
        return out
    except EngineDeadError as exc:
        raise APIError(503, str(exc), "ServiceUnavailableError") from exc
    finally:
        left.cancel()
        await stream.aclose()


def usage(out: RequestOutput) -> dict[str, Any]:
    prompt, completion = out.request.num_prompt_tokens, len(out.request.output_token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": out.timeline.num_cached_tokens},
    }


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event (OpenAI's streams): a JSON chunk or the closing "[DONE]"."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def ndjson(data: dict[str, Any]) -> str:
    """One line of a newline-delimited JSON stream (Ollama's)."""
    return json.dumps(data) + "\n"
