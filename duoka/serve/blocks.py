"""The paged KV cache's bookkeeping: which fixed-size blocks each sequence owns, and prefix caching.

The cache is `num_blocks` blocks of `block_size` token slots (the tensors live with the model
runner; this module only hands out block ids). A sequence's block table lists its blocks in
token order: token at position p sits in slot block_table[p // block_size] * block_size +
p % block_size.

Prefix caching (vLLM's automatic prefix caching, in the nano-vllm layout): a block that is full
of computed tokens is registered under a hash of its token ids chained with its parent block's
hash, so one hash names a whole prefix and equal blocks after different prefixes never meet.
A later sequence whose leading full blocks have registered hashes takes those blocks (reference
count + 1) instead of computing them again. Blocks are append-only once full, so a shared block
is never written. A block whose last user leaves keeps its hash and contents and goes to the
tail of the free list; allocation takes from the head and drops the old hash only then, so
freed blocks are evicted least recently freed first and a later request still hits the ones
that survive. A sequence takes cached blocks only within its Sequence.cache_limit: never its
last token, and for a request that asks for prompt logprobs only the rows already scored (the
cache holds keys and values, not the logits those rows need).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

import numpy as np


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """Hash of one full block: its token ids chained with the parent block's hash (b"" for the
    first block). SHA-256, as vLLM's default: prompts are untrusted input, and a collision made
    on purpose would let one request read another's cache entries; Python's hash() is not
    collision-resistant. About a microsecond per block."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def chain_seed(adapter: int) -> bytes:
    """The parent hash of a sequence's first block: b"" for the base model, a digest of the
    slot for a LoRA adapter's (Sequence.adapter). The same tokens give other keys and values
    under another adapter, so its blocks must never be found by another adapter's prompts."""
    return hashlib.sha256(b"duoka lora adapter %d" % adapter).digest() if adapter else b""


class BlockManager:
    """Block ids 0..num_blocks-1 with reference counts, a free list in LRU order and a
    hash -> block map of cached full blocks. `seq` arguments are duoka.serve.scheduler.Sequence
    (not imported: the scheduler imports this module).

    Per-sequence state it keeps on the Sequence: block_table, block_array (the table as int32
    for prepare_inputs: block_array[:len(block_table)] == block_table, the rest spare room),
    num_computed, num_cached_tokens, block_hashes (content hashes of the full blocks of all_ids,
    grown incrementally and kept across preemption: the tokens never change) and
    num_registered_blocks (how many leading blocks of the table are already in the hash map, so
    registration never rescans a prompt).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks >= 1 and block_size >= 1, (num_blocks, block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        # Keys only, in eviction order (head first). An OrderedDict gives O(1) pop at the head,
        # append at the tail and removal from the middle (a cache hit on a free block).
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Prefix-cache counters in tokens, cumulative, with vLLM's meaning (hit rate =
        # hits / queries). Counted once per request, at its first admission: a re-admission
        # after preemption would mostly hit its own freed blocks and inflate the rate.
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds (cached or not: a cached free block is evicted on demand)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (vLLM's kv-cache usage)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    # ------------------------------------------------------------------ admission
    def can_allocate(self, seq, max_new_tokens: int) -> bool:
        """Whether allocate(seq, max_new_tokens) would succeed now (changes nothing)."""
        return self._plan(seq, max_new_tokens)[2]

    def allocate(self, seq, max_new_tokens: int) -> int:
        """Admit a sequence that holds no blocks: take its cached leading full blocks, then fresh
        blocks for up to max_new_tokens (>= 1) of the tokens that follow. Sets block_table,
        num_computed (the cached tokens) and, at the first admission, num_cached_tokens.
        Returns how many new tokens it has slots for, or 0 (nothing changed) when the free
        blocks do not suffice."""
        assert not seq.block_table and seq.num_computed == 0 and max_new_tokens >= 1
        hits, num_new, fits = self._plan(seq, max_new_tokens)
        if not fits:
            return 0
        for b in hits:
            if self.ref_counts[b] == 0:
                del self.free_queue[b]
            self.ref_counts[b] += 1
        num_computed = len(hits) * self.block_size
        need = -(-(num_computed + num_new) // self.block_size) - len(hits)
        self._append_blocks(seq, hits + [self._take_free() for _ in range(need)])
        seq.num_computed = num_computed
        seq.num_registered_blocks = len(hits)
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = num_computed
            if self.enable_prefix_caching:
                self.prefix_queries += seq.num_prompt_tokens
                self.prefix_hits += num_computed
        return num_new

    def _plan(self, seq, max_new_tokens: int) -> tuple[list[int], int, bool]:
        hits = self._lookup(seq)
        num_computed = len(hits) * self.block_size
        num_new = min(seq.num_tokens - num_computed, max_new_tokens)
        need = -(-(num_computed + num_new) // self.block_size) - len(hits)
        # a hit on a free block takes it out of the free list, so it is not there to allocate
        reclaimed = sum(1 for b in hits if self.ref_counts[b] == 0)
        return hits, num_new, need + reclaimed <= len(self.free_queue)

    def _lookup(self, seq) -> list[int]:
        """The blocks holding seq's longest cached prefix of full blocks, within the tokens the
        cache may serve it (Sequence.cache_limit: never the last token, whose logits the next
        token is sampled from, nor a prompt row whose logprobs are still owed)."""
        if not self.enable_prefix_caching:
            return []
        n = seq.cache_limit // self.block_size
        self._extend_hashes(seq, n)
        hits = []
        for h in seq.block_hashes[:n]:
            b = self.cached.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    # ------------------------------------------------------------------ running
    def ensure_slots(self, seq, num_new: int) -> bool:
        """Give a running sequence blocks for its next num_new tokens (positions num_computed ..
        num_computed + num_new - 1). False, changing nothing, when the free blocks do not suffice."""
        need = -(-(seq.num_computed + num_new) // self.block_size) - len(seq.block_table)
        if need <= 0:  # most decode steps: the last block still has room
            return True
        if need > len(self.free_queue):
            return False
        self._append_blocks(seq, [self._take_free() for _ in range(need)])
        return True

    def register_computed(self, seq) -> None:
        """Register the hashes of seq's blocks that became full of computed tokens (call after
        num_computed advanced, i.e. once the step's K/V are written)."""
        if not self.enable_prefix_caching:
            return
        n = seq.num_computed // self.block_size
        if n <= seq.num_registered_blocks:
            return
        self._extend_hashes(seq, n)
        for i in range(seq.num_registered_blocks, n):
            h, b = seq.block_hashes[i], seq.block_table[i]
            assert self.hash_of[b] is None, "a block is registered once, when it becomes full"
            # Two sequences that computed the same block side by side: the first one registered
            # stays the cached copy; the twin is freed without a hash (evicted first).
            if h not in self.cached:
                self.cached[h] = b
                self.hash_of[b] = h
        seq.num_registered_blocks = n

    def free(self, seq) -> None:
        """Release seq's blocks (finish, abort or preemption): reference counts drop; a block
        nobody holds goes to the free list, at the tail if it is cached (evicted last) or at
        the head if not. Tail blocks are freed first so that, among one sequence's blocks, the
        end of the prefix is evicted before its beginning (a hit needs the whole chain)."""
        for b in reversed(seq.block_table):
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] >= 0
            if self.ref_counts[b] == 0:
                self.free_queue[b] = None
                if self.hash_of[b] is None:
                    self.free_queue.move_to_end(b, last=False)
        seq.block_table.clear()
        seq.num_computed = 0
        seq.num_registered_blocks = 0

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _append_blocks(seq, blocks: list[int]) -> None:
        """Append to seq's block table and to its int32 copy, which grows by doubling so that
        appending stays amortised O(1) per block."""
        table, start = seq.block_table, len(seq.block_table)
        table.extend(blocks)
        if len(table) > len(seq.block_array):
            grown = np.zeros(max(len(table), 2 * len(seq.block_array), 16), dtype=np.int32)
            grown[:start] = seq.block_array[:start]
            seq.block_array = grown
        seq.block_array[start:len(table)] = blocks

    def _take_free(self) -> int:
        b, _ = self.free_queue.popitem(last=False)
        h = self.hash_of[b]
        if h is not None:  # evicted: its contents are about to be overwritten
            del self.cached[h]
            self.hash_of[b] = None
        self.ref_counts[b] = 1
        return b

    def _extend_hashes(self, seq, n: int) -> None:
        """Make seq.block_hashes cover its first n full blocks (tokens of all_ids, which only grow)."""
        hashes, ids, bs = seq.block_hashes, seq.all_ids, self.block_size
        assert n * bs <= len(ids)
        for i in range(len(hashes), n):
            hashes.append(block_hash(hashes[-1] if i else chain_seed(seq.adapter), ids[i * bs:(i + 1) * bs]))
