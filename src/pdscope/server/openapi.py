"""The published OpenAPI schema, made to say what the server does.

FastAPI documents a 422 the server never sends (validation errors are 400 here, as OpenAI and
vLLM answer), only JSON where the server also streams SSE or NDJSON, and none of the errors the
guard or the engine give. Limits that depend on the loaded model (vocabulary size, context
length) are filled in when the schema is first asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI

from pdscope.engine.llm_engine import LLMEngine
from pdscope.server.common import Dialect

TEXT_ROUTES = {"/": "text/plain", "/health": "text/plain", "/metrics": "text/plain"}
WHY = {
    "400": "Invalid request: the message names the field",
    "401": "Missing or wrong API key (--api-key)",
    "403": "Host or Origin not allowed (--allowed-hosts, --allowed-origins)",
    "404": "The model named is not the one served",
    "413": "Body larger than --max-request-bytes",
    "415": "Content-Type is not application/json",
    "500": "An error inside the server; the connection stays usable",
    "503": "Queue full (--max-queue; Retry-After says when to retry) or engine stopped",
}


def install(app: FastAPI, llm: LLMEngine, dialects: Sequence[Dialect]) -> None:
    """Replace ``app.openapi`` with one that patches FastAPI's schema once."""
    generate: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            _patch(schema, llm, dialects)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _patch(schema: dict[str, Any], llm: LLMEngine, dialects: Sequence[Dialect]) -> None:
    stream_types = {path: kind for d in dialects for path, kind in d.stream_types.items()}
    for path, operations in schema.get("paths", {}).items():
        error = next(d for d in dialects if path.startswith(d.prefix)).error_schema
        for method, op in operations.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            codes = ["401", "403", "500"]
            if method == "post":
                codes += ["400", "404", "413", "415"]
            elif "{model" in path:
                codes.append("404")
            if path in stream_types:  # generating routes: the queue may be full
                codes.append("503")
            for code in codes:
                responses[code] = {
                    "description": WHY[code],
                    "content": {"application/json": {"schema": error}},
                }
            if "503" in codes:
                responses["503"]["headers"] = {
                    "Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}
                }
            ok = responses.setdefault("200", {"description": "Successful Response"})
            if path in stream_types:
                # An SSE event's data is a JSON chunk, or the closing "[DONE]".
                event = {"anyOf": [{"type": "object"}, {"type": "string"}]}
                ok.setdefault("content", {})[stream_types[path]] = {"schema": event}
            if path in TEXT_ROUTES:
                ok["content"] = {TEXT_ROUTES[path]: {"schema": {"type": "string"}}}
    limits = {
        "token-id": {"maximum": llm.tokenizer.vocab_size - 1},
        "max-tokens": {"maximum": llm.max_model_len - 1},
        "prompt-ids": {"maxItems": llm.max_model_len - 1},
        # Exact integers: as floats these bounds round past 2**64 and invite 2**64 + 382.
        "seed": {"minimum": -(2**63), "maximum": 2**64 - 1},
    }
    _fill(schema.get("components", {}), limits)


def _fill(node: Any, limits: dict[str, dict[str, int]]) -> None:
    """Put the model's numbers where the request models marked them (``x-pdscope``)."""
    if isinstance(node, dict):
        mark = node.pop("x-pdscope", None)
        if mark in limits:
            node.pop("exclusiveMaximum", None)
            node.update(limits[mark])
        for value in node.values():
            _fill(value, limits)
    elif isinstance(node, list):
        for value in node:
            _fill(value, limits)
