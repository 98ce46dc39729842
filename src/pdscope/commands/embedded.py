"""The embedded server: what `probe`, `bench` and `watch` measure when given no URL.

``pdscope serve`` with the built-in small model, started as a child process on a free loopback
port (built on first use) and stopped when the command ends, however it ends.
"""

from __future__ import annotations

import shlex
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

EMBEDDED_MODEL = "small"


class EmbeddedServerError(RuntimeError):
    """The embedded server did not start (its log's tail is in the message)."""


@contextmanager
def embedded_server(
    url: str | None,
    command: str,
    server_args: str = "",
    announce: Callable[[str], None] | None = None,
) -> Iterator[str]:
    """Yield ``url`` as it is when given; else start the embedded server and yield its URL.

    ``server_args`` are extra `pdscope serve` flags, shell-quoted; ``command`` names the log's
    temporary folder (``pdscope-<command>-*``).
    """
    if url is not None:
        yield url
        return
    from pdscope.server.launch import start_server

    try:
        args = shlex.split(server_args)
    except ValueError as exc:
        raise EmbeddedServerError(
            f"cannot split the server's flags {server_args!r}: {exc}"
        ) from None
    if announce is not None:
        announce(
            f"starting the embedded server (pdscope serve, built-in {EMBEDDED_MODEL} model; "
            "built on first use) ..."
        )
    log = Path(tempfile.mkdtemp(prefix=f"pdscope-{command}-")) / "server.log"
    try:
        server = start_server(EMBEDDED_MODEL, log, *args, name=EMBEDDED_MODEL)
    except RuntimeError as exc:
        raise EmbeddedServerError(str(exc)) from None
    try:
        yield server.url
    finally:
        server.stop()
