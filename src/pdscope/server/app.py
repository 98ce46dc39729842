"""The HTTP front: one FastAPI app over one AsyncEngine, with OpenAI and Ollama dialects.

Errors are JSON in the dialect of the route that failed: OpenAI-style
``{"error": {"message", "type", "param", "code"}}`` everywhere but under ``/api/``, where Ollama's
``{"error": "..."}`` is used. Nothing a client sends produces a 500 or stops the engine.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
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
from pdscope.server.metrics import EngineMetrics
from pdscope.server.protocol import ChatMessage

OPEN_PATHS = {"/health", "/metrics"}  # reachable without the API key


class APIError(Exception):
    """An error a client caused (4xx) or a capacity limit (503), with a message naming it."""

    def __init__(
        self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


@dataclass
class ServerState:
    engine: AsyncEngine
    model_name: str
    api_key: str | None = None
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

    def chat_prompt(self, messages: list[ChatMessage]) -> list[int]:
        plain = [{"role": m.role, "content": _content_text(m.content)} for m in messages]
        try:
            text = self.llm.tokenizer.apply_chat_template(plain, add_generation_prompt=True)
        except Exception as exc:
            raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from exc
        return self.llm.tokenizer.encode(text, add_special_tokens=False)

    @staticmethod
    def sampling(build: Callable[[], SamplingParams]) -> SamplingParams:
        """Sampling parameters from a request body; a bad combination is the client's 400."""
        try:
            return build()
        except ValueError as exc:
            raise APIError(400, f"invalid sampling parameters: {exc}") from exc

    def max_tokens_for(self, prompt_ids: list[int], asked: int | None) -> int:
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
                param="max_tokens",
            )
        return asked

    async def start(
        self, request: Request, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> RequestStream:
        try:
            arrival = getattr(request.state, "arrival_s", None)
            return await self.engine.add(prompt_ids, params, request_id, arrival)
        except QueueFullError as exc:
            raise APIError(503, str(exc), "ServiceUnavailableError") from exc
        except EngineDeadError as exc:
            raise APIError(503, str(exc), "ServiceUnavailableError") from exc
        except ValueError as exc:
            raise APIError(400, str(exc), param="prompt") from exc


def state_of(request: Request) -> ServerState:
    """The ServerState every route works with (set by build_app)."""
    return request.app.state.pdscope


def _content_text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


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


def _error_body(path: str, status: int, message: str, kind: str, param: str | None) -> dict:
    if path.startswith("/api/"):
        return {"error": message}
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def build_app(state: ServerState) -> JSONBodies:
    from pdscope.server import ollama_api, openai_api

    app = FastAPI(title="pdscope", version=__version__, docs_url=None, redoc_url=None)
    app.state.pdscope = state
    metrics = EngineMetrics(state.llm, state.model_name)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        body = _error_body(request.url.path, exc.status, exc.message, exc.kind, exc.param)
        return JSONResponse(body, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        param = None
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            param = param or where or None
            problems.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        message = "invalid request: " + "; ".join(problems)
        return JSONResponse(
            _error_body(request.url.path, 400, message, "BadRequestError", param), status_code=400
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        kind = "NotFoundError" if exc.status_code == 404 else "BadRequestError"
        return JSONResponse(
            _error_body(request.url.path, exc.status_code, message, kind, None),
            status_code=exc.status_code,
        )

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        # A bug in one request's handling fails that request alone.
        message = f"internal error: {type(exc).__name__}: {exc}"
        return JSONResponse(
            _error_body(request.url.path, 500, message, "InternalServerError", None),
            status_code=500,
        )

    @app.middleware("http")
    async def require_key(request: Request, call_next: Callable) -> Any:
        # A request's clocks (TTFT, queue time, e2e) start here, when the server has it.
        request.state.arrival_s = time.perf_counter()
        if state.api_key and request.url.path not in OPEN_PATHS:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
                body = _error_body(
                    request.url.path,
                    401,
                    "missing or invalid API key: send 'Authorization: Bearer <key>'",
                    "AuthenticationError",
                    None,
                )
                return JSONResponse(body, status_code=401)
        return await call_next(request)

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
    return JSONBodies(app)  # type: ignore[return-value]


class JSONBodies:
    """ASGI wrapper: every POST body is JSON, whatever Content-Type says.

    Ollama's clients and curl -d send JSON without ``application/json``; without this FastAPI
    would read such a body as a form and report a confusing type error.
    """

    def __init__(self, app: FastAPI):
        self.app = app
        self.state = app.state

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


def sse(data: dict[str, Any] | str) -> str:
    import json

    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
