"""The engine in a process of its own, behind the LLMEngine interface the AsyncEngine drives.

Why: in one process the HTTP event loop and the engine share one GIL. At 256 streams the
loop's work per token (SSE events, socket writes) lands between the engine's steps and
stretches them, while the device waits (on one H200, 7B: 24.1k total tok/s through HTTP
against 31.1k for the engine alone; bench/NOTES.md, "Serving"). Here the engine process
only schedules, launches and detokenizes; the server's process only talks HTTP.

Protocol over one duplex pipe (pickled messages, in order):
  server -> engine: ("add", request_id, prompt_ids, params), ("abort", request_id), ("stop",)
  engine -> server: ("ready", EngineInfo) once, or ("error", cause, fix) / ("crash", trace);
                    then per step ("step", outputs, stats), or ("failed", trace) when one failed.
The engine process steps on its own while it has work and blocks on the pipe when idle, so
the server's side reads one step's outputs per step() call and never polls.

Requests are checked on the server's side with the engine's own RequestLimits before they
are sent, so a refusal is still an error of the add call (the API's 400); the engine process
then accepts whatever arrives (a refusal there is a bug, reported as a failed step).

Lifetime: the engine process ends with the server's (die_with_launcher: a pidfd on its
parent, and the parent-death signal), ignores SIGINT/SIGTERM (the server drains first, then
sends "stop"), and is killed if it has not stopped STOP_TIMEOUT_S after "stop".
"""

from __future__ import annotations

import multiprocessing
import queue
import signal
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path

from duoka.data.tokenizer import load_tokenizer
from duoka.errors import DuokaError
from duoka.host.lifetime import die_with_launcher
from duoka.serve.config import EngineConfig
from duoka.serve.engine import EngineStats, LLMEngine, RequestLimits, lora_slot
from duoka.serve.params import RequestOutput, SamplingParams
from duoka.serve.worker import RunnerFactory

# After "stop" the engine process only leaves its loop; CUDA teardown takes a few seconds.
STOP_TIMEOUT_S = 30.0


class EngineProcessError(RuntimeError):
    """The engine process failed a step or is gone (the AsyncEngine reports it as an engine error)."""


@dataclass(frozen=True)
class EngineInfo:
    """What the server's side needs to know of the engine once it has loaded."""
    folder: str
    model_name: str
    max_model_len: int
    default_params: dict
    limits: RequestLimits
    stats: EngineStats
    loras: tuple[tuple[str, str], ...] = ()  # the --lora adapters: (name, folder) in slot order


class EngineProcess:
    """Starts an LLMEngine(config) in a spawned process and waits until it has loaded (its
    DuokaError, e.g. a model folder that is not there, is raised here). Then behaves as the
    engine for one caller thread: add_request / abort / step / stats / has_unfinished / shutdown.
    log and runner_factory (LLMEngine's; None: its defaults) travel pickled: module-level
    functions and classes, or partials of them."""

    def __init__(self, config: EngineConfig, *, log=None, runner_factory: RunnerFactory | None = None):
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=engine_main, args=(config, child, log, runner_factory), name="duoka-engine")
        self._proc.start()
        child.close()  # the child's end lives in the child only: its exit is then our EOF
        reply = self._recv_start()
        info: EngineInfo = reply[1]
        self.folder = Path(info.folder)
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.default_params = info.default_params
        self.limits = info.limits
        self.loras = info.loras
        self.lora_names = tuple(name for name, _ in info.loras)
        self.tokenizer = load_tokenizer(self.folder)
        self.device = None  # the model is in the other process: this side needs no CUDA device
        self._stats = info.stats
        self._unfinished: set[str] = set()  # added, final output not received yet
        # The engine's answers are read as they come, by a thread of their own: were they read
        # only in step(), an engine blocked writing answers could stop reading commands while
        # this side blocks writing a burst of adds to it, and both would wait forever.
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._receive, name="duoka-engine-answers", daemon=True).start()

    def _receive(self) -> None:
        while True:
            try:
                self._answers.put(self._conn.recv())
            except (EOFError, OSError):
                self._answers.put(("gone",))
                return

    def _recv_start(self):
        try:
            reply = self._conn.recv()
        except EOFError:
            self._proc.join()
            raise DuokaError(f"the engine process exited while loading the model (exit code {self._proc.exitcode})",
                             "its messages above say why; `duoka doctor` checks the GPU and driver") from None
        if reply[0] == "error":
            self._proc.join()
            raise DuokaError(reply[1], reply[2])
        if reply[0] == "crash":
            self._proc.join()
            raise DuokaError(f"the engine failed to start:\n{reply[1].rstrip()}",
                             "the traceback above names the cause; report it if it is not your setup")
        return reply

    # ---------------------------------------------------------------- the engine's interface
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
                    lora: str | None = None, after: str | None = None) -> None:
        if request_id in self._unfinished:
            raise DuokaError(f"request id {request_id!r} is already running", "give each request its own id")
        self.limits.check(prompt_ids, params)
        lora_slot(self.lora_names, lora)  # an unknown adapter is refused here, as the engine would
        self._send(("add", request_id, list(prompt_ids), params, lora, after))
        self._unfinished.add(request_id)

    def abort(self, request_id: str) -> None:
        if request_id in self._unfinished:
            self._send(("abort", request_id))

    def has_unfinished(self) -> bool:
        return bool(self._unfinished)

    def step(self) -> list[RequestOutput]:
        """The next step's outputs, waiting for the engine process to finish that step."""
        reply = self._answers.get()
        if reply[0] == "gone":
            self._answers.put(reply)  # every later call fails the same way
            self._proc.join(1.0)
            raise EngineProcessError(f"the engine process is gone (exit code {self._proc.exitcode})")
        if reply[0] == "failed":
            raise EngineProcessError(f"the engine process failed a step:\n{reply[1].rstrip()}")
        _, outputs, self._stats = reply
        for out in outputs:
            if out.finished:
                self._unfinished.discard(out.request_id)
        return outputs

    def stats(self) -> EngineStats:
        return self._stats

    def shutdown(self) -> None:
        try:
            self._send(("stop",))
        except EngineProcessError:
            pass  # already gone
        self._proc.join(STOP_TIMEOUT_S)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()

    def _send(self, message) -> None:
        try:
            self._conn.send(message)
        except (BrokenPipeError, OSError):
            raise EngineProcessError(f"the engine process is gone (exit code {self._proc.exitcode})") from None


# ---------------------------------------------------------------- the engine process
def engine_main(config: EngineConfig, conn, log=None, runner_factory: RunnerFactory | None = None) -> None:
    die_with_launcher()
    # The server's process takes the signals and drains; this one stops when told.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        hooks = {name: hook for name, hook in (("log", log), ("runner_factory", runner_factory)) if hook is not None}
        engine = LLMEngine(config, **hooks)
    except DuokaError as e:
        conn.send(("error", e.cause, e.fix))
        return
    except BaseException:
        conn.send(("crash", traceback.format_exc()))
        return
    conn.send(("ready", EngineInfo(str(engine.folder), engine.model_name, engine.max_model_len,
                                   engine.default_params, engine.limits, engine.stats(), engine.loras)))
    try:
        _loop(engine, conn)
    except (EOFError, BrokenPipeError):
        pass  # the server's process is gone; die_with_launcher ends this one too


def _loop(engine: LLMEngine, conn) -> None:
    while True:
        # Idle: block until a command comes. Busy: take what has arrived, then step.
        commands = [] if engine.has_unfinished() else [conn.recv()]
        while conn.poll():
            commands.append(conn.recv())
        failures, unheard = [], []
        for command in commands:
            if command[0] == "stop":
                return
            try:
                if command[0] == "add":
                    request_id, prompt_ids, params, lora, after = command[1:]
                    engine.add_request(request_id, prompt_ids, params, lora=lora, after=after)
                else:
                    engine.abort(command[1])
            except Exception:
                failures.append(traceback.format_exc())
                if command[0] == "add":  # the server's side waits for every request's final output
                    unheard.append(RequestOutput(command[1], [], "", None, True, "abort", len(command[2]), 0, 0))
        outputs, stepped = [], engine.has_unfinished()
        if stepped:
            try:
                outputs = engine.step()
            except Exception:
                failures.append(traceback.format_exc())
        if failures:
            conn.send(("failed", "\n".join(failures)))
        # Every step is answered, outputs or not: the server's side hands over new requests
        # between two answers, so a long prefill must not keep them waiting.
        if stepped or unheard:
            # Prompt logprobs cross as the engine made them: columns (serve.logprob_columns), a few buffers.
            conn.send(("step", unheard + outputs, engine.stats()))

