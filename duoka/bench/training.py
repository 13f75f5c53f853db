"""`duoka bench`: training throughput of one (model, layout, seq, micro-batch) on this
machine's GPUs, optionally side by side with the transformers peer in the same call.

Runs the real `duoka train` (random tokens, checkpoints off) for warm-up + timed steps in a
scratch run directory and reads its metrics.jsonl as the steps land (a progress line each):
tokens/s/GPU and MFU over the timed steps (total tokens / total time), the largest per-rank
peak memory, and the step-time breakdown over the same steps (breakdown). With --vs-peer
the peer script (the repository's bench/peers/train_peer.py, or --peer) runs under torchrun
with the same model, micro-batch, sequence and GPU count, DDP or FSDP2 as the layout's data
parallelism; `vs_peer` = duoka tokens/s / peer tokens/s.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from duoka import runtime
from duoka.errors import DuokaError
from duoka.state_files import read_jsonl

ROOT = Path(__file__).resolve().parents[2]  # the repository (or site-packages): what PYTHONPATH needs for duoka
PEER_MODELS = {"qwen2-0.5b": "0.5b", "qwen2-1.5b": "1.5b", "qwen2-7b": "7b"}
TRAIN_PEER = "train_peer.py"  # in the repository's bench/peers/
# How often a running benchmark looks for new steps in metrics.jsonl (a progress line each).
PROGRESS_POLL_S = 1.0


def repository_peer(script: str) -> Path | None:
    """bench/peers/SCRIPT of the duoka repository this package runs from (a clone, installed
    with `pip install -e .`); None for an installed duoka, which has no bench/: nothing outside
    the repository is looked for."""
    if not (ROOT / "pyproject.toml").is_file():  # site-packages, not the repository
        return None
    path = ROOT / "bench" / "peers" / script
    return path if path.is_file() else None


def peer_missing(script: str, given: Path | None) -> DuokaError:
    if given is not None:
        return DuokaError(f"peer script {given} not found", f"pass --peer the path of {script}")
    return DuokaError(f"--vs-peer runs the transformers peer, bench/peers/{script} of the duoka repository, and "
                      f"this duoka is installed without the repository ({ROOT})",
                      f"run duoka from a clone of the repository (pip install -e .), or pass --peer PATH/{script} "
                      "(a copy of that script)")


def layout_overrides(layout: str) -> tuple[list[str], dict]:
    """`fsdp+tp2+ac+compile` -> config overrides, and what the layout means for the peer.
    Parts: ddp | fsdp | hsdpR (R replica groups) | tpN | ppN (1F1B) | ac | compile | fused | reduce-every |
    noreshard."""
    flags, info = [], {"dp_mode": "ddp", "tp": 1, "pp": 1, "ac": False, "compile": False, "fused": False}
    for part in layout.split("+"):
        if part in ("ddp", "fsdp"):
            info["dp_mode"] = part
        elif part.startswith("hsdp") and part[4:].isdigit():
            info["dp_mode"] = "fsdp"
            flags.append(f"--parallel.dp_replicate={int(part[4:])}")
        elif part[:2] in ("tp", "pp") and part[2:].isdigit():
            info[part[:2]] = int(part[2:])
        elif part == "ac":
            info["ac"] = True
        elif part == "compile":
            info["compile"] = True
        elif part == "fused":  # the chunked head + cross-entropy (duoka only; the peer has no such switch)
            info["fused"] = True
        elif part == "reduce-every":  # fsdp accumulation: reduce-scatter every micro-batch (duoka only)
            flags.append("--parallel.reduce_every_microbatch=true")
        elif part == "noreshard":  # fsdp: blocks stay gathered from forward to backward (ZeRO-2-like)
            flags.append("--parallel.reshard_after_forward=false")
        else:
            raise DuokaError(f"--layout part {part!r} is not understood",
                             "join parts with +: ddp | fsdp | hsdpR | tpN | ppN | ac | compile | fused | "
                             "reduce-every | noreshard, "
                             "e.g. fsdp+tp2+compile")
    flags += [f"--parallel.dp_mode={info['dp_mode']}", f"--parallel.tp={info['tp']}", f"--parallel.pp={info['pp']}",
              f"--training.activation_checkpointing={'full' if info['ac'] else 'none'}",
              f"--training.compile={str(info['compile']).lower()}",
              f"--training.fused_loss={str(info['fused']).lower()}"]
    return flags, info


# The phases of a step on the device's timeline, in order; each interval lies inside the step
# (timing.PhaseTimer's marks, between the previous step's end and this one's), so they never
# add up to more than it.
DEVICE_PHASES = ("forward", "backward", "pipeline", "optimizer")


def breakdown(timed: list[dict]) -> dict[str, float]:
    """The mean step's parts (seconds), which add up to the mean step time: the device phases,
    `data` (the host fetching and copying the batch) where it lies inside the step, and
    `other` (exposed communication, host gaps). Means, not medians: medians of the parts do
    not add up to the median step (a slow step is slow in one part), and each record's own
    `other` is cut at 0 where its host-timed `data` overlapped the device's work (on GPU the
    host fetches the next batch while the device still runs the last step), which made the
    parts add up to more than the step. Such overlapped data time is reported apart, as
    `data_overlapped` (not a part of the step)."""
    step = statistics.fmean(r["step_time_s"] for r in timed)
    seen = {k for r in timed for k in r.get("phase_s", {})}
    parts = {k: statistics.fmean(r.get("phase_s", {}).get(k, 0.0) for r in timed) for k in DEVICE_PHASES if k in seen}
    data = statistics.fmean(r.get("phase_s", {}).get("data", 0.0) for r in timed) if "data" in seen else None
    overlapped = data is not None and sum(parts.values()) + data > step
    if data is not None and not overlapped:
        parts["data"] = data
    parts["other"] = max(0.0, step - sum(parts.values()))  # >= 0 but for float rounding
    if overlapped:
        parts["data_overlapped"] = data
    return parts


def shares(parts: dict[str, float]) -> dict[str, int]:
    """Whole percents of the step for each part that is one (data_overlapped is not), rounded
    so that they add up to exactly 100 (largest remainders get the spare points)."""
    inside = {k: v for k, v in parts.items() if k != "data_overlapped"}
    total = sum(inside.values()) or 1.0
    exact = {k: 100 * v / total for k, v in inside.items()}
    out = {k: int(v) for k, v in exact.items()}
    for k in sorted(exact, key=lambda k: exact[k] - out[k], reverse=True)[:100 - sum(out.values())]:
        out[k] += 1
    return out


def summarize(records: list[dict], warmup: int, world: int) -> dict:
    timed = records[warmup:]
    if not timed:
        raise DuokaError(f"no timed steps: {len(records)} steps ran, {warmup} of them warm-up", "raise --steps")
    seconds = sum(r["step_time_s"] for r in timed)
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in timed)
    mfu = None if timed[0]["mfu"] is None else sum(r["mfu"] * r["step_time_s"] for r in timed) / seconds
    return {
        "tokens_per_s_per_gpu": tokens / seconds / world,
        "mfu": mfu,
        "peak_mem_gib": max((r.get("peak_mem_gib") or 0.0) for r in records),
        "step_time_s": statistics.median(r["step_time_s"] for r in timed),
        "step_times_s": [r["step_time_s"] for r in timed],  # to spot a slow outlier behind a low mean
        "host_s": {k: statistics.median(r["host_s"][k] for r in timed) for k in ("launch", "wait")}
        if all("host_s" in r for r in timed) else None,
        "mean_step_time_s": seconds / len(timed),
        "breakdown_s": breakdown(timed),
        "final_loss": timed[-1]["loss"],
    }


class StepProgress:
    """A progress line for each step that lands in the run's metrics.jsonl while it trains."""

    def __init__(self, metrics: Path, warmup: int, steps: int, log: Callable[[str], None]):
        self.metrics, self.warmup, self.total, self.log = metrics, warmup, warmup + steps, log
        self.shown, self.started = 0, time.monotonic()

    def __call__(self) -> None:
        records = read_jsonl(self.metrics)[0] if self.metrics.is_file() else []
        for r in records[self.shown:]:
            kind = "warm-up" if r["step"] <= self.warmup else f"timed {r['step'] - self.warmup}/{self.total - self.warmup}"
            self.log(f"duoka bench: step {r['step']}/{self.total} ({kind}) {r['step_time_s'] * 1e3:,.0f} ms, "
                     f"{r['tokens_per_s_per_gpu']:,.0f} tokens/s per process; {time.monotonic() - self.started:.0f} s "
                     "since the start")
        self.shown = max(self.shown, len(records))


def run_duoka(model: str, layout: str, seq: int, micro_batch: int, global_batch: int | None, steps: int, warmup: int,
              nproc: int, timeout: int, settings: list[str] = (), profile: bool = False,
              trace_dir: Path | None = None, log: Callable[[str], None] | None = None) -> dict:
    """One `duoka train` run; with `log`, a line as it starts and one per step as it lands."""
    flags, info = layout_overrides(layout)
    dp = nproc // (info["tp"] * info["pp"]) or 1
    global_batch = global_batch or micro_batch * dp
    run = Path(tempfile.mkdtemp(prefix="duoka-bench-")) / "run"
    cmd = [sys.executable, "-m", "duoka.cli", "train", f"--job.output_dir={run}", f"--model.flavor={model}",
           "--data.path=random", f"--training.seq_len={seq}", f"--training.micro_batch_size={micro_batch}",
           f"--training.global_batch_size={global_batch}", f"--training.steps={warmup + steps}",
           "--checkpoint.enabled=false", "--checkpoint.export_final=false", f"--metrics.log_interval={warmup + steps}",
           "--optimizer.warmup_steps=2", f"--nproc-per-node={nproc}", *flags]
    for setting in settings:
        if "=" not in setting or not setting.split("=", 1)[0].count("."):
            raise DuokaError(f"--set {setting!r} is not SECTION.KEY=VALUE", "e.g. --set parallel.reshard_after_forward=false")
        cmd.append(f"--{setting}")
    if profile:  # the last warm-up step, so the profiler's overhead stays out of the timed steps
        if warmup < 1:
            raise DuokaError("--profile needs at least one warm-up step", "use --warmup 1 or more")
        cmd.append(f"--metrics.profile_step={warmup}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    progress = StepProgress(run / "metrics.jsonl", warmup, steps, log) if log is not None else None
    if log is not None:
        log(f"duoka bench: duoka train {model} {layout}, {nproc} process(es): {warmup} warm-up + {steps} timed steps "
            "(start-up first: the model is built, and compiled where the layout says so)")
    try:
        proc = run_process_group(cmd, timeout, env, progress)
        if proc.returncode != 0:
            tail = proc.stderr.strip().splitlines()[-12:]
            raise DuokaError(f"duoka train failed for {model} {layout}:\n    " + "\n    ".join(tail),
                             "run the same duoka train command by hand for the whole log")
        records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        kernels = json.loads((run / "profile" / "kernels-rank0.json").read_text()) if profile else None
        if profile and trace_dir is not None:  # the run directory is temporary: keep the traces, compressed
            trace_dir.mkdir(parents=True, exist_ok=True)
            for trace in sorted((run / "profile").glob("trace-rank*.json")):
                with trace.open("rb") as src, gzip.open(trace_dir / f"{trace.name}.gz", "wb") as dst:
                    shutil.copyfileobj(src, dst)
    finally:
        shutil.rmtree(run.parent, ignore_errors=True)
    result = {**summarize(records, warmup, nproc), "global_batch": global_batch, "settings": list(settings)}
    if kernels is not None:
        result["profile"] = kernels
    return result


_LIVE_GROUPS: set[int] = set()  # sessions started by run_process_group and still running


def stop_process_groups_on_signal() -> None:
    """On SIGTERM or SIGINT (a `timeout` around a bench script), kill every session that
    run_process_group started, then exit: otherwise they outlive the script."""
    def handler(signum, frame):
        for pgid in list(_LIVE_GROUPS):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        runtime.hard_exit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def run_process_group(cmd: list[str], timeout: float, env: dict,
                      on_tick: Callable[[], None] | None = None) -> subprocess.CompletedProcess:
    """Runs a launcher (torchrun and its workers) in a session of its own and kills the whole
    session when it ends or times out. subprocess.run's timeout kills only the launcher, and
    its orphaned workers would keep training on the GPUs beside the next measurement. Its
    output goes to files (no pipe to fill while it runs); on_tick is called every
    PROGRESS_POLL_S while it runs, and once after."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env, start_new_session=True)
        _LIVE_GROUPS.add(proc.pid)
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    raise DuokaError(f"{' '.join(cmd[:4])} ... ran past {timeout} s and was stopped with its workers",
                                     "raise --timeout, or run fewer steps")
                try:
                    proc.wait(min(PROGRESS_POLL_S, max(0.0, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    pass
                if on_tick is not None:
                    on_tick()
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # after a clean exit there is nothing left to kill
            except ProcessLookupError:
                pass
            proc.wait()
            _LIVE_GROUPS.discard(proc.pid)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())


def run_peer(peer: Path, model: str, info: dict, seq: int, micro_batch: int, steps: int, warmup: int, nproc: int,
             timeout: int) -> dict:
    if model not in PEER_MODELS:
        raise DuokaError(f"the peer has no configuration for {model}",
                         f"--vs-peer works with {', '.join(PEER_MODELS)}")
    if not peer.is_file():
        raise peer_missing(TRAIN_PEER, peer)
    mode = "fsdp2" if info["dp_mode"] == "fsdp" or info["tp"] > 1 or info["pp"] > 1 else "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", str(peer),
           f"--model={PEER_MODELS[model]}", f"--mode={mode}", f"--seq={seq}", f"--mbs={micro_batch}",
           f"--steps={steps}", f"--warmup={warmup}"] + (["--ac"] if info["ac"] else []) + \
        (["--compile"] if info["compile"] else [])
    proc = run_process_group(cmd, timeout, dict(os.environ))
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-8:]
        raise DuokaError("the peer run failed:\n    " + "\n    ".join(tail), "check the peer command: " + " ".join(cmd))
    r = json.loads(lines[-1][len("RESULT "):])
    return {"mode": mode, "tokens_per_s_per_gpu": r["tok_s_gpu"], "mfu": r["mfu_pct"] / 100,
            "peak_mem_gib": r["peak_mem_gib"], "step_time_s": r["step_s"], "global_batch": micro_batch * nproc}


def bench(model: str, layout: str, seq: int, micro_batch: int, steps: int, warmup: int, global_batch: int | None,
          vs_peer: bool, peer: Path | None, nproc: int | None, timeout: int, settings: list[str] = (),
          profile: bool = False, trace_dir: Path | None = None, log: Callable[[str], None] | None = None) -> dict:
    """`peer`: the peer script (None: not here, refused with --vs-peer); `log`: progress lines."""
    import torch  # here, not at the top: `duoka bench serve` imports this module and needs no torch

    if vs_peer and (peer is None or not peer.is_file()):  # before minutes of duoka's own run
        raise peer_missing(TRAIN_PEER, peer)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the training run sees what this process sees
    nproc = nproc or torch.cuda.device_count() or 1
    result = {"model": model, "layout": layout, "seq": seq, "micro_batch": micro_batch, "device": device,
              "gpus": nproc, "timed_steps": steps,
              **run_duoka(model, layout, seq, micro_batch, global_batch, steps, warmup, nproc, timeout, settings,
                          profile, trace_dir, log)}
    if vs_peer:
        _, info = layout_overrides(layout)
        if log is not None:
            log(f"duoka bench: the transformers peer, {nproc} process(es), {warmup} warm-up + {steps} timed steps")
        result["peer"] = run_peer(peer, model, info, seq, micro_batch, steps, warmup, nproc, timeout)
        result["vs_peer"] = result["tokens_per_s_per_gpu"] / result["peer"]["tokens_per_s_per_gpu"]
    return result


def processes(result: dict) -> str:
    """What the run ran on: "2 GPUs", "1 GPU", "2 CPU processes" (results before `device` were GPU runs)."""
    n = result["gpus"]
    if result.get("device", "cuda") == "cpu":
        return f"{n} CPU process{'es' if n != 1 else ''}"
    return f"{n} GPU{'s' if n != 1 else ''}"


def render(result: dict, console) -> None:
    from rich.table import Table

    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    cpu = result.get("device", "cuda") == "cpu"
    console.print(f"{result['model']} | {result['layout']} | seq {result['seq']} | micro-batch {result['micro_batch']} "
                  f"| {processes(result)}", style="bold")
    table = Table()
    table.add_column("")
    table.add_column("tokens/s/process" if cpu else "tokens/s/GPU", justify="right")
    table.add_column("MFU", justify="right")
    table.add_column("peak GiB", justify="right")
    table.add_column("median step s", justify="right")
    table.add_row("duoka", f"{result['tokens_per_s_per_gpu']:,.0f}", pct(result["mfu"]),
                  "-" if cpu else f"{result['peak_mem_gib']:.1f}", f"{result['step_time_s']:.3f}")
    if "peer" in result:
        p = result["peer"]
        table.add_row(f"peer ({p['mode']})", f"{p['tokens_per_s_per_gpu']:,.0f}", pct(p["mfu"]),
                      f"{p['peak_mem_gib']:.1f}", f"{p['step_time_s']:.3f}")
        table.add_row("duoka / peer", f"{result['vs_peer']:.3f}", "", "", "")
    console.print(table)
    parts = dict(result["breakdown_s"])
    overlapped = parts.pop("data_overlapped", None)
    percent = shares(parts)
    console.print(f"step time (mean of {result['timed_steps']} timed steps, {sum(parts.values()) * 1e3:,.1f} ms): "
                  + ", ".join(f"{k} {v * 1e3:,.1f} ms ({percent[k]}%)" for k, v in parts.items())
                  + (f"; data {overlapped * 1e3:,.1f} ms on the host, while the device ran the previous step"
                     if overlapped is not None else ""))
    if "profile" in result:
        console.print("profiled step, top kernels by device time:")
        for k in result["profile"]["kernels"][:12]:
            console.print(f"  {k['ms']:8.1f} ms {k['share']:5.1%} x{k['calls']:<4} {k['name'][:100]}")
