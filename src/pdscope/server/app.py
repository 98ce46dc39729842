"""The HTTP front: one FastAPI app over one AsyncEngine, with OpenAI and Ollama dialects.

Errors are JSON in the dialect of the route that failed: OpenAI-style
``{"error": {"message", "type", "param", "code"}}`` everywhere but under ``/api/``, where Ollama's
``{"error": "..."}`` is used. Nothing a client sends produces a 500 or stops the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdscope import __version__
from pdscope.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    QueueFullError,
    RequestStream,
)
from pdscope.engine.llm_engine import LLMEngine, RequestOutput
from pdscope.engine.sampling_params import SamplingParams
from pdscope.server.guard import Guard, GuardConfig, error_body, error_json
from pdscope.server.metrics import EngineMetrics
from pdscope.server.protocol import ChatMessage

# Texts shorter than this are tokenized on the event loop: a thread hop would cost more than
# the few milliseconds they take.
INLINE_TOKENIZE_CHARS = 2000
RETRY_AFTER_S = 1  # what a 503 from --max-queue tells clients to wait


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

    def check_model(self, name: str | None) -> None:
        """Requests may name the served model (Ollama clients may add ":latest") or omit it."""
        if name in (None, "", self.model_name, f"{self.model_name}:latest"):
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

    async def chat_prompt(self, messages: list[ChatMessage]) -> list[int]:
        plain = [{"role": m.role, "content": _content_text(m.content)} for m in messages]
        chars = sum(len(m["content"]) for m in plain)

        def render() -> str:
            return self.llm.tokenizer.apply_chat_template(plain, add_generation_prompt=True)

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
        except ValueError as exc:
            raise APIError(400, f"invalid sampling parameters: {exc}") from exc

    def max_tokens_for(
        self, prompt_ids: list[int], asked: int | None, name: str = "max_tokens"
    ) -> int:
        """Output budget: what was asked, or the rest of the context; refuse if it cannot fit."""
        limit = self.llm.max_model_len
        room = limit - len(prompt_ids)
        if room < 1:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. "
                f"However, your prompt has {len(prompt_ids)} tokens.",
                param="prompt",
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
        self, request: Request, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> RequestStream:
        try:
            arrival = getattr(request.state, "arrival_s", None)
            return await self.engine.add(prompt_ids, params, request_id, arrival)
        except QueueFullError as exc:
            retry = {"Retry-After": str(RETRY_AFTER_S)}
            raise APIError(503, str(exc), "ServiceUnavailableError", headers=retry) from exc
        except EngineDeadError as exc:
            raise APIError(503, str(exc), "ServiceUnavailableError") from exc
        except ValueError as exc:
            raise APIError(400, str(exc), param="prompt") from exc


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
    """Run a non-streaming request to its end; a client that leaves aborts it."""

    async def last() -> RequestOutput:
        final = None
        async for out in stream:
            final = out
        assert final is not None
        return final

    task = asyncio.ensure_future(last())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                out = task.result()
                if out.error:  # this request alone failed inside the engine
                    raise APIError(500, f"request failed: {out.error}", "InternalServerError")
                return out
            if await request.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected")
    except EngineDeadError as exc:
        raise APIError(503, str(exc), "ServiceUnavailableError") from exc
    finally:
        await stream.aclose()


def usage(out: RequestOutput) -> dict[str, Any]:
    prompt, completion = out.request.num_prompt_tokens, len(out.request.output_token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": out.timeline.num_cached_tokens},
    }


def validation_problems(errors: Sequence[Any]) -> dict[str, str]:
    """Field path -> what is wrong with it, one entry per field.

    pydantic reports a value that fits no member of a union once per member, under type tags
    ('list[TextPart]', 'function-after[...]'); those tags are dropped from the path, and where
    one member got past the type check its complaint is the one that says what is wrong."""
    errors = _likeliest_branch(errors)
    by_field: dict[str, list[dict[str, Any]]] = {}
    for err in errors:
        where = ".".join(str(p) for p in err.get("loc", ()) if _is_field_step(p))
        by_field.setdefault(where, []).append(err)
    problems = {}
    for where, errs in by_field.items():
        specific = [e for e in errs if not str(e.get("type", "")).endswith("_type")] or errs
        messages = dict.fromkeys(str(e.get("msg")) for e in specific)
        problems[where] = "; ".join(list(messages)[:3])
    return problems


def _likeliest_branch(errors: Sequence[Any]) -> list[Any]:
    """For a body that fits none of a union of models (/tokenize's prompt or chat shapes),
    the errors of the shape it was closest to: the one missing the fewest fields."""
    branches: dict[str, list[Any]] = {}
    for err in errors:
        tag = next((p for p in err.get("loc", ()) if isinstance(p, str) and p[:1].isupper()), "")
        branches.setdefault(tag, []).append(err)
    if len(branches) < 2 or "" in branches:
        return list(errors)

    def missing(tag: str) -> int:
        return sum(e.get("type") == "missing" for e in branches[tag])

    fewest = min(missing(tag) for tag in branches)
    return [e for tag, errs in branches.items() if missing(tag) == fewest for e in errs]


def _is_field_step(step: Any) -> bool:
    return isinstance(step, int) or (
        step != "body" and re.fullmatch(r"[a-z_][a-z0-9_]*", str(step)) is not None
    )


def build_app(state: ServerState) -> Guard:
    from pdscope.server import ollama_api, openai_api, openapi

    app = FastAPI(title="pdscope", version=__version__, docs_url=None, redoc_url=None)
    app.state.pdscope = state
    metrics = EngineMetrics(state.llm, state.model_name)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        body = error_body(request.url.path, exc.status, exc.message, exc.kind, exc.param)
        return ErrorResponse(body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = validation_problems(exc.errors())
        param = next((where for where in problems if where), None)
        message = "invalid request: " + "; ".join(
            f"{where}: {msg}" if where else msg for where, msg in problems.items()
        )
        return ErrorResponse(
            error_body(request.url.path, 400, message, "BadRequestError", param), status_code=400
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        if exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        kind = "NotFoundError" if exc.status_code == 404 else "BadRequestError"
        return ErrorResponse(
            error_body(request.url.path, exc.status_code, message, kind, None),
            status_code=exc.status_code,
            headers=exc.headers,  # 405 carries Allow
        )

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        # A bug in one request's handling fails that request alone (Guard keeps the
        # connection open after it).
        message = f"internal error: {type(exc).__name__}: {exc}"
        return ErrorResponse(
            error_body(request.url.path, 500, message, "InternalServerError", None),
            status_code=500,
        )

    @app.get("/health")
    async def health() -> PlainTextResponse:
        if not state.engine.is_running:
            return PlainTextResponse("engine is not running", status_code=503)
        return PlainTextResponse("")

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(
            generate_latest(metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST
        )

    app.include_router(openai_api.router)
    app.include_router(ollama_api.router)
    openapi.install(app, state.llm)
    json_paths = frozenset(
        r.path
        for router in (openai_api.router, ollama_api.router)
        for r in router.routes
        if isinstance(r, APIRoute) and "POST" in r.methods
    )
    return Guard(app, dataclasses.replace(state.guard, json_paths=json_paths))


def sse(data: dict[str, Any] | str) -> str:
    import json

    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
