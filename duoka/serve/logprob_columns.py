"""A request's prompt logprobs as columns of numbers, from the device's copy to the server: a
scoring request (lm-eval's echo with logprobs) has an entry per prompt token, and as TokenLogprob
objects they were half of the server's CPU to unpickle (bench/NOTES.md 35) and, built from each
step's rows and from the prefix cache's blocks, ~3 ms of the engine's host time per scored
prompt of 330 tokens (NOTES 40). So the engine gathers them as rows of arrays (EntryRows, into
a request's PromptEntries), they cross the pipe as a few buffers (PromptLogprobColumns), and
the server writes the completions API's lists from the columns without building the objects.

The columns hold exactly the entries' values: token ids and ranks as int64, logprobs as float64
(each one an fp32 value widened, as TokenLogprob holds it), so list(columns) equals the list of
TokenLogprob the entries stand for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from duoka.serve.params import LOGPROB_FLOOR, TokenLogprob

NO_RANK = -1  # a rank of None (sampled tokens have none; prompt entries always do)


@dataclass(eq=False)
class PromptLogprobColumns(Sequence):
    """[None, entry 1, ..., entry P-1] of one prompt (the first token has no entry), by columns:
    entry i's top alternatives are top_ids/top_values[starts[i - 1]:starts[i]]."""
    token_ids: np.ndarray  # int64 [P - 1]
    logprobs: np.ndarray  # float64 [P - 1]
    ranks: np.ndarray  # int64 [P - 1], NO_RANK for None
    starts: np.ndarray  # int64 [P]: offsets into the top columns, starts[0] = 0
    top_ids: np.ndarray  # int64 [sum of the entries' top lengths]
    top_values: np.ndarray  # float64, likewise

    @classmethod
    def pack(cls, entries: list[TokenLogprob | None]) -> PromptLogprobColumns:
        if not entries or entries[0] is not None or any(e is None for e in entries[1:]):
            raise ValueError("prompt logprobs are [None, entry, ...]: the first token alone has no entry")
        body = entries[1:]
        n = len(body)
        tops = [pair for e in body for pair in e.top]
        return cls(np.fromiter((e.token_id for e in body), np.int64, n),
                   np.fromiter((e.logprob for e in body), np.float64, n),
                   np.fromiter((NO_RANK if e.rank is None else e.rank for e in body), np.int64, n),
                   np.concatenate(([0], np.cumsum(np.fromiter((len(e.top) for e in body), np.int64, n)))),
                   np.fromiter((t for t, _ in tops), np.int64, len(tops)),
                   np.fromiter((v for _, v in tops), np.float64, len(tops)))

    def __len__(self) -> int:
        return len(self.token_ids) + 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return list(self)[i]
        i = range(len(self))[i]  # negative indices, and IndexError past the end
        if i == 0:
            return None
        j = i - 1
        a, b = int(self.starts[j]), int(self.starts[j + 1])
        rank = int(self.ranks[j])
        return TokenLogprob(int(self.token_ids[j]), float(self.logprobs[j]),
                            list(zip(self.top_ids[a:b].tolist(), self.top_values[a:b].tolist())),
                            None if rank == NO_RANK else rank)

    def __iter__(self) -> Iterator[TokenLogprob | None]:
        return iter(self.entries())

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def entries(self) -> list[TokenLogprob | None]:
        """The entries as TokenLogprob objects (what was packed)."""
        ids, lps, ranks = self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()
        pairs = list(zip(self.top_ids.tolist(), self.top_values.tolist()))
        starts = self.starts.tolist()
        return [None] + [TokenLogprob(t, lp, pairs[starts[j]:starts[j + 1]], None if r == NO_RANK else r)
                         for j, (t, lp, r) in enumerate(zip(ids, lps, ranks))]

    def completion_lists(self, prompt_ids: list[int], name: Callable[[int], str]) -> dict:
        """api_logprobs.completion_logprobs(echoed(prompt_ids, self), name, 0), written from the
        columns: the same four lists, value for value."""
        names = [name(t) for t in prompt_ids]
        offsets, offset = [], 0
        for text in names:
            offsets.append(offset)
            offset += len(text)
        values = np.where(np.isfinite(self.logprobs), self.logprobs, LOGPROB_FLOOR).tolist()
        top_values = np.where(np.isfinite(self.top_values), self.top_values, LOGPROB_FLOOR).tolist()
        top_names = [name(t) for t in self.top_ids.tolist()]
        starts = self.starts.tolist()
        tops: list[dict | None] = [None]
        for j, value in enumerate(values):
            top = dict(zip(top_names[starts[j]:starts[j + 1]], top_values[starts[j]:starts[j + 1]]))
            top.setdefault(names[j + 1], value)  # the token itself is always listed, as vLLM does
            tops.append(top)
        return {"tokens": names, "token_logprobs": [None, *values], "top_logprobs": tops, "text_offset": offsets}


class EntryRows(NamedTuple):
    """Consecutive prompt entries of one request: the prompt token each scores, its logprob and
    rank, and its k most likely alternatives (most likely first). Arrays of n rows, any dtypes
    holding the values exactly (fp32 logprobs widened, ids as integers)."""
    token_ids: np.ndarray  # [n]
    logprobs: np.ndarray  # [n]
    ranks: np.ndarray  # [n]
    top_ids: np.ndarray  # [n, k]
    top_values: np.ndarray  # [n, k]


class PromptEntries:
    """A scoring request's prompt entries as they arrive, in order (rows computed by its steps,
    rows read from cached blocks): entry i scores prompt token i + 1, each with the request's k
    alternatives. The columns are made at the first rows, sized for the whole prompt (2 + 2k
    numbers a token), so nothing is built per token."""

    def __init__(self, capacity: int, k: int):
        self.capacity, self.k, self.count = capacity, k, 0
        self._columns: EntryRows | None = None

    def __len__(self) -> int:
        return self.count

    def append(self, rows: EntryRows) -> None:
        n = len(rows.token_ids)
        if not n:
            return
        assert self.count + n <= self.capacity and rows.top_ids.shape == (n, self.k), (self.count, n, self.k)
        if self._columns is None:
            c, k = self.capacity, self.k
            self._columns = EntryRows(np.empty(c, np.int64), np.empty(c, np.float64), np.empty(c, np.int64),
                                      np.empty((c, k), np.int64), np.empty((c, k), np.float64))
        for column, part in zip(self._columns, rows):
            column[self.count:self.count + n] = part
        self.count += n

    def rows(self, start: int, end: int) -> EntryRows:
        """Entries start..end - 1 (views)."""
        assert 0 <= start <= end <= self.count, (start, end, self.count)
        if self._columns is None:  # none yet (block 0 of a 1-token block size holds no entry)
            ints, floats = np.empty(0, np.int64), np.empty(0, np.float64)
            return EntryRows(ints, floats, ints, np.empty((0, self.k), np.int64), np.empty((0, self.k), np.float64))
        return EntryRows(*(column[start:end] for column in self._columns))

    def columns(self) -> PromptLogprobColumns:
        """[None, entry 1, ...]: the prompt's logprobs as the request's output carries them."""
        n, k = self.count, self.k
        ids, logprobs, ranks, top_ids, top_values = self.rows(0, n)
        return PromptLogprobColumns(ids.copy(), logprobs.copy(), ranks.copy(), np.arange(n + 1, dtype=np.int64) * k,
                                    top_ids.reshape(-1).copy(), top_values.reshape(-1).copy())

    def entries(self) -> list[TokenLogprob]:
        """The entries as TokenLogprob objects (tests, and readers that want them one by one)."""
        return self.columns().entries()[1:]
