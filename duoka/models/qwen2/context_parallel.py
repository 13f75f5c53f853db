"""Context parallelism for training (parallel.cp): each sequence of a batch split over the cp
ranks of a group, attention over every rank's keys and values, all-gathered (Llama 3's
context parallelism, arXiv:2407.21783 section 3.3.2: with grouped-query attention the keys and
values are a fraction of the activations, and any mask, packed documents included, applies to
the gathered rows unchanged).

Causal balance: the sequence is cut into 2 x cp chunks; rank i holds chunk i and chunk
2cp-1-i, so each rank's queries see about the same number of keys (Megatron's layout).

Everything but attention is per token and runs on the local tokens as it would on the whole
sequence; the rotary positions are the tokens' own (given with the batch); the loss is the
local tokens' sum, normalised by the global token count like every layout's. The all-gather
is differentiable: backward reduce-scatters the keys' and values' gradients to their ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_gather_tensor, all_gather_tensor_autograd


def chunk_index(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The positions in the sequence (int64) that `rank` of `cp` holds, in its local order:
    chunk `rank`, then chunk 2cp-1-rank, of 2cp equal chunks."""
    if seq_len % (2 * cp):
        raise ValueError(f"a sequence of {seq_len} tokens does not cut into 2 x {cp} equal chunks")
    size = seq_len // (2 * cp)
    first, second = rank * size, (2 * cp - 1 - rank) * size
    return torch.cat([torch.arange(first, first + size), torch.arange(second, second + size)])


def shard_sequence(batch: dict[str, torch.Tensor], cp: int, rank: int) -> dict[str, torch.Tensor]:
    """This rank's part of a micro-batch: every [batch, seq] tensor cut to its chunks (tokens,
    labels, positions, document ids). cu_seqlens, a whole-sequence layout, is dropped: the
    context mask replaces it."""
    index = chunk_index(batch["tokens"].shape[1], cp, rank)
    return {k: v.index_select(1, index) for k, v in batch.items() if k != "cu_seqlens"}


@dataclass(frozen=True)
class ContextGroup:
    """The cp group a model's forward splits its sequence over (made once per run)."""
    group: dist.ProcessGroup
    size: int
    rank: int


@dataclass(frozen=True)
class ContextMask:
    """What attention needs under context parallelism: the group whose keys and values it
    gathers, and `allowed` [b or 1, 1, Lq, L], which gathered key (in the all-gather's order,
    rank by rank) each local query sees: causal by place in the sequence, within its document."""
    group: ContextGroup
    allowed: torch.Tensor

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Keys or values [b, heads, Lq, d] of every rank, [b, heads, L, d], differentiably."""
        return all_gather_tensor_autograd(t.contiguous(), gather_dim=2, group=self.group.group)


def context_mask(context: ContextGroup, seq_len_local: int, documents: torch.Tensor | None,
                 device: torch.device) -> ContextMask:
    """The mask of this rank's queries; the documents of every rank's tokens are all-gathered
    (one small collective, no gradient)."""
    full = seq_len_local * context.size
    q_index = chunk_index(full, context.size, context.rank).to(device)
    kv_index = torch.cat([chunk_index(full, context.size, r) for r in range(context.size)]).to(device)
    allowed = (kv_index[None, :] <= q_index[:, None])[None]
    if documents is not None:
        kv_documents = all_gather_tensor(documents.contiguous(), gather_dim=1, group=context.group)
        allowed = allowed & (documents[:, :, None] == kv_documents[:, None, :])
    return ContextMask(context, allowed[:, None])
