"""The door of `pdscope serve`: one pure ASGI layer in front of the FastAPI app.

It decides, before any route runs, whether a request may come in at all: Host (DNS rebinding),
Origin (cross-site pages), API key, Content-Type and body size. It also turns an error that
escapes the app into a JSON 500 on a connection that stays open.

It is plain ASGI and not ``@app.middleware("http")`` on purpose: Starlette's HTTP middleware
hands routes a ``receive`` that never reports the client leaving, so a non-streaming request
kept generating after its client was gone.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import re
import socket
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("pdscope.serve")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health", "/metrics"})  # reachable without the API key
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
# Browser pages allowed to call the server by default: those served from this machine.
LOOPBACK_ORIGINS = tuple(
    f"{scheme}://{host}{port}"
    for scheme in ("http", "https")
    for host in ("localhost", "127.0.0.1", "[::1]")
    for port in ("", ":*")
)
CORS_METHODS = "GET, POST, OPTIONS"
CORS_MAX_AGE_S = 600


# (path, status, message, kind, param) -> the JSON body of an error in the dialect of the path
ErrorBody = Callable[[str, int, str, str, "str | None"], dict]


def error_json(body: dict) -> bytes:
    # ASCII escapes: a message quoting client text can never fail to encode.
    return json.dumps(body, ensure_ascii=True).encode()


@dataclass(frozen=True)
class GuardConfig:
    api_key: str | None = None
    bound_host: str = "127.0.0.1"
    allowed_origins: tuple[str, ...] = ()  # added to LOOPBACK_ORIGINS; "*" allows any
    allowed_hosts: tuple[str, ...] = ()  # Host names accepted besides loopback names and IPs
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    json_paths: frozenset[str] = field(default_factory=frozenset)  # POST routes taking JSON
    get_paths: frozenset[str] = field(default_factory=frozenset)  # GET routes, HEAD served too

    def origin_allowed(self, origin: str) -> bool:
        origin = origin.lower()
        patterns = (*LOOPBACK_ORIGINS, *(o.lower().rstrip("/") for o in self.allowed_origins))
        return any(p == "*" or _matches(origin, p) for p in patterns)

    def host_allowed(self, host_header: str) -> bool:
        """Only a server bound to loopback checks Host: there a page on an attacker's domain
        that re-resolves to 127.0.0.1 (DNS rebinding) is the threat. An IP literal cannot be
        rebound, so any is accepted; names must be loopback ones or allowed."""
        if not _is_loopback(self.bound_host):
            return True
        name = _host_name(host_header)
        allowed = {h.lower().rstrip(".") for h in self.allowed_hosts}
        if "*" in allowed or name in allowed or name in ("", "localhost", _hostname()):
            return True
        if name.endswith(".localhost") or name == self.bound_host.lower():
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True


def _matches(origin: str, pattern: str) -> bool:
    """'*' in a pattern stands for any run of characters but '/'; everything else is literal
    (brackets included, as in 'http://[::1]:*')."""
    regex = "[^/]*".join(re.escape(part) for part in pattern.split("*"))
    return re.fullmatch(regex, origin) is not None


def _hostname() -> str:
    return socket.gethostname().lower()


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_name(host_header: str) -> str:
    """'example.com:8000' -> 'example.com', '[::1]:8000' -> '::1'."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and "+json" in media)


class BodyTooLarge(Exception):
    pass


class Guard:
    """ASGI wrapper around the FastAPI app; see the module docstring."""

    def __init__(self, app: ASGIApp, config: GuardConfig, error_body: ErrorBody):
        self.app = app
        self.config = config
        self.error_body = error_body

    def __getattr__(self, name: str) -> Any:
        # Tests and uvicorn may look at the wrapped app's attributes (state, routes, openapi).
        return getattr(self.app, name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # A request's clocks (TTFT, queue time, e2e) start here, when the server has it.
        scope.setdefault("state", {})["arrival_s"] = time.perf_counter()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path, method, c = scope["path"], scope["method"], self.config

        async def refuse(status: int, message: str, kind: str, extra: dict | None = None) -> None:
            await _send_json(
                send, status, self.error_body(path, status, message, kind, None), extra
            )

        if not c.host_allowed(headers.get("host", "")):
            await refuse(
                403,
                f"Host {headers['host']!r} is not allowed: this server answers to loopback "
                "names and IP addresses; add the name with --allowed-hosts",
                "PermissionDeniedError",
            )
            return
        origin = headers.get("origin")
        cors: dict[str, str] = {}
        if origin is not None:
            if not c.origin_allowed(origin):
                await refuse(
                    403,
                    f"Origin {origin!r} is not allowed to call this server; "
                    "add it with --allowed-origins",
                    "PermissionDeniedError",
                )
                return
            cors = {"access-control-allow-origin": origin, "vary": "Origin"}
            if method == "OPTIONS" and "access-control-request-method" in headers:
                await _preflight(send, cors, headers)
                return
        if c.api_key and path not in OPEN_PATHS:
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {c.api_key}".encode()):
                await refuse(
                    401,
                    "missing or invalid API key: send 'Authorization: Bearer <key>'",
                    "AuthenticationError",
                    cors,  # an allowed page may read why it was refused
                )
                return
        if method == "POST" and path in c.json_paths:
            kind = headers.get("content-type", "")
            if not _is_json(kind):
                await refuse(
                    415,
                    f"Content-Type must be application/json, got {kind or 'none'!r} "
                    "(with curl: -H 'Content-Type: application/json')",
                    "UnsupportedMediaTypeError",
                    cors,
                )
                return
            try:
                receive = await self._read_body(receive, headers)
            except BodyTooLarge:
                # Closing stops the server from reading (and discarding) the rest of a body
                # it has refused: 100 MB of it cost streams in flight a 0.46 s stall.
                await refuse(
                    413,
                    f"request body is larger than {c.max_request_bytes:,} bytes "
                    "(--max-request-bytes)",
                    "RequestTooLargeError",
                    {**cors, "connection": "close"},
                )
                return
        head = method == "HEAD" and path in c.get_paths
        if head:  # FastAPI routes answer only the methods they list: HEAD is the GET, no body
            scope = {**scope, "method": "GET"}
        await self._run(scope, receive, send, path, cors, head)

    async def _read_body(self, receive: Receive, headers: dict[str, str]) -> Receive:
        """Read the body up front, refusing it once it passes the limit: a declared length
        over it is refused before a byte is read, a chunked one as soon as it grows over."""
        limit = self.config.max_request_bytes
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise BodyTooLarge
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left; let the app see it
                early = message
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                raise BodyTooLarge
            if not message.get("more_body", False):
                early = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                break
        pending: list[Message] = [early]

        async def replay() -> Message:
            # After the body, the real receive: that is where a disconnect shows.
            return pending.pop() if pending else await receive()

        return replay

    async def _run(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        path: str,
        cors: dict[str, str],
        head: bool = False,
    ) -> None:
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if cors:
                    message = {
                        **message,
                        "headers": [*message.get("headers", []), *_encode(cors)],
                    }
            elif head and message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            # Starlette answers with our JSON 500 and then re-raises; uvicorn would close the
            # keep-alive connection under the client's next request. The answer is out (or is
            # sent here), so the error ends here, logged.
            log.exception("error in %s %s", scope["method"], path)
            if not started:
                message = f"internal error: {type(exc).__name__}: {exc}"
                body = self.error_body(path, 500, message, "InternalServerError", None)
                await _send_json(send, 500, body, cors)


def _encode(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


async def _send_json(send: Send, status: int, body: dict, extra: dict | None = None) -> None:
    payload = error_json(body)
    headers = {
        "content-type": "application/json",
        "content-length": str(len(payload)),
        **(extra or {}),
    }
    await send({"type": "http.response.start", "status": status, "headers": _encode(headers)})
    await send({"type": "http.response.body", "body": payload})


async def _preflight(send: Send, cors: dict[str, str], headers: dict[str, str]) -> None:
    """Answer a CORS preflight from an allowed origin: which methods and headers it may use."""
    asked = headers.get("access-control-request-headers", "")
    reply = {
        **cors,
        "access-control-allow-methods": CORS_METHODS,
        "access-control-allow-headers": asked or "Authorization, Content-Type",
        "access-control-max-age": str(CORS_MAX_AGE_S),
        "vary": "Origin, Access-Control-Request-Method, Access-Control-Request-Headers",
        "content-length": "0",
    }
    await send({"type": "http.response.start", "status": 204, "headers": _encode(reply)})
    await send({"type": "http.response.body", "body": b""})
