"""How a launch ends, as the command's exit code and one message: the codes that schedulers
and `&&` chains read (docs/training.md lists them) and the two outcomes that carry one.

Imports no torch: `duoka train` reads these before its workers start."""

from __future__ import annotations

import signal
from pathlib import Path

from duoka.errors import DuokaError

# A stop by signal N exits 128 + N, as a process killed by N would, so that schedulers and
# `&&` chains see an unfinished job.
EXIT_WORKER_DIED = 1  # a worker was killed or crashed, no restart left: resuming may succeed
EXIT_USER_ERROR = 2  # DuokaError: cause and fix; the same command fails the same way


class TrainingStopped(Exception):
    """The job stopped early on a signal (SIGTERM, SIGINT), having saved a checkpoint or not.
    Exit code 128 + the signal's number, as a job killed by it, so that schedulers and `&&`
    chains do not mistake it for a finished run."""

    def __init__(self, run_dir: Path, signum: int, saved_step: str | None):
        name = signal.Signals(signum).name
        resume = f"--checkpoint.resume=auto --job.output_dir={run_dir}"
        if saved_step is not None:
            message = f"stopped by {name} after saving step {saved_step}; continue with {resume}"
        else:
            message = (f"stopped by {name} before a checkpoint was saved (a second signal, or a stop that did not "
                       f"finish within the grace period); continue from the newest one with {resume}")
        super().__init__(message)
        self.exit_code = 128 + signum


class WorkerFailed(DuokaError):
    """A worker failed and no restart is left; `exit_code` tells a scheduler whether trying
    again may help (EXIT_WORKER_DIED) or not (EXIT_USER_ERROR), or is a worker's own."""

    def __init__(self, cause: str, fix: str | None, exit_code: int):
        super().__init__(cause, fix)
        self.exit_code = exit_code

    def __reduce__(self):
        return (type(self), (self.cause, self.fix, self.exit_code))
