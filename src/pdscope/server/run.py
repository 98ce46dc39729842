"""`pdscope serve`: load the engine, log the KV pool, run uvicorn until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
from collections.abc import Iterator
from types import FrameType

import uvicorn

from pdscope.engine import malloc
from pdscope.engine.async_engine import AsyncEngine, EngineDeadError
from pdscope.engine.kernels import parse_kernels
from pdscope.engine.llm_engine import EngineArgs, LLMEngine, engine_device, heap_rule
from pdscope.heap import freeze_startup_heap
from pdscope.server.app import build_app
from pdscope.server.common import ServerState
from pdscope.server.guard import DEFAULT_MAX_REQUEST_BYTES, GuardConfig

log = logging.getLogger("pdscope.serve")


# After the abort, how long a stream may still take to leave: one whose client stopped
# reading waits in its send for ever, and uvicorn alone would wait for it for ever too.
FORCE_AFTER_ABORT_S = 5.0


class _Server(uvicorn.Server):
    """uvicorn, with vLLM's shutdown: on SIGTERM/SIGINT new connections are refused, requests
    in flight get ``shutdown_timeout_s`` to finish, and then the engine aborts them (and
    admits no more), so every stream ends with finish_reason "abort" and its connection
    closes. A stream still open FORCE_AFTER_ABORT_S later (a client that stopped reading) is
    cancelled. A second signal aborts at once. (uvicorn alone waited for every stream without
    limit: 77 s for 16 streams of 4,000 tokens, and for ever behind a client not reading.)"""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, shutdown_timeout_s: float):
        config.timeout_graceful_shutdown = math.ceil(shutdown_timeout_s + FORCE_AFTER_ABORT_S)
        super().__init__(config)
        self.engine, self.shutdown_timeout_s = engine, shutdown_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        # The engine, the app and uvicorn's protocols (config.load) are loaded by now: what is
        # alive stays alive, and a full collection that walked it stalled every stream
        # (pdscope/heap.py). Frozen before the sockets listen, so no request waits for it.
        if not self.should_exit:
            frozen, took_s = freeze_startup_heap()
            log.info("froze the start-up heap: %d objects in %.0f ms", frozen, took_s * 1e3)
        if not self.should_exit:  # a signal during the freeze: exit without listening
            await super().startup(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            # The shutdown on SIGINT/SIGTERM was graceful; uvicorn would re-raise the signal so
            # the process dies by it. Exit 0 instead: a clean stop is not a crash.
            self._captured_signals.clear()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and self._loop is not None:
            # The second signal: stop waiting for streams. Through the loop, not from here: a
            # signal handler that took the engine's locks could find them held by this thread.
            self._loop.call_soon_threadsafe(self._abort_now)
        super().handle_exit(sig, frame)

    def _abort_now(self) -> None:
        self._abort_in_flight()
        # A stream that still cannot end (its client stopped reading) holds the exit no more
        # than FORCE_AFTER_ABORT_S, whatever --shutdown-timeout said.
        assert self._loop is not None
        self._loop.call_later(FORCE_AFTER_ABORT_S, setattr, self, "force_exit", True)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(
            self.shutdown_timeout_s, self._abort_in_flight
        )
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _abort_in_flight(self) -> None:
        with contextlib.suppress(EngineDeadError):  # the engine stopped first: nothing to end
            self.engine.abort_all()


def start_engine(args: EngineArgs, max_queue: int | None) -> AsyncEngine:
    # Built on the thread that steps it: one OpenMP team in the process (async_engine.py).
    # Its tensors from the main heap, the one the engine settles (engine/malloc.py): the
    # thread takes a heap when it first allocates.
    if parse_kernels(args.kernels).get("heap") != "default" and heap_rule(
        engine_device(args.device)
    ):
        malloc.share_main_heap()
    running = AsyncEngine(lambda: LLMEngine(args), max_queue)
    engine = running.engine
    tokens = engine.pool.num_blocks * engine.pool.block_size
    log.info("model %s on %s, %s", engine.path, engine.device, str(engine.dtype).split(".")[-1])
    # what libgomp read when torch loaded (commands/serve.py sets the count from the model)
    policy = os.environ.get("OMP_WAIT_POLICY")
    log.info(
        "OpenMP workers spin before they sleep: GOMP_SPINCOUNT=%s%s",
        os.environ.get("GOMP_SPINCOUNT", "unset (libgomp's default)"),
        f", OMP_WAIT_POLICY={policy}" if policy else "",
    )
    log.info(engine.pool_summary)
    log.info(
        "maximum concurrency for %d tokens per request: %.2fx",
        engine.max_model_len,
        tokens / engine.max_model_len,
    )
    return running


def serve(
    args: EngineArgs,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_queue: int | None = None,
    allowed_origins: tuple[str, ...] = (),
    allowed_hosts: tuple[str, ...] = (),
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    shutdown_timeout_s: float = 0.0,
) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    engine = start_engine(args, max_queue)
    name = served_model_name or args.model
    guard = GuardConfig(
        api_key=api_key,
        bound_host=host,
        allowed_origins=allowed_origins,
        allowed_hosts=allowed_hosts,
        max_request_bytes=max_request_bytes,
    )
    app = build_app(ServerState(engine, name, guard))
    log.info("serving %r on http://%s:%d (OpenAI /v1, Ollama /api, /metrics)", name, host, port)
    try:
        config = uvicorn.Config(app, host=host, port=port, log_level="info")
        _Server(config, engine, shutdown_timeout_s).run()
    finally:
        engine.shutdown()
        log.info("engine stopped")
