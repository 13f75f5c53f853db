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
that survive. A sequence never takes the block of its last token (the model runs on at least
one token, whose logits the next token is sampled from).

Prompt logprobs (serve.logprob_cache): a request that asks for them needs every prompt row's
entry, and the keys and values of a cached block do not give its rows' logits. So a scoring
request keeps its entries with the blocks it registers (token t's entry with the block that
holds token t), and another one reads a cached block only where those entries, of at least its
k, cover what reading skips; elsewhere it computes the block again (counted as a bypass).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

import numpy as np

from duoka.serve.logprob_cache import BlockLogprobs


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
        # Prompt entries of cached blocks (keyed by their hashes, dropped on eviction), and the
        # cached tokens that requests with prompt logprobs computed again because the blocks
        # carried no entries of their k (cumulative, at first admission as the hits).
        self.logprobs = BlockLogprobs(block_size)
        self.logprob_bypass_requests = 0
        self.logprob_bypass_tokens = 0

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
        hits, num_new, fits, bypassed = self._plan(seq, max_new_tokens)
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
        if seq.owes_prompt_rows:
            self._read_entries(seq, min(num_computed, seq.num_prompt_tokens - 1))
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = num_computed
            if self.enable_prefix_caching:
                self.prefix_queries += seq.num_prompt_tokens
                self.prefix_hits += num_computed
                self.logprob_bypass_requests += bypassed > 0
                self.logprob_bypass_tokens += bypassed
        return num_new

    def _plan(self, seq, max_new_tokens: int) -> tuple[list[int], int, bool, int]:
        """(the cached blocks seq takes, its new tokens, whether they fit, the cached tokens it
        computes again for want of stored prompt entries)."""
        hits = self._lookup(seq)
        bypassed = 0
        if hits and seq.owes_prompt_rows:
            readable, bypass = self._scorable(seq, len(hits))
            bypassed = (len(hits) - readable) * self.block_size if bypass else 0
            hits = hits[:readable]
        num_computed = len(hits) * self.block_size
        num_new = min(seq.num_tokens - num_computed, max_new_tokens)
        need = -(-(num_computed + num_new) // self.block_size) - len(hits)
        # a hit on a free block takes it out of the free list, so it is not there to allocate
        reclaimed = sum(1 for b in hits if self.ref_counts[b] == 0)
        return hits, num_new, need + reclaimed <= len(self.free_queue), bypassed

    def _lookup(self, seq) -> list[int]:
        """The blocks holding seq's longest cached prefix of full blocks, never its last token
        (whose logits the next token is sampled from)."""
        if not self.enable_prefix_caching:
            return []
        n = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, n)
        hits = []
        for h in seq.block_hashes[:n]:
            b = self.cached.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def _scorable(self, seq, num_hits: int) -> tuple[int, bool]:
        """How many of its num_hits leading cached blocks a request that still owes prompt rows
        may read, and whether it stopped short at a cached block without entries of its k (a
        bypass). Reading m blocks, it computes from token m * bs on, so the rows it has not
        scored yet below m * bs (prompt_logprob_rows.., scoring tokens up to m * bs) come from
        the entries of the blocks that hold those tokens: up to block m itself, whose first
        token's entry is the last row of block m - 1. Block m's keys and values are computed
        again (another request's next block differs: the choices after a shared context)."""
        bs, done, last = self.block_size, seq.prompt_logprob_rows, seq.num_prompt_tokens - 1
        end = min(seq.num_tokens // bs, num_hits + 1, last // bs + 1)  # full blocks, up to the prompt's last token
        self._extend_hashes(seq, end)
        stored = self._stored_run(seq, end)
        m = min(done // bs, num_hits)  # rows all scored already: readable without entries
        while m < num_hits and min((m + 1) * bs, last) // bs < stored:
            m += 1
        return m, stored < end and seq.block_hashes[stored] in self.cached

    def entries_in_flight(self, running) -> dict[bytes, int]:
        """Block hash -> the largest k of the prompt entries that running requests will keep with
        their full prompt blocks not registered yet (for waits_for_entries)."""
        in_flight: dict[bytes, int] = {}
        for seq in running:
            if seq.owes_prompt_rows:
                self.add_in_flight(seq, in_flight)
        return in_flight

    def add_in_flight(self, seq, in_flight: dict[bytes, int]) -> None:
        n, k = seq.num_prompt_tokens // self.block_size, seq.params.prompt_logprobs
        self._extend_hashes(seq, n)
        for h in seq.block_hashes[seq.num_registered_blocks:n]:
            if in_flight.get(h, -1) < k:
                in_flight[h] = k

    def waits_for_entries(self, seq, in_flight: dict[bytes, int]) -> bool:
        """Whether waiting seq (prompt rows owed) had better wait: the blocks past those that
        carry entries for it are being computed with entries of its k, and once they are
        cached it reads at least one block more (it needs entries a block past what it reads)."""
        n, k = seq.num_prompt_tokens // self.block_size, seq.params.prompt_logprobs
        self._extend_hashes(seq, n)
        stored = self._stored_run(seq, n)
        coming = 0
        while stored + coming < n and coming < 2 and in_flight.get(seq.block_hashes[stored + coming], -1) >= k:
            coming += 1
        return coming >= 1 and stored + coming >= 2

    def _stored_run(self, seq, end: int) -> int:
        """The first block from the one holding token prompt_logprob_rows + 1 (the first whose
        entry seq still owes) up to end that carries no entries of seq's k; end if none."""
        stored, k = (seq.prompt_logprob_rows + 1) // self.block_size, seq.params.prompt_logprobs
        while stored < end and self.logprobs.has(seq.block_hashes[stored], k):
            stored += 1
        return stored

    def _read_entries(self, seq, end: int) -> None:
        """Take seq's prompt rows prompt_logprob_rows..end - 1 (tokens up to end) from the
        entries of the blocks holding their tokens (_scorable found them there)."""
        bs = self.block_size
        token = seq.prompt_logprob_rows + 1  # row r scores token r + 1
        if token <= end:
            first, last = token // bs, end // bs  # the blocks holding tokens token..end
            seq.prompt_logprob_entries.append(self.logprobs.read(
                seq.block_hashes[first:last + 1], seq.all_ids[token:end + 1], token - first * bs,
                seq.params.prompt_logprobs))
        seq.prompt_logprob_rows = max(seq.prompt_logprob_rows, end)

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
        if seq.params.prompt_logprobs is not None:
            self._keep_entries(seq, seq.num_registered_blocks, n)
        seq.num_registered_blocks = n

    def _keep_entries(self, seq, start: int, end: int) -> None:
        """Keep with each newly registered block start..end - 1 of a request with prompt logprobs
        the entries of its tokens (token t's is prompt_logprob_entries[t - 1]), where its tokens
        are all prompt tokens and their rows have landed. Keyed by hash, they go with whichever
        block the cache holds under it (a twin computed side by side is not cached)."""
        bs, k, entries = self.block_size, seq.params.prompt_logprobs, seq.prompt_logprob_entries
        # Blocks whose tokens' entries have all landed: block i's last token is entry (i + 1) * bs - 2.
        stop = min(end, seq.num_prompt_tokens // bs, (len(entries) + 1) // bs)
        if stop > start:
            blocks = [h if h in self.cached else None for h in seq.block_hashes[start:stop]]
            self.logprobs.put(blocks, entries.rows(max(start * bs - 1, 0), stop * bs - 1), k)

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
            self.logprobs.drop(h)
            self.hash_of[b] = None
        self.ref_counts[b] = 1
        return b

    def hash_prompt(self, seq) -> None:
        """Hash seq's full prompt blocks now (a new request: the engine adds it while the device
        runs a step, so the scheduler does not do it with the device idle)."""
        if self.enable_prefix_caching:
            self._extend_hashes(seq, seq.num_prompt_tokens // self.block_size)

    def _extend_hashes(self, seq, n: int) -> None:
        """Make seq.block_hashes cover its first n full blocks (tokens of all_ids, which only grow).
        A block's hash chains its token ids (int64 bytes) to the parent block's hash (chain_seed
        for the first). SHA-256, as vLLM's default: prompts are untrusted input, and a collision
        made on purpose would let one request read another's cache entries; Python's hash() is
        not collision-resistant. About a microsecond per block."""
        hashes, ids, bs = seq.block_hashes, seq.all_ids, self.block_size
        assert n * bs <= len(ids)
        if n <= len(hashes):
            return
        # The new blocks' tokens as bytes at once, cut per block.
        first = len(hashes)
        data, width = array("q", ids[first * bs:n * bs]).tobytes(), bs * 8
        parent = hashes[-1] if first else chain_seed(seq.adapter)
        for j in range(n - first):
            parent = hashlib.sha256(parent + data[j * width:(j + 1) * width]).digest()
            hashes.append(parent)
