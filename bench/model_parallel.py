"""Model-parallel layouts on this machine's GPUs: tokens/s/GPU, MFU and peak memory of
`duoka train` per (model, layout, micro-batch) case, for comparison with `duoka plan`.

    python bench/model_parallel.py --out $OUT/model_parallel.json \
        --case qwen2-7b:fsdp:2 --case qwen2-7b:tp2:2 --case qwen2-7b:pp2:2 ...

Layouts: ddp, fsdp, tpN (tensor parallel over N GPUs, data parallel over the rest), ppN
(1F1B pipeline over N GPUs), each optionally +ac (full activation checkpointing). Random
tokens, seq 2048, bf16, eager blocks, global batch --global-batch (the same for every
case: accumulation fills the difference), checkpoints off. Figures are medians over the
steps after the first two; peak memory is the largest torch.cuda.max_memory_allocated()
of any rank in any step.

Reproduces bench/results/model_parallel.md and .json, which docs/training.md (model
parallelism) and docs/plan.md (the tensor-parallel cost constant) cite; device kind
nvidia-h200-x2, from the repository root:

    PYTHONPATH=$PWD python bench/model_parallel.py --out $OUT/model_parallel.json --timeout 100 \
        --case qwen2-7b:fsdp:2 --case qwen2-7b:tp2:2 --case qwen2-7b:pp2:2 --case qwen2-1.5b:tp2:4 \
        --case qwen2-0.5b:pp2:4 --case qwen2-1.5b:fsdp:4 --case qwen2-0.5b:ddp:4
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

ROOT = Path(__file__).resolve().parents[1]


def layout_flags(layout: str) -> list[str]:
    flags = []
    if layout.endswith("+ac"):
        layout = layout[:-3]
        flags.append("--training.activation_checkpointing=full")
    if layout in ("ddp", "fsdp"):
        return flags + [f"--parallel.dp_mode={layout}"]
    if layout.startswith("tp"):
        return flags + [f"--parallel.tp={int(layout[2:])}"]
    if layout.startswith("pp"):
        return flags + [f"--parallel.pp={int(layout[2:])}", "--parallel.pp_schedule=1f1b"]
    raise SystemExit(f"unknown layout {layout}")


def run_case(flavor: str, layout: str, micro_batch: int, args) -> dict:
    run = Path(tempfile.mkdtemp(prefix="duoka-mp-")) / "run"
    cmd = [sys.executable, "-m", "duoka.cli", "train", f"--job.output_dir={run}", f"--model.flavor={flavor}",
           "--data.path=random", f"--training.seq_len={args.seq}", f"--training.micro_batch_size={micro_batch}",
           f"--training.global_batch_size={args.global_batch}", f"--training.steps={args.steps}",
           "--training.dtype=bf16", "--checkpoint.enabled=false", "--checkpoint.export_final=false",
           "--metrics.log_interval=1", "--optimizer.warmup_steps=2", *layout_flags(layout)]
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    out = {"wall_s": round(time.perf_counter() - t, 1)}
    if proc.returncode != 0:
        return {**out, "error": proc.stderr[-2500:]}
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    timed = recs[2:] or recs
    return {**out,
            "tokens_per_s_per_gpu": statistics.median(r["tokens_per_s_per_gpu"] for r in timed),
            "mfu": statistics.median(r["mfu"] or 0.0 for r in timed),  # null on CPU
            "step_time_s": statistics.median(r["step_time_s"] for r in timed),
            "peak_mem_gib": max(r.get("peak_mem_gib", 0.0) for r in recs),
            "peak_mem_gib_per_rank": [max(r["per_rank"]["peak_mem_gib"][i] for r in recs)
                                      for i in range(len(recs[0]["per_rank"]["peak_mem_gib"]))],
            "loss_first_last": [recs[0]["loss"], recs[-1]["loss"]]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--case", action="append", required=True, help="FLAVOR:LAYOUT:MICRO_BATCH")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--timeout", type=int, default=150)
    args = p.parse_args()
    import torch

    res = {"gpus": torch.cuda.device_count(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "seq": args.seq, "global_batch": args.global_batch, "cases": []}
    for case in args.case:
        flavor, layout, mb = case.split(":")
        r = {"model": flavor, "layout": layout, "micro_batch": int(mb), **run_case(flavor, layout, int(mb), args)}
        res["cases"].append(r)
        args.out.write_text(json.dumps(res, indent=2) + "\n")  # after every case: a timeout keeps the rest
        print(json.dumps({k: v for k, v in r.items() if k != "error"} | ({"error": r["error"][-600:]}
                                                                          if "error" in r else {})), flush=True)


if __name__ == "__main__":
    main()
