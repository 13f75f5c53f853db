"""Context parallelism for training (parallel.cp): each sequence of a batch split over the cp
ranks of a group, attention computed over the whole sequence by one of two methods
(parallel.cp_method):

- allgather: attention over every rank's keys and values, all-gathered (Llama 3's context
  parallelism, arXiv:2407.21783 section 3.3.2: with grouped-query attention the keys and values
  are a fraction of the activations, and any mask, packed documents included, applies to the
  gathered rows unchanged). The mask is dense: [local queries, every key].
- ulysses: an all-to-all turns this rank's tokens of every head into every token of cp-th of
  the heads (DeepSpeed-Ulysses, arXiv:2309.14509); attention runs as in one process over the
  whole sequence, put back in its own order (plain causal kernels, varlen or flex for packed
  documents: no dense mask on CUDA), and a second all-to-all returns this rank's tokens. The
  query heads must divide by cp; where the KV heads do not, each is repeated up to a multiple
  of cp before the exchange (repeats whole groups, so every query head still meets its own
  key head). Per rank it moves seq/cp tokens of q, k, v and the output, which stays the same
  as the sequence and cp grow together, where the all-gather receives the whole sequence's keys.

Causal balance: the sequence is cut into 2 x cp chunks; rank i holds chunk i and chunk
2cp-1-i, so each rank's queries see about the same number of keys (Megatron's layout).

Everything but attention is per token and runs on the local tokens as it would on the whole
sequence; the rotary positions are the tokens' own (given with the batch, applied before any
exchange); the loss is the local tokens' sum, normalised by the global token count like every
layout's. Both exchanges are differentiable: the all-gather's backward reduce-scatters the
keys' and values' gradients, an all-to-all's backward is the opposite all-to-all.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

try:  # torch >= 2.12 names them *_single; 2.11's *_tensor are the same collectives
    from torch.distributed._functional_collectives import all_gather_single, all_gather_single_autograd
except ImportError:
    from torch.distributed._functional_collectives import all_gather_tensor as all_gather_single
    from torch.distributed._functional_collectives import all_gather_tensor_autograd as all_gather_single_autograd

from duoka.errors import DuokaError

CONTEXT_METHODS = ("allgather", "ulysses")


def ulysses_fits(n_heads: int, cp: int) -> bool:
    """Whether Ulysses can split this model's query heads over cp ranks (whole heads each)."""
    return n_heads % cp == 0


def resolve_context_method(method: str, cp: int, n_heads: int) -> str:
    """parallel.cp_method for a model of n_heads query heads: auto is ulysses where the heads
    divide by cp (no dense mask, the ordinary attention kernels, traffic per rank that stays
    the same as the sequence and cp grow together), else allgather. ulysses where they do not
    divide is refused, naming the fix."""
    if method == "auto":
        return "ulysses" if ulysses_fits(n_heads, cp) else "allgather"
    if method not in CONTEXT_METHODS:
        raise DuokaError(f"parallel.cp_method={method!r} is not a context-parallel method",
                         f"choose one of: auto, {', '.join(CONTEXT_METHODS)}")
    if method == "ulysses" and not ulysses_fits(n_heads, cp):
        divisors = [d for d in range(2, n_heads + 1) if n_heads % d == 0]
        raise DuokaError(f"parallel.cp_method=ulysses splits the model's {n_heads} attention heads over the "
                         f"parallel.cp={cp} ranks, but {cp} does not divide {n_heads}",
                         f"use parallel.cp_method=allgather (auto picks it here), or a parallel.cp dividing "
                         f"{n_heads}: {', '.join(map(str, divisors))}")
    return method


def ulysses_kv_repeat(n_kv_heads: int, cp: int) -> int:
    """How many copies of each KV head Ulysses sends: enough that the KV heads divide by cp
    (lcm(kv heads, cp) in all, which divides the query heads as both its factors do; 1 where
    they already divide). Repeating each head in place keeps GQA's grouping: a rank's query
    heads are one block, whose KV heads are the block's share."""
    return cp // math.gcd(n_kv_heads, cp)


def chunk_index(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The positions in the sequence (int64) that `rank` of `cp` holds, in its local order:
    chunk `rank`, then chunk 2cp-1-rank, of 2cp equal chunks."""
    if seq_len % (2 * cp):
        raise ValueError(f"a sequence of {seq_len} tokens does not cut into 2 x {cp} equal chunks")
    size = seq_len // (2 * cp)
    first, second = rank * size, (2 * cp - 1 - rank) * size
    return torch.cat([torch.arange(first, first + size), torch.arange(second, second + size)])


@dataclass(frozen=True)
class ContextGroup:
    """The cp group a model's forward splits its sequence over (made once per run), and how
    its attention spans the sequence: method, one of CONTEXT_METHODS (resolved, never auto)."""
    group: dist.ProcessGroup
    size: int
    rank: int
    method: str = "allgather"


def shard_sequence(batch: dict[str, torch.Tensor], context: ContextGroup) -> dict[str, torch.Tensor]:
    """This rank's part of a micro-batch: every [batch, seq] tensor cut to its chunks (tokens,
    labels, positions, document ids). cu_seqlens, a whole-sequence layout, stays for Ulysses,
    whose attention runs over the whole sequence in its order; the all-gather drops it (its
    dense mask replaces it)."""
    index = chunk_index(batch["tokens"].shape[1], context.size, context.rank)
    out = {k: v.index_select(1, index) for k, v in batch.items() if k != "cu_seqlens"}
    if context.method == "ulysses" and "cu_seqlens" in batch:
        out["cu_seqlens"] = batch["cu_seqlens"]
    return out


@dataclass(frozen=True)
class ContextMask:
    """What attention needs under the all-gather: the group whose keys and values it
    gathers, and `allowed` [b or 1, 1, Lq, L], which gathered key (in the all-gather's order,
    rank by rank) each local query sees: causal by place in the sequence, within its document."""
    group: ContextGroup
    allowed: torch.Tensor

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Keys or values [b, heads, Lq, d] of every rank, [b, heads, L, d], differentiably."""
        return all_gather_single_autograd(t.contiguous(), gather_dim=2, group=self.group.group)


def _rank_order(context: ContextGroup, seq_len_local: int, device: torch.device) -> torch.Tensor:
    """[L]: the sequence position of each place of a gather over the group (rank 0's local
    tokens, then rank 1's, ...)."""
    full = seq_len_local * context.size
    return torch.cat([chunk_index(full, context.size, r) for r in range(context.size)]).to(device)


def context_mask(context: ContextGroup, seq_len_local: int, documents: torch.Tensor | None,
                 device: torch.device) -> ContextMask:
    """The mask of this rank's queries; the documents of every rank's tokens are all-gathered
    (one small collective, no gradient)."""
    full = seq_len_local * context.size
    q_index = chunk_index(full, context.size, context.rank).to(device)
    kv_index = _rank_order(context, seq_len_local, device)
    allowed = (kv_index[None, :] <= q_index[:, None])[None]
    if documents is not None:
        kv_documents = all_gather_single(documents.contiguous(), gather_dim=1, group=context.group)
        allowed = allowed & (documents[:, :, None] == kv_documents[:, None, :])
    return ContextMask(context, allowed[:, None])


@dataclass(frozen=True)
class UlyssesMask:
    """What attention needs under Ulysses: the group; `inner`, the whole sequence's mask in its
    own order, as one process builds it (None: causal; a dense mask, a BlockMask or a Varlen
    for packed documents); `to_sequence` [L], the gathered place of each sequence position, and
    `to_ranks` [L], the sequence position of each gathered place (inverse permutations)."""
    group: ContextGroup
    inner: object
    to_sequence: torch.Tensor
    to_ranks: torch.Tensor

    def heads_to_sequence(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [b, heads, L/cp, d] of this rank's tokens -> [b, heads/cp, L, d]: every token,
        in sequence order, of this rank's block of heads (head group = rank). One all-to-all
        carries the three; k and v are first repeated where their heads do not divide by cp."""
        cp = self.group.size
        repeat = ulysses_kv_repeat(k.shape[1], cp)
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        # Per tensor [cp (destination = head group), b, heads/cp, L/cp, d]; q, k and v of one
        # destination side by side, so dim 0 splits the buffer into the cp equal messages.
        parts = [t.unflatten(1, (cp, -1)).movedim(1, 0) for t in (q, k, v)]
        got = all_to_all_single_autograd(torch.cat(parts, dim=2), None, None, self.group.group)
        # got [cp (source rank), b, heads/cp, L/cp, d]: the source ranks' tokens in their order.
        got = got.movedim(0, 2).flatten(2, 3).index_select(2, self.to_sequence)
        q, k, v = got.split([p.shape[2] for p in parts], dim=1)
        return q, k, v

    def sequence_to_heads(self, out: torch.Tensor) -> torch.Tensor:
        """Attention's output [b, heads/cp, L, d] (sequence order) -> this rank's tokens with
        every head, [b, L/cp, heads x d] (head-major, as one process's), by the opposite all-to-all."""
        cp = self.group.size
        out = out.index_select(2, self.to_ranks)  # rank 0's tokens, rank 1's, ...
        send = out.unflatten(2, (cp, -1)).movedim(2, 0).contiguous()  # [cp (destination), b, h/cp, L/cp, d]
        got = all_to_all_single_autograd(send, None, None, self.group.group)  # [cp (head group), ...]
        return got.permute(1, 3, 0, 2, 4).flatten(2)


def ulysses_mask(context: ContextGroup, seq_len_local: int, documents: torch.Tensor | None,
                 document_mask: Callable[[torch.Tensor], object], device: torch.device) -> UlyssesMask:
    """The Ulysses attention of one forward: with packed documents, every rank's document ids
    all-gathered (one small collective, no gradient), put in sequence order and made into the
    whole sequence's mask by `document_mask` (the model's kernel choice)."""
    to_ranks = _rank_order(context, seq_len_local, device)
    to_sequence = torch.argsort(to_ranks)
    inner = None
    if documents is not None:
        gathered = all_gather_single(documents.contiguous(), gather_dim=1, group=context.group)
        inner = document_mask(gathered.index_select(1, to_sequence))
    return UlyssesMask(context, inner, to_sequence, to_ranks)
