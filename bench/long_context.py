"""Long sequences on one GPU without context parallelism (issue 41): Qwen2-7B trained at 8K, 16K
and 32K tokens a sequence, duoka against the transformers peer at the same length where it fits,
then duoka alone past the native 32K positions on a YaRN config (`--longest`).

    PYTHONPATH=$PWD timeout 590 python3 bench/long_context.py --out $OUT/long_context.json \
        --budget 560 [--seq 8192 --seq 16384 --seq 32768] [--longest 65536]   # nvidia-h200
    PYTHONPATH=$PWD .venv/bin/python bench/long_context.py --out /tmp/lc.json --model tiny \
        --seq 256 --seq 512 --steps 3 --warmup 1 --longest 1024               # CPU smoke run

Both sides: micro-batch 1, bf16 compute on fp32 weights (FSDP2 on one GPU: bf16 parameters
gathered, fp32 master and gradients), every decoder layer recomputed in the backward (duoka's
training.activation_checkpointing=full, the peer's --ac: transformers' gradient checkpointing),
random tokens. duoka also computes the output head and loss in chunks (training.fused_loss) and
compiles its blocks (training.compile=auto, on for CUDA); the peer runs eager, as transformers
users train at long context (its per-layer compile under checkpointing is not its measured
configuration, bench/peers/train_peer.py's table). The optimizer is plain SGD on both sides
(bench/moe_vs_peer.py's settings): AdamW's 8 bytes of state a parameter (57 GiB for 7.6B) on top
of fp32 weights and gradients (57 GiB) leave one H200 too little for the peer at any length;
with SGD the sequence length, not the optimizer, decides what fits. The optimizer table
(docs/training.md) gives each optimizer's cost.

`--longest N`: duoka only, at N tokens, on the 7B with Qwen's YaRN rope scaling (factor
N / 32768, over 32,768 original positions) in its config.json: a random folder written once by
transformers on the GPU (bench/serve_models.make_folder), its config edited. It shows the
longest sequence one GPU trains without cp; cp goes past it (docs/training.md, Long context).

Writes --out (JSON, rewritten after each run): device, versions, per length `duoka` and `peer`
with tok_s_gpu, mfu_pct (PaLM's convention: 6 x weights + 12 x layers x hidden x seq FLOPs a
token, over 989 TFLOP/s; both sides count alike), peak_mem_gib (max allocated), step_s, and
`vs_peer`; an out-of-memory run reads as {"error": "out of memory ..."}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_vs_peer import DUOKA_OPTIMIZER
from serve_models import make_folder
from train_vs_peer import FLAVOR, Budget, run_duoka, run_peer

PEER = ROOT / "bench" / "peers" / "train_peer.py"
LONG = ["--training.activation_checkpointing=full", "--training.fused_loss=true"]


def yarn_folder(model: str, root: str, seq: int) -> Path:
    """make_folder's random checkpoint of `model` in a folder of its own whose config.json has
    YaRN rope scaling reaching `seq` positions (factor seq / original, at least 1). The files are
    hard links (no copy of the weights; duoka refuses symbolic links out of a model folder), and
    the original folder, which the serving benches reuse, keeps its config."""
    source = make_folder(model, root)
    folder = source.with_name(f"{source.name}-yarn{seq}")
    folder.mkdir(exist_ok=True)
    for f in source.iterdir():
        if f.name != "config.json" and not (folder / f.name).exists():
            os.link(f, folder / f.name)
    config = json.loads((source / "config.json").read_text())
    original = config["max_position_embeddings"]
    config["rope_scaling"] = {"rope_type": "yarn", "factor": max(1.0, seq / original),
                              "original_max_position_embeddings": original}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def summarise(run: dict) -> dict:
    """An out-of-memory failure (duoka's report or torch's exception) as one line; other results
    unchanged."""
    error = run.get("error", "")
    if "CUDA out of memory" in error or "OutOfMemoryError" in error:
        line = next(x for x in error.splitlines() if "CUDA out of memory" in x or "OutOfMemoryError" in x)
        return {"error": "out of memory: " + line.strip()[:300]}
    return run


def main() -> None:
    p = argparse.ArgumentParser(description="duoka train against the transformers peer at long sequences")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="7b", help="the peer's shape name (bench/peers/qwen2_shapes.py)")
    p.add_argument("--seq", type=int, action="append", default=[], help="lengths of the pair (default 8K, 16K, 32K)")
    p.add_argument("--longest", type=int, action="append", default=[], help="duoka alone at these lengths, YaRN")
    p.add_argument("--no-peer", action="store_true", help="duoka only")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=int, default=240, help="seconds per run")
    p.add_argument("--budget", type=int, default=0, help="seconds for all runs (0: no limit)")
    p.add_argument("--root", default="/tmp/duoka-models", help="where --longest's folder is written")
    a = p.parse_args()
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    result = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__, "model": a.model,
              "micro_batch": 1, "optimizer": "sgd", "timed_steps": a.steps - a.warmup, "lengths": []}

    def save() -> None:
        a.out.write_text(json.dumps(result, indent=2) + "\n")

    budget = Budget(a.timeout, a.budget)

    def guarded(run, args: tuple, extra: list[str]) -> dict:
        return summarise(budget.run(run, args, extra))

    # A shape without a duoka flavor (the peer's CPU-sized `tiny`) reaches duoka as a random folder.
    shape = [] if a.model in FLAVOR else [f"--model.path={make_folder(a.model, a.root)}"]
    duoka_extra = DUOKA_OPTIMIZER["sgd"] + LONG + shape
    for seq in a.seq or [8192, 16384, 32768]:
        row = {"seq": seq, "rope": "native"}
        result["lengths"].append(row)
        steps = (1, seq, a.steps, a.warmup)
        row["duoka"] = guarded(run_duoka, (a.model, "fsdp", *steps, cuda), duoka_extra)
        print("duoka", seq, json.dumps(row["duoka"]), flush=True)
        save()
        if not a.no_peer:
            row["peer"] = guarded(run_peer, (PEER, a.model, "fsdp", *steps, False), ["--optimizer=sgd", "--ac"])
            print("peer", seq, json.dumps(row["peer"]), flush=True)
            if "tok_s_gpu" in row["duoka"] and "tok_s_gpu" in row["peer"]:
                row["vs_peer"] = round(row["duoka"]["tok_s_gpu"] / row["peer"]["tok_s_gpu"], 3)
            save()
    for seq in a.longest:
        folder = yarn_folder(a.model, a.root, seq)
        row = {"seq": seq, "rope": json.loads((folder / "config.json").read_text())["rope_scaling"]}
        result["lengths"].append(row)
        steps = (1, seq, min(a.steps, 3), 1)
        row["duoka"] = guarded(run_duoka, (a.model, "fsdp", *steps, cuda), duoka_extra + [f"--model.path={folder}"])
        print("duoka", seq, json.dumps(row["duoka"]), flush=True)
        save()
    save()


if __name__ == "__main__":
    main()
