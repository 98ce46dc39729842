"""Async streaming over the engine: the engine loop runs on its own thread, asyncio callers
receive each request's outputs as they are produced.

Every touch of engine state happens on the engine thread: callers submit closures to an inbox
that the loop drains between steps, so the scheduler and pool need no locks, and a slow HTTP
client never blocks a step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

from pdscope.engine.llm_engine import LLMEngine, RequestOutput
from pdscope.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped (shut down or crashed); no request can be served."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopping = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="pdscope-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def _submit(self, fn: Callable[[], None]) -> None:
        if not self.is_running:
            raise EngineDeadError(f"engine is not running: {self.error or 'shut down'}")
        self._inbox.put(fn)
        self._wake.set()

    async def call(self, fn: Callable[[], object]) -> object:
        """Run ``fn`` on the engine thread between steps and return its result."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def run() -> None:
            try:
                result = fn()
            except BaseException as exc:
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

        self._submit(run)
        return await future

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; leaving the loop early (a client that disconnects)
        aborts the request and frees everything it held."""
        loop = asyncio.get_running_loop()
        request_id = request_id or uuid.uuid4().hex
        outputs: asyncio.Queue = asyncio.Queue()

        def add() -> None:
            self.engine.add_request(prompt, params, request_id)
            self._streams[request_id] = (loop, outputs)

        await self.call(add)  # a bad prompt raises here, before anything streams
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished and self.is_running:
                self._submit(lambda: self._abort(request_id))

    async def abort(self, request_id: str) -> bool:
        return bool(await self.call(lambda: self._abort(request_id)))

    def _abort(self, request_id: str) -> bool:
        self._streams.pop(request_id, None)
        return self.engine.abort(request_id)

    def _loop(self) -> None:
        try:
            while not self._stopping:
                while True:
                    try:
                        self._inbox.get_nowait()()
                    except queue.Empty:
                        break
                if not self.engine.has_unfinished():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    stream = self._streams.get(out.request_id)
                    if stream is None:
                        continue
                    if out.finished:
                        del self._streams[out.request_id]
                    stream[0].call_soon_threadsafe(stream[1].put_nowait, out)
        except BaseException as exc:
            log.exception("engine loop crashed")
            self.error = exc
            dead = EngineDeadError(f"engine loop crashed: {exc!r}")
            for loop, outputs in self._streams.values():
                loop.call_soon_threadsafe(outputs.put_nowait, dead)
            self._streams.clear()
        finally:
            self._stopping = True

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the loop; requests still streaming get :class:`EngineDeadError`."""
        if not self._thread.is_alive():
            return

        def stop() -> None:
            self._stopping = True
            dead = EngineDeadError("engine shut down")
            for loop, outputs in self._streams.values():
                loop.call_soon_threadsafe(outputs.put_nowait, dead)
            self._streams.clear()

        self._inbox.put(stop)
        self._wake.set()
        self._thread.join(timeout_s)


def _settle(future: asyncio.Future, result: object, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
