"""Prompt logprobs kept with the prefix cache's blocks, so that scoring requests (echo with
logprobs, vLLM's prompt_logprobs) share a cached prefix instead of computing it again.

What an entry depends on: prefill row p's logits (after tokens 0..p) score prompt token p + 1,
so token t's entry (its logprob and rank, the k most likely tokens at its place) is a function
of tokens 0..t and nothing else. The entry of token t is therefore kept with the block that
holds token t, under that block's chain hash (BlockManager._extend_hashes), which names every token up
to the block's end: tokens 0..t included. Keyed by the block of the row instead (token t - 1's),
the entry of a block's first token would hang on a hash that does not name that token.

A record is one block's entries: block_size tokens (block 0's first token has none), fp32
logprobs and top values (the head's log-softmax is fp32: kept exactly), int32 ranks and top
ids, with the k of the request that computed it. Memory is bounded: a record exists only
while its hash is in the prefix cache (BlockManager drops it with the block on eviction), and
k <= MAX_LOGPROBS, so at most num_blocks x block_size x (2 + 2 x 20) x 4 bytes of host memory
(2.7 KB a 16-token block at k = 20, 0.3% of its 917 KB of keys and values in Qwen2-7B; 256 B
at lm-eval's k = 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from duoka.serve.logprob_columns import EntryRows
from duoka.serve.params import MAX_LOGPROBS


@dataclass(frozen=True)
class BlockRecord:
    """One block's prompt entries: slot s holds the entry of the block's token s."""
    k: int
    logprobs: np.ndarray  # float32 [block_size]; NaN at block 0's slot 0 (no entry)
    ranks: np.ndarray  # int32 [block_size]
    top_ids: np.ndarray  # int32 [block_size, k], most likely first
    top_values: np.ndarray  # float32 [block_size, k]


class BlockLogprobs:
    """Chain hash of a cached full block -> the BlockRecord of its tokens' prompt entries."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.records: dict[bytes, BlockRecord] = {}

    def __len__(self) -> int:
        return len(self.records)

    @property
    def nbytes(self) -> int:
        return sum(r.logprobs.nbytes + r.ranks.nbytes + r.top_ids.nbytes + r.top_values.nbytes
                   for r in self.records.values())

    def has(self, block: bytes, k: int) -> bool:
        """Whether the block carries entries with at least k alternatives per token."""
        record = self.records.get(block)
        return record is not None and record.k >= k

    def put(self, blocks: list[bytes | None], rows: EntryRows, k: int) -> None:
        """Keep the entries of consecutive full blocks' tokens (None: a block not to keep), each
        with k alternatives: rows run to the last block's end, from its first block's token 0,
        or token 1 for block 0 (whose first token has no entry). A record of at least k already
        there stays (the same values: both come from the same tokens); a smaller one is
        replaced. The run is narrowed once, then each record gets arrays of its own (a block
        outlives its neighbours in the cache); block by block this was ~25 us of the host's
        step time each (bench/NOTES.md 44)."""
        bs, n = self.block_size, len(blocks)
        first = n * bs - len(rows.token_ids)  # 1 for a run from block 0
        assert 0 <= k <= MAX_LOGPROBS and first in (0, 1) and rows.top_ids.shape == (n * bs - first, k), (
            k, first, rows.top_ids.shape)
        keep = [j for j, block in enumerate(blocks) if block is not None and not self.has(block, k)]
        if not keep:
            return  # nothing to keep: no run to narrow
        logprobs = np.full(n * bs, np.nan, dtype=np.float32)
        ranks = np.zeros(n * bs, dtype=np.int32)
        top_ids = np.zeros((n * bs, k), dtype=np.int32)
        top_values = np.zeros((n * bs, k), dtype=np.float32)
        # fp32 values widened on the way in: narrowing them back is exact.
        logprobs[first:], ranks[first:] = rows.logprobs, rows.ranks
        top_ids[first:], top_values[first:] = rows.top_ids, rows.top_values
        for j in keep:
            cut = slice(j * bs, (j + 1) * bs)
            self.records[blocks[j]] = BlockRecord(k, logprobs[cut].copy(), ranks[cut].copy(), top_ids[cut].copy(),
                                                  top_values[cut].copy())

    def read(self, blocks: list[bytes], token_ids: list[int], first: int, k: int) -> EntryRows:
        """The entries of token_ids, the tokens held by consecutive blocks from slot `first` of
        the first, with their k most likely alternatives (each record's own k >= k, cut). One
        concatenation per column for the whole run: a scoring request reads ~15 blocks of its
        shared context, and block by block that was ~30 us of the host's step time each
        (bench/NOTES.md 44)."""
        records = [self.records[block] for block in blocks]
        end = first + len(token_ids)
        assert all(r.k >= k for r in records) and end <= self.block_size * len(records), (k, end, len(records))

        def column(part):
            return np.concatenate([part(r) for r in records])[first:end]

        logprobs = column(lambda r: r.logprobs)
        assert not np.isnan(logprobs).any(), "a slot without an entry"  # block 0's first token
        return EntryRows(np.asarray(token_ids, dtype=np.int64), logprobs, column(lambda r: r.ranks),
                         column(lambda r: r.top_ids[:, :k]), column(lambda r: r.top_values[:, :k]))

    def drop(self, block: bytes) -> None:
        """The block left the prefix cache (evicted): its entries go with it."""
        self.records.pop(block, None)
