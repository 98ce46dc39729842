"""Async streaming over the engine: the engine loop runs on its own thread, asyncio callers
receive each request's outputs as they are produced.

Every touch of engine state happens on the engine thread: callers submit closures to an inbox
that the loop drains between steps, so the scheduler and pool need no locks, and a slow HTTP
client never blocks a step.

Given a function that builds the engine, the thread builds it too (the server's way), so one
thread runs every torch op and C kernel of the process. GNU OpenMP gives each thread that
starts a parallel region its own team of workers; once a process's teams hold more threads
than it has CPUs, every worker stops spinning at a barrier after ~1,000 spins and sleeps in the
kernel, and each of a step's many barriers pays a wake-up. Loaded on the main thread and
stepped on this one, a 2-core server's batch-1 decode took 1.1-1.3x the TPOT of the same engine
in process (docs/performance.md, "One OpenMP team"; libgomp's do_spin counts down its
throttled spin whenever the managed threads outnumber the CPUs).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

from pdscope.engine.llm_engine import LLMEngine, RequestOutput
from pdscope.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped (shut down or crashed); no request can be served."""


class QueueFullError(RuntimeError):
    """More requests are waiting than ``max_queue`` allows; the new one was not accepted."""


class AsyncEngine:
    def __init__(
        self, engine: LLMEngine | Callable[[], LLMEngine], max_queue: int | None = None
    ) -> None:
        """``engine``: the engine, or a function that builds it on the engine thread (returns
        once it is built; what the build raised is raised here)."""
        self.max_queue = max_queue
        # (work, on_dead): on_dead settles the caller if the loop stops before running work.
        self._inbox: queue.SimpleQueue[tuple[Callable[[], None], Callable[[], None]]] = (
            queue.SimpleQueue()
        )
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, OutputSlot]] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._closing = False  # abort_all ran: a server shutting down admits nothing more
        self.error: BaseException | None = None
        if isinstance(engine, LLMEngine):
            self.engine = engine
            self._thread = threading.Thread(target=self._loop, name="pdscope-engine", daemon=True)
            self._thread.start()
            return
        built: list[LLMEngine | BaseException] = []

        def build_then_loop() -> None:
            try:
                self.engine = engine()  # before the loop reads it
            except BaseException as exc:
                built.append(exc)
                return
            built.append(self.engine)
            self._loop()

        self._thread = threading.Thread(target=build_then_loop, name="pdscope-engine", daemon=True)
        self._thread.start()
        try:
            while not built and self._thread.is_alive():
                self._thread.join(0.05)  # in steps, so Ctrl-C still reaches this thread
        except BaseException:
            self._stopping = True  # the loop ends as soon as the build returns
            raise
        if not built:
            raise EngineDeadError("the engine thread ended before the engine was built")
        if isinstance(built[0], BaseException):
            error = built.pop()  # no reference from here to the failed build's frames
            self._thread.join()
            raise error

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def _submit(self, fn: Callable[[], None], on_dead: Callable[[], None] = lambda: None) -> None:
        if not self.is_running:
            raise EngineDeadError(f"engine is not running: {self.error or 'shut down'}")
        self._inbox.put((fn, on_dead))
        self._wake.set()
        if not self._thread.is_alive():  # the loop died between the check and the put
            self._drain()

    def _drain(self) -> None:
        while True:
            try:
                _, on_dead = self._inbox.get_nowait()
            except queue.Empty:
                return
            on_dead()

    async def call(self, fn: Callable[[], object]) -> object:
        """Run ``fn`` on the engine thread between steps and return its result."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def run() -> None:
            try:
                result = fn()
            except BaseException as exc:
                _call_on(loop, _settle, future, None, exc)
            else:
                _call_on(loop, _settle, future, result, None)

        def dead() -> None:
            error = EngineDeadError(f"engine is not running: {self.error or 'shut down'}")
            _call_on(loop, _settle, future, None, error)

        self._submit(run, dead)
        return await future

    async def add(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        arrival_s: float | None = None,
    ) -> RequestStream:
        """Admit a request and return its output stream. A bad prompt or a full queue raises
        here, before anything streams; closing the stream early aborts the request.

        ``arrival_s`` (perf_counter) defaults to now: the request's clock starts when the caller
        has it, not when the engine thread gets round to it after the step in progress."""
        loop = asyncio.get_running_loop()
        arrival_s = time.perf_counter() if arrival_s is None else arrival_s
        request_id = request_id or uuid.uuid4().hex
        outputs = OutputSlot()

        def add() -> None:
            if self._closing:
                raise EngineDeadError("the server is shutting down: no new requests")
            waiting = len(self.engine.scheduler.waiting)
            if self.max_queue is not None and waiting >= self.max_queue:
                raise QueueFullError(
                    f"server is at capacity: {waiting} requests already waiting "
                    f"(--max-queue {self.max_queue}); retry later"
                )
            self.engine.add_request(prompt, params, request_id, arrival_s)
            self._streams[request_id] = (loop, outputs)

        await self.call(add)
        return RequestStream(self, request_id, outputs)

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; leaving the loop early (a client that disconnects)
        aborts the request and frees everything it held."""
        stream = await self.add(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    async def abort(self, request_id: str) -> bool:
        return bool(await self.call(lambda: self._abort(request_id)))

    def abort_all(self) -> None:
        """From any thread: abort every request in the engine, each stream ending with a final
        output, finish reason "abort", and admit no new one (a server shutting down)."""

        def abort() -> None:
            self._closing = True
            outputs = self.engine.abort_all()
            for out in outputs:
                stream = self._streams.pop(out.request_id, None)
                if stream is not None:
                    _call_on(stream[0], stream[1].put, out)
            if outputs:
                log.info("aborted %d requests in flight", len(outputs))

        self._submit(abort)

    def _abort(self, request_id: str) -> bool:
        self._streams.pop(request_id, None)
        return self.engine.abort(request_id)

    def _loop(self) -> None:
        try:
            while not self._stopping:
                while True:
                    try:
                        work, _ = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    work()
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
                    _call_on(stream[0], stream[1].put, out)
        except BaseException as exc:
            log.exception("engine loop crashed")
            self.error = exc
            dead = EngineDeadError(f"engine loop crashed: {exc!r}")
            for loop, outputs in self._streams.values():
                _call_on(loop, outputs.put, dead)
            self._streams.clear()
        finally:
            self._stopping = True
            self._drain()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the loop; requests still streaming get :class:`EngineDeadError`."""
        if not self._thread.is_alive():
            return

        def stop() -> None:
            self._stopping = True
            dead = EngineDeadError("engine shut down")
            for loop, outputs in self._streams.values():
                _call_on(loop, outputs.put, dead)
            self._streams.clear()

        self._inbox.put((stop, lambda: None))
        self._wake.set()
        self._thread.join(timeout_s)


class OutputSlot:
    """One request's undelivered outputs: one per step, as vLLM's own queue gives a reader
    that keeps up, up to MAX_PENDING; past that each later step merges into the newest held
    (its new token ids appended, the rest taken from the later step). Every output carries
    the whole text so far, so an unbounded queue behind a client that stopped reading grew
    with the square of the output: ~0.5 GB for one stalled 20,000-token stream. The engine
    never waits on a reader; an error is delivered after the outputs held. Used on the event
    loop's thread only."""

    MAX_PENDING = 32

    def __init__(self) -> None:
        self._items: collections.deque[RequestOutput] = collections.deque()
        self._error: BaseException | None = None  # delivered after the outputs still held
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = self._error or item
        elif len(self._items) >= self.MAX_PENDING:
            held = self._items[-1]
            held.new_token_ids.extend(item.new_token_ids)  # in place: no copy per step
            item.new_token_ids = held.new_token_ids
            self._items[-1] = item
        else:
            self._items.append(item)
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        await self._ready.wait()
        if self._items:
            item: RequestOutput | BaseException = self._items.popleft()
        else:
            assert self._error is not None
            item = self._error  # stays: every later read gets it too
        if not self._items and self._error is None:
            self._ready.clear()
        return item


class RequestStream:
    """One request's outputs as an async iterator. ``aclose`` before the end aborts it, whether
    or not iteration ever started, so no path leaves a request holding KV blocks."""

    def __init__(self, engine: AsyncEngine, request_id: str, outputs: OutputSlot):
        self.engine = engine
        self.request_id = request_id
        self._outputs = outputs
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._outputs.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    async def aclose(self) -> None:
        if not self.finished:
            self.finished = True
            if self.engine.is_running:
                rid = self.request_id
                self.engine._submit(lambda: self.engine._abort(rid))


def _call_on(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: object) -> None:
    """Run ``fn(*args)`` on ``loop``'s thread, from the engine thread; a loop already closed
    (a server forced to exit) has no reader or caller left to tell."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


def _settle(future: asyncio.Future, result: object, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
