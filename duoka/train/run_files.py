"""The files of a run directory that the launcher and the workers both read or write, beside
the files users rely on (config.toml, metrics.jsonl, checkpoints/): a stop's marker, the restart
log, the workers' error reports, and which tokenizer files travel with a checkpoint.

Imports no torch: the launcher reads these before and after its workers run."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from duoka.state_files import read_jsonl

# Written into the run directory by rank 0 when a run saved and stopped early (SIGTERM or
# SIGINT); node 0's launcher removes it when a run starts.
STOPPED_MARKER = "STOPPED"
# One line per automatic restart (--max-restarts), appended by node 0's launcher.
RESTARTS_LOG = "restarts.jsonl"

# The tokenizer's files, copied into every checkpoint and exported model.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def tokenizer_files(folder: Path) -> list[str]:
    """The TOKENIZER_FILES that `folder` holds."""
    return [str(folder / n) for n in TOKENIZER_FILES if (folder / n).is_file()]


def error_report_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / f"error-rank{rank}.json"


def write_error_report(run_dir: str | Path, rank: int, cause: str, fix: str | None, **extra) -> None:
    """The error a worker leaves for the launcher, which turns the reports into one message.
    If the file cannot be written (a full disk), the message still reaches the user on stderr."""
    try:
        error_report_path(run_dir, rank).write_text(json.dumps({"rank": rank, "cause": cause, "fix": fix, **extra}))
    except OSError:
        if not extra.get("lost_peer"):
            print(f"error: rank {rank}: {cause}" + (f"\n  fix: {fix}" if fix else ""), file=sys.stderr, flush=True)


def read_error_reports(run_dir: str | Path) -> dict[int, dict]:
    """rank -> the error that worker wrote (write_error_report's format)."""
    reports = {}
    for path in Path(run_dir).glob("error-rank*.json"):
        with contextlib.suppress(OSError, ValueError):
            reports[int(path.stem.removeprefix("error-rank"))] = json.loads(path.read_text())
    return reports


def last_logged_step(run_dir: Path) -> int | None:
    """The step of metrics.jsonl's last whole record (None: no step logged)."""
    path = run_dir / "metrics.jsonl"
    records = read_jsonl(path)[0] if path.exists() else []
    for record in reversed(records):
        with contextlib.suppress(ValueError, KeyError, TypeError):
            return int(record["step"])
    return None
