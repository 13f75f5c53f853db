"""The model side of a serving step: the scheduled tokens as flat arrays (StepInputs), the
paged KV cache sized from the memory left after the weights, and one forward per step.

The runner does not know about requests or ranks: under tensor parallelism every rank
runs the same `execute` on the same StepInputs (rank 0 builds them, duoka.serve.step_channel sends
them), and only rank 0 reads the logits.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from duoka.errors import DuokaError
from duoka.models import paged_decode, paged_mixed
from duoka.models.quant.small_batch import save_tuned_configs
from duoka.models.qwen2.model import Qwen2
from duoka.models.qwen2.multi_lora import adapter_ids_of
from duoka.models.qwen2.paged import PagedBatch
from duoka.serve.sampling import to_device
from duoka.serve.scheduler import ScheduledItem, Sequence

# CPU serving is for laptops and tests: without a GPU's memory to fill, the cache takes
# at most this much of the host's RAM unless --kv-cache-memory says otherwise.
CPU_KV_CACHE_GIB = 1.0


# Steps compile (their blocks, on first sight of a kind of step) without duck sizing: a step
# as long as a model size (128 tokens, hidden 128) would be tied to it, every other length then
# compiled anew, and torch's limit of 8 compiled variants is a hard error under fullgraph.
STEP_SIZES_UNTIED = torch.fx.experimental._config.patch(use_duck_shape=False)


@dataclass
class StepInputs:
    """One step's tokens, flattened over the scheduled sequences (see PagedBatch)."""
    token_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T]
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    context_lens: torch.Tensor  # int32 [B]
    query_start: torch.Tensor  # int32 [B + 1]
    logits_indices: torch.Tensor  # int64 [S]
    max_query_len: int
    num_decodes: int  # the first num_decodes sequences take one token each (decode_first order)
    max_context_len: int
    prefill_context: int  # context tokens of the sequences after the decodes, in all
    # int32 [T]: each token's LoRA adapter slot (0: the base model); None when every token is
    # the base model's (always without --lora: then a step carries and computes nothing more).
    adapter_ids: torch.Tensor | None = None

    def sizes(self) -> tuple[int, int, int, int, int]:
        """(T, B, max_blocks, S, A), A = T with adapter_ids, else 0: every array's shape follows
        from these (array_shapes)."""
        b, max_blocks = self.block_tables.shape
        t = self.token_ids.numel()
        return t, b, max_blocks, self.logits_indices.numel(), 0 if self.adapter_ids is None else t

    def packed(self) -> torch.Tensor:
        """The arrays back to back as one int32 tensor, the form in which they travel (to the
        device, to the other tensor-parallel ranks): every value is a token id, a position, a
        length, an adapter slot or a block or slot index, none near 2^31, and int32 halves the bytes."""
        return torch.cat([array.reshape(-1).to(torch.int32) for name in ARRAY_DTYPES
                          if (array := getattr(self, name)) is not None])

    @classmethod
    def unpack(cls, packed: torch.Tensor, sizes: tuple[int, ...], scalars: dict[str, int]) -> StepInputs:
        """The inverse of packed(), on packed's device: the int32 arrays are views into it (see
        own_storage)."""
        shapes = array_shapes(*sizes)
        parts = packed.split([math.prod(shape) for shape in shapes])
        arrays = {name: part.view(shape).to(dtype)
                  for (name, dtype), part, shape in zip(ARRAY_DTYPES.items(), parts, shapes)}
        if not sizes[4]:
            arrays["adapter_ids"] = None
        return cls(**arrays, **scalars)

    def own_storage(self) -> StepInputs:
        """The same inputs, each array that is a view at an offset (unpack's int32 arrays)
        copied into storage of its own. The compiled blocks guard on whether an input's offset
        is 0, as prepare_inputs' arrays and the graphs' buffers have it: the eager path's
        unpacked views made a compiled variant of their own (bench/NOTES.md 43). Only that path
        needs it; a graph's replay copies the arrays into its buffers anyway."""
        views = {name: array.clone() for name in ARRAY_DTYPES
                 if (array := getattr(self, name)) is not None and array.storage_offset()}
        return dataclasses.replace(self, **views) if views else self

    def scalars(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in SCALARS}

    def to(self, device: torch.device) -> StepInputs:
        """The same inputs on `device`, moved in one copy (packed): seven small copies, each
        from freshly pinned memory, cost more than a batch-1 decode step."""
        if device.type == "cpu":
            return self
        return StepInputs.unpack(self.packed().to(device), self.sizes(), self.scalars())


# StepInputs' arrays with their dtypes (PagedBatch's), in packing order, and its integers.
ARRAY_DTYPES = {"token_ids": torch.int64, "positions": torch.int64, "slot_mapping": torch.int64,
                "block_tables": torch.int32, "context_lens": torch.int32, "query_start": torch.int32,
                "logits_indices": torch.int64, "adapter_ids": torch.int32}
SCALARS = ("max_query_len", "num_decodes", "max_context_len", "prefill_context")
NUM_SIZES = 5  # len(StepInputs.sizes())


def array_shapes(t: int, b: int, max_blocks: int, s: int, a: int) -> list[tuple[int, ...]]:
    """The arrays' shapes, in ARRAY_DTYPES' order, for T tokens, B sequences, S logits rows
    and A adapter slots (T or 0)."""
    return [(t,), (t,), (t,), (b, max_blocks), (b,), (b + 1,), (s,), (a,)]


def decode_first(items: list[ScheduledItem]) -> list[ScheduledItem]:
    """The step's one-token items first (the decode kernel's part), the rest after, each
    group in scheduling order. The logits rows follow this order."""
    decodes = [item for item in items if item.num_new == 1]
    if len(decodes) == len(items):  # a decode-only step keeps its list
        return items
    return decodes + [item for item in items if item.num_new != 1]


def prepare_inputs(items: list[ScheduledItem], block_size: int) -> StepInputs:
    """Host-side arrays for the scheduled items (in decode_first order), with a logits row
    for each item that samples (its last new token).

    Per item only the Python reads that cannot be avoided (its start, size, tokens and block
    table); everything else is computed on whole arrays, and each array becomes a tensor once."""
    n = len(items)
    seqs = [item.seq for item in items]
    starts = np.array([item.start for item in items], dtype=np.int64)
    num_new = np.array([item.num_new for item in items], dtype=np.int64)
    max_query_len = int(num_new.max())
    query_start = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(num_new, out=query_start[1:])
    if max_query_len == 1:  # all decodes: one token each, at its start
        tokens = np.array([seq.all_ids[start] for seq, start in zip(seqs, starts.tolist())], dtype=np.int64)
        positions = starts
        rows = np.arange(n)
    else:
        tokens = np.fromiter(chain.from_iterable(item.seq.all_ids[item.start:item.start + item.num_new]
                                                 for item in items), dtype=np.int64, count=int(query_start[-1]))
        rows = np.repeat(np.arange(n), num_new)
        positions = np.arange(len(tokens)) + (starts - query_start[:-1])[rows]
    block_tables = _block_tables(seqs)
    slots = block_tables[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
    context = starts + num_new
    sample = np.array([item.sample for item in items], dtype=bool)
    is_prefill = num_new != 1
    # Only a step with some adapter's request carries adapter slots (a base-only step, and
    # every step without --lora, pays for this one scan).
    adapters = [seq.adapter for seq in seqs]
    adapter_ids = None
    if any(adapters):
        per_seq = np.array(adapters, dtype=np.int32)
        adapter_ids = torch.from_numpy(per_seq if max_query_len == 1 else per_seq[rows])
    return StepInputs(
        token_ids=torch.from_numpy(tokens),
        positions=torch.from_numpy(positions),
        slot_mapping=torch.from_numpy(slots),
        block_tables=torch.from_numpy(block_tables),
        context_lens=torch.from_numpy(context.astype(np.int32)),
        query_start=torch.from_numpy(query_start.astype(np.int32)),
        logits_indices=torch.from_numpy(query_start[1:][sample] - 1),
        max_query_len=max_query_len,
        num_decodes=n - int(is_prefill.sum()),
        max_context_len=int(context.max()),
        prefill_context=int(context[is_prefill].sum()),
        adapter_ids=adapter_ids,
    )


def _block_tables(seqs: list[Sequence]) -> np.ndarray:
    """int32 [rows, widest table]: each row a copy of its sequence's table (BlockManager's int32
    block_array, not a list), padded with block 0: a row is read only up to its context length."""
    lengths = [len(seq.block_table) for seq in seqs]
    block_tables = np.zeros((len(seqs), max(lengths)), dtype=np.int32)
    for row, seq, length in zip(block_tables, seqs, lengths):
        row[:length] = seq.block_array[:length]
    return block_tables


@dataclass(frozen=True)
class Piece:
    """Tokens of one sequence computed in a step (speculative decoding's steps, whose tokens are
    not all in seq.all_ids yet): `tokens` at positions start, start + 1, ..., with logits for
    the last `logits` of them. flat: one decode row per token, each attending to its context up
    to itself, which is what the decode kernel and the CUDA graphs run; else one chunk row, as a
    prefill. A one-token piece is a decode row either way."""
    seq: Sequence
    start: int
    tokens: list[int]
    flat: bool
    logits: int

    @property
    def decode_rows(self) -> bool:
        return self.flat or len(self.tokens) == 1


def pieces_inputs(pieces: list[Piece], block_size: int) -> StepInputs:
    """StepInputs for `pieces`, decode-row pieces first (the decode kernel takes the leading
    one-token rows); the logits rows follow the pieces' order and, within one, their tokens'."""
    rows = []  # (piece, first token, count) per row
    for piece in pieces:
        if piece.decode_rows:
            rows += [(piece, j, 1) for j in range(len(piece.tokens))]
        else:
            rows.append((piece, 0, len(piece.tokens)))
    num_decodes = sum(1 for _, _, count in rows if count == 1)
    assert all(count == 1 for _, _, count in rows[:num_decodes]), "decode-row pieces come first"
    seqs = [piece.seq for piece, _, _ in rows]
    starts = np.array([piece.start + j for piece, j, _ in rows], dtype=np.int64)
    counts = np.array([count for _, _, count in rows], dtype=np.int64)
    # Row i's logits: the last want[i] of its tokens, those among its piece's last `logits`.
    want = np.array([min(count, max(0, j + count - (len(piece.tokens) - piece.logits)))
                     for piece, j, count in rows], dtype=np.int64)
    query_start = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(counts, out=query_start[1:])
    tokens = np.fromiter(chain.from_iterable(piece.tokens[j:j + count] for piece, j, count in rows), dtype=np.int64,
                         count=int(query_start[-1]))
    row_of = np.repeat(np.arange(len(rows)), counts)
    positions = np.arange(len(tokens)) + (starts - query_start[:-1])[row_of]
    block_tables = _block_tables(seqs)
    slots = block_tables[row_of, positions // block_size].astype(np.int64) * block_size + positions % block_size
    context = starts + counts
    ends = np.repeat(query_start[1:] - want, want)
    logits_indices = ends + np.arange(int(want.sum())) - np.repeat(np.cumsum(want) - want, want)
    adapters = [seq.adapter for seq in seqs]
    return StepInputs(
        token_ids=torch.from_numpy(tokens), positions=torch.from_numpy(positions),
        slot_mapping=torch.from_numpy(slots), block_tables=torch.from_numpy(block_tables),
        context_lens=torch.from_numpy(context.astype(np.int32)),
        query_start=torch.from_numpy(query_start.astype(np.int32)),
        logits_indices=torch.from_numpy(logits_indices.astype(np.int64)), max_query_len=int(counts.max()),
        num_decodes=num_decodes, max_context_len=int(context.max()),
        prefill_context=int(context[num_decodes:].sum()),
        adapter_ids=torch.from_numpy(np.array(adapters, dtype=np.int32)[row_of]) if any(adapters) else None)


@dataclass(frozen=True)
class CacheShape:
    """The paged KV cache of one rank: num_blocks blocks of block_size tokens per layer."""
    num_layers: int
    num_blocks: int
    block_size: int
    kv_heads: int  # this rank's (under tensor parallelism, its share or a replica)
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.block_size * self.kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size


def available_kv_bytes(device: torch.device, gpu_memory_utilization: float, kv_cache_memory_gib: float | None) -> int:
    """Bytes the KV cache may take: an explicit size, or on GPU what is left of
    gpu_memory_utilization x the card once this process's peak (weights + one profiled step)
    and other processes' memory are counted, as vLLM sizes it; on CPU a bounded share of RAM."""
    if kv_cache_memory_gib is not None:
        return int(kv_cache_memory_gib * 2**30)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        others = total - free - torch.cuda.memory_reserved(device)
        return int(total * gpu_memory_utilization - others - torch.cuda.max_memory_allocated(device))
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(min(CPU_KV_CACHE_GIB * 2**30, available * gpu_memory_utilization))


# Decode batch sizes replayed from CUDA graphs; a step of n decodes runs the smallest
# bucket >= n with padding rows (vLLM's and nano-vllm's choice of sizes).
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
# Token counts of the mixed steps (prefill chunks beside decodes) replayed from CUDA graphs, up
# to the step budget: eagerly such a step is bound by the host (a 7B's 28 layers ~35-45 ms
# whatever its size, bench/NOTES.md 31), while a larger one keeps the GPU busy by itself. Steps
# of 256 tokens apart: a step computes its padding rows too (a 1,032-token step would cost
# twice its work in a bucket of 2,048).
MIXED_GRAPH_TOKENS = (128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048)


class ModelRunner:
    """The model and its paged cache on one device; `execute` runs one step.

    The cache holds one block more than the scheduler hands out: the scratch block that a
    CUDA graph's padding rows write their keys and values into."""

    def __init__(self, model: Qwen2, shape: CacheShape, device: torch.device, max_model_len: int,
                 max_num_seqs: int = 256, cuda_graphs: bool = True, max_num_batched_tokens: int = 8192,
                 backend: str | None = None):
        self.model = model
        self.shape = shape
        self.device = device
        block = (shape.num_blocks + 1, shape.block_size, shape.kv_heads, shape.head_dim)
        self.k_caches = [torch.zeros(block, dtype=shape.dtype, device=device) for _ in range(shape.num_layers)]
        self.v_caches = [torch.zeros(block, dtype=shape.dtype, device=device) for _ in range(shape.num_layers)]
        self.scratch_block = shape.num_blocks
        fast = device.type == "cuda" and paged_decode.available() and shape.dtype in (torch.bfloat16, torch.float16)
        # backend: PagedBatch's ("reference" or "cuda"); None: cuda where it runs. A test forces
        # "cuda" on the CPU to run the graphs' bookkeeping under Triton's interpreter.
        self.backend = backend or ("cuda" if fast else "reference")
        self.max_blocks = -(-max_model_len // shape.block_size)
        self.max_model_len = max_model_len
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # by decodes
        self.mixed_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # by tokens
        # Served LoRA adapters (duoka.models.qwen2.multi_lora): the per-token slots every
        # adapted projection reads, set before each forward. None without --lora.
        self.adapter_ids = adapter_ids_of(model)
        if cuda_graphs and self.backend == "cuda":
            tokens = sorted({min(t, max_num_batched_tokens) for t in MIXED_GRAPH_TOKENS} if paged_mixed.available()
                            else set())
            with STEP_SIZES_UNTIED:
                self._capture([b for b in GRAPH_BUCKETS if b <= max_num_seqs] or [1], tokens)
            save_tuned_configs()  # what the warm-up tuned (FP8's small-batch kernel): kept for the next start

    def _batch(self, x: StepInputs, splits: int) -> PagedBatch:
        return PagedBatch(self.k_caches, self.v_caches, x.slot_mapping, x.block_tables, x.context_lens,
                          x.query_start, x.max_query_len, x.logits_indices, self.backend, x.num_decodes, splits,
                          x.prefill_context, x.max_context_len)

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """The step's logits [S, vocab] in fp32 (hidden states on a stage without a head)."""
        n = len(inputs.context_lens)
        # A graph returns a logits row for every sequence: a step where one does not sample (a
        # chunk of one token inside a prompt) runs eagerly.
        if self.graphs and inputs.num_decodes == n and len(inputs.logits_indices) == n and n <= max(self.graphs):
            return self._replay(inputs)
        if self.mixed_graphs and len(inputs.token_ids) <= max(self.mixed_graphs) and \
                max(n, len(inputs.logits_indices)) <= len(self._mixed.context_lens):
            return self._replay_mixed(inputs)
        return self._eager(inputs, None).float()

    @torch.inference_mode()
    def execute_with_hidden(self, inputs: StepInputs, hidden_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """execute()'s logits, and the final hidden states [P, dim] of the token rows
        hidden_rows [P] (prompt logprobs: head() turns them into logits slice by slice). Eager
        always: a CUDA graph returns logits only."""
        logits, hidden = self._eager(inputs, hidden_rows)
        return logits.float(), hidden

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [R, dim] -> fp32 logits [R, vocab] (the output head is whole on
        every tensor-parallel rank: no collective)."""
        return self.head_logits(hidden).float()

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """head()'s logits in the model's dtype: prompt logprobs read them unwidened."""
        return self.model.output(hidden)

    def _eager(self, inputs: StepInputs, hidden_rows: torch.Tensor | None):
        """The forward without a graph: the model's output as it returns it (PagedBatch.hidden_indices)."""
        x = inputs.to(self.device).own_storage()
        if self.adapter_ids is not None:
            ids = x.adapter_ids
            if ids is None:  # a base-only step
                ids = torch.zeros(len(x.token_ids), dtype=torch.int32, device=self.device)
            elif not ids.is_inference():  # a host step's own array (CPU): an inference tensor as the zeros
                ids = ids.clone()  # are, or a compiled block would be compiled once for each kind
            self.adapter_ids.use(ids)
        splits = paged_decode.num_splits(x.num_decodes, self.shape.kv_heads, x.max_context_len) if x.num_decodes else 1
        batch = self._batch(x, splits)
        if hidden_rows is not None:
            batch.hidden_indices = to_device(hidden_rows, self.device)
        with STEP_SIZES_UNTIED:
            return self.model(x.token_ids[None], positions=x.positions, paged=batch)

    # ---------------------------------------------------------------- CUDA graphs
    @torch.inference_mode()
    def _capture(self, buckets: list[int], token_buckets: list[int]) -> None:
        """One graph per bucket of decode batch size and one per bucket of a mixed step's
        tokens, largest first, sharing one memory pool. The graphs read fixed input buffers;
        each replay copies the step's values into them."""
        size = max(buckets)
        pool = self._capture_mixed(token_buckets, size) if token_buckets else None
        long = dict(dtype=torch.long, device=self.device)
        self._static = StepInputs(
            token_ids=torch.zeros(size, **long), positions=torch.zeros(size, **long),
            slot_mapping=torch.full((size,), self.scratch_block * self.shape.block_size, **long),
            block_tables=torch.full((size, self.max_blocks), self.scratch_block, dtype=torch.int32, device=self.device),
            context_lens=torch.ones(size, dtype=torch.int32, device=self.device),
            query_start=torch.arange(size + 1, dtype=torch.int32, device=self.device),
            logits_indices=torch.arange(size, **long), max_query_len=1, num_decodes=size,
            max_context_len=self.max_model_len, prefill_context=0,
            adapter_ids=None if self.adapter_ids is None else torch.zeros(size, dtype=torch.int32, device=self.device))
        for bucket in sorted(buckets, reverse=True):
            batch = self._bucket_batch(bucket)
            if self.adapter_ids is not None:  # the graph reads its slots from the static buffer
                self.adapter_ids.use(self._static.adapter_ids[:bucket])
            tokens, positions = self._static.token_ids[None, :bucket], self._static.positions[:bucket]
            graph, logits, pool = capture_graph(
                lambda t=tokens, p=positions, b=batch: self.model(t, positions=p, paged=b).float(), pool)
            self.graphs[bucket] = (graph, logits)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _capture_mixed(self, buckets: list[int], seqs: int):
        """The mixed steps' graphs: up to `seqs` sequences with up to a bucket's tokens in all,
        every row's attention through the host-free kernel (PagedBatch backend "mixed"). Each
        returns the final hidden states of `seqs` rows (those a step asks logits of first; the
        head runs after the replay, so the graphs hold [seqs, dim], not [seqs, vocab], each).
        Returns the pool."""
        size = max(buckets)
        long = dict(dtype=torch.long, device=self.device)
        int32 = dict(dtype=torch.int32, device=self.device)
        self._mixed = StepInputs(
            token_ids=torch.zeros(size, **long), positions=torch.zeros(size, **long),
            slot_mapping=torch.full((size,), self.scratch_block * self.shape.block_size, **long),
            block_tables=torch.full((seqs, self.max_blocks), self.scratch_block, **int32),
            context_lens=torch.zeros(seqs, **int32), query_start=torch.zeros(seqs + 1, **int32),
            logits_indices=torch.zeros(seqs, **long), max_query_len=size, num_decodes=0,
            max_context_len=self.max_model_len, prefill_context=0,
            adapter_ids=None if self.adapter_ids is None else torch.zeros(size, **int32))
        pool = None
        for bucket in sorted(buckets, reverse=True):
            s = self._mixed
            batch = PagedBatch(self.k_caches, self.v_caches, s.slot_mapping[:bucket], s.block_tables, s.context_lens,
                               s.query_start, bucket, s.logits_indices[:0], "mixed", 0, 1, 0, self.max_model_len,
                               hidden_indices=s.logits_indices)
            if self.adapter_ids is not None:
                self.adapter_ids.use(s.adapter_ids[:bucket])
            tokens, positions = s.token_ids[None, :bucket], s.positions[:bucket]
            graph, hidden, pool = capture_graph(
                lambda t=tokens, p=positions, b=batch: self.model(t, positions=p, paged=b)[1], pool)
            self.mixed_graphs[bucket] = (graph, hidden)
        return pool

    def _replay_mixed(self, inputs: StepInputs) -> torch.Tensor:
        """A mixed step from the smallest graph that holds its tokens: padding rows write to the
        scratch block and belong to no sequence (their attention is zero, their logits unread);
        padding sequences have no rows."""
        n, b, rows = len(inputs.token_ids), len(inputs.context_lens), len(inputs.logits_indices)
        bucket = min(t for t in self.mixed_graphs if t >= n)
        s = self._mixed
        x = inputs.to(self.device)
        stage(s, x)
        s.slot_mapping[n:bucket].fill_(self.scratch_block * self.shape.block_size)
        s.query_start[:b + 1].copy_(x.query_start)
        s.query_start[b + 1:].fill_(n)
        s.logits_indices[:rows].copy_(x.logits_indices)
        s.logits_indices[rows:].zero_()  # a stale index could lie past this bucket's rows
        graph, hidden = self.mixed_graphs[bucket]
        graph.replay()
        return self.head(hidden[:rows])

    def _bucket_batch(self, bucket: int) -> PagedBatch:
        s = self._static
        view = StepInputs(s.token_ids[:bucket], s.positions[:bucket], s.slot_mapping[:bucket], s.block_tables[:bucket],
                          s.context_lens[:bucket], s.query_start[:bucket + 1], s.logits_indices[:bucket], 1, bucket,
                          self.max_model_len, 0)
        return self._batch(view, paged_decode.num_splits(bucket, self.shape.kv_heads, self.max_model_len))

    def _replay(self, inputs: StepInputs) -> torch.Tensor:
        n = len(inputs.context_lens)
        bucket = min(b for b in self.graphs if b >= n)
        s = self._static
        stage(s, inputs.to(self.device))
        # Padding rows: one token of context in the scratch block, written to the scratch block.
        s.slot_mapping[n:bucket].fill_(self.scratch_block * self.shape.block_size)
        s.context_lens[n:bucket].fill_(1)
        s.block_tables[n:bucket, 0].fill_(self.scratch_block)
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits[:n]


def stage(static: StepInputs, x: StepInputs) -> None:
    """A step's token rows and sequences into the leading rows of a graph's input buffers (its
    replay then pads the rest). Padding rows keep stale adapter slots: their outputs are
    dropped, and no row reads another's."""
    t, b = len(x.token_ids), len(x.context_lens)
    static.token_ids[:t].copy_(x.token_ids)
    static.positions[:t].copy_(x.positions)
    static.slot_mapping[:t].copy_(x.slot_mapping)
    static.context_lens[:b].copy_(x.context_lens)
    static.block_tables[:b, :x.block_tables.shape[1]].copy_(x.block_tables)
    if static.adapter_ids is not None:
        if x.adapter_ids is not None:
            static.adapter_ids[:t].copy_(x.adapter_ids)
        else:
            static.adapter_ids[:t].zero_()


def capture_graph(forward, pool):
    """(graph, its output, the pool) for forward(), run once first outside the capture (so the
    compiler and Triton compile their kernels there). The graph replays forward's kernels
    reading the same input buffers and writing the same output tensor."""
    forward()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph, out, graph.pool()


def profile_step(model: Qwen2, tokens: int, rows: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 max_model_len: int, backend: str | None = None) -> torch.Tensor:
    """The logits of one prefill of `tokens` (the scheduler's largest step), `rows` of them, on a
    runner of its own whose cache just holds it: the peak it leaves is counted before the serving
    cache is sized. Called outside inference mode, as the serving runner is made: caches made in
    it would be inference tensors, whose dispatch keys the compiled blocks guard on, and this
    step a compiled variant of its own (bench/NOTES.md 41)."""
    blocks = -(-tokens // block_size)
    args = model.args
    shape = CacheShape(args.n_layers, blocks, block_size, args.n_kv_heads, args.resolved_head_dim, dtype)
    runner = ModelRunner(model, shape, device, max_model_len, cuda_graphs=False, backend=backend)
    with torch.inference_mode():  # inference tensors, as a step's inputs are once copied to the device
        inputs = StepInputs(
            token_ids=torch.zeros(tokens, dtype=torch.long), positions=torch.arange(tokens),
            slot_mapping=torch.arange(tokens), block_tables=torch.arange(blocks, dtype=torch.int32)[None],
            context_lens=torch.tensor([tokens], dtype=torch.int32),
            query_start=torch.tensor([0, tokens], dtype=torch.int32),
            logits_indices=torch.arange(tokens - min(tokens, rows), tokens), max_query_len=tokens,
            num_decodes=0, max_context_len=tokens, prefill_context=tokens)
    return runner.execute(inputs)


def cache_shape(model: Qwen2, kv_heads: int, block_size: int, dtype: torch.dtype, kv_bytes: int,
                max_model_len: int, max_num_seqs: int, num_blocks: int | None = None,
                extra_bytes_per_block: int = 0) -> CacheShape:
    """The cache for kv_bytes, capped at what max_num_seqs sequences of max_model_len can use;
    num_blocks overrides the size (tests force preemption with a tiny cache). extra_bytes_per_block:
    what each block also takes elsewhere (a speculative draft model's cache, block for block)."""
    args = model.args
    shape = CacheShape(args.n_layers, 0, block_size, kv_heads, args.resolved_head_dim, dtype)
    per_block = shape.bytes_per_block + extra_bytes_per_block
    blocks_per_seq = -(-max_model_len // block_size)
    if num_blocks is None:
        num_blocks = max(0, min(kv_bytes // per_block, blocks_per_seq * max_num_seqs))
    if num_blocks < blocks_per_seq:
        need = blocks_per_seq * per_block / 2**30
        raise DuokaError(
            f"the KV cache has room for {num_blocks * block_size} tokens, less than one request of "
            f"--max-model-len {max_model_len} ({need:.2f} GiB)",
            "lower --max-model-len, raise --gpu-memory-utilization, or use more GPUs with --tp",
        )
    return CacheShape(args.n_layers, num_blocks, block_size, kv_heads, args.resolved_head_dim, dtype)
