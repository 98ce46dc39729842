"""`pdscope serve`: load the engine, log the KV pool, run uvicorn until SIGINT/SIGTERM."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import uvicorn

from pdscope.engine.async_engine import AsyncEngine
from pdscope.engine.llm_engine import EngineArgs, LLMEngine
from pdscope.server.app import build_app
from pdscope.server.common import ServerState
from pdscope.server.guard import DEFAULT_MAX_REQUEST_BYTES, GuardConfig

log = logging.getLogger("pdscope.serve")


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            # The shutdown on SIGINT/SIGTERM was graceful; uvicorn would re-raise the signal so
            # the process dies by it. Exit 0 instead: a clean stop is not a crash.
            self._captured_signals.clear()


def start_engine(args: EngineArgs, max_queue: int | None) -> AsyncEngine:
    engine = LLMEngine(args)
    tokens = engine.pool.num_blocks * engine.pool.block_size
    log.info("model %s on %s, %s", engine.path, engine.device, str(engine.dtype).split(".")[-1])
    log.info(engine.pool_summary)
    log.info(
        "maximum concurrency for %d tokens per request: %.2fx",
        engine.max_model_len,
        tokens / engine.max_model_len,
    )
    return AsyncEngine(engine, max_queue)


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
        # uvicorn handles SIGINT/SIGTERM: stop accepting, finish the responses in flight.
        _Server(uvicorn.Config(app, host=host, port=port, log_level="info")).run()
    finally:
        engine.shutdown()
        log.info("engine stopped")
