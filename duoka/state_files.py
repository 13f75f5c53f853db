"""Files duoka keeps state in, written so that a torn write (a full disk, a kill, a power loss
in the middle) never stops the next run from reading them.

- JSON lines, appended one record at a time (metrics.jsonl, restarts.jsonl): a reader takes
  the whole records and ignores a torn last line; before appending again, cut_torn_tail cuts
  it off (with a warning), so new records never join a fragment.
- Whole files (config.toml, the serve result file, caches' manifests): written to a temporary
  name beside the target, fsynced, then renamed over it, so a reader sees the old file or the
  new one, never half of one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def read_jsonl(path: Path) -> tuple[list[dict], int]:
    """(the file's whole records, the bytes of a torn tail after them). A line that does not
    parse ends the records: anything after it was written after a failure."""
    data = path.read_bytes()
    records, good = [], 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break  # a record is whole only with its newline
        try:
            record = json.loads(line)
        except ValueError:
            break
        if not isinstance(record, dict):
            break
        records.append(record)
        good += len(line)
    return records, len(data) - good


def cut_torn_tail(path: Path, warn=None) -> int:
    """Cut what follows the last whole record of a JSON-lines file; returns the bytes cut.
    warn(message) says so when there was anything to cut."""
    if not path.exists():
        return 0
    records, torn = read_jsonl(path)
    if torn:
        with open(path, "rb+") as f:
            f.truncate(path.stat().st_size - torn)
            f.flush()
            os.fsync(f.fileno())
        if warn is not None:
            warn(f"{path}: cut {torn} byte(s) of a torn last record (a write cut short: full disk or a kill) "
                 f"after {len(records)} whole record(s)")
    return torn


def write_whole(path: Path, data: str | bytes) -> None:
    """Write the file whole or not at all: a temporary file beside it, fsynced, renamed."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
