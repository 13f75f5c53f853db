"""Per-GPU memory estimate for training, used by `training.micro_batch_size = auto`.

A first estimate from the shapes (the planner issue refines it against measured peaks):
- weights, gradients and AdamW moments in fp32 (16 bytes per parameter), divided by the
  number of shards under FSDP;
- FSDP's gathered bf16 copy of the largest block (two, for prefetch);
- activations kept for backward, per token and layer, counted from the saved tensors of
  this model with SDPA flash attention: norms' inputs and fp32 statistics, q/k/v/out,
  the MLP's gate/up/product (~ 12·h + 4·kv + 5·I elements at 2 bytes), or only the block
  input under full activation checkpointing;
- logits in bf16 plus the fp32 copy and its gradient for cross-entropy (10 bytes per vocab
  entry per token).
"""

from __future__ import annotations

from duoka.models.qwen2.args import ModelArgs


def training_bytes(args: ModelArgs, micro_batch: int, seq_len: int, dp_shard: int, activation_checkpointing: bool,
                   bf16: bool = True) -> int:
    params = args.num_params()
    state = 16 * params / dp_shard
    if dp_shard > 1:
        block = params / max(1, args.n_layers)
        state += 2 * 2 * block
    tokens = micro_batch * seq_len
    elem = 2 if bf16 else 4
    kv = args.n_kv_heads * args.resolved_head_dim
    per_layer = (12 * args.dim + 4 * kv + 5 * args.intermediate_size) * elem
    if activation_checkpointing:
        per_layer = args.dim * elem
        recompute = (12 * args.dim + 4 * kv + 5 * args.intermediate_size) * elem  # one block live in backward
    else:
        recompute = 0
    activations = tokens * (args.n_layers * per_layer + recompute)
    logits = tokens * args.vocab_size * (10 if bf16 else 12)
    return int(state + activations + logits)


def largest_fitting_micro_batch(args: ModelArgs, per_rank: int, seq_len: int, dp_shard: int,
                                activation_checkpointing: bool, free_bytes: int, headroom: float = 0.85) -> int:
    """The largest divisor of the per-rank batch whose estimate fits in headroom x free memory."""
    best = 1
    for mb in range(1, per_rank + 1):
        if per_rank % mb == 0 and training_bytes(args, mb, seq_len, dp_shard, activation_checkpointing) <= headroom * free_bytes:
            best = mb
    return best
