"""Every state file survives a torn write: a torn JSON-lines tail is cut off with a warning and
the run goes on; whole files are replaced by rename, never half-written. (Checkpoint files,
train_state.json and manifest.json live in a .partial folder until complete: their tears are
damage that test_checkpoint_integrity covers.)"""

from __future__ import annotations

import json
import os
from collections import namedtuple
from pathlib import Path

import pytest

from duoka.errors import DuokaError
from duoka.launch.agent import Restarts
from duoka.launch.serving import serving_result
from duoka.launch.training import run_lock
from duoka.state_files import cut_torn_tail, read_jsonl, write_whole
from duoka.train.run_files import RESTARTS_LOG, last_logged_step
from duoka.train.step_metrics import truncate_metrics

TORN = [
    b'{"step": 3, "loss": 1.',  # cut mid-record: no newline
    b'{"step": 3, "loss": 1.5}',  # whole JSON, but its newline never written
    b'\x00\x00\x00\x00',  # a file system's zero-filled tail after a crash
]


def _records(path: Path, steps) -> None:
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in steps))


@pytest.mark.parametrize("tail", TORN, ids=["mid-record", "no newline", "zeros"])
def test_a_torn_tail_is_ignored_by_readers_and_cut_with_a_warning(tmp_path, tail):
    path = tmp_path / "metrics.jsonl"
    _records(path, [1, 2])
    whole = path.stat().st_size
    with open(path, "ab") as f:
        f.write(tail)
    records, torn = read_jsonl(path)
    assert [r["step"] for r in records] == [1, 2] and torn == len(tail)
    assert last_logged_step(tmp_path) == 2
    said = []
    assert cut_torn_tail(path, said.append) == len(tail)
    assert path.stat().st_size == whole and "torn" in said[0] and "2 whole record" in said[0]
    assert cut_torn_tail(path, said.append) == 0 and len(said) == 1  # nothing more to cut, nothing said


def test_resume_cuts_a_torn_metrics_line_and_the_steps_past_the_checkpoint(tmp_path):
    """A disk that filled between checkpoints left half a record: a resume from step 2 keeps
    steps 1-2 (it used to die in a JSONDecodeError, on every restart too)."""
    path = tmp_path / "metrics.jsonl"
    _records(path, [1, 2, 3])
    with open(path, "ab") as f:
        f.write(TORN[0])
    said = []
    truncate_metrics(path, 2, said.append)
    assert [r["step"] for r in read_jsonl(path)[0]] == [1, 2] and read_jsonl(path)[1] == 0
    assert len(said) == 1 and "torn" in said[0]


def test_the_restart_log_is_cut_before_it_grows(tmp_path):
    """restarts.jsonl, appended by node 0's launcher at each restart: a torn line from an
    earlier failure is cut before the next record, which then reads whole."""
    run = tmp_path / "run"
    run.mkdir()
    log_path = run / RESTARTS_LOG
    log_path.write_text(json.dumps({"restart": 1}) + "\n" + '{"restart": 2, "ca')
    Failure = namedtuple("Failure", "timestamp exitcode")
    spec = namedtuple("Spec", "run_dir")(str(run))
    said = []
    restarts = Restarts(spec, lambda s: (None, 0), max_restarts=3, node_rank=0, log=said.append)
    assert restarts.after_failure({0: Failure(1.0, 1)})
    records, torn = read_jsonl(log_path)
    assert [r["restart"] for r in records] == [1, 1] and torn == 0
    assert any("torn" in line for line in said)


def test_a_whole_file_is_replaced_or_left_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / "config.toml"
    write_whole(path, "old = 1\n")
    write_whole(path, "new = 2\n")
    assert path.read_text() == "new = 2\n"

    def cut(src, dst):  # the process dies between writing and renaming
        raise OSError(28, os.strerror(28), str(dst))

    monkeypatch.setattr(os, "replace", cut)
    with pytest.raises(OSError):
        write_whole(path, "torn = 3\n")
    assert path.read_text() == "new = 2\n" and [p.name for p in tmp_path.iterdir()] == ["config.toml"]


def test_a_torn_run_lock_still_locks(tmp_path):
    """The lock is the flock, not the file's text: a torn holder line neither blocks a new job
    nor stops the lock from refusing a second one."""
    (tmp_path / ".lock").write_bytes(b"\x00\x001234 ho")
    with run_lock(tmp_path):
        assert (tmp_path / ".lock").read_text().split()[0] == str(os.getpid())


def test_the_serve_result_file_is_read_whole_or_not_at_all(tmp_path):
    """Rank 0 of `duoka serve --tp N` leaves how it ended for the launcher (written by rename);
    one it could not finish (empty, cut) counts as none: the signal's code, or a dead worker's."""
    result = tmp_path / "rank0"
    write_whole(result, "2\nthe cause\nthe fix\n")
    with pytest.raises(DuokaError, match="the cause"):
        serving_result(result, None)
    for torn in ("", "1", "\x00\x00"):
        result.write_text(torn)
        assert serving_result(result, 15) == (1 if torn == "1" else 128 + 15)
    result.unlink()
    assert serving_result(result, None) == 1
