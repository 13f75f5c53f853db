"""Every private Python and PyTorch API duoka relies on, each with what it saves.
tests/unit/test_runtime.py fails, naming the API and its user here, if an upgrade removes one.

Imports no torch: `duoka` commands and the launcher import this before torch (~2 s) is needed."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from multiprocessing import forkserver
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    import torch


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
