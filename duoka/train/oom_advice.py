"""What a worker says when the GPU runs out of memory: the cause with its numbers, and only the
remedies the run has not taken yet. A fix that names a setting already in force (a 7B at 98,304
tokens, micro-batch 1, recomputation on, told to turn recomputation on) sends the user round in
a circle; past those levers what is left is the sequence itself, which context parallelism
splits."""

from __future__ import annotations

import re

from duoka.config import Config

# torch's message: "CUDA out of memory. Tried to allocate 18.56 GiB. GPU 0 has a total capacity ..."
_WANTED = re.compile(r"Tried to allocate ([\d.]+ [KMGT]?i?B)")


def oom_cause(cfg: Config, rank: int, error: BaseException) -> str:
    """The first clause is what `duoka doctor` reads (doctor/rank_failures.py): keep its form."""
    t = cfg.training
    cause = f"CUDA out of memory on rank {rank} (micro-batch {t.micro_batch_size}, seq_len {t.seq_len})"
    wanted = _WANTED.search(str(error))
    return cause + (f": it tried to allocate {wanted.group(1)} more" if wanted else "")


def oom_fix(cfg: Config, world: int) -> str:
    """The remedies not in force yet, cheapest to the step's speed first, then `duoka plan`."""
    t, p, o = cfg.training, cfg.parallel, cfg.optimizer
    steps = []
    if t.micro_batch_size == "auto" or t.micro_batch_size > 1:
        steps.append("lower training.micro_batch_size (gradient accumulation keeps the global batch)")
    if t.activation_checkpointing == "none":
        steps.append("set training.activation_checkpointing=full")
    if not t.fused_loss and p.tp == 1 and p.pp == 1:
        steps.append("set training.fused_loss=true (no whole logits tensor)")
    if p.dp_mode != "fsdp" and world > 1:
        steps.append("shard weights, gradients and optimizer state with parallel.dp_mode=fsdp")
    if o.name == "adamw" and o.offload == "none":
        steps.append("keep less optimizer state: optimizer.name=adamw8bit, or optimizer.offload=cpu on one GPU")
    if t.micro_batch_size == 1 and t.activation_checkpointing == "full":
        more = f"raise parallel.cp above {p.cp}" if p.cp > 1 else "split it over GPUs with parallel.cp=2 or more"
        steps.append(f"one sequence of {t.seq_len} tokens is what does not fit: {more} (parallel.dp_mode=fsdp), "
                     "or lower training.seq_len")
    model = cfg.model.path or cfg.model.flavor
    steps.append(f"`duoka plan --model {model} --seq {t.seq_len} --gpus N --gpu-memory GB` estimates what fits")
    return "; ".join(steps)
