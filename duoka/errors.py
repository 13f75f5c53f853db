"""One error type for everything a user can cause.

The CLI prints `error: <cause>` and `fix: <fix>` and exits non-zero; library callers
catch `DuokaError` and read the two fields. Bugs in duoka itself stay ordinary
exceptions with tracebacks, so they are not mistaken for user errors.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path


class DuokaError(Exception):
    def __init__(self, cause: str, fix: str | None = None):
        super().__init__(cause if fix is None else f"{cause}\n  fix: {fix}")
        self.cause = cause
        self.fix = fix

    def __reduce__(self):  # raised in a worker process, it must arrive whole in the parent
        return (type(self), (self.cause, self.fix))


# Install hints for the optional features, named by pyproject.toml's extras (which hold the
# versions tested): an error naming a missing package gives these as its fix.
QUANT_INSTALL = "pip install 'duoka[quant]' (torchao; with a PyTorch other than 2.13, the torchao release made for it)"
DATA_INSTALL = "pip install 'duoka[data]' (pyarrow)"


# The file-system errors a user's setup causes (an output folder that is read-only, a full
# disk), with their fix; any other OSError stays a bug's traceback.
_FILE_ERRORS = {
    errno.ENOSPC: ("no space left on device", "free space on that disk, or point the output at a disk with room"),
    errno.EDQUOT: ("disk quota exceeded", "free space within your quota, or point the output at another disk"),
    errno.EACCES: ("permission denied", "choose a folder you can write to, or give yourself write permission on it"),
    errno.EPERM: ("operation not permitted", "choose a folder you can write to, or give yourself write permission"),
    errno.EROFS: ("read-only file system", "choose a folder on a writable disk"),
    errno.ENOTDIR: ("a part of the path is a file, not a folder", "fix the path, or move that file away"),
    errno.EEXIST: ("a file stands where a folder is needed (not a folder)", "fix the path, or move that file away"),
    errno.ENAMETOOLONG: ("the file name is too long", "use a shorter path"),
}


def file_error(e: BaseException) -> DuokaError | None:
    """The DuokaError for a file-system error a user can mend, found in `e` or the exceptions
    it was raised from; None when there is none (a bug, to be raised as it is)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FILE_ERRORS:
            meaning, fix = _FILE_ERRORS[e.errno]
            where = e.filename if e.filename is not None else "(no path given)"
            cause = f"{meaning}: {where}"
            if e.errno in (errno.ENOSPC, errno.EDQUOT) and e.filename is not None:
                cause += f" ({_free_at(Path(os.fsdecode(e.filename)))} free there)"
            return DuokaError(cause, fix)
        e = e.__cause__ or e.__context__
    return None


def _free_at(path: Path) -> str:
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return "unknown"
    return f"{free / 1e9:.1f} GB" if free >= 1e8 else f"{free / 1e6:.1f} MB"
