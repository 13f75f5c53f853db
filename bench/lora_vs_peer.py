"""duoka LoRA against transformers + PEFT (bench/peers/lora_peer.py) on one GPU, in one device
call: tokens/s and peak memory at the same rank, targets and micro-batch. Reproduces the LoRA
table of docs/performance.md ("LoRA and QLoRA") and docs/lora.md's "Speed"
(bench/results/lora/lora_vs_peer.run*.json); device kind nvidia-h200, from the repository root:

    PYTHONUNBUFFERED=1 PYTHONPATH=$PWD timeout 580 python3 bench/lora_vs_peer.py --out $OUT/lora_vs_peer.json \
        --case peer:7b:4 --case duoka:7b:4 --case peer:1.5b:8 --case duoka:1.5b:8 --case duoka:7b:2:4096
    # CPU check of the script itself:
    python3 bench/lora_vs_peer.py --out /tmp/l.json --case duoka:debug:2:64 --case peer:tiny:2:64

Both sides: random bf16 weights, random tokens, LoRA rank 16 with alpha 32 and no dropout on
all seven linear layers of every block (PEFT's `all-linear`; the head frozen), AdamW on the
adapters only, seq 2048, one process. The peer runs its default 3 warm-up + 8 timed steps
with each decoder layer compiled (its best configuration, lora_peer.py's table); duoka runs
`duoka train` for as many steps (`--lora.rank=16 --data.path=random`, compiled, the fused
chunked loss) and both figures are the median step's tokens/s (the peer's own statistic);
duoka's mean over the timed steps is recorded beside it. Peak memory: the peer's
max_memory_allocated, duoka's largest per-step peak (metrics.jsonl).

Cases run in the order given (default: the 7B pair first, the issue's target); a case that
would not finish inside --budget-s (its estimate in CASE_SECONDS) is skipped and recorded so.
The JSON is rewritten after every case, so a call cut short keeps what finished.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The peer's model names; `tiny` (the peer's) and `debug` (duoka's) only check this script on a CPU.
FLAVOR = {"0.5b": "qwen2-0.5b", "1.5b": "qwen2-1.5b", "7b": "qwen2-7b", "debug": "debug"}
RANK, ALPHA = 16, 32  # the peer's: lora_alpha = 2 x rank
WARMUP, TIMED = 3, 8  # the peer's defaults
# Seconds a case may take, start and compile included (measured on one H200, 2026-12-01: 37-50 s;
# the JSON records each case's wall time, so the next call can replace these with readings).
CASE_SECONDS = {"7b": 60, "1.5b": 50, "0.5b": 55, "debug": 60, "tiny": 60}
# side:model:micro-batch[:seq], most wanted first. 7B at micro-batch 4 is the target
# (1.3x the peer's 13,955 tok/s); 7B at seq 4096 checks that a 7B LoRA fits one H200 there;
# then 1.5B and 0.5B, which the issue asks to report.
DEFAULT_CASES = ("peer:7b:4", "duoka:7b:4", "duoka:7b:2:4096", "duoka:1.5b:8", "peer:1.5b:8", "duoka:0.5b:8",
                 "peer:0.5b:8")


def run_duoka(model: str, mbs: int, seq: int, extra: list[str], compile_cache: str | None, timeout: int,
              profile_dir: Path | None = None) -> dict:
    run = Path(tempfile.mkdtemp(prefix="duoka-lora-")) / "run"
    if profile_dir is not None:  # one step after the timed ones, so the figures above are unprofiled
        extra = [*extra, f"--metrics.profile_step={WARMUP + TIMED + 1}"]  # 1-based
    cmd = [sys.executable, "-m", "duoka.cli", "train", f"--job.output_dir={run}", f"--model.flavor={FLAVOR[model]}",
           "--data.path=random", f"--training.seq_len={seq}", f"--training.micro_batch_size={mbs}",
           f"--training.global_batch_size={mbs}", f"--training.steps={WARMUP + TIMED + (profile_dir is not None)}",
           "--training.dtype=bf16",
           f"--lora.rank={RANK}", f"--lora.alpha={ALPHA}", "--lora.target_modules=all-linear",
           "--training.compile=true", "--training.fused_loss=true", "--checkpoint.enabled=false",
           "--checkpoint.export_final=false", "--metrics.log_interval=1", "--optimizer.warmup_steps=2",
           "--nproc-per-node=1", *([f"--training.compile_cache={compile_cache}"] if compile_cache else []), *extra]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:], "wall_s": round(wall, 1), "command": cmd}
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][WARMUP:WARMUP + TIMED]
    if profile_dir is not None:  # the per-kernel table and the phase summary of the profiled step
        profile_dir.mkdir(parents=True, exist_ok=True)
        tag = f"{model}-mb{mbs}-seq{seq}"
        shutil.copy(run / "profile" / "kernels-rank0.json", profile_dir / f"kernels-{tag}.json")
        trace = next((run / "profile").glob("trace-rank0.json*"))
        summary = subprocess.run([sys.executable, str(ROOT / "bench" / "trace_summary.py"), str(trace)],
                                 capture_output=True, text=True)
        (profile_dir / f"phases-{tag}.txt").write_text(summary.stdout + summary.stderr[-2000:])
    step = statistics.median(r["step_time_s"] for r in recs)
    seconds = sum(r["step_time_s"] for r in recs)
    banner = next((line for line in proc.stderr.splitlines() if "duoka train" in line and "parameters" in line), "")
    return {"tokens_per_s": round(mbs * seq / step), "tokens_per_s_mean": round(mbs * seq * len(recs) / seconds),
            "mfu_pct": round(100 * statistics.median(r["mfu"] for r in recs), 1) if recs[0]["mfu"] else None,
            "peak_mem_gib": round(max(r.get("peak_mem_gib") or 0 for r in recs), 1),
            "phase_s": {k: round(statistics.median(r["phase_s"][k] for r in recs), 4) for k in recs[0]["phase_s"]},
            "step_s": round(step, 4), "final_loss": round(recs[-1]["loss"], 4), "wall_s": round(wall, 1),
            "banner": banner, "command": cmd}


def run_peer(peer: Path, model: str, mbs: int, seq: int, timeout: int) -> dict:
    peer = peer.resolve()
    cmd = [sys.executable, str(peer), f"--model={model}", f"--rank={RANK}", f"--mbs={mbs}", f"--seq={seq}",
           f"--steps={TIMED}", f"--warmup={WARMUP}", "--compile"]
    t = time.perf_counter()
    # The peer imports its sibling qwen2_shapes.py (found beside the script); run it from its folder.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=peer.parent)
    wall = time.perf_counter() - t
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr or proc.stdout)[-2000:], "wall_s": round(wall, 1), "command": cmd}
    r = json.loads(lines[-1])
    return {"tokens_per_s": round(r["tokens_per_s"]), "mfu_pct": round(100 * r["mfu"], 1) if r["mfu"] else None,
            "peak_mem_gib": round(r["peak_mem_gib"], 1) if r["peak_mem_gib"] else None,
            "trainable_params": r["trainable_params"], "wall_s": round(wall, 1), "command": cmd}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peer", type=Path, default=ROOT / "bench" / "peers" / "lora_peer.py")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--case", action="append", default=[], help="side:model:micro-batch[:seq], e.g. duoka:7b:4 "
                   f"(default: {' '.join(DEFAULT_CASES)})")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="extra duoka train setting for every duoka case (repeatable)")
    p.add_argument("--compile-cache", default=None, help="training.compile_cache for the duoka cases")
    p.add_argument("--budget-s", type=float, default=560, help="skip cases that would end past this (default 560)")
    p.add_argument("--timeout", type=int, default=300, help="seconds per case")
    p.add_argument("--profile-dir", type=Path, default=None,
                   help="profile one more step of each duoka case; its kernel table and phase summary go here")
    a = p.parse_args()
    import torch

    started = time.perf_counter()
    results = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "torch": torch.__version__,
               "rank": RANK, "alpha": ALPHA, "targets": "all-linear", "warmup_steps": WARMUP,
               "timed_steps": TIMED, "duoka_extra": a.set, "cases": []}
    for case in a.case or DEFAULT_CASES:
        side, model, mbs, *rest = case.split(":")
        seq = int(rest[0]) if rest else 2048
        row = {"side": side, "model": model, "micro_batch": int(mbs), "seq": seq}
        left = a.budget_s - (time.perf_counter() - started)
        if left < CASE_SECONDS[model]:
            row["skipped"] = f"{left:.0f} s of the budget left, the case needs about {CASE_SECONDS[model]} s"
        else:
            try:
                row.update(run_duoka(model, int(mbs), seq, [f"--{s}" for s in a.set], a.compile_cache,
                                     min(a.timeout, int(left)), a.profile_dir) if side == "duoka"
                           else run_peer(a.peer, model, int(mbs), seq, min(a.timeout, int(left))))
            except subprocess.TimeoutExpired as e:
                row["error"] = f"timed out after {e.timeout} s"
        results["cases"].append(row)
        pairs = {(r["model"], r["micro_batch"], r["seq"], r["side"]): r for r in results["cases"] if "tokens_per_s" in r}
        results["vs_peer"] = {f"{m} mb{b} seq{s}": round(d["tokens_per_s"] / pairs[(m, b, s, "peer")]["tokens_per_s"], 3)
                              for (m, b, s, side_), d in pairs.items() if side_ == "duoka" and (m, b, s, "peer") in pairs}
        a.out.write_text(json.dumps(results, indent=1) + "\n")
        print(json.dumps({k: v for k, v in row.items() if k != "command"}), flush=True)
    print(f"{'case':<24}{'tok/s':>9}{'MFU %':>7}{'GiB':>7}{'wall s':>8}")
    for r in results["cases"]:
        name = f"{r['side']} {r['model']} mb{r['micro_batch']} seq{r['seq']}"
        print(f"{name:<24}{r.get('tokens_per_s', r.get('skipped') and 'skipped' or 'error'):>9}"
              f"{r.get('mfu_pct') or '-':>7}{r.get('peak_mem_gib') or '-':>7}{r.get('wall_s', '-'):>8}")
    print("duoka / peer:", results["vs_peer"])


if __name__ == "__main__":
    main()
