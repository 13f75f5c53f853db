"""An output folder on a disk that is full, read-only or not a folder at all gets one message
naming the path and exit 2, never a traceback. A full disk at any point of a run ends it so,
and leaves it resumable: the metrics line the disk cut short is cut off on resume (with a
warning), and the run continues from its newest checkpoint with every step logged once. (A
save that does not fit is refused before writing, naming the space it needs:
tests/unit/test_checkpoint_integrity.py.)

The disk is a small tmpfs mounted by the test (root only; skipped with the reason elsewhere).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

FLAGS = ("--training.seq_len=32", "--training.global_batch_size=2", "--checkpoint.keep=1")


def _mount(mount: Path, options: str):
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    yield from _mount(tmp_path / "disk", "size=40m")


@pytest.fixture
def read_only_disk(tmp_path):
    yield from _mount(tmp_path / "ro", "ro,size=1m")


def test_read_only_or_impossible_output_folders_are_one_message(in_process, read_only_disk, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    corpus = Path(__file__).resolve().parents[2] / "duoka" / "assets" / "corpus"
    for args, where, meaning in [
        (("train", "--training.steps=1", f"--job.output_dir={read_only_disk / 'run'}"), read_only_disk / "run",
         "read-only file system"),
        (("prepare", "--data", str(corpus), "--out", str(read_only_disk / "p")), read_only_disk / "p",
         "read-only file system"),
        (("train", "--training.steps=1", f"--job.output_dir={a_file / 'run'}"), a_file / "run", "not a folder"),
        (("prepare", "--data", str(corpus), "--out", str(a_file / "p")), a_file / "p", "not a folder"),
    ]:
        proc = in_process(*args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.count("error:") == 1 and meaning in proc.stderr and str(where) in proc.stderr, proc.stderr


def _fill(disk: Path, when: Path, stop: threading.Event) -> None:
    """Once `when` exists, fill the disk to the last byte with a file of its own."""
    while not when.exists() and not stop.is_set():
        time.sleep(0.02)
    with open(disk / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
        try:
            while True:  # the last bytes of the last page
                f.write(b"\0")
                f.flush()
        except OSError:
            pass


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_disk_full_while_training_ends_with_one_message_and_the_run_resumes(duoka, in_process, small_disk):
    run = small_disk / "run"
    stop = threading.Event()
    filler = threading.Thread(target=_fill, args=(small_disk, run / "checkpoints" / "step-2", stop), daemon=True)
    filler.start()
    try:
        proc = duoka("train", *FLAGS, "--training.steps=400", "--checkpoint.interval=2",
                     f"--job.output_dir={run}", timeout=300)
    finally:
        stop.set()
        filler.join()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("error:") == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "no space left on device" in proc.stderr and str(run) in proc.stderr, proc.stderr[-3000:]
    # Steps were logged after the checkpoint when the disk filled (a line may be torn).
    (small_disk / "filler").unlink()
    resumed = duoka("train", *FLAGS, "--training.steps=4", "--checkpoint.interval=2", "--checkpoint.resume=auto",
                    f"--job.output_dir={run}", timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr + resumed.stdout
    assert _steps(run) == [1, 2, 3, 4]
    impossible = run / "metrics.jsonl" / "hf"  # an export into a path through a file
    proc = in_process("export", str(run / "checkpoints" / "step-4"), "--out", str(impossible))
    assert proc.returncode == 2 and proc.stderr.count("error:") == 1 and "not a folder" in proc.stderr, proc.stderr


BOTH_RUNS = """
import sys
from duoka.cli import main
for out in sys.argv[1:]:
    print("exit", main(["train", "--training.steps=1", f"--job.output_dir={out}"]), flush=True)
"""


def test_a_read_only_directory_is_one_message_naming_the_path(duoka, tmp_path):
    """A folder without write permission: a new run directory in it cannot be made, and in an
    existing one the run's lock file cannot be (a PermissionError from the lock): one message
    each. Root ignores file modes, so as root the command runs without the capabilities that
    let it (setpriv)."""
    locked = tmp_path / "locked"
    (locked / "run").mkdir(parents=True)
    for folder in (locked / "run", locked):
        folder.chmod(0o555)
    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: file modes cannot be made to apply")
        prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--"]
    try:
        proc = subprocess.run([*prefix, sys.executable, "-c", BOTH_RUNS, str(locked / "new"), str(locked / "run")],
                              capture_output=True, text=True, cwd=duoka.root, env=duoka.env(), timeout=300)
    finally:
        for folder in (locked, locked / "run"):
            folder.chmod(0o755)
    assert proc.stdout.split() == ["exit", "2", "exit", "2"], proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: permission denied: {locked / 'new'}",
                      f"error: permission denied: {locked / 'run' / '.lock'}"]
    assert "Traceback" not in proc.stderr and proc.stderr.count("fix: choose a folder you can write to") == 2
