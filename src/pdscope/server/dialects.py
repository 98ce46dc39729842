"""The API dialects `pdscope serve` speaks: adding one is a module exporting a ``DIALECT``
(see ``common.Dialect``) and one entry here.

The most specific prefix comes first: a path's dialect is the first whose prefix it starts with,
so OpenAI's "/" takes every path no other dialect claims (/health, /metrics, unknown paths).
"""

from __future__ import annotations

from typing import Any

from pdscope.server import ollama_api, openai_api
from pdscope.server.common import Dialect

DIALECTS: tuple[Dialect, ...] = (ollama_api.DIALECT, openai_api.DIALECT)


def dialect_of(path: str) -> Dialect:
    return next(d for d in DIALECTS if path.startswith(d.prefix))


def error_body(
    path: str, status: int, message: str, kind: str, param: str | None
) -> dict[str, Any]:
    """An error in the dialect of the route that failed."""
    return dialect_of(path).error_shape(status, message, kind, param)
