"""Randomized fault-injection trials of `duoka train` (2 CPU processes over gloo), with the
table of outcomes written into docs/reliability.md.

    python tools/fault_trials.py [--trials 10] [--kinds kill_worker,...] [--seed 0] [--write-docs]

Each trial starts the same small run (debug flavor, fp32, a checkpoint every 5 steps),
injects one fault at a random moment, lets duoka recover (by itself where it can, else with
`--checkpoint.resume=auto`, as a user or a scheduler's requeue would), and compares the final
weights with an uninterrupted run of the same configuration. Kinds:

  kill_worker    kill -9 of a random worker at a random step; --max-restarts 3 restarts the
                 group, which resumes from the newest intact checkpoint by itself
  kill_launcher  kill -9 of the launcher: every worker must be gone within seconds; resumed
  sigterm_group  SIGTERM to the whole process group (scancel, preemption): a checkpoint is
                 saved and the job exits with its stop code; resumed
  sigstop_rank   SIGSTOP of a random worker: the hang watchdog ends the job within its
                 timeout; resumed
  damaged_ckpt   the newest checkpoint's shard gets flipped bytes after a stop: resume falls
                 back to the previous intact checkpoint
  disk_full      the run directory on a small tmpfs that fills mid-run (needs mount rights;
                 skipped otherwise): the error names the full disk, no .partial is left;
                 resumed elsewhere after freeing space
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
STEPS, INTERVAL = 20, 5
COMMON = ["--model.flavor=debug", f"--training.steps={STEPS}", "--training.seq_len=32",
          "--training.global_batch_size=8", "--training.dtype=fp32", "--optimizer.warmup_steps=2",
          "--optimizer.schedule=constant", f"--checkpoint.interval={INTERVAL}", "--checkpoint.keep=2",
          "--metrics.log_interval=100", "--metrics.tensorboard=false", "--nproc-per-node=2"]
HANG_TIMEOUT_S = 20  # the watchdog's limit in the sigstop trials (well above a step of this run)
KINDS = ("kill_worker", "kill_launcher", "sigterm_group", "sigstop_rank", "damaged_ckpt", "disk_full")


@dataclass
class Trial:
    kind: str
    fault_step: int  # the step the fault was aimed at (1-based)
    recovered: bool  # the run reached its last step and exported
    by_itself: bool  # without a second `duoka train`
    steps_lost: int  # steps trained twice: from the checkpoint resumed to the step reached
    equal: bool  # final weights equal the uninterrupted run's
    seconds: float
    note: str


def duoka(run_dir: Path, *extra: str, **popen) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "duoka.cli", "train", f"--job.output_dir={run_dir}", *COMMON, *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **popen)


def finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return json.loads(lines[-1])["step"] if lines else 0


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        if last_step(run_dir) >= step:
            return True
        time.sleep(0.05)
    return False


def _children() -> dict[int, list[int]]:
    """ppid -> pids, from /proc."""
    out: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return out


def alive(pid: int) -> bool:
    """Running, not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def workers_of(proc: subprocess.Popen) -> list[int]:
    """The launcher's training processes: the children of its worker server (forked, they
    share the server's command line), or its own children that are not that server."""
    children = _children()
    found = []
    for pid in children.get(proc.pid, []):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"forkserver" in cmdline:
            found += children.get(pid, [])
        elif b"resource_tracker" not in cmdline:
            found.append(pid)
    return found


def signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def weights(run_dir: Path) -> dict:
    return load_file(run_dir / "hf" / f"step-{STEPS}" / "model.safetensors")


def same_weights(a: Path, b: Path) -> bool:
    try:
        wa, wb = weights(a), weights(b)
    except FileNotFoundError:
        return False
    return wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)


def steps_lost(run_dir: Path, err: str, reached: int) -> int:
    """Steps trained twice: from the restart log (restarts by themselves), else from the
    resume's own line ("resuming from ... (step N)") against the step reached at the fault."""
    restarts = run_dir / "restarts.jsonl"
    if restarts.exists():
        return sum(int(json.loads(line).get("steps_lost") or 0) for line in restarts.read_text().splitlines() if line)
    found = re.findall(r"resuming from .* \(step (\d+)\)", err)
    return max(0, reached - int(found[-1])) if found else reached


def trial(kind: str, rng: random.Random, reference: Path, work: Path) -> Trial:
    run = work / f"{kind}-{rng.randrange(10**6)}"
    step = rng.randrange(2, STEPS - 1)
    t0 = time.monotonic()
    by_itself, note = True, ""
    at_fault: dict[str, int] = {}  # the step logged when the fault struck
    if kind == "kill_worker":
        proc = duoka(run, "--max-restarts=3")
        wait_for_step(run, step, proc)
        victims = workers_of(proc)
        if victims:
            signal_pid(rng.choice(victims), signal.SIGKILL)
        at_fault["step"] = last_step(run)
        code, err = finish(proc)
        note = f"exit {code}"
    elif kind == "kill_launcher":
        proc = duoka(run)
        wait_for_step(run, step, proc)
        before = workers_of(proc)
        at_fault["step"] = last_step(run)
        proc.kill()
        proc.wait()
        gone_by = time.monotonic() + 10
        while time.monotonic() < gone_by and any(alive(p) for p in before):
            time.sleep(0.1)
        left = [p for p in before if alive(p)]
        note = f"{len(left)} worker(s) alive 10 s after the launcher; " if left else "workers gone; "
        for p in left:
            signal_pid(p, signal.SIGKILL)
        by_itself = False
        code, err = finish(duoka(run, "--checkpoint.resume=auto"))
    elif kind == "sigterm_group":
        proc = duoka(run)
        wait_for_step(run, step, proc)
        os.killpg(proc.pid, signal.SIGTERM)
        code, err = finish(proc)
        at_fault["step"] = last_step(run)
        note = f"stop exit {code}; "
        by_itself = False
        code, err = finish(duoka(run, "--checkpoint.resume=auto"))
    elif kind == "sigstop_rank":
        proc = duoka(run, f"--reliability.hang_timeout_s={HANG_TIMEOUT_S}")
        wait_for_step(run, max(step, 3), proc)
        victims = workers_of(proc)
        if victims:
            signal_pid(rng.choice(victims), signal.SIGSTOP)
        code, err = finish(proc)
        at_fault["step"] = last_step(run)
        for p in victims:
            signal_pid(p, signal.SIGKILL)
        named = [line for line in err.splitlines() if line.startswith("error:")]
        note = f"hang exit {code}: {named[0][:100] if named else 'no error line'}; "
        by_itself = False
        code, err = finish(duoka(run, "--checkpoint.resume=auto"))
    elif kind == "damaged_ckpt":
        proc = duoka(run)
        wait_for_step(run, max(step, 2 * INTERVAL + 1), proc)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        at_fault["step"] = last_step(run)
        complete = sorted((p for p in (run / "checkpoints").glob("step-*") if not p.name.endswith(".partial")),
                          key=lambda p: int(p.name.split("-")[1]))
        if complete:
            shard = min(complete[-1].glob("*.distcp"))
            data = bytearray(shard.read_bytes())
            for i in range(0, len(data), max(1, len(data) // 16)):
                data[i] ^= 0xFF
            shard.write_bytes(bytes(data))
            note = f"flipped bytes in {complete[-1].name}/{shard.name}; "
        by_itself = False
        code, err = finish(duoka(run, "--checkpoint.resume=auto"))
        note += "damage named on resume; " if "is damaged, skipped" in err else "no warning naming the damage; "
    elif kind == "disk_full":
        mount = work / f"small-{rng.randrange(10**6)}"
        mount.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)],
                          capture_output=True, check=False).returncode != 0:
            return Trial(kind, 0, False, False, 0, False, 0.0, "skipped: cannot mount a tmpfs here")
        try:
            small = mount / "run"
            code, err = finish(duoka(small))
            partial = list((small / "checkpoints").glob("*.partial")) if (small / "checkpoints").exists() else []
            note = (f"exit {code}, {'names the full disk' if 'space' in err.lower() else 'disk not named'}, "
                    f"{len(partial)} .partial left; ")
            shutil.copytree(small, run, ignore=shutil.ignore_patterns("*.partial"))
        finally:
            subprocess.run(["umount", str(mount)], capture_output=True, check=False)
        by_itself = False
        code, err = finish(duoka(run, "--checkpoint.resume=auto"))
    else:
        raise ValueError(kind)
    return Trial(kind, step, code == 0 and last_step(run) == STEPS, by_itself and code == 0,
                 steps_lost(run, err, at_fault.get("step", step)),
                 code == 0 and same_weights(run, reference), round(time.monotonic() - t0, 1),
                 note + ("" if code == 0 else err.strip().splitlines()[-1][:100] if err.strip() else f"exit {code}"))


def table(trials: list[Trial]) -> str:
    rows = ["| kind | trials | recovered | by itself | final weights equal | steps lost (mean) | notes |",
            "|---|---|---|---|---|---|---|"]
    for kind in dict.fromkeys(t.kind for t in trials):
        ts = [t for t in trials if t.kind == kind]
        notes = "; ".join(sorted({t.note for t in ts if t.note}))[:300]
        rows.append(f"| {kind} | {len(ts)} | {sum(t.recovered for t in ts)} | {sum(t.by_itself for t in ts)} | "
                    f"{sum(t.equal for t in ts)} | {sum(t.steps_lost for t in ts) / len(ts):.1f} | {notes} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=10, help="trials per kind")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write-docs", action="store_true", help="write the table into docs/reliability.md")
    ap.add_argument("--json", type=Path, help="also write every trial as JSON here")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    work = Path(tempfile.mkdtemp(prefix="duoka-faults-"))
    reference = work / "reference"
    code, err = finish(duoka(reference))
    if code != 0:
        print(err[-3000:], file=sys.stderr)
        return 1
    trials = []
    for kind in a.kinds.split(","):
        for _ in range(a.trials):
            t = trial(kind, rng, reference, work)
            print(json.dumps(asdict(t)), flush=True)
            trials.append(t)
    text = table(trials)
    print(text)
    if a.json:
        a.json.write_text(json.dumps([asdict(t) for t in trials], indent=1))
    if a.write_docs:
        doc = ROOT / "docs" / "reliability.md"
        begin, end = "<!-- fault-trials:begin -->", "<!-- fault-trials:end -->"
        body = doc.read_text() if doc.exists() else f"# Reliability\n\n{begin}\n{end}\n"
        head, _, rest = body.partition(begin)
        _, _, tail = rest.partition(end)
        stamp = f"`python tools/fault_trials.py --trials {a.trials} --kinds {a.kinds} --seed {a.seed} --write-docs`"
        doc.write_text(f"{head}{begin}\n{stamp} ({time.strftime('%Y-%m-%d')}, 2 CPU processes, {STEPS} steps, "
                       f"a checkpoint every {INTERVAL}):\n\n{text}\n{end}{tail}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
