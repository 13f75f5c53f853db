"""The `duoka serve` process: engine, engine thread, HTTP app and uvicorn, and a clean exit.

Lifecycle: the port is checked before the model loads (a taken port should not cost a
model load); once uvicorn listens, one line says where and how much fits. SIGTERM or
SIGINT drains: new requests get 503 + Retry-After, in-flight ones may finish for
`grace_s` seconds, the rest are aborted with an error their clients can read; then
uvicorn closes and the process exits 0. A second signal aborts what is still running
at once.

`serve()` takes an already-built engine (or a factory): for tensor parallelism the engine on
rank 0 is the one that drives the other ranks, and whoever starts those ranks
(launch/serving.py, serve/rank_process.py) hands it over here; this module never starts
processes. Its keywords are ServerConfig's fields (serve/config.py).
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable
from typing import Any

import uvicorn

from duoka.data.chat_template import stop_renders
from duoka.errors import DuokaError
from duoka.host.ports import port_is_free
from duoka.serve.api import build_app
from duoka.serve.async_engine import AsyncEngine, Draining
from duoka.serve.config import DEFAULT_GRACE_S, DEFAULT_HOST, DEFAULT_MAX_QUEUE, DEFAULT_PORT
from duoka.serve.http_middleware import check_origins
from duoka.serve.server_metrics import ServeMetrics

# vLLM logs its stats line every 5 s.
CONSOLE_INTERVAL_S = 5.0
# Once drained, uvicorn only has finished responses to flush and idle connections to close.
UVICORN_SHUTDOWN_S = 5.0


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# Hosts that only this machine reaches: a server bound there needs no key.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def serve(engine: Any | Callable[[], Any], *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
          api_key: str | None = None, max_queue: int = DEFAULT_MAX_QUEUE, served_model_name: str | None = None,
          grace_s: float = DEFAULT_GRACE_S, allowed_origins: tuple[str, ...] = (), log_requests: bool = False,
          log=_log) -> int:
    """Serve `engine` (an LLMEngine, or a no-argument callable that builds one) over HTTP until
    SIGTERM/SIGINT; returns 0 after a drain. The engine is shut down on the way out."""
    if not 0 < port < 65536:
        raise DuokaError(f"--port {port} is not a TCP port", "use a port in 1..65535, e.g. --port 8000")
    if not port_is_free(host, port):
        raise DuokaError(f"{host}:{port} is already in use (another server?)",
                         f"stop the other process, or pick another port: --port {port + 1}")
    if max_queue < 1:
        raise DuokaError(f"--max-queue {max_queue} must be at least 1", f"e.g. --max-queue {DEFAULT_MAX_QUEUE}")
    if grace_s < 0:
        raise DuokaError(f"the drain grace period {grace_s} s is negative", f"e.g. {DEFAULT_GRACE_S:g} s")
    allowed_origins = check_origins(allowed_origins)
    if api_key is None and host not in LOOPBACK_HOSTS:
        log(f"duoka: warning: --host {host} listens beyond this machine and no --api-key is set: anyone who can reach "
            f"port {port} can use the model; add --api-key KEY (or set DUOKA_API_KEY)")
    if callable(engine) and not hasattr(engine, "step"):
        engine = engine()
    try:
        name = served_model_name or engine.model_name
        async_engine = AsyncEngine(engine, max_queue, ServeMetrics(name), log=log)
        try:
            app = build_app(async_engine, engine.tokenizer, name, engine.max_model_len, engine.default_params,
                            api_key=api_key, adapters=tuple(engine.loras), allowed_origins=allowed_origins,
                            log_requests=log_requests, log=log)
            config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                    lifespan="off", timeout_graceful_shutdown=UVICORN_SHUTDOWN_S)
            stats = engine.stats()
            kv_tokens = stats.kv_blocks * stats.block_size
            ready = (f"serving {name} on http://{host}:{port} (KV cache: {kv_tokens:,} tokens, max concurrency "
                     f"{kv_tokens / engine.max_model_len:.1f}x at {engine.max_model_len:,} tokens per request)")
            asyncio.run(_serve(uvicorn.Server(config), async_engine, grace_s, ready, log))
        finally:
            async_engine.close()
    finally:
        shutdown = getattr(engine, "shutdown", None)  # the contract's LLMEngine.shutdown (TP: stops the workers)
        if shutdown is not None:
            shutdown()
    return 0


async def _serve(server: uvicorn.Server, async_engine: AsyncEngine, grace_s: float, ready: str, log) -> None:
    loop = asyncio.get_running_loop()
    serving = asyncio.ensure_future(server.serve())
    while not server.started:
        if serving.done():  # uvicorn gave up during start-up; it has logged why
            await serving
            raise DuokaError("the HTTP server did not start (see the message above)",
                             "check --host and --port")
        await asyncio.sleep(0.02)
    # uvicorn's own handlers would close the connections at once; ours drain first. Installed
    # after start-up, they replace uvicorn's for as long as the server runs.
    signals: list[int] = []
    stop = asyncio.Event()

    def on_signal(sig: int) -> None:
        signals.append(sig)
        if len(signals) == 1:
            stop.set()
        else:
            log("duoka serve: second signal: aborting the requests still running")
            async_engine.abort_all(Draining("the server was stopped; the request was aborted"))
            stop_renders("the server was stopped")

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    log(ready)
    console = asyncio.ensure_future(_console(async_engine.metrics, log))
    try:
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if stop.is_set():
            in_flight = async_engine.in_flight
            log(f"duoka serve: {signal.Signals(signals[0]).name}: draining ({in_flight} request(s) in flight, "
                f"up to {grace_s:g} s); a second signal aborts them")
            await async_engine.drain(grace_s)
            # A chat template still rendering (the request never reached the engine) would keep
            # its worker thread, and so the process, alive: it stops at its next check.
            stop_renders("the server is stopping")
            server.should_exit = True
        await serving
    finally:
        console.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    log("duoka serve: stopped")


async def _console(metrics: ServeMetrics, log) -> None:
    while True:
        await asyncio.sleep(CONSOLE_INTERVAL_S)
        line = metrics.console_line()
        if line is not None:
            log(line)
