"""One engine thread owns the model and KV cache; asyncio handlers talk to it by messages.

HTTP handlers call ``add`` (validated and enqueued by the engine thread, errors come back as
exceptions) and iterate the outputs of their request; ``abort`` (a client that went away)
frees the request's blocks at the next step boundary.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass

from fastforward.engine import LLMEngine
from fastforward.outputs import RequestOutput
from fastforward.sampling_params import SamplingParams
from fastforward.server.metrics import EngineGauges, ServerMetrics

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is over its bound; the client should retry later."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    prompt_text: str | None
    future: Future
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue


@dataclass(slots=True)
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int = 256) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = ServerMetrics()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Add] = {}
        self._pending_adds = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.healthy = True
        self.metrics.set_gauges(self._gauges())  # /metrics is right before the first request

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout=10)

    # ---- called from asyncio handlers ----------------------------------------------------

    async def generate(
        self, prompt: list[int], params: SamplingParams, request_id: str, prompt_text: str | None
    ) -> AsyncIterator[RequestOutput]:
        """Enqueue a request and yield its outputs until it finishes (abort on early exit)."""
        if self.metrics.gauges.num_waiting + self._pending_adds >= self.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests)")
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        future: Future = Future()
        with self._lock:
            self._pending_adds += 1
        self._commands.put(_Add(request_id, prompt, params, prompt_text, future, loop, outputs))
        finished = False
        try:
            try:
                await asyncio.wrap_future(future)  # raises the engine's ValueError for bad input
            except Exception:
                finished = True  # rejected: there is nothing to abort
                raise
            # (Cancelled while the engine adds it: the abort below is queued after the add.)
            while True:
                out = await outputs.get()
                if isinstance(out, Exception):  # the engine loop failed this request
                    finished = True
                    raise out
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._commands.put(_Abort(request_id))

    # ---- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain(block=not self.engine.has_unfinished_requests())
                if self.engine.has_unfinished_requests():
                    self._step()
            except Exception:  # a bug must not kill the loop silently
                logger.exception("engine loop error")
                self.healthy = False
                self._fail_all("internal engine error")
                self.healthy = True

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        adds = 0
        try:
            while cmd is not None:
                adds += isinstance(cmd, _Add)
                self._handle(cmd)
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
        finally:
            # Publish the new state (an abort frees blocks even when no step follows) before
            # the added requests stop counting as pending, so that the waiting bound never
            # misses a request in between.
            self.metrics.set_gauges(self._gauges())
            with self._lock:
                self._pending_adds -= adds

    def _handle(self, cmd: _Add | _Abort) -> None:
        if isinstance(cmd, _Abort):
            self.engine.abort_request(cmd.request_id)
            self._streams.pop(cmd.request_id, None)
            return
        try:
            self.engine.add_request(cmd.prompt, cmd.params, request_id=cmd.request_id)
        except Exception as e:
            cmd.loop.call_soon_threadsafe(_set_exception, cmd.future, e)
            return
        self._streams[cmd.request_id] = cmd
        cmd.loop.call_soon_threadsafe(_set_result, cmd.future)

    def _step(self) -> None:
        for out in self.engine.step():
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
                self.metrics.record_finished(out)
            if stream is not None:
                stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, out)
        self.metrics.set_gauges(self._gauges())

    def _gauges(self) -> EngineGauges:
        stats = self.engine.scheduler.get_stats()
        kv = self.engine.scheduler.kv
        usable = self.engine.kv_config.num_blocks - 1
        return EngineGauges(
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            kv_blocks_used=usable - kv.num_free_blocks,
            kv_blocks_free=kv.num_free_blocks,
            num_preemptions=stats.num_preemptions,
            prefix_cache_queries=getattr(stats, "prefix_cache_queries", 0),
            prefix_cache_hits=getattr(stats, "prefix_cache_hits", 0),
            spec_verifications=stats.spec_verifications,
            spec_draft_tokens=stats.spec_draft_tokens,
            spec_accepted_tokens=stats.spec_accepted_tokens,
        )

    def _fail_all(self, message: str) -> None:
        for rid, stream in list(self._streams.items()):
            self.engine.abort_request(rid)
            err = RuntimeError(message)
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, err)
        self._streams.clear()


def _set_result(future: Future) -> None:
    if not future.done():
        future.set_result(None)


def _set_exception(future: Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
