"""Every private Python and PyTorch API duoka relies on, each with what it saves.
tests/unit/test_runtime.py fails, naming the API and its user here, if an upgrade removes one.

Imports no torch: `duoka` commands and the launcher import this before torch (~2 s) is needed."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from multiprocessing import forkserver
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    import torch
    from torch.distributed.elastic.rendezvous import RendezvousParameters


def exit_now(code: int) -> NoReturn:
    """Exit as the interpreter's shutdown would, minus its teardown of torch's modules (1-2 s
    on 2 CPU cores for every `duoka` command): thread pools are told to finish, non-daemon
    threads joined, exit handlers run and the output flushed, then os._exit."""
    # The hooks that tell thread pools to finish (concurrent.futures registers them; torch.compile's
    # compile pool is one), run first as the interpreter's shutdown does: the join below would
    # otherwise wait forever on a pool's idle workers. Private: threading._threading_atexits.
    for hook in reversed(getattr(threading, "_threading_atexits", [])):
        hook()
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # private: the registered exit handlers, run now rather than at teardown
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):  # a closed pipe (`duoka generate | head`) or stream
            pass
    os._exit(code)


def hard_exit(code: int) -> NoReturn:
    """Leave at once, without exit handlers or teardown: from a signal handler, or once a
    worker's checkpoint is saved and its agent is shutting down."""
    os._exit(code)


def stop_forkserver() -> None:
    """End multiprocessing's fork server. Left alone it lives until it notices this process's
    exit and then spends ~1 s in torch's teardown holding our stdout and stderr open, so
    whoever reads them to the end waits for it. multiprocessing has no public call for this;
    ForkServer._stop() alone would wait for that teardown, hence the SIGKILL first."""
    server = forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server._stop()  # reaps it and forgets it, so a later start in this process makes a new one


def device_sleep(cycles: int) -> None:
    """A device-side spin of `cycles` SM clock cycles on the current stream (torch.cuda._sleep):
    the debug slowdown stretches only the GPU's work, the host never waits."""
    import torch  # already loaded by the caller; at module level it would slow every command's start

    torch.cuda._sleep(cycles)


def set_grad_divisor(optimizer: torch.optim.Optimizer, divisor: torch.Tensor) -> None:
    """Make the next fused Adam/AdamW step divide every gradient by `divisor` inside its own
    kernel, through the `grad_scale` attribute AMP's GradScaler unscales with: a separate
    multiply would read and write every fp32 gradient once more."""
    optimizer.grad_scale = divisor


def set_found_inf(optimizer: torch.optim.Optimizer, found: torch.Tensor) -> None:
    """Make the next fused Adam/AdamW step skip its update where `found` (a float32 tensor on
    the parameters' device) is 1, through the `found_inf` attribute AMP's GradScaler skips
    steps with: the kernel leaves the parameters and moments as they are and the step count
    is put back. The decision stays on the device, so skipping costs the host no wait."""
    optimizer.found_inf = found


# prctl(2) options (linux/prctl.h).
PR_SET_PDEATHSIG, PR_GET_PDEATHSIG = 1, 2


def _prctl(option: int, arg: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def set_parent_death_signal(signum: int) -> None:
    """Have the kernel send `signum` to this process when its parent (the thread that forked
    it) ends, whatever way it ends: prctl(PR_SET_PDEATHSIG), which Python does not wrap."""
    _prctl(PR_SET_PDEATHSIG, signum)


def parent_death_signal() -> int:
    """The signal set_parent_death_signal asked for (0: none)."""
    found = ctypes.c_int(0)
    _prctl(PR_GET_PDEATHSIG, ctypes.addressof(found))
    return found.value


@contextlib.contextmanager
def elastic_agent_hooks(on_failure: Callable[[dict], bool]) -> Iterator[None]:
    """While inside, torch's elastic agent (1) calls on_failure(failures) each time it finds its
    worker group failed (failures: global rank -> ProcessFailure; every worker of this node has
    exited by then), before it restarts the group; a False return makes the failure final;
    and (2) kills its workers at once on a second signal while it waits for them to stop after
    a first: SimpleElasticAgent.run would otherwise call _shutdown again from its `finally` and
    wait out the whole grace period once more. torch has no hooks for either: this wraps
    LocalElasticAgent._monitor_workers and _shutdown and empties _remaining_restarts (private)."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SignalException

    monitor, shutdown = LocalElasticAgent._monitor_workers, LocalElasticAgent._shutdown

    def _monitor_workers(self, worker_group):
        result = monitor(self, worker_group)
        if result.state == WorkerState.FAILED and result.failures and not on_failure(result.failures):
            self._remaining_restarts = 0
        return result

    def _shutdown(self, *args, **kwargs):
        try:
            return shutdown(self, *args, **kwargs)
        except SignalException:
            if self._pcontext is not None:
                self._pcontext.close(signal.SIGKILL, timeout=5)
            raise

    LocalElasticAgent._monitor_workers, LocalElasticAgent._shutdown = _monitor_workers, _shutdown
    try:
        yield
    finally:
        LocalElasticAgent._monitor_workers, LocalElasticAgent._shutdown = monitor, shutdown


RENDEZVOUS_BACKEND = "duoka-c10d"


def register_rendezvous() -> str:
    """Register torch's c10d rendezvous with two changes, under the name returned (LaunchConfig's
    rdzv_backend). (1) The store the workers share, hosted by the agent, is new at every
    rendezvous round, as torch meant (pytorch#135712, #135957): torch 2.13 keeps one for all
    rounds, so the group restarted after a failure reads the keys its predecessor left there
    (gloo then dials dead ports and times out). (2) Given a local_addr (a single node:
    127.0.0.1), both stores listen on that address only; a multi-node rendezvous store listens
    on the endpoint's address unless that is a loopback one. TCPStore listens on every
    interface whatever host it is given, unless handed a socket bound beforehand. Private:
    DynamicRendezvousHandler's _bootstrap_store_info, _shared_tcp_store_server and
    _create_tcp_store_server."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(RENDEZVOUS_BACKEND, _create_rendezvous)
    return RENDEZVOUS_BACKEND


def _create_rendezvous(params: RendezvousParameters):
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend, create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    host, port = params.endpoint.rsplit(":", 1)
    listen = params.local_addr or _reachable_address(host)
    if params.get_as_bool("is_host") and listen is not None:
        store = _bound_store(listen, int(port), params.get_as_int("read_timeout", 60))
        backend = C10dRendezvousBackend(store, params.run_id)
    else:
        backend, store = create_backend(params)
    handler = create_handler(store, backend, params)
    join = handler.next_rendezvous

    def next_rendezvous():
        handler._bootstrap_store_info = handler._shared_tcp_store_server = None
        return join()

    handler.next_rendezvous = next_rendezvous
    handler.get_backend = lambda: RENDEZVOUS_BACKEND  # the registry checks the name it was asked for
    if params.local_addr:
        handler._create_tcp_store_server = lambda addr, port: _bound_store(addr, port, 300)
    return handler


def _reachable_address(host: str) -> str | None:
    """The address `host` names here, or None where it is a loopback address (another node
    reaches this one by some other address, so the store must listen on all of them)."""
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return None
    return None if address.startswith("127.") else address


def _bound_store(host: str, port: int, timeout_s: int):
    """A TCPStore server that listens on `host` only (on `port`; 0: a free one)."""
    from datetime import timedelta

    import torch.distributed as dist

    with socket.create_server((host, port)) as sock:
        port = sock.getsockname()[1]
        return dist.TCPStore(host, port, is_master=True, multi_tenant=True, timeout=timedelta(seconds=timeout_s),
                             master_listen_fd=sock.detach())
