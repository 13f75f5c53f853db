"""A first data path: text or JSONL documents, tokenized once into a cached token array,
packed into fixed windows, and served in a global deterministic order.

Documents are joined with an end-of-text token between them and cut into windows of
seq_len + 1 tokens (inputs and shifted labels), so no token is wasted on padding.
Attention may cross a document boundary here; document masking, `duoka prepare` and
resumable sampling are the data issue's.

The order is global: the samples of step s are positions [s*B, (s+1)*B) of an endless
stream of per-epoch permutations seeded by (seed, epoch). Data-parallel rank r takes a
contiguous slice of that global batch. The global batch is therefore the same set of
samples whatever the number of ranks or micro-batches, which is what makes every layout
compute the same gradient.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from duoka.errors import DuokaError
from duoka.models.qwen2.model import document_starts

RANDOM_DATA = "random"


TEXT_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz")


def corpus_files(path: Path, suffixes: tuple[str, ...] = TEXT_SUFFIXES) -> list[Path]:
    """The data files at `path`: the file itself, or every file below a folder, sorted."""
    names = ", ".join(suffixes)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.name.endswith(suffixes))
        if not files:
            raise DuokaError(f"data folder {path} has no {names} files",
                             "point data.path at a file or a folder of such files")
        return files
    if not path.is_file():
        raise DuokaError(f"data.path {path} does not exist", f"pass a file ({names}) or a folder of them")
    if not path.name.endswith(suffixes):
        raise DuokaError(f"data.path {path} is not one of {names}",
                         "convert it to JSONL with one {\"text\": ...} object per line")
    return [path]


def iter_documents(path: Path, text_field: str) -> Iterator[str]:
    if path.name.endswith(".txt"):
        # One document per block separated by a blank line.
        block: list[str] = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    block.append(line)
                elif block:
                    yield "".join(block).rstrip("\n")
                    block = []
        if block:
            yield "".join(block).rstrip("\n")
        return
    for lineno, record in iter_jsonl(path):
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise DuokaError(f"{path}:{lineno} has no string field {text_field!r}",
                             f"set data.text_field to the field that holds the text (keys here: "
                             f"{', '.join(record) if isinstance(record, dict) else type(record).__name__})")
        yield text


def iter_jsonl(path: Path, malformed: list[str] | None = None) -> Iterator[tuple[int, object]]:
    """(line number, parsed object) for each non-blank line of a .jsonl or .jsonl.gz file.
    A line that is not JSON is an error, or, given a `malformed` list, noted there as
    "file:line: reason" and skipped."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                if malformed is None:
                    raise DuokaError(f"{path}:{lineno} is not valid JSON ({e.msg})",
                                     "fix or remove that line (each line must be one JSON object)") from None
                malformed.append(f"{path}:{lineno}: not valid JSON ({e.msg})")
                continue
            yield lineno, record


def cache_key(files: list[Path], *parts: object) -> str:
    """Names a cached product of these files: changes when a file's path, size or mtime
    changes, or any of the parts (tokenizer fingerprint, fields, lengths)."""
    key = hashlib.sha256()
    for f in files:
        st = f.stat()
        key.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    key.update("|".join(map(str, parts)).encode())
    return key.hexdigest()[:24]


def _cache_dir() -> Path:
    base = os.environ.get("DUOKA_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "duoka")
    return Path(base).expanduser() / "tokens"


def end_of_text_id(tokenizer) -> int:
    """The token between packed documents: Qwen2's <|endoftext|>, else the eos token."""
    eot = tokenizer.token_to_id("<|endoftext|>")
    if eot is None:
        eot = tokenizer.eos_id
    if eot is None:
        raise DuokaError(f"tokenizer {tokenizer.folder} has no <|endoftext|> or eos token to separate documents",
                         "use a Qwen2 tokenizer")
    return eot


def tokenize_corpus(path: Path, tokenizer, text_field: str = "text") -> Path:
    """Token ids of all documents, end-of-text between them, as a cached uint32 .npy file.

    The cache key covers the files (path, size, mtime), the tokenizer's content hash and
    the field, so a changed corpus or tokenizer is tokenized again."""
    files = corpus_files(path)
    eot = end_of_text_id(tokenizer)
    out = _cache_dir() / f"{cache_key(files, tokenizer.fingerprint, text_field, eot)}.npy"
    if out.is_file():
        return out

    chunks, batch = [], []

    def flush():
        for ids in tokenizer.encode_batch(batch, add_special_tokens=False):
            chunks.append(np.asarray(ids + [eot], dtype=np.uint32))
        batch.clear()

    for f in files:
        for doc in iter_documents(f, text_field):
            batch.append(doc)
            if len(batch) >= 1024:
                flush()
    flush()
    if not chunks:
        raise DuokaError(f"data.path {path} holds no documents", "check the files and data.text_field")
    tokens = np.concatenate(chunks)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp.npy")
    np.save(tmp, tokens)
    os.replace(tmp, out)  # atomic: concurrent launchers never read a half-written cache
    return out


class PackedWindows:
    """Window i = stream[i*seq_len : i*seq_len + seq_len + 1] (input and shifted label), where
    the stream is one cached token file or the shards of a `duoka prepare` folder in order."""

    def __init__(self, token_path: Path, seq_len: int):
        if token_path.is_dir():  # a prepared folder
            manifest = json.loads((token_path / "manifest.json").read_text())
            self.shards = [np.load(token_path / s["file"], mmap_mode="r") for s in manifest["shards"] if s["tokens"]]
        else:
            self.shards = [np.load(token_path, mmap_mode="r")]
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])
        total = int(self.starts[-1])
        self.seq_len = seq_len
        self.n = (total - 1) // seq_len
        if self.n < 1:
            raise DuokaError(f"the corpus has {total} tokens, fewer than one window of "
                             f"training.seq_len + 1 = {seq_len + 1}", "use more data or a shorter training.seq_len")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        start, end = i * self.seq_len, i * self.seq_len + self.seq_len + 1
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        parts = []
        while start < end:  # a window may span the end of one shard and the start of the next
            shard, offset = self.shards[first], start - int(self.starts[first])
            take = min(end - start, len(shard) - offset)
            parts.append(shard[offset : offset + take])
            start += take
            first += 1
        return torch.from_numpy(np.concatenate(parts).astype(np.int64))


class RandomTokens:
    """Uniform random tokens, a pure function of the sample index (for throughput runs)."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.n = 2**40

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((self.seed, i)) & 0x7FFFFFFFFFFFFFFF)
        return torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=g)


def split_batch(batch: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A stacked micro-batch -> (inputs, labels). Pretraining items are [seq_len + 1]
    token windows; SFT items are [2, seq_len + 1] (tokens, target flags), whose non-target
    labels become ignore_index."""
    if batch.dim() == 2:
        return batch[:, :-1], batch[:, 1:]
    tokens, keep = batch[:, 0], batch[:, 1]
    return tokens[:, :-1], tokens[:, 1:].masked_fill(keep[:, 1:] == 0, ignore_index)


def document_layout(inputs: torch.Tensor, eot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token document index and position within the document for packed inputs
    [batch, seq]: a document ends with its end-of-text token, the next one starts after it."""
    is_eot = inputs == eot
    doc = torch.cumsum(is_eot.long(), dim=1) - is_eot.long()  # the end-of-text stays in its document
    index = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
    starts = torch.ones_like(is_eot)
    starts[:, 1:] = is_eot[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return doc, index - first


def step_inputs(batch: torch.Tensor, ignore_index: int, end_of_text: int | None, varlen: bool,
                always_positions: bool = False) -> dict:
    """One micro-batch as the tensors a training step feeds the model, built on the host
    (in the data thread) so the GPU never waits on data-dependent shapes: tokens and
    labels; with document masking (end_of_text set) the document ids, positions restarting
    per document, and for the varlen kernel the documents' cumulative lengths.
    always_positions: give [batch, seq] positions even without document masking (model
    parallelism: a pipeline stage or a sequence shard cannot infer them from its input)."""
    tokens, labels = split_batch(batch, ignore_index)
    out = {"tokens": tokens, "labels": labels}
    if end_of_text is not None:
        out["document_ids"], out["positions"] = document_layout(tokens, end_of_text)
        if varlen:
            out["cu_seqlens"] = document_starts(out["document_ids"])
    elif always_positions:
        out["positions"] = torch.arange(tokens.shape[1]).expand_as(tokens).contiguous()
    return out


def global_batch_indices(step: int, global_batch: int, n_samples: int, seed: int) -> list[int]:
    """Sample indices of optimizer step `step` (0-based): a function of (seed, step) only."""
    if n_samples > 2**32:  # RandomTokens: every index is already random, nothing to shuffle
        return list(range(step * global_batch, (step + 1) * global_batch))
    out = []
    for pos in range(step * global_batch, (step + 1) * global_batch):
        epoch, offset = divmod(pos, n_samples)
        out.append(int(_permutation(n_samples, seed, epoch)[offset]))
    return out


_PERM_CACHE: dict[tuple[int, int, int], np.ndarray] = {}


def _permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    key = (n, seed, epoch)
    if key not in _PERM_CACHE:
        _PERM_CACHE.clear()  # one epoch at a time is all a run needs
        _PERM_CACHE[key] = np.random.default_rng([seed, epoch]).permutation(n)
    return _PERM_CACHE[key]


def rank_batches(dataset, step: int, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int,
                 seed: int) -> list[torch.Tensor]:
    """This rank's micro-batches for `step`, each [micro_batch, seq_len + 1]."""
    per_rank = global_batch // dp_size
    indices = global_batch_indices(step, global_batch, len(dataset), seed)[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    return [torch.stack([dataset[i] for i in indices[k : k + micro_batch]]) for k in range(0, per_rank, micro_batch)]


def share_batches(dataset, step: int, global_batch: int, offset: int, sizes: list[int],
                  seed: int) -> list[torch.Tensor]:
    """A load-balanced rank's micro-batches for `step`: its contiguous slice
    [offset, offset + sum(sizes)) of the step's global sample order, cut into micro-batches
    of the given sizes (duoka.parallel.balance). With equal shares and full micro-batches
    this is rank_batches."""
    indices = global_batch_indices(step, global_batch, len(dataset), seed)[offset:offset + sum(sizes)]
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    return [torch.stack([dataset[i] for i in indices[a:a + n]]) for a, n in zip(starts, sizes)]


class Prefetcher:
    """Builds the next steps' micro-batches in a background thread, in pinned memory on
    GPU machines, so the training loop only waits when the host falls behind; that wait
    is what metrics.jsonl reports as data_time_s. A thread suffices: the work is numpy
    slicing and a copy, which release the GIL."""

    def __init__(self, make_batches, first_step: int, last_step: int, pin: bool, depth: int = 2):
        import queue
        import threading

        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()

        def run():
            try:
                for step in range(first_step, last_step):
                    batches = make_batches(step)
                    if pin:
                        batches = [{k: t.pin_memory() for k, t in b.items()} for b in batches]
                    while not self._stop.is_set():
                        try:
                            self._queue.put((step, batches), timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    if self._stop.is_set():
                        return
            except BaseException as e:  # surfaced in the training loop, not lost in a thread
                self._queue.put((None, e))

        self._thread = threading.Thread(target=run, name="duoka-data", daemon=True)
        self._thread.start()

    def get(self, step: int) -> list[dict[str, torch.Tensor]]:
        got, batches = self._queue.get()
        if got is None:
            raise batches
        assert got == step, f"data for step {got} arrived while step {step} was expected"
        return batches

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
