"""AsyncLLMEngine: one ``LLMEngine`` shared by many asyncio connections.

``LLMEngine`` is not thread safe, so exactly one background thread owns it.
Connections talk to that thread through a command queue (add, abort, stop);
the thread drains the queue, runs ``step()`` while any request is unfinished
and hands each output back to the event loop with ``call_soon_threadsafe``.
When nothing is running it blocks on the queue (no spinning).

Requests from every connection join the same continuous batch: the scheduler
sees them all. A connection that goes away calls :meth:`AsyncLLMEngine.abort`,
which frees the request's blocks at the next iteration.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import AsyncIterator, Callable, Optional

from paged_jax.outputs import RequestOutput
from paged_jax.sampling_params import SamplingParams

logger = logging.getLogger("paged_jax.server")


class EngineDeadError(RuntimeError):
    """The engine thread stopped (an exception in ``step()`` or shutdown)."""


class RequestStream:
    """Where the outputs of one request go (each output is cumulative).

    Lives on the event loop; the engine thread only calls :meth:`put` through
    ``call_soon_threadsafe``. Several requests (one per prompt of a batched
    completion) may share one ``asyncio.Queue``: items are ``(index, output)``,
    or ``(index, exception)`` when the request failed.
    """

    def __init__(self, request_id: str, arrival_time: float, queue: Optional[asyncio.Queue] = None,
                 index: int = 0):
        self.request_id = request_id
        self.arrival_time = arrival_time
        self.queue: asyncio.Queue = queue if queue is not None else asyncio.Queue()
        self.index = index
        self.finished = False  # set when the last output (or an error) is queued
        # Engine-thread bookkeeping for the latency histograms.
        self.first_token_time: Optional[float] = None
        self.last_token_time: Optional[float] = None
        self.num_tokens = 0

    def put(self, item) -> None:
        if isinstance(item, BaseException) or item.finished:
            self.finished = True
        self.queue.put_nowait((self.index, item))

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        """The outputs of this request alone (when it has its own queue)."""
        while True:
            _, item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return


class AsyncLLMEngine:
    """Owns an ``LLMEngine`` in a background thread; coroutines add, stream and abort requests.

    ``metrics`` (optional) gets ``on_output(stream, output, now)`` for every
    output and ``on_abort()`` per aborted request in the engine thread, and
    ``on_prompt(num_tokens)`` per accepted request.
    """

    STATS_INTERVAL_S = 0.1  # how often a busy engine refreshes ``stats`` (for /metrics)

    def __init__(self, engine, metrics=None):
        self.engine = engine
        self.metrics = metrics
        self._cmds: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self.error: Optional[BaseException] = None
        # Called (in the engine thread) once the engine has stopped after a failed step; the server
        # uses it to exit non-zero so that a supervisor restarts it.
        self.on_fatal: Optional[Callable[[BaseException], object]] = None
        self.stats: dict = engine.get_stats()  # snapshot, replaced (never mutated) by the engine thread
        self._stats_time = time.monotonic()

    # ---- lifecycle (event loop side) ---------------------------------------------
    def start(self, loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine thread is already running")
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="paged-jax-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        self._cmds.put(("stop",))
        self._thread.join(timeout)
        self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ---- requests (event loop side) -----------------------------------------------
    async def add_request(self, request_id: str, prompt: Optional[str], sampling_params: SamplingParams,
                          prompt_token_ids: Optional[list[int]] = None, sink: Optional[asyncio.Queue] = None,
                          index: int = 0) -> RequestStream:
        """Queue a request; returns its stream once the engine has accepted it.

        ``sink`` and ``index``: deliver ``(index, output)`` items to a queue shared with other requests.

        Raises what ``LLMEngine.add_request`` raises (``ValueError`` for a bad
        request), or :class:`EngineDeadError`.
        """
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running ({self.error!r})" if self.error
                                  else "the engine is not running")
        stream = RequestStream(request_id, time.monotonic(), sink, index)
        accepted = self._loop.create_future()
        self._cmds.put(("add", stream, prompt, sampling_params, prompt_token_ids, accepted))
        try:
            await accepted  # raises the engine's exception for a rejected request
        except asyncio.CancelledError:  # the client went away before the engine took the request
            self.abort(request_id)
            raise
        if self.metrics is not None and prompt_token_ids is not None:
            self.metrics.on_prompt(len(prompt_token_ids))
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (safe to call for finished or unknown ids, and from any thread)."""
        self._cmds.put(("abort", request_id))

    # ---- the engine thread -----------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            cmds = []
            if not engine.has_unfinished_requests():
                cmds.append(self._cmds.get())  # idle: block until there is something to do
            while True:
                try:
                    cmds.append(self._cmds.get_nowait())
                except queue.Empty:
                    break
            for cmd in cmds:
                if cmd[0] == "stop":
                    self._fail_all(EngineDeadError("the server is shutting down"))
                    return
                self._handle(cmd)
            if self.error is None and engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except Exception as exc:  # the engine's state is unknown: stop serving
                    logger.exception("engine step failed; failing every request")
                    self.error = exc
                    self._fail_all(EngineDeadError(f"engine step failed: {exc!r}"))
                    if self.on_fatal is not None:
                        self.on_fatal(exc)
                    continue
                self._deliver(outputs)
            # get_stats() walks the block tables: refresh the snapshot a few times a second, and when idle.
            now = time.monotonic()
            if now - self._stats_time >= self.STATS_INTERVAL_S or not engine.has_unfinished_requests():
                self.stats, self._stats_time = engine.get_stats(), now

    def _handle(self, cmd: tuple) -> None:
        if cmd[0] == "abort":
            rid = cmd[1]
            if self._streams.pop(rid, None) is not None:
                self.engine.abort_request(rid)
                if self.metrics is not None:
                    self.metrics.on_abort()
            return
        _, stream, prompt, params, ids, accepted = cmd
        if self.error is not None:
            self._resolve(accepted, exc=EngineDeadError(f"the engine stopped: {self.error!r}"))
            return
        try:
            self.engine.add_request(stream.request_id, prompt, params, ids, arrival_time=stream.arrival_time)
        except Exception as exc:
            self._resolve(accepted, exc=exc)
            return
        self._streams[stream.request_id] = stream
        self._resolve(accepted, result=True)

    def _resolve(self, fut: asyncio.Future, result=None, exc: Optional[BaseException] = None) -> None:
        def done():
            if fut.done():  # the waiting coroutine was cancelled
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        self._loop.call_soon_threadsafe(done)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        batch: list[tuple[RequestStream, object]] = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted meanwhile
                continue
            if out.finished:
                del self._streams[out.request_id]
            if self.metrics is not None:
                self.metrics.on_output(stream, out, now)
            batch.append((stream, out))
        if batch:
            self._call_soon(lambda: [s.put(o) for s, o in batch])

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = list(self._streams.values()), {}
        for rid in [s.request_id for s in streams]:
            try:
                self.engine.abort_request(rid)
            except Exception:  # pragma: no cover - best effort after a failed step
                pass
        if streams:
            self._call_soon(lambda: [s.put(exc) for s in streams])

    def _call_soon(self, fn: Callable[[], object]) -> None:
        try:
            self._loop.call_soon_threadsafe(fn)
        except RuntimeError:  # the loop is closed (shutdown): nobody is listening any more
            pass
