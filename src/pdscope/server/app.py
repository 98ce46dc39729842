"""The HTTP front: one FastAPI app over one AsyncEngine, speaking every dialect in
``dialects.DIALECTS`` (OpenAI and Ollama), plus /health and /metrics.

Errors are JSON in the dialect of the route that failed (``dialects.error_body``: Ollama's
``{"error": "..."}`` under ``/api/``, OpenAI's ``{"error": {"message", "type", "param",
"code"}}`` elsewhere). Nothing a client sends produces a 500 or stops the engine.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdscope import __version__
from pdscope.server.common import APIError, ErrorResponse, ServerState
from pdscope.server.guard import Guard
from pdscope.server.metrics import EngineMetrics

__all__ = ["ServerState", "build_app", "validation_problems"]


def validation_problems(errors: Sequence[Any]) -> dict[str, str]:
    """Field path -> what is wrong with it, one entry per field.

    pydantic reports a value that fits no member of a union once per member, under type tags
    ('list[TextPart]', 'function-after[...]'); those tags are dropped from the path, and where
    one member got past the type check its complaint is the one that says what is wrong."""
    errors = _likeliest_branch(errors)
    by_field: dict[str, list[dict[str, Any]]] = {}
    for err in errors:
        if err.get("type") == "json_invalid":  # its loc is ("body", the character's offset)
            at = err.get("loc", ())[-1]
            detail = (err.get("ctx") or {}).get("error", err.get("msg"))
            by_field.setdefault("", []).append(
                {"msg": f"the body is not valid JSON: {detail} (at character {at})"}
            )
            continue
        if err.get("type") == "missing" and tuple(err.get("loc", ())) == ("body",):
            by_field.setdefault("", []).append({"msg": "no request body: send a JSON object"})
            continue
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
    from pdscope.server import openapi
    from pdscope.server.dialects import DIALECTS, error_body

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
        # A model-level refusal (FieldError) names its field; pydantic's location cannot.
        named = (getattr((e.get("ctx") or {}).get("error"), "param", None) for e in exc.errors())
        param = next(filter(None, named), None) or next((w for w in problems if w), None)
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
        kinds = {404: "NotFoundError", 405: "MethodNotAllowedError"}
        kind = kinds.get(exc.status_code, "BadRequestError")
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

    @app.get("/")
    async def root() -> PlainTextResponse:
        # What Ollama answers here; its CLI sends HEAD / before anything else.
        return PlainTextResponse("pdscope is running")

    for dialect in DIALECTS:
        app.include_router(dialect.router)
    openapi.install(app, state.llm, DIALECTS)
    json_paths = frozenset(
        r.path
        for dialect in DIALECTS
        for r in dialect.router.routes
        if isinstance(r, APIRoute) and "POST" in r.methods
    )
    # The dialects' routes too: app.routes does not list a router's routes here.
    routes = [*app.routes, *(r for dialect in DIALECTS for r in dialect.router.routes)]
    get_paths = frozenset(r.path for r in routes if isinstance(r, APIRoute) and "GET" in r.methods)
    guard = dataclasses.replace(state.guard, json_paths=json_paths, get_paths=get_paths)
    return Guard(app, guard, error_body)
