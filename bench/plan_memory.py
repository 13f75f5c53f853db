"""Measured peak memory of training steps against duoka.plan.memory's estimate.

Each point runs in a fresh process (so no allocator state carries over): the model built
as the trainer builds it (fp32 weights under autocast for a single process or DDP; FSDP2
with bf16 parameters and fp32 reduction, one unit per block plus the root kept gathered),
fused AdamW, the trainer's loss (summed fp32 cross-entropy, logits dropped before backward),
gradient accumulation without sync, `zero_grad(set_to_none=True)`. It reports
torch.cuda.max_memory_allocated() of the third step next to the estimate.

Data-parallel layouts only (tp/pp go through the trainer itself). One GPU:

    PYTHONPATH=$PWD python bench/plan_memory.py --out plan_memory.json \
        --point qwen2-0.5b:single:8:2048:none:1 --point qwen2-1.5b:fsdp:4:2048:full:2

Several GPUs (DDP or FSDP over all of them): one point per run, under
`torchrun --nproc-per-node N bench/plan_memory.py --point ...` (it then runs in the workers
themselves).
A point is FLAVOR:LAYOUT:MICRO_BATCH:SEQ:AC:ACCUMULATION with LAYOUT single, ddp or fsdp
and AC none or full.

Reproduces bench/results/plan_memory.md and .json, which docs/plan.md (memory) cites and
tests/unit/test_planner.py reads; device kinds nvidia-h200 (the one-GPU points) and
nvidia-h200-x2 (the torchrun points); the exact commands are in plan_memory.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def measure(point: str) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from duoka.models.qwen2.args import get_flavor
    from duoka.models.qwen2.model import build_model
    from duoka.plan.memory import GIB, Layout, estimate_memory

    flavor, layout_name, mb, seq, ac, acc = point.split(":")
    mb, seq, acc, ac = int(mb), int(seq), int(acc), ac == "full"
    args = get_flavor(flavor)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    if layout_name != "single":
        for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29531"), ("RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(key, value)
        dist.init_process_group("nccl", device_id=device)
    model = build_model(args)
    if ac:
        for name, block in model.layers.items():
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)
    if layout_name == "fsdp":
        mesh = init_device_mesh("cuda", (world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers.values():
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
        model.to_empty(device=device)
        model.tie_weights()
        model.init_weights()
        layout = Layout("fsdp", 1, world)
        autocast = False
    else:
        model.to_empty(device=device)
        model.tie_weights()
        model.init_weights()
        if layout_name == "ddp":
            model = DistributedDataParallel(model, device_ids=[rank])
        layout = Layout("ddp", world if layout_name == "ddp" else 1)
        autocast = True
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    gen = torch.Generator().manual_seed(0)

    def summed_loss(tokens):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")

    peaks = []
    for step in range(3):
        torch.cuda.reset_peak_memory_stats(device)
        for i in range(acc):
            last = i == acc - 1
            tokens = torch.randint(0, args.vocab_size, (mb, seq + 1), generator=gen).to(device)
            if layout_name == "fsdp":
                model.set_requires_gradient_sync(last)
                (summed_loss(tokens) / (mb * seq)).backward()
            elif layout_name == "ddp" and not last:
                with model.no_sync():
                    (summed_loss(tokens) / (mb * seq)).backward()
            else:
                (summed_loss(tokens) / (mb * seq)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        peaks.append(torch.cuda.max_memory_allocated(device) / GIB)
    est = estimate_memory(args, layout, mb, seq, ac, acc)
    if dist.is_initialized():
        dist.destroy_process_group()
    return {"point": point, "layout": layout.describe(), "world": world, "measured_gib": round(peaks[-1], 2),
            "step_peaks_gib": [round(p, 2) for p in peaks], "estimate_gib": round(est.allocated / GIB, 2),
            "error_pct": round(100 * (est.allocated / GIB / peaks[-1] - 1), 1), "estimate": est.to_dict(),
            "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--point", action="append", required=True)
    p.add_argument("--out", default=None)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # internal: run one point in this process
    a = p.parse_args()
    if a.one or "LOCAL_RANK" in os.environ:
        if len(a.point) != 1:
            p.error("under torchrun give one --point per run")
        result = measure(a.point[0])
        if int(os.environ.get("RANK", "0")) == 0:
            print("RESULT " + json.dumps(result), flush=True)
        return
    results = []
    for point in a.point:
        t = time.perf_counter()
        # A fresh process per point: no allocator or NCCL state carries over.
        proc = subprocess.run([sys.executable, __file__, "--one", "--point", point], capture_output=True, text=True,
                              env=os.environ.copy(), check=False)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not lines:
            tail = (proc.stderr or proc.stdout)[-1500:]
            oom = "OutOfMemoryError" in tail
            result = {"point": point, "error": "out of memory" if oom else tail}
        else:
            result = json.loads(lines[-1][7:])
        result["wall_s"] = round(time.perf_counter() - t, 1)
        print(json.dumps({k: v for k, v in result.items() if k != "estimate"}), flush=True)
        results.append(result)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
