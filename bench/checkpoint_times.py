"""Checkpoint save/restore times and the data-wait share for a Qwen2 shape on this machine's GPUs.

    python bench/checkpoint_times.py --flavor qwen2-1.5b --out $OUT/checkpoint_times.json

`duoka train` runs on the bundled corpus (seq 2048, micro-batch 4, bf16, FSDP2 over the
visible GPUs): (1) 4 steps with synchronous checkpoints at steps 2 and 4, written by one
thread per rank and then by four; (2) resume from step 4 to step 5 (restore time, then one
more synchronous save); (3) 8 fresh steps with asynchronous checkpoints at 2, 4, 6, 8. A dd
run gives the disk's own write speed for scale. The "blocked" figure is how long the training
loop waited for each save (sync: the whole write; async: the copy to host memory).

Reproduces bench/results/checkpoint_times.md, which docs/training.md (checkpoints),
docs/cluster.md and docs/config.md (`write_threads`) cite; from the repository root:

    # nvidia-h200-x2, one of its GPUs; then nvidia-h200
    CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$PWD python bench/checkpoint_times.py --flavor qwen2-1.5b \
        --out $OUT/checkpoint_times.json
    PYTHONPATH=$PWD python bench/checkpoint_times.py --flavor qwen2-1.5b --phases async --out $OUT/checkpoint_async.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train(run: Path, *extra: str) -> str:
    cmd = [sys.executable, "-m", "duoka.cli", "train", f"--job.output_dir={run}", *BASE, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=400,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return proc.stderr


def blocked(log: str) -> list[float]:
    return [float(x) for x in re.findall(r"training blocked ([\d.]+) s", log)]


def main() -> None:
    global BASE
    p = argparse.ArgumentParser()
    p.add_argument("--flavor", default="qwen2-1.5b")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dir", type=Path, default=Path("/tmp/duoka-ckpt-bench"))
    p.add_argument("--phases", default="sync,async", help="sync (with restore) and/or async")
    a = p.parse_args()
    BASE = [f"--model.flavor={a.flavor}", f"--model.tokenizer={ROOT / 'duoka' / 'assets' / 'tiny-qwen2'}",
            "--training.seq_len=2048", "--training.micro_batch_size=4", "--parallel.dp_mode=fsdp",
            "--checkpoint.interval=2", "--checkpoint.keep=1", "--checkpoint.export_final=false",
            "--metrics.log_interval=1"]
    import torch

    n = torch.cuda.device_count()
    BASE.append(f"--training.global_batch_size={4 * n}")
    shutil.rmtree(a.dir, ignore_errors=True)
    res = {"flavor": a.flavor, "gpus": n, "gpu": torch.cuda.get_device_name()}

    def record(**kv):  # written after every phase, so a timed-out call still returns what it measured
        res.update(kv)
        a.out.write_text(json.dumps(res, indent=2) + "\n")
        print(json.dumps(kv), flush=True)

    phases = a.phases.split(",")
    if "sync" in phases:
        # The disk's own sequential write speed, for scale: 4 GiB through dd with a final fsync.
        a.dir.mkdir(parents=True, exist_ok=True)
        dd = subprocess.run(["dd", "if=/dev/zero", f"of={a.dir / 'dd.bin'}", "bs=64M", "count=64", "conv=fsync"],
                            capture_output=True, text=True)
        (a.dir / "dd.bin").unlink(missing_ok=True)
        record(disk_write=dd.stderr.strip().splitlines()[-1] if dd.stderr else "")
        sync_run = a.dir / "sync"
        for threads in (1, 4):
            shutil.rmtree(sync_run, ignore_errors=True)
            log = train(sync_run, "--training.steps=4", f"--checkpoint.write_threads={threads}")
            record(**{f"sync_save_blocked_s_threads{threads}": blocked(log)})
        ckpt = sync_run / "checkpoints" / "step-4"
        recs = [json.loads(x) for x in (sync_run / "metrics.jsonl").read_text().splitlines()]
        record(checkpoint_gib=round(sum(f.stat().st_size for f in ckpt.glob("*.distcp")) / 2**30, 2),
               data_wait_share=[round(r["data_time_s"] / r["step_time_s"], 4) for r in recs[1:]],
               step_time_s=[round(r["step_time_s"], 3) for r in recs])
        log = train(sync_run, "--training.steps=5", "--checkpoint.resume=auto")
        record(restore_s=float(re.search(r"loaded .* in ([\d.]+) s", log).group(1)))
        shutil.rmtree(sync_run)
    if "async" in phases:
        # Saves at steps 2, 4 and 6 of 8: the last two reuse the pinned buffers of the first.
        run = a.dir / "async"
        log = train(run, "--training.steps=8", "--checkpoint.async_save=true")
        recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        record(async_save_blocked_s=blocked(log), async_step_time_s=[round(r["step_time_s"], 3) for r in recs])
    shutil.rmtree(a.dir, ignore_errors=True)


BASE: list[str] = []

if __name__ == "__main__":
    main()
