"""Qwen1.5-MoE-A2.7B training, duoka against the transformers peer in the same call (issue 40):
tokens/s per GPU, MFU on the active parameters and peak memory of `duoka train
--model.flavor=qwen2-moe-a2.7b` and of bench/peers/train_peer.py (transformers'
Qwen2MoeForCausalLM, its router's load-balancing loss on as duoka's flavor has it), one process
per GPU, random tokens at seq 2048, bf16, FSDP2 on both sides.

    PYTHONPATH=$PWD timeout 570 python3 bench/moe_vs_peer.py --out $OUT/moe_train.json --budget 540 \
        --compile-case moe-a2.7b:fsdp:4 --peer-eager                      # nvidia-h200
    PYTHONPATH=$PWD timeout 570 python3 bench/moe_vs_peer.py --out $OUT/moe_train_h100.json --budget 540 \
        --layers 12 --compile-case moe-a2.7b:fsdp:4 --peer-eager          # nvidia-h100-x1
    PYTHONPATH=$PWD .venv/bin/python bench/moe_vs_peer.py --out /tmp/moe_train_tiny.json \
        --case moe-tiny:fsdp:2 --seq 64 --steps 4 --warmup 2 [--layers 2]  # CPU smoke run

Nothing to carry (plain SGD needs no torchao; `--optimizer adamw` neither).

Why SGD. Qwen1.5-MoE-A2.7B has 14.3B parameters (2.4B active per token): fp32 weights and
gradients alone are 8 bytes each, 107 GiB, and AdamW's two moments 107 GiB more, which no single
GPU holds (`duoka plan --model qwen2-moe-a2.7b --gpus 1` says so too; AdamW with its state on
the host needs 213 GiB of host memory, more than the GPU machines have). So both sides train
with plain SGD (no momentum, no weight decay: torch's foreach SGD in place, no state and no
transient copy; a weight decay would copy every gradient, 53 GiB), which leaves the forward
and backward, what the 2x is about, unchanged. `--optimizer adamw` for a cut model.

Memory per GPU (estimate_gib, printed and written with the results; the step's peak is the
larger of the forward's end, weights + saved activations + logits, and the backward's end,
weights + gradients + FSDP2's buffers): the whole model at micro-batch 4 about 100 and 112 GiB,
for the H200's 141 GB (micro-batch 8 would need ~146 GiB at the forward's end); an 80 GB H100
cannot hold even its weights and gradients, so `--layers 12` trains the first 12 of the 24
layers of the same shape (7.5B parameters): about 57 and 61 GiB at micro-batch 4. A cut model
reaches duoka as a random folder of that shape (bench/serve_models.make_folder, written by
transformers on the GPU, --model.path) and the peer as `--layers`.

Cases: `--case MODEL:LAYOUT:MICRO_BATCH` both eager, `--compile-case` both compiled (duoka's
training.compile, the peer's per-layer `layer.compile()`); `--peer-eager` adds the peer eager
to each compiled case (as most users run transformers). Each run gets at most --timeout s,
and none starts with less than a minute of --budget left. Steps: --steps per run, the first
--warmup untimed (they compile). duoka's figure is its metrics.jsonl over the timed steps
(bench/train_vs_peer.py's run_duoka), the peer's its RESULT line; both count FLOPs the
same way (6 x the active matmul weights + 12 x layers x hidden x seq per token, PaLM's
convention, 989 TFLOP/s peak): `flops_per_token` in the JSON holds both, which must agree.

Writes --out (JSON, rewritten after each run): the device, versions, shape, optimizer,
memory estimate, flops_per_token, and per case `duoka`, `peer` (and `peer_eager`) with
tok_s_gpu, mfu_pct, peak_mem_gib, step_s, final_loss (the peer's aux_loss and experts
implementation, duoka's expert_max_imbalance), wall_s, and `vs_peer` = duoka / peer tok/s.
Target (issue 40): vs_peer >= 2 on one H200 with the whole model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_models import make_folder  # noqa: E402  (also puts bench/peers on sys.path)
from train_vs_peer import FLAVOR, Budget, gpu_count, run_duoka, run_peer  # noqa: E402

import qwen2_shapes  # noqa: E402

PEER = ROOT / "bench" / "peers" / "train_peer.py"
# Optimizer state per parameter (fp32 moments); weights and gradients are fp32 on both sides
# (FSDP2's sharded parameters and reduced gradients): 8 bytes per parameter more.
STATE_BYTES = {"sgd": 0, "adamw": 8}
WEIGHT_GRAD_BYTES = 8
# The step's settings duoka takes for each optimizer, to match the peer's (lr 1e-4, no momentum,
# no weight decay for SGD; AdamW's defaults otherwise).
DUOKA_OPTIMIZER = {"sgd": ["--optimizer.name=sgd", "--optimizer.sgd_momentum=0", "--optimizer.nesterov=false",
                           "--optimizer.weight_decay=0", "--optimizer.lr=1e-4"],
                   "adamw": ["--optimizer.name=adamw", "--optimizer.lr=1e-4"]}
# Logits per token and vocabulary entry: the bf16 logits, their fp32 copy for the loss and its
# gradient (training.fused_loss's help: ~1.5 MB a token at Qwen2's 152k vocabulary without it).
LOGIT_BYTES_PER_VOCAB = 2 + 4 + 4


def activation_bytes_per_token_layer(c: dict) -> int:
    """What one layer saves per token for its backward, counted from the ops' saved inputs, bf16
    but for the router's fp32 probabilities: the attention with its two norms ~12 hidden-wide
    tensors; a MoE layer's router logits and probabilities, its k dispatched rows, their expert
    outputs and weighted outputs, the experts' gate, up, SwiGLU and product, the shared expert's
    four of them. About 189 KB for Qwen1.5-MoE-A2.7B."""
    h = c["hidden_size"]
    attention = 2 * 10 * h + 2 * 2 * h
    if not qwen2_shapes.is_moe(c):
        return attention + 2 * 4 * c["intermediate_size"]
    k, e = c["num_experts_per_tok"], c["num_experts"]
    return attention + 6 * e + 2 * 3 * k * h + 2 * 4 * k * c["moe_intermediate_size"] \
        + 2 * 4 * c["shared_expert_intermediate_size"]


def estimate_gib(c: dict, mbs: int, seq: int, optimizer: str, shards: int = 1) -> dict:
    """The step's memory per GPU under FSDP2 over `shards` GPUs (one: the whole model), GiB: the
    larger of the forward's end (weights, state, saved activations, logits) and the backward's
    end (weights, gradients, state, FSDP2's buffers) is the peak."""
    p = qwen2_shapes.num_params(c)
    layers = c["num_hidden_layers"]
    tokens = mbs * seq
    state = STATE_BYTES[optimizer] * p / shards
    embeddings = c["hidden_size"] * c["vocab_size"] * (1 if c["tie_word_embeddings"] else 2)
    layer_params = (p - embeddings) / layers
    # FSDP2 holds two layers' bf16 parameters gathered, and a layer's bf16 gradients with their fp32
    # reduction copy while it reduces: (2 x 2 + 2 + 4) bytes per parameter of a layer.
    buffers = 10 * layer_params
    saved = tokens * (layers * activation_bytes_per_token_layer(c) + LOGIT_BYTES_PER_VOCAB * c["vocab_size"])
    forward_end = 4 * p / shards + state + saved
    backward_end = WEIGHT_GRAD_BYTES * p / shards + state + buffers
    gib = 2**30
    return {"params": p, "weights_grads_state_gib": round((WEIGHT_GRAD_BYTES * p / shards + state) / gib, 1),
            "forward_end_gib": round(forward_end / gib, 1), "backward_end_gib": round(backward_end / gib, 1)}


def duoka_flops(model: str, folder: Path | None, seq: int) -> float:
    from duoka.models.qwen2.args import get_flavor
    from duoka.models.qwen2.hf_adapter import read_config

    args = read_config(folder) if folder else get_flavor(FLAVOR[model])
    return args.flops_per_token(seq)


def main() -> None:
    p = argparse.ArgumentParser(description="duoka train against the transformers peer on Qwen2-MoE shapes")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--case", action="append", default=[], help="MODEL:LAYOUT:MICRO_BATCH, both eager")
    p.add_argument("--compile-case", action="append", default=[], help="the same, both compiled")
    p.add_argument("--peer-eager", action="store_true", help="compiled cases: the peer eager too")
    p.add_argument("--layers", type=int, default=0, help="decoder layers (0: the shape's own)")
    p.add_argument("--optimizer", default="sgd", choices=sorted(STATE_BYTES))
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--timeout", type=int, default=240, help="seconds per run")
    p.add_argument("--budget", type=int, default=0, help="seconds for all runs (0: no limit)")
    p.add_argument("--root", default="/tmp/duoka-models", help="where a cut model's folder is written")
    a = p.parse_args()
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    result = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name() if cuda else "cpu",
              "gpus": gpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
              "seq": a.seq, "optimizer": a.optimizer, "timed_steps": a.steps - a.warmup, "cases": []}
    total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None

    def save() -> None:
        a.out.write_text(json.dumps(result, indent=2) + "\n")

    budget = Budget(a.timeout, a.budget)

    cases = [(c, False) for c in a.case] + [(c, True) for c in a.compile_case]
    for case, compile in cases:
        model, layout, mbs = case.split(":")
        mbs = int(mbs)
        c = qwen2_shapes.shape(model, a.layers)
        estimate = estimate_gib(c, mbs, a.seq, a.optimizer, gpu_count())
        row = {"model": model, "layers": c["num_hidden_layers"], "layout": layout, "micro_batch": mbs,
               "compile": compile, "memory_estimate": estimate}
        result["cases"].append(row)
        print(json.dumps(row), flush=True)
        if total_gib and estimate["weights_grads_state_gib"] > total_gib:
            row["error"] = (f"skipped: weights, gradients and {a.optimizer} state alone are "
                            f"{estimate['weights_grads_state_gib']} GiB, more than this GPU's {total_gib:.0f}: "
                            "cut the model with --layers (12 fits 80 GB with sgd)")
            save()
            continue
        folder = make_folder(model, a.root, layers=a.layers, train=True) if a.layers else None
        duoka_extra = DUOKA_OPTIMIZER[a.optimizer] + ([f"--model.path={folder}"] if folder else [])
        peer_extra = [f"--optimizer={a.optimizer}"] + ([f"--layers={a.layers}"] if a.layers else [])
        result["flops_per_token"] = {"duoka": duoka_flops(model, folder, a.seq),
                                     "peer": qwen2_shapes.flops_per_token(c, a.seq)}
        steps = (mbs, a.seq, a.steps, a.warmup)
        runs = [("duoka", run_duoka, (model, layout, *steps, compile), duoka_extra),
                ("peer", run_peer, (PEER, model, layout, *steps, compile), peer_extra)]
        if compile and a.peer_eager:
            runs.append(("peer_eager", run_peer, (PEER, model, layout, *steps, False), peer_extra))
        for side, run, args, extra in runs:
            row[side] = budget.run(run, args, extra)
            print(side, json.dumps(row[side]), flush=True)
            save()
        for side in ("peer", "peer_eager"):
            if "tok_s_gpu" in row["duoka"] and "tok_s_gpu" in row.get(side, {}):
                row["vs_" + side] = round(row["duoka"]["tok_s_gpu"] / row[side]["tok_s_gpu"], 3)
        save()
    print(json.dumps({k: v for k, v in result.items() if k != "cases"}), flush=True)
    print(f"{'case':<32}{'duoka tok/s/GPU':>16}{'MFU':>7}{'GiB':>7}{'peer tok/s/GPU':>16}{'MFU':>7}{'GiB':>7}"
          f"{'ratio':>7}")
    for r in result["cases"]:
        d, q = r.get("duoka", {}), r.get("peer", {})
        name = f"{r['model']} L{r['layers']} {r['layout']} mb{r['micro_batch']}{' compile' if r['compile'] else ''}"
        print(f"{name:<32}{d.get('tok_s_gpu', 'err'):>16}{d.get('mfu_pct') or '-':>7}{d.get('peak_mem_gib', '-'):>7}"
              f"{q.get('tok_s_gpu', 'err'):>16}{q.get('mfu_pct') or '-':>7}{q.get('peak_mem_gib', '-'):>7}"
              f"{r.get('vs_peer', '-'):>7}")


if __name__ == "__main__":
    main()
