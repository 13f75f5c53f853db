"""The engine behind an event loop: one thread steps the LLMEngine, coroutines stream its outputs.

The LLMEngine is not thread-safe, so exactly one thread (the engine thread) ever touches it:
coroutines hand their adds and aborts over through an inbox, and the thread applies them
between two steps. Outputs travel back per request through a RequestStream (a deque and a waiter), one
call_soon_threadsafe per event loop and step (not per token). With no work the thread
sleeps on a condition variable; it never spins.

Errors:
- an add the engine refuses (DuokaError: the prompt cannot fit, ...) is raised by
  `await generate(...)` itself, before any output, so the API can answer 400;
- QueueFull / Draining / EngineDead (ServerBusy, HTTP 503) refuse a request up front;
- a step that raises fails every in-flight request with EngineError (HTTP 500, logged with
  its traceback) and aborts them in the engine. The engine then keeps serving new requests:
  a step failure is most often one batch's problem (a bad input slipping past validation),
  and the scheduler's state is made consistent again by the aborts. If an abort itself
  fails, or MAX_STEP_FAILURES steps fail in a row with nothing in between succeeding, the
  engine is declared dead: new requests get 503 and /health says so, so that a supervisor
  restarts the process instead of it failing every request forever.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import traceback
from collections import defaultdict, deque
from dataclasses import dataclass

import torch

from duoka.errors import DuokaError
from duoka.serve.params import RequestOutput, SamplingParams
from duoka.serve.server_metrics import ServeMetrics

# Consecutive failed steps after which the engine counts as broken rather than unlucky.
MAX_STEP_FAILURES = 3
# How long drain() waits for the engine thread to hand over the final outputs of the
# requests it aborted after the grace period (one step, normally milliseconds).
ABORT_SETTLE_S = 10.0


class ServerBusy(Exception):
    """The request was refused before it reached the engine (HTTP 503 with Retry-After)."""

    retry_after_s = 1


class QueueFull(ServerBusy):
    pass


class Draining(ServerBusy):
    retry_after_s = 5  # this process is going away; another replica (or its restart) takes over


class EngineDead(ServerBusy):
    retry_after_s = 5


class EngineError(Exception):
    """The engine failed while this request was in flight (HTTP 500, "engine error")."""


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: RequestStream
    accepted: asyncio.Future
    arrival: float
    lora: str | None = None
    after: str | None = None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _AbortAll:
    error: Exception


@dataclass
class _Live:
    """The engine thread's record of one accepted request (its timestamps feed the metrics)."""

    stream: RequestStream | None  # None once the consumer went away: the final "abort" output is still counted
    loop: asyncio.AbstractEventLoop
    arrival: float
    first_token: float | None = None
    last_token: float | None = None


class RequestStream:
    """One request's outputs (RequestOutput deltas), in order; ends after the finished one.

    Leaving it early (the consumer is cancelled, or calls abort()/aclose()) aborts the
    request in the engine, which frees its KV blocks at once.

    Its channel is a deque and one waiter future rather than an asyncio.Queue: an SSE stream
    takes one item per token, and the queue's bookkeeping (unfinished-task counts, an Event,
    a getter deque) was per-token work on the event loop, under the GIL the engine needs."""

    def __init__(self, owner: AsyncEngine, request_id: str):
        self.request_id = request_id
        self._owner = owner
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None
        self._ended = False

    def __aiter__(self) -> RequestStream:
        return self

    async def _wait(self) -> None:
        while not self._items:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            except asyncio.CancelledError:
                self.abort()
                raise
            finally:
                self._waiter = None

    async def __anext__(self) -> RequestOutput:
        if self._ended:
            raise StopAsyncIteration
        if not self._items:
            await self._wait()
        item = self._items.popleft()
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        if item.finished:
            self._ended = True
        return item

    async def next_batch(self) -> list[RequestOutput]:
        """Every output that has arrived (at least one; waits for it), in order: what a
        consumer that fell behind by a few steps can write at once. An error after some
        outputs is raised by the next call, after they are handed over. Raises
        StopAsyncIteration once the stream has ended."""
        if self._ended:
            raise StopAsyncIteration
        if not self._items:
            await self._wait()
        items, batch = self._items, []
        while items:
            item = items[0]
            if isinstance(item, BaseException):
                if batch:
                    break  # raised by the next call
                items.popleft()
                self._ended = True
                raise item
            batch.append(items.popleft())
            if item.finished:
                self._ended = True
                break
        return batch

    def abort(self) -> None:
        if not self._ended:
            self._ended = True
            self._owner._post(_Abort(self.request_id))

    async def aclose(self) -> None:
        self.abort()

    def _put(self, item) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class AsyncEngine:
    """max_queue: how many requests may wait for admission (accepted, not yet running) before
    new ones are refused with QueueFull."""

    def __init__(self, engine, max_queue: int, metrics: ServeMetrics | None = None, log=_log):
        if max_queue < 1:
            raise DuokaError(f"--max-queue {max_queue} must be at least 1", "e.g. --max-queue 4096")
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = metrics if metrics is not None else ServeMetrics(engine.model_name)
        self._log = log
        self._cv = threading.Condition()
        # ---- shared, guarded by _cv
        self._inbox: list = []
        self._pending_adds = 0  # adds posted, not yet applied by the engine thread
        self._engine_waiting = 0  # the engine's num_waiting after the last command or step
        self._in_flight = 0  # accepted requests whose final output has not been handed over
        self._accepting = True
        self._dead: str | None = None
        self._stop = False
        # ---- engine thread only
        self._live: dict[str, _Live] = {}
        self._failures = 0
        # The current CUDA device is per thread and starts at cuda:0 in a new one: an engine on
        # cuda:N (a tensor-parallel rank) would allocate and replay graphs on the wrong GPU. A bare
        # "cuda" means the device current here, in the thread that built the engine.
        device = getattr(engine, "device", None)
        self._cuda_index = None
        if isinstance(device, torch.device) and device.type == "cuda":
            self._cuda_index = device.index if device.index is not None else torch.cuda.current_device()
        self._thread = threading.Thread(target=self._run, name="duoka-engine", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- event-loop side
    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
                       lora: str | None = None, after: str | None = None) -> RequestStream:
        """Queue a request; returns its stream once the engine has accepted it. Raises the
        engine's DuokaError when it refuses the request, or ServerBusy. lora, after: the
        engine's add_request's."""
        loop = asyncio.get_running_loop()
        arrival = time.monotonic()
        stream = RequestStream(self, request_id)
        accepted = loop.create_future()
        with self._cv:
            if self._dead is not None:
                raise EngineDead(f"the engine stopped working ({self._dead}); the server must be restarted")
            if not self._accepting:
                raise Draining("the server is shutting down and accepts no new requests")
            if self._engine_waiting + self._pending_adds >= self.max_queue:
                raise QueueFull(f"{self._engine_waiting + self._pending_adds} requests are already waiting "
                                f"(--max-queue {self.max_queue}); retry shortly")
            self._inbox.append(_Add(request_id, list(prompt_ids), params, stream, accepted, arrival, lora, after))
            self._pending_adds += 1
            self._in_flight += 1
            self._cv.notify()
        try:
            await accepted
        except asyncio.CancelledError:
            stream.abort()  # applied after the add (the inbox keeps order), so nothing leaks
            raise
        return stream

    @property
    def in_flight(self) -> int:
        with self._cv:
            return self._in_flight

    @property
    def accepting(self) -> bool:
        with self._cv:
            return self._accepting and self._dead is None

    @property
    def dead(self) -> str | None:
        with self._cv:
            return self._dead

    async def drain(self, grace_s: float) -> None:
        """Stop accepting (new requests get Draining), let the in-flight requests finish for up
        to grace_s seconds, then abort the rest (their streams end with Draining)."""
        with self._cv:
            self._accepting = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if self.in_flight:
            self._log(f"duoka serve: {self.in_flight} request(s) still running after the {grace_s:g} s grace period; "
                      "aborting them")
            self.abort_all(Draining(f"the server shut down; the request was cut off after the {grace_s:g} s "
                                    "grace period"))
        deadline = loop.time() + ABORT_SETTLE_S
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.02)

    def abort_all(self, error: Exception) -> None:
        """Abort every request in flight; their streams end with `error`."""
        self._post(_AbortAll(error))

    def close(self) -> None:
        """Stop the engine thread (after drain(); requests still in flight are failed). The
        engine itself stays up: its owner shuts it down."""
        with self._cv:
            self._stop = True
            self._accepting = False
            self._cv.notify()
        self._thread.join()

    def _post(self, command) -> None:
        with self._cv:
            self._inbox.append(command)
            self._cv.notify()

    # ---------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            if self._cuda_index is not None:
                torch.cuda.set_device(self._cuda_index)
            busy = False
            while True:
                with self._cv:
                    while not self._inbox and not busy and not self._stop:
                        self._cv.wait()
                    if self._stop:
                        break
                    commands, self._inbox = self._inbox, []
                self._apply(commands)
                if self.engine.has_unfinished():
                    self._step()
                busy = self.engine.has_unfinished()
                with self._cv:
                    if self._dead is not None:
                        break
        except BaseException as e:  # a bug here must not leave requests hanging on a dead thread
            self._log(f"duoka serve: the engine thread crashed:\n{traceback.format_exc()}")
            self._die(f"engine thread crashed: {type(e).__name__}: {e}")
        self._fail_everything(Draining("the server shut down before the request finished")
                              if self._dead is None else EngineError(f"engine error: {self._dead}"))

    def _apply(self, commands: list) -> None:
        applied_adds = 0
        for command in commands:
            if isinstance(command, _Add):
                applied_adds += 1
                try:
                    self.engine.add_request(command.request_id, command.prompt_ids, command.params,
                                            lora=command.lora, after=command.after)
                except Exception as e:  # DuokaError: refused (the caller's 400); anything else: its 500
                    self._settle(command.accepted, e)
                    with self._cv:
                        self._in_flight -= 1
                    continue
                self._live[command.request_id] = _Live(command.stream, command.accepted.get_loop(), command.arrival)
                self._settle(command.accepted, None)
            elif isinstance(command, _Abort):
                live = self._live.get(command.request_id)
                if live is not None and live.stream is not None:
                    live.stream = None
                    self.engine.abort(command.request_id)  # its final "abort" output comes with the next step
            elif isinstance(command, _AbortAll):
                deliveries = defaultdict(list)
                for request_id, live in self._live.items():
                    if live.stream is not None:
                        deliveries[live.loop].append((live.stream, command.error))
                        live.stream = None
                        self.engine.abort(request_id)
                self._deliver(deliveries)
        stats = self.engine.stats()
        with self._cv:
            self._pending_adds -= applied_adds
            self._engine_waiting = stats.num_waiting
        self.metrics.update_engine(stats)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            self._step_failed(traceback.format_exc())
            return
        self._failures = 0
        now = time.monotonic()
        deliveries = defaultdict(list)
        finished = 0
        gaps = []  # inter-token latencies, observed together after the loop
        lives = self._live
        for out in outputs:
            live = lives.get(out.request_id)
            if live is None:
                continue
            n = len(out.new_token_ids)
            if n:
                if live.first_token is None:
                    live.first_token = now
                    self.metrics.observe_first_token(now - live.arrival)
                elif n == 1:
                    gaps.append(now - live.last_token)
                else:  # n tokens together: each gets gap / n, as observe_inter_token does
                    gaps.extend([(now - live.last_token) / n] * n)
                live.last_token = now
            if out.finished:
                del self._live[out.request_id]
                finished += 1
                self.metrics.observe_finished(out.finish_reason, now - live.arrival)
            if live.stream is not None:
                deliveries[live.loop].append((live.stream, out))
        self._deliver(deliveries)
        self.metrics.observe_inter_tokens(gaps)
        stats = self.engine.stats()
        with self._cv:
            self._in_flight -= finished
            self._engine_waiting = stats.num_waiting
        self.metrics.update_engine(stats)

    def _step_failed(self, trace: str) -> None:
        self._failures += 1
        self._log(f"duoka serve: engine step failed ({len(self._live)} request(s) in flight get an engine error):\n"
                  f"{trace.rstrip()}")
        error = EngineError("engine error: the model step failed; the server's log has the traceback")
        now = time.monotonic()
        deliveries = defaultdict(list)
        usable = True
        for request_id, live in self._live.items():
            if live.stream is not None:
                deliveries[live.loop].append((live.stream, error))
                self.metrics.observe_finished("error", now - live.arrival)
                try:
                    self.engine.abort(request_id)
                except Exception:
                    self._log(f"duoka serve: aborting {request_id} after the failed step failed too:\n"
                              f"{traceback.format_exc().rstrip()}")
                    usable = False
        with self._cv:
            self._in_flight -= len(self._live)
        self._live.clear()
        self._deliver(deliveries)
        if not usable:
            self._die("a failed step left requests that could not be aborted")
        elif self._failures >= MAX_STEP_FAILURES:
            self._die(f"{self._failures} engine steps failed in a row")

    def _die(self, reason: str) -> None:
        with self._cv:
            if self._dead is None:
                self._dead = reason
                self._log(f"duoka serve: the engine is not usable any more ({reason}); "
                          "new requests get 503 and /health fails, restart the server")

    def _fail_everything(self, error: Exception) -> None:
        """The thread is ending: every request still waiting on it gets `error`."""
        with self._cv:
            commands, self._inbox = self._inbox, []
            self._accepting = False
        deliveries = defaultdict(list)
        for command in commands:
            if isinstance(command, _Add):
                self._settle(command.accepted, EngineDead(str(error)) if self._dead else Draining(str(error)))
        for live in self._live.values():
            if live.stream is not None:
                deliveries[live.loop].append((live.stream, error))
        self._live.clear()
        self._deliver(deliveries)
        with self._cv:
            self._in_flight = 0
            self._pending_adds = 0

    @staticmethod
    def _settle(future: asyncio.Future, error: BaseException | None) -> None:
        def settle():
            if not future.done():  # the caller may have been cancelled meanwhile
                future.set_exception(error) if error is not None else future.set_result(None)

        try:
            future.get_loop().call_soon_threadsafe(settle)
        except RuntimeError:  # that event loop is closed: nobody is waiting any more
            pass

    @staticmethod
    def _deliver(deliveries: dict) -> None:
        for loop, items in deliveries.items():
            def put(items=items):
                for stream, item in items:
                    stream._put(item)

            try:
                loop.call_soon_threadsafe(put)
            except RuntimeError:  # that event loop is closed: nobody is reading any more
                pass
