"""duoka train against the transformers peer (bench/peers/train_peer.py), same GPUs, same run:
tokens/s/GPU, MFU and peak memory for a list of (model, layout, micro-batch) cases, both sides
eager (or both compiled). Reproduces bench/results/train_vs_peer.md (device kind
nvidia-h200-x2, from the repository root), which README.md ("Measured") and docs/plan.md
(the FSDP overhead constant) cite:

    python bench/train_vs_peer.py --out $OUT/train_vs_peer.json \
        --case 0.5b:ddp:8 --case 0.5b:fsdp:8 --case 1.5b:ddp:4 --case 1.5b:fsdp:4 [--compile-case 0.5b:ddp:8]

Both sides train on random tokens at seq 2048 in bf16 (duoka: `data.path=random`), one
process per visible GPU, global batch = micro-batch x GPUs (no accumulation), warmup
steps excluded. duoka's figure is total tokens over total step time of the timed steps
from metrics.jsonl; the peer prints its own (its timing loop, its MFU formula, which is
the same PaLM convention as ours). bench/moe_vs_peer.py runs the MoE shapes through the same
run_duoka and run_peer (their `extra` flags: the optimizer, a cut model's folder).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The peer's shape names (bench/peers/qwen2_shapes.py) -> duoka's flavors of the same shapes.
FLAVOR = {"0.5b": "qwen2-0.5b", "1.5b": "qwen2-1.5b", "7b": "qwen2-7b", "moe-a2.7b": "qwen2-moe-a2.7b",
          "moe-57b": "qwen2-57b-a14b", "moe-tiny": "qwen2-moe-tiny"}
PEER_MODE = {"ddp": "ddp", "fsdp": "fsdp2"}


def gpu_count() -> int:
    """Processes per side: one per GPU; one on a machine without GPUs (a CPU smoke run)."""
    import torch

    return max(1, torch.cuda.device_count())


def run_duoka(model: str, layout: str, mbs: int, seq: int, steps: int, warmup: int, compile: bool, timeout: int,
              extra: Sequence[str] = ()) -> dict:
    """extra: further config overrides; a `--model.path=` among them replaces the flavor."""
    n = gpu_count()
    run = Path(tempfile.mkdtemp(prefix="duoka-bench-")) / "run"
    shape = [] if any(x.startswith("--model.path=") for x in extra) else [f"--model.flavor={FLAVOR[model]}"]
    cmd = [sys.executable, "-m", "duoka.cli", "train", f"--job.output_dir={run}", *shape,
           "--data.path=random", f"--training.seq_len={seq}", f"--training.micro_batch_size={mbs}",
           f"--training.global_batch_size={mbs * n}", f"--training.steps={steps}", "--training.dtype=bf16",
           f"--parallel.dp_mode={layout}", f"--training.compile={str(compile).lower()}",
           "--checkpoint.enabled=false", "--checkpoint.export_final=false", "--metrics.log_interval=5",
           "--optimizer.warmup_steps=2", *extra]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - t
    metrics = (run / "metrics.jsonl").read_text() if proc.returncode == 0 else ""
    shutil.rmtree(run.parent, ignore_errors=True)  # a 7B run's folder held a 30 GB checkpoint
    if proc.returncode != 0:
        return {"error": proc.stderr[-1500:]}
    recs = [json.loads(line) for line in metrics.splitlines()][warmup:]
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in recs)
    seconds = sum(r["step_time_s"] for r in recs)
    tps_gpu = tokens / seconds / n
    mfu = sum(r["mfu"] * r["step_time_s"] for r in recs) / seconds if recs[0]["mfu"] is not None else None
    result = {"tok_s_gpu": round(tps_gpu), "mfu_pct": round(100 * mfu, 1) if mfu else None,
              "peak_mem_gib": round(max(r.get("peak_mem_gib", 0) for r in recs), 1),
              "step_s": round(seconds / len(recs), 4), "final_loss": round(recs[-1]["loss"], 3),
              "wall_s": round(wall, 1)}
    loads = [r["expert_load"] for r in recs if "expert_load" in r]  # a MoE's routing, last timed step
    if loads:
        result["expert_max_imbalance"] = loads[-1]["max_imbalance"]
    return result


def child_error(output: str) -> str:
    """The peer's own exception line (torchrun prints it as `[rank0]: SomeError: ...` and then
    its own traceback, which is all a tail of the output would keep), else the tail."""
    raised = [line for line in output.splitlines() if re.match(r"(\[rank\d+\]: )?[\w.]+(Error|Exception)\b", line)
              and "ChildFailedError" not in line]
    return raised[0][:1500] if raised else output[-1500:]


def run_peer(peer: Path, model: str, layout: str, mbs: int, seq: int, steps: int, warmup: int, compile: bool,
             timeout: int, extra: Sequence[str] = ()) -> dict:
    """extra: further peer flags (--optimizer, --layers)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={gpu_count()}", str(peer),
           f"--model={model}", f"--mode={PEER_MODE[layout]}", f"--seq={seq}", f"--mbs={mbs}", f"--steps={steps - warmup}",
           f"--warmup={warmup}"] + (["--compile"] if compile else []) + list(extra)
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": child_error(proc.stderr or proc.stdout)}
    r = json.loads(lines[-1][len("RESULT "):])
    moe = {k: r[k] for k in ("experts", "aux_loss") if k in r}
    return {"tok_s_gpu": r["tok_s_gpu"], "mfu_pct": r["mfu_pct"], "peak_mem_gib": r["peak_mem_gib"],
            "step_s": r["step_s"], "final_loss": r["loss"], **moe, "wall_s": round(wall, 1)}


class Budget:
    """Runs of at most `per_run` seconds each, all within `total` seconds from now (0: no
    total); a run that would get less than a minute is skipped, one that overruns is recorded
    as timed out (bench/moe_vs_peer.py, bench/long_context.py)."""

    def __init__(self, per_run: int, total: int):
        self.per_run, self.total, self.t0 = per_run, total, time.perf_counter()

    def run(self, run, args: tuple, extra: Sequence[str]) -> dict:
        """run(*args, timeout=..., extra=extra), or an {"error": ...} saying why it did not finish."""
        left = self.total - (time.perf_counter() - self.t0) if self.total else float("inf")
        timeout = int(min(self.per_run, left))
        if timeout < 60:
            return {"error": "skipped: less than a minute of --budget left"}
        try:
            return run(*args, timeout=timeout, extra=extra)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout} s"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--peer", type=Path, default=ROOT / "bench" / "peers" / "train_peer.py")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--case", action="append", default=[], help="MODEL:LAYOUT:MICRO_BATCH, e.g. 0.5b:ddp:8")
    p.add_argument("--compile-case", action="append", default=[], help="same, both sides with compile")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--timeout", type=int, default=150)
    a = p.parse_args()
    import torch

    results = {"gpus": gpu_count(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "seq": a.seq, "timed_steps": a.steps - a.warmup, "cases": []}
    cases = [(c, False) for c in a.case] + [(c, True) for c in a.compile_case]
    for case, compile in cases:
        model, layout, mbs = case.split(":")
        row = {"model": model, "layout": layout, "micro_batch": int(mbs), "compile": compile}
        runs = {"duoka": lambda: run_duoka(model, layout, int(mbs), a.seq, a.steps, a.warmup, compile, a.timeout),
                "peer": lambda: run_peer(a.peer, model, layout, int(mbs), a.seq, a.steps, a.warmup, compile, a.timeout)}
        for side, run in runs.items():
            try:
                row[side] = run()
            except subprocess.TimeoutExpired:
                row[side] = {"error": f"timed out after {a.timeout} s"}
        if "tok_s_gpu" in row["duoka"] and "tok_s_gpu" in row["peer"]:
            row["vs_peer"] = round(row["duoka"]["tok_s_gpu"] / row["peer"]["tok_s_gpu"], 3)
        results["cases"].append(row)
        a.out.write_text(json.dumps(results, indent=2) + "\n")
        print(json.dumps(row), flush=True)
    print(f"{'case':<26}{'duoka tok/s/GPU':>16}{'MFU':>7}{'GiB':>7}{'peer tok/s/GPU':>16}{'MFU':>7}{'GiB':>7}{'ratio':>7}")
    for r in results["cases"]:
        d, q = r["duoka"], r["peer"]
        name = f"{r['model']} {r['layout']} mb{r['micro_batch']}{' compile' if r['compile'] else ''}"
        print(f"{name:<26}{d.get('tok_s_gpu', 'err'):>16}{d.get('mfu_pct') or '-':>7}{d.get('peak_mem_gib', '-'):>7}"
              f"{q.get('tok_s_gpu', 'err'):>16}{q.get('mfu_pct') or '-':>7}{q.get('peak_mem_gib', '-'):>7}"
              f"{r.get('vs_peer', '-'):>7}")


if __name__ == "__main__":
    main()
