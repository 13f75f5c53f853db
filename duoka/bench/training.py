"""`duoka bench`: training throughput of one (model, layout, seq, micro-batch) on this
machine's GPUs, optionally side by side with the transformers peer in the same call.

Runs the real `duoka train` (random tokens, checkpoints off) for warm-up + timed steps in a
scratch run directory and reads its metrics.jsonl: tokens/s/GPU and MFU over the timed
steps (total tokens / total time), the largest per-rank peak memory, and the medians of
the step-time breakdown (forward, backward, optimizer, data, and the rest: exposed
communication and host gaps; see PhaseTimer in duoka/timing.py). With --vs-peer the
peer script (the repository's bench/peers/train_peer.py, or --peer) runs under torchrun with the
same model, micro-batch, sequence and GPU count, DDP or FSDP2 as the layout's data
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
from pathlib import Path

from duoka import runtime
from duoka.errors import DuokaError

ROOT = Path(__file__).resolve().parents[2]  # the repository (or site-packages): what PYTHONPATH needs for duoka
PEER_MODELS = {"qwen2-0.5b": "0.5b", "qwen2-1.5b": "1.5b", "qwen2-7b": "7b"}
# The transformers peer is a script of the repository (bench/peers/), beside this package's folder.
# An installed duoka (site-packages) has no bench/ there: --vs-peer then needs --peer.
DEFAULT_PEER = ROOT / "bench" / "peers" / "train_peer.py"


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


def summarize(records: list[dict], warmup: int, world: int) -> dict:
    timed = records[warmup:]
    if not timed:
        raise DuokaError(f"no timed steps: {len(records)} steps ran, {warmup} of them warm-up", "raise --steps")
    seconds = sum(r["step_time_s"] for r in timed)
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in timed)
    mfu = None if timed[0]["mfu"] is None else sum(r["mfu"] * r["step_time_s"] for r in timed) / seconds
    seen = {k for r in timed for k in r.get("phase_s", {})}
    phases = [k for k in ("forward", "backward", "pipeline", "optimizer", "data", "other") if k in seen]
    return {
        "tokens_per_s_per_gpu": tokens / seconds / world,
        "mfu": mfu,
        "peak_mem_gib": max((r.get("peak_mem_gib") or 0.0) for r in records),
        "step_time_s": statistics.median(r["step_time_s"] for r in timed),
        "step_times_s": [r["step_time_s"] for r in timed],  # to spot a slow outlier behind a low mean
        "host_s": {k: statistics.median(r["host_s"][k] for r in timed) for k in ("launch", "wait")}
        if all("host_s" in r for r in timed) else None,
        "breakdown_s": {k: statistics.median(r["phase_s"].get(k, 0.0) for r in timed) for k in phases},
        "final_loss": timed[-1]["loss"],
    }


def run_duoka(model: str, layout: str, seq: int, micro_batch: int, global_batch: int | None, steps: int, warmup: int,
              nproc: int, timeout: int, settings: list[str] = (), profile: bool = False,
              trace_dir: Path | None = None) -> dict:
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
    try:
        proc = run_process_group(cmd, timeout, env)
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


def run_process_group(cmd: list[str], timeout: float, env: dict) -> subprocess.CompletedProcess:
    """Runs a launcher (torchrun and its workers) in a session of its own and kills the whole
    session when it ends or times out. subprocess.run's timeout kills only the launcher, and
    its orphaned workers would keep training on the GPUs beside the next measurement."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    _LIVE_GROUPS.add(proc.pid)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise DuokaError(f"{' '.join(cmd[:4])} ... ran past {timeout} s and was stopped with its workers",
                         "raise --timeout, or run fewer steps") from None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # after a clean exit there is nothing left to kill
        except ProcessLookupError:
            pass
        _LIVE_GROUPS.discard(proc.pid)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def run_peer(peer: Path, model: str, info: dict, seq: int, micro_batch: int, steps: int, warmup: int, nproc: int,
             timeout: int) -> dict:
    if model not in PEER_MODELS:
        raise DuokaError(f"the peer has no configuration for {model}",
                         f"--vs-peer works with {', '.join(PEER_MODELS)}")
    if not peer.is_file():
        raise DuokaError(f"peer script {peer} not found",
                         "pass --peer PATH/train_peer.py: the peer scripts are in bench/peers/ of a clone of the "
                         "duoka repository (an installed duoka does not ship them)")
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
          vs_peer: bool, peer: Path, nproc: int | None, timeout: int, settings: list[str] = (),
          profile: bool = False, trace_dir: Path | None = None) -> dict:
    if nproc is None:
        import torch

        nproc = torch.cuda.device_count() or 1
    result = {"model": model, "layout": layout, "seq": seq, "micro_batch": micro_batch, "gpus": nproc,
              "timed_steps": steps,
              **run_duoka(model, layout, seq, micro_batch, global_batch, steps, warmup, nproc, timeout, settings,
                          profile, trace_dir)}
    if vs_peer:
        _, info = layout_overrides(layout)
        result["peer"] = run_peer(peer, model, info, seq, micro_batch, steps, warmup, nproc, timeout)
        result["vs_peer"] = result["tokens_per_s_per_gpu"] / result["peer"]["tokens_per_s_per_gpu"]
    return result


def render(result: dict, console) -> None:
    from rich.table import Table

    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    table = Table(title=f"{result['model']} | {result['layout']} | seq {result['seq']} | micro-batch "
                        f"{result['micro_batch']} | {result['gpus']} GPU(s)")
    table.add_column("")
    table.add_column("tokens/s/GPU", justify="right")
    table.add_column("MFU", justify="right")
    table.add_column("peak GiB", justify="right")
    table.add_column("step s", justify="right")
    table.add_row("duoka", f"{result['tokens_per_s_per_gpu']:,.0f}", pct(result["mfu"]),
                  f"{result['peak_mem_gib']:.1f}", f"{result['step_time_s']:.3f}")
    if "peer" in result:
        p = result["peer"]
        table.add_row(f"peer ({p['mode']})", f"{p['tokens_per_s_per_gpu']:,.0f}", pct(p["mfu"]),
                      f"{p['peak_mem_gib']:.1f}", f"{p['step_time_s']:.3f}")
        table.add_row("duoka / peer", f"{result['vs_peer']:.3f}", "", "", "")
    console.print(table)
    parts = result["breakdown_s"]
    total = result["step_time_s"]
    console.print("step time (median): " + ", ".join(f"{k} {v * 1e3:.1f} ms ({v / total:.0%})"
                                                     for k, v in parts.items()))
    if "profile" in result:
        console.print("profiled step, top kernels by device time:")
        for k in result["profile"]["kernels"][:12]:
            console.print(f"  {k['ms']:8.1f} ms {k['share']:5.1%} x{k['calls']:<4} {k['name'][:100]}")
