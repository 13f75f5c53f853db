"""QLoRA's loss criterion (issue 26): the same fine-tuning run with bf16 LoRA and with NF4
QLoRA (`--lora.quantize=nf4`), one GPU, one device call; both loss curves, the mean loss
of the final 50 steps and their difference, peak memory and tokens/s, into JSON.

    PYTHONPATH=$PWD timeout 590 python3 bench/qlora_loss.py --out $OUT/qlora_loss.json [--speed-case 7b:4:2048]
    # CPU check of the script itself (debug flavor, a few steps):
    PYTHONPATH=$PWD python3 bench/qlora_loss.py --flavor debug --steps 6 --tail 3 --micro-batch 2 \
        --seq 64 --out /tmp/qlora_loss.json

Both runs: `duoka train` on one process with the same seed, base, data and settings; only
lora.quantize differs. The base is the flavor's seeded random init unless --model-path names
a Hugging Face folder (the GPU machines reach no hub); the data is the bundled corpus through
the bundled tokenizer (duoka/assets/tiny-qwen2: 4,096 tokens, inside Qwen2's vocabulary).
LoRA rank 16, alpha 32, all seven linear layers, AdamW on the adapters (duoka's defaults
otherwise), compiled where training.compile=auto compiles (CUDA). 200 steps of 8 x 1,024
tokens of Qwen2-0.5B take about 1.5 minutes a run on one H200, start and compile included.

The criterion: |mean QLoRA loss - mean LoRA loss| over the final --tail steps, relative to
the LoRA mean. Each run's tokens/s is the median step's after --skip warm-up steps; its peak
memory the largest per-step peak (metrics.jsonl).

--speed-case 7b:4:2048 adds QLoRA's speed and memory on Qwen2-7B (random weights and tokens,
rank 16, micro-batch 4, seq 2048, compiled) through bench/lora_vs_peer.py's runner, the one
its LoRA cases run through (`--speed-case debug:2:64` checks it on a CPU).

Reproduces docs/lora.md's and docs/performance.md's QLoRA figures (bench/results/lora/
qlora_loss.json); bench/lora_qlora.sh runs it in its device call (nvidia-h200, torchao's wheel
carried).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lora_vs_peer import ALPHA, RANK
from lora_vs_peer import run_duoka as run_speed_case

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "duoka" / "assets" / "tiny-qwen2"


def train(quantize: str, a: argparse.Namespace) -> dict:
    """One run; its per-step losses and figures."""
    run = Path(tempfile.mkdtemp(prefix=f"duoka-qlora-{quantize}-")) / "run"
    base = [f"--model.path={a.model_path}"] if a.model_path else [f"--model.flavor={a.flavor}",
                                                                   f"--model.tokenizer={TOKENIZER}"]
    cmd = [sys.executable, "-m", "duoka.cli", "train", f"--job.output_dir={run}", *base,
           f"--training.seq_len={a.seq}", f"--training.micro_batch_size={a.micro_batch}",
           f"--training.global_batch_size={a.micro_batch}", f"--training.steps={a.steps}",
           f"--training.dtype={a.dtype}", f"--training.seed={a.seed}", f"--optimizer.lr={a.lr}",
           f"--optimizer.warmup_steps={min(10, a.steps // 4)}", f"--lora.rank={RANK}", f"--lora.alpha={ALPHA}",
           "--lora.target_modules=all-linear", f"--lora.quantize={quantize}", "--checkpoint.enabled=false",
           "--checkpoint.export_final=false", "--metrics.log_interval=50", "--nproc-per-node=1",
           *[f"--{s}" for s in a.set]]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:], "wall_s": round(wall, 1), "command": cmd}
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    timed = recs[a.skip:] or recs
    step = statistics.median(r["step_time_s"] for r in timed)
    tokens = a.micro_batch * a.seq
    banner = next((line for line in proc.stderr.splitlines() if "duoka train" in line and "parameters" in line), "")
    return {"losses": [round(r["loss"], 5) for r in recs],
            "tail_mean_loss": statistics.fmean(r["loss"] for r in recs[-a.tail:]),
            "tokens_per_s": round(tokens / step), "step_s": round(step, 4),
            "peak_mem_gib": round(max(r.get("peak_mem_gib") or 0 for r in recs), 2) or None,
            "wall_s": round(wall, 1), "banner": banner, "command": cmd}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--flavor", default="qwen2-0.5b", help="model.flavor (default qwen2-0.5b; debug checks the script)")
    p.add_argument("--model-path", default=None, help="a Hugging Face folder as the base instead of a random one")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--tail", type=int, default=50, help="final steps whose mean loss is compared (default 50)")
    p.add_argument("--skip", type=int, default=10, help="warm-up steps left out of tokens/s (default 10)")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bf16", help="training.dtype (default bf16)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="extra duoka train setting for both runs (repeatable)")
    p.add_argument("--speed-case", action="append", default=[], metavar="MODEL:MICRO_BATCH:SEQ",
                   help="also QLoRA's speed and memory there, e.g. 7b:4:2048 (repeatable)")
    p.add_argument("--timeout", type=int, default=300, help="seconds per run")
    a = p.parse_args()
    import torch

    results = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "torch": torch.__version__,
               "flavor": a.flavor, "model_path": a.model_path, "steps": a.steps, "tail": a.tail,
               "micro_batch": a.micro_batch, "seq": a.seq, "lr": a.lr, "seed": a.seed, "dtype": a.dtype,
               "rank": RANK, "alpha": ALPHA, "extra": a.set, "runs": {}}
    for quantize in ("none", "nf4"):
        results["runs"]["lora" if quantize == "none" else "qlora"] = train(quantize, a)
        a.out.write_text(json.dumps(results, indent=1) + "\n")
    lora, qlora = results["runs"]["lora"], results["runs"]["qlora"]
    if "tail_mean_loss" in lora and "tail_mean_loss" in qlora:
        diff = qlora["tail_mean_loss"] - lora["tail_mean_loss"]
        results["tail_loss_difference"] = round(diff, 5)
        results["tail_loss_relative_difference"] = round(abs(diff) / lora["tail_mean_loss"], 5)
    results["qlora_speed"] = []
    for case in a.speed_case:
        model, mbs, seq = case.split(":")
        row = {"model": model, "micro_batch": int(mbs), "seq": int(seq), "quantize": "nf4"}
        try:
            row.update(run_speed_case(model, int(mbs), int(seq), ["--lora.quantize=nf4"], None, a.timeout))
        except subprocess.TimeoutExpired as e:
            row["error"] = f"timed out after {e.timeout} s"
        results["qlora_speed"].append(row)
        a.out.write_text(json.dumps(results, indent=1) + "\n")
    a.out.write_text(json.dumps(results, indent=1) + "\n")
    for name, r in results["runs"].items():
        print(f"{name:<6} tail mean loss {r.get('tail_mean_loss', float('nan')):.4f}  "
              f"{r.get('tokens_per_s', '-')} tok/s  {r.get('peak_mem_gib') or '-'} GiB  {r.get('wall_s', '-')} s  "
              f"{r.get('error', '')[-300:]}")
    print("QLoRA - LoRA, final", a.tail, "steps:", results.get("tail_loss_difference"),
          "relative", results.get("tail_loss_relative_difference"))
    for row in results["qlora_speed"]:
        print("QLoRA speed:", {k: v for k, v in row.items() if k not in ("command", "banner", "phase_s")})


if __name__ == "__main__":
    main()
