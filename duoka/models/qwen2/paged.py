"""Attention over a paged KV cache: the serving engine's one model step.

The engine keeps every layer's keys and values in fixed-size blocks, [num_blocks,
block_size, kv_heads, head_dim], and gives each sequence a block table (its blocks in
order). One step runs the new tokens of all scheduled sequences as a single row of T
tokens: prefill chunks and one-token decodes side by side. Each new token's K/V is
written to its slot (block * block_size + offset), then each sequence's queries attend to
its whole context through its block table.

Three ways to run it, chosen by the runner for its device (PagedBatch.backend):
  reference: each sequence's blocks gathered into a padded dense tensor, SDPA under an
      explicit mask. Any device, any dtype; what the fast paths are checked against.
  cuda: the step's decodes (laid out first) through a Triton kernel that reads the blocks
      in place (duoka.models.paged_decode); its prefill chunks through flash attention
      (varlen) over their gathered contexts, whose cost is small beside the chunk's matmuls.
  mixed: every row, decodes and chunks alike, through one Triton kernel that reads the
      blocks in place and takes every size from device tensors (duoka.models.paged_mixed):
      what the runner's CUDA graphs of mixed steps replay.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from duoka.models import paged_decode, paged_mixed


BACKENDS = ("reference", "cuda", "mixed")  # the module docstring's three ways; PagedBatch.sizes holds the index
NO_PREFILL = 2  # the length of a step's prefill_index when it has no prefill chunks (see PagedBatch)


@dataclass
class PagedBatch:
    """One engine step's metadata, on the model's device. Sequence b's new tokens are rows
    query_start[b]:query_start[b+1] of the T tokens; they are the last tokens of its
    context of context_lens[b] tokens, whose K/V live in the blocks block_tables[b]."""
    k_caches: list[torch.Tensor]  # per layer [num_blocks, block_size, kv_heads, head_dim] (one: for_layer)
    v_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor  # int64 [T]
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    context_lens: torch.Tensor  # int32 [B]
    query_start: torch.Tensor  # int32 [B + 1]
    max_query_len: int
    logits_indices: torch.Tensor  # int64 [S]: the rows whose next-token logits are wanted
    backend: str = "reference"  # or "cuda" or "mixed" (see the module's docstring)
    # For the cuda backend: the first num_decodes sequences are one-token decodes, their
    # contexts cut into decode_splits parts; the rest are prefill chunks whose contexts
    # hold prefill_context tokens in all, the longest max_context_len.
    num_decodes: int = 0
    decode_splits: int = 1
    prefill_context: int = 0
    max_context_len: int = 0
    # The sizes above and the backend (its index in BACKENDS) as one host tensor, the form in
    # which they enter the attention operator: a compiled graph that read the integers or the
    # string would specialise on their values, one more compiled variant of every block for
    # each (torch's recompile limit is a hard error under fullgraph). Made once per step
    # (for_layer's copies share it).
    sizes: torch.Tensor | None = None
    # int64 [P]: rows whose final hidden states (after the norm) the forward returns beside the
    # logits, for a head run slice by slice outside it (prompt logprobs: a long prefill chunk
    # would otherwise materialise P x vocab). None: logits only.
    hidden_indices: torch.Tensor | None = None
    # For the cuda backend's prefill chunks: prefill_gather_index's int32 offsets and slots, the
    # same for every layer, so made once a step (for_layer's copies share it), not by each layer.
    # A step without chunks passes NO_PREFILL's two zeros, never None: a tensor or None would
    # be two compiled variants of every block (and a length of 0 or 1 a specialised one).
    prefill_index: torch.Tensor | None = None

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"PagedBatch backend {self.backend!r}: one of {', '.join(BACKENDS)}")
        if self.sizes is not None:  # for_layer's copy of a step's batch
            return
        self.sizes = torch.tensor([self.max_query_len, self.num_decodes, self.decode_splits, self.prefill_context,
                                   self.max_context_len, BACKENDS.index(self.backend)])
        if self.prefill_index is None:
            chunks = self.backend == "cuda" and self.num_decodes < len(self.context_lens)
            self.prefill_index = prefill_gather_index(
                self.block_tables, self.context_lens, self.query_start, self.num_decodes, self.prefill_context,
                self.block_size) if chunks else self.block_tables.new_zeros(NO_PREFILL)
        # Their sizes only reach the opaque operator: unbacked, a compiled block neither
        # specialises on a size of 0 or 1 nor ties one to an equal size elsewhere (duck sizing: a
        # block table 128 wide would otherwise pin the head dimension's 128 to it). Without
        # torch._dynamo imported nothing compiled runs (torch.compile imports it), and importing
        # it would cost a process that never compiles a second.
        if "torch._dynamo" in sys.modules:
            for t in (self.slot_mapping, self.block_tables, self.context_lens, self.query_start, self.prefill_index):
                torch._dynamo.decorators.mark_unbacked(t, list(range(t.dim())))

    @property
    def block_size(self) -> int:
        return self.k_caches[0].shape[1]

    def for_layer(self, layer: int) -> PagedBatch:
        """The step as one layer sees it: its own caches only. A compiled decoder block then
        indexes no list by its layer number, so every layer shares one compiled graph."""
        return dataclasses.replace(self, k_caches=[self.k_caches[layer]], v_caches=[self.v_caches[layer]])


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, kv_heads, head_dim] into their slots of the layer's cache (the reference
    backend's; the GPU's is paged_decode.write_kv, one kernel for both)."""
    kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        batch: PagedBatch) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads, head_dim], causal within each sequence's context.

    Every sequence's queries are padded to max_query_len and its keys to the block table's
    width; padded key slots are masked out, padded query rows see key 0 only (so no row is
    all -inf) and are dropped."""
    n_tokens, n_heads, head_dim = q.shape
    n_seqs, max_blocks = batch.block_tables.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    q_lens = batch.query_start[1:] - batch.query_start[:-1]
    seq_of = torch.repeat_interleave(torch.arange(n_seqs, device=q.device), q_lens, output_size=n_tokens)
    row_in_seq = torch.arange(n_tokens, device=q.device) - batch.query_start[seq_of]
    max_q = batch.max_query_len

    q_pad = q.new_zeros(n_seqs, max_q, n_heads, head_dim)
    q_pad[seq_of, row_in_seq] = q
    width = max_blocks * block_size
    keys = k_cache[batch.block_tables.long()].reshape(n_seqs, width, kv_heads, head_dim)
    values = v_cache[batch.block_tables.long()].reshape(n_seqs, width, kv_heads, head_dim)

    # Query i of sequence b sits at context position context_len - q_len + i.
    query_pos = (batch.context_lens - q_lens)[:, None] + torch.arange(max_q, device=q.device)[None, :]
    key_pos = torch.arange(width, device=q.device)
    mask = key_pos[None, None, :] <= query_pos[:, :, None]
    mask |= key_pos[None, None, :] == 0  # padded rows (query_pos beyond the context) stay finite
    mask &= key_pos[None, None, :] < batch.context_lens[:, None, None]
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=mask[:, None], enable_gqa=n_heads != kv_heads,
    )
    return out.transpose(1, 2)[seq_of, row_in_seq]


@functools.cache
def _varlen():
    # Imported on first use: the module imports torch._dynamo, a second of start-up for
    # every process that never runs varlen (CPU training and serving).
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn, inspect.signature(varlen_attn).parameters


def causal_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                  max_q: int, max_k: int) -> torch.Tensor:
    """Flash attention over concatenated sequences, q [Tq, heads, d], k/v [Tk, kv_heads, d];
    causal with the queries aligned to the end of their keys (a chunk after its context).
    PyTorch's varlen API changed between releases: causal was `is_causal`, now a window."""
    varlen_attn, params = _varlen()
    kwargs = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if k.shape[1] != q.shape[1] and "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


def prefill_gather_index(block_tables: torch.Tensor, context_lens: torch.Tensor, query_start: torch.Tensor,
                         num_decodes: int, prefill_context: int, block_size: int) -> torch.Tensor:
    """For the P prefill chunks (the sequences after the decodes), one int32 tensor of
    [P + 1 query offsets | P + 1 context offsets | each context token's cache slot], in
    gathered_prefill's order: every sequence's whole context, position by position."""
    first = num_decodes
    tables, context = block_tables[first:], context_lens[first:]
    cu_q = query_start[first:] - query_start[first]
    cu_k = F.pad(context.cumsum(0, dtype=torch.int32), (1, 0))
    seq = torch.repeat_interleave(torch.arange(len(context), device=context.device), context.long(),
                                  output_size=prefill_context)
    pos = torch.arange(prefill_context, device=context.device) - cu_k[seq]
    slots = tables[seq, pos // block_size] * block_size + pos % block_size
    return torch.cat([cu_q.int(), cu_k, slots.int()])


def gathered_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, prefill_index: torch.Tensor,
                     num_chunks: int, max_query_len: int, max_context_len: int) -> torch.Tensor:
    """The prefill chunks: each one's whole context gathered from its blocks on the device (the
    slots of prefill_gather_index), then causal flash attention."""
    n = num_chunks + 1
    cu_q, cu_k, slots = prefill_index[:n], prefill_index[n:2 * n], prefill_index[2 * n:]
    kv_heads, head_dim = k_cache.shape[2:]
    keys = k_cache.view(-1, kv_heads, head_dim)[slots]
    values = v_cache.view(-1, kv_heads, head_dim)[slots]
    return causal_varlen(q, keys, values, cu_q, cu_k, max_query_len, max_context_len)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
    """One layer's attention for a step (batch: PagedBatch.for_layer): q [1, heads, T,
    head_dim], k/v [1, kv_heads, T, head_dim] (the new tokens, rotated) -> [1, T, heads * head_dim].

    It runs as one custom operator, opaque to torch.compile: a compiled decoder block keeps
    its norms, projections and rotary embedding in one graph around it, and the step's sizes
    reach the kernels in one host tensor (PagedBatch.sizes)."""
    return torch.ops.duoka.paged_attention(
        q, k, v, batch.k_caches[0], batch.v_caches[0], batch.slot_mapping, batch.block_tables,
        batch.context_lens, batch.query_start, batch.sizes, batch.prefill_index)


# The operator's body runs once per layer of every eager step, on the host's critical path (a
# 7B step's 28 calls were ~11 ms of its CPU, bench/NOTES.md 36): on the GPU's paths (cuda,
# mixed) it builds no objects and computes nothing that is the same for every layer
# (PagedBatch.prefill_index); the reference path, the CPU's, rebuilds its PagedBatch.
@torch.library.custom_op("duoka::paged_attention", mutates_args=("k_cache", "v_cache"))
def _paged_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, query_start: torch.Tensor, sizes: torch.Tensor,
                        prefill_index: torch.Tensor) -> torch.Tensor:
    max_query_len, num_decodes, decode_splits, prefill_context, max_context_len, form = sizes.tolist()
    backend = BACKENDS[form]
    q = q[0].transpose(0, 1)  # [T, heads, head_dim]
    if backend == "reference":
        write_kv(k_cache, v_cache, k[0].transpose(0, 1), v[0].transpose(0, 1), slot_mapping)
        batch = PagedBatch([k_cache], [v_cache], slot_mapping, block_tables, context_lens, query_start, max_query_len,
                           slot_mapping[:0], backend, num_decodes, decode_splits, prefill_context, max_context_len,
                           sizes, prefill_index=prefill_index)
        out = reference_attention(q, k_cache, v_cache, batch)
        return out.reshape(1, out.shape[0], -1)
    paged_decode.write_kv(k_cache, v_cache, k[0].transpose(0, 1), v[0].transpose(0, 1), slot_mapping)
    if backend == "mixed":  # every row through the host-free kernel: a CUDA graph's mixed step
        out = paged_mixed.mixed_attention(q, k_cache, v_cache, block_tables, context_lens, query_start)
        return out.reshape(1, out.shape[0], -1)
    n = num_decodes
    decoded = None
    if n:
        decoded = paged_decode.decode_attention(q[:n], k_cache, v_cache, block_tables[:n], context_lens[:n],
                                                decode_splits)
        if n == q.shape[0]:
            return decoded.reshape(1, n, -1)
    prefilled = gathered_prefill(q[n:].contiguous(), k_cache, v_cache, prefill_index, len(context_lens) - n,
                                 max_query_len, max_context_len)
    out = prefilled if decoded is None else torch.cat([decoded, prefilled])
    return out.reshape(1, out.shape[0], -1)


@_paged_attention_op.register_fake
def _(q, k, v, k_cache, v_cache, slot_mapping, block_tables, context_lens, query_start, sizes, prefill_index):
    return q.new_empty(1, q.shape[2], q.shape[1] * q.shape[3])
