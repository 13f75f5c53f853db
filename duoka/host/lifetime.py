"""How long a worker process lives: exactly as long as the launcher that started it
(training's workers and the tensor-parallel ranks of `duoka serve` alike)."""

from __future__ import annotations

import multiprocessing
import os
import select
import signal
import threading

from duoka import runtime

# A worker that returned waits for its agent to release it, which an agent that is itself
# stopping (SIGTERM) never does. The return value is in the agent's pipe once handed over, so
# the worker leaves on its own after this long.
RELEASE_WAIT_S = 0.5


def die_with_launcher() -> None:
    """End this worker as soon as its launcher ends, however it ends (kill -9, the OOM killer).
    The worker server outlives the launcher while any worker holds its pipe, so the kernel's
    parent-death signal cannot reach the workers through it: each worker watches the launcher
    itself through a pidfd (the kernel's handle on that one process, so a reused pid is never
    mistaken for it) on a thread that only waits. Should the server die first, the launcher can
    no longer see this worker exit: the worker goes too (SIGKILL; torch's SIGINT would now ask
    for a save)."""
    runtime.set_parent_death_signal(signal.SIGKILL)
    try:
        handle = os.pidfd_open(multiprocessing.parent_process().pid)
    except ProcessLookupError:  # already gone
        runtime.hard_exit(1)
    threading.Thread(target=_end_with, args=(handle,), name="duoka-launcher-watch", daemon=True).start()


def _end_with(handle: int) -> None:
    select.select([handle], [], [])  # readable once the process has exited
    os.kill(os.getpid(), signal.SIGKILL)


def leave_after_return() -> None:
    """Called as a worker returns its result to the agent: exit RELEASE_WAIT_S later even if
    the agent, stopping itself, never collects this process."""
    leave = threading.Timer(RELEASE_WAIT_S, runtime.hard_exit, args=(0,))
    leave.daemon = True
    leave.start()
