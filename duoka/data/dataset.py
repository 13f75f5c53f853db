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
import re
import stat
import zlib
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import torch

from duoka.cache import cache_home
from duoka.errors import DuokaError
from duoka.models.qwen2.model import document_starts

RANDOM_DATA = "random"
MANIFEST = "manifest.json"  # of a `duoka prepare` folder
PREPARE_AGAIN = ("run `duoka prepare` again with the same --data and --out: it redoes what is missing or damaged "
                 "and keeps the rest")

TEXT_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz")


def corpus_files(path: Path, suffixes: tuple[str, ...] = TEXT_SUFFIXES) -> list[Path]:
    """The data files at `path`: the file itself, or every file below a folder, sorted."""
    names = ", ".join(suffixes)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.name.endswith(suffixes))
        for f in files:
            _refuse_special(f)
        if not files and any(path.glob("shard-*.npy")):
            raise DuokaError(f"{path} holds `duoka prepare` shards but no {MANIFEST} (an interrupted prepare?)",
                             PREPARE_AGAIN)
        if not files:
            raise DuokaError(f"data folder {path} has no {names} files",
                             "point data.path at a file or a folder of such files")
        return files
    _refuse_special(path)
    if not path.is_file():
        raise DuokaError(f"data.path {path} does not exist", f"pass a file ({names}) or a folder of them")
    if not path.name.endswith(suffixes):
        raise DuokaError(f"data.path {path} is not one of {names}",
                         "convert it to JSONL with one {\"text\": ...} object per line")
    return [path]


_SPECIAL_FILES = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                  (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _refuse_special(path: Path) -> None:
    """A data path that exists but is no regular file (a FIFO, /dev/zero) is named as what it
    is: data is read more than once (tokenized, counted, keyed by size), which a stream cannot
    give, and /dev/zero would be read for ever."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return  # missing: the caller says so
    for test, what in _SPECIAL_FILES:
        if test(mode):
            raise DuokaError(f"data.path {path} is {what}, not a regular file",
                             "save the data to a file first (e.g. `cat STREAM > data.jsonl`) and pass that file")


class Skipped:
    """Malformed records left out: their exact count and the first few, "file:line: reason"."""

    SHOWN = 20  # enough to see the pattern; a corpus may have millions

    def __init__(self):
        self.count = 0
        self.first: list[str] = []

    def add(self, where: str) -> None:
        self.count += 1
        if len(self.first) < self.SHOWN:
            self.first.append(where)


JSON_CONTEXT = 30  # characters of a malformed JSON line shown each side of the error
# Bytes read to tell a binary file from text: a NUL byte among them means binary, as git and grep decide.
BINARY_PROBE = 8192
_NOT_UTF8 = re.compile("[\udc80-\udcff]")  # what surrogateescape makes of each byte that is not UTF-8


def iter_lines(path: Path, on_bad: Callable[[str], None] | None = None) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line of a UTF-8 text file (a byte-order mark at its start
    left out), .gz decompressed, with Python's universal newlines. A binary file is an error
    naming it. A line that is not UTF-8 is an error naming file:line, or, given `on_bad`,
    passed to it as "file:line: reason" and left out."""
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            head = f.read(BINARY_PROBE)
        nul = head.find(b"\0")
        if nul >= 0:
            raise DuokaError(f"{path} is a binary file, not UTF-8 text (a NUL byte at offset {nul})",
                             "remove it from the data, or convert it to UTF-8 text "
                             "(iconv -t UTF-8 for another text encoding)")
        # surrogateescape: a bad byte costs its line only, not the rest of the file, and the
        # line number stays exact (a strict decoder fails on a whole buffered block).
        # utf-8-sig: a byte-order mark at the start (Windows tools write one) is not part of the text.
        with opener(path, "rt", encoding="utf-8-sig", errors="surrogateescape") as f:
            for lineno, line in enumerate(f, start=1):
                bad = _NOT_UTF8.search(line)
                if bad is not None:
                    where = (f"{path}:{lineno}: not UTF-8 (byte 0x{ord(bad.group()) - 0xDC00:02x} at character "
                             f"{bad.start() + 1})")
                    if on_bad is None:
                        raise DuokaError(where, "fix or remove that line, or convert the file to UTF-8 "
                                                "(iconv -t UTF-8); `duoka prepare` skips and counts such lines")
                    on_bad(where)
                    continue
                yield lineno, line
    except (OSError, EOFError, zlib.error) as e:  # unreadable, or a damaged or truncated .gz
        raise DuokaError(f"{path} cannot be read ({str(e) or type(e).__name__})",
                         "check the file (gzip -t for .gz); copy it again if it is damaged") from None


def iter_documents(path: Path, text_field: str, skipped: Skipped | None = None) -> Iterator[str]:
    """The documents of a .txt (blank-line-separated blocks) or JSONL file. A malformed record
    (a line not UTF-8 or not JSON, a JSONL record without the text field) is an error naming
    file:line, or, given `skipped`, counted there and left out (a .txt document whole)."""
    if path.name.endswith(".txt"):
        block: list[str] = []
        bad: list[str] = []  # lines of the current block that were not UTF-8 (left out)
        for _, line in iter_lines(path, bad.append if skipped is not None else None):
            if line.strip():
                block.append(line)
                continue
            if bad:  # a bad line is not blank: it belongs to the block this blank line ends
                skipped.add(f"{bad[0]}; its document was left out")
            elif block:
                yield "".join(block).rstrip("\n")
            block, bad[:] = [], []
        if bad:
            skipped.add(f"{bad[0]}; its document was left out")
        elif block:
            yield "".join(block).rstrip("\n")
        return
    for lineno, record in iter_jsonl(path, skipped):
        text = record.get(text_field) if isinstance(record, dict) else None
        if isinstance(text, str):
            yield text
        elif skipped is not None:
            skipped.add(f"{path}:{lineno}: no string field {text_field!r}")
        else:
            raise DuokaError(f"{path}:{lineno} has no string field {text_field!r}",
                             f"set data.text_field to the field that holds the text (keys here: "
                             f"{', '.join(record) if isinstance(record, dict) else type(record).__name__})")


def json_error(e: json.JSONDecodeError, line: str) -> str:
    """What json found wrong, where, and the text around it (at most JSON_CONTEXT characters
    each side: a line can be megabytes)."""
    start = max(0, e.pos - JSON_CONTEXT)
    near = line[start:e.pos + JSON_CONTEXT].rstrip("\n")
    return f"{e.msg} at column {e.colno}, near {'...' if start else ''}{near!r}"


def iter_jsonl(path: Path, skipped: Skipped | None = None) -> Iterator[tuple[int, object]]:
    """(line number, parsed object) for each non-blank line of a .jsonl or .jsonl.gz file.
    A line that is not UTF-8 or not JSON is an error, or, given `skipped`, counted there and
    left out."""
    for lineno, line in iter_lines(path, skipped.add if skipped is not None else None):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            why = json_error(e, line)
            if skipped is None:
                raise DuokaError(f"{path}:{lineno} is not valid JSON ({why})",
                                 "fix or remove that line (each line must be one JSON object)") from None
            skipped.add(f"{path}:{lineno}: not valid JSON ({why})")
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
    return cache_home() / "tokens"


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
    if out.is_file() and _readable(out):  # a damaged cache is rebuilt, not trusted
        return out

    chunks = list(token_arrays(tokenizer, (doc for f in files for doc in iter_documents(f, text_field)), eot))
    if not chunks:
        raise DuokaError(f"data.path {path} holds no documents", "check the files and data.text_field")
    tokens = np.concatenate(chunks)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp.npy")
    np.save(tmp, tokens)
    os.replace(tmp, out)  # atomic: concurrent launchers never read a half-written cache
    return out


# A document longer than this is tokenized in pieces of at most this many characters: the
# tokenizer holds ~200 bytes a character of what it encodes (a 40 MB line took 6.3 GiB whole),
# so its memory then follows the piece (~50 MB), not the line. Pieces are cut before a space that
# starts a word, where Qwen2's pre-tokenizer splits anyway: the tokens are those of the whole.
PIECE_CHARS = 1 << 18
# Characters encoded per encode_batch call (with at most BATCH_DOCUMENTS documents): the
# encodings of a batch are held together, ~200 MB for 1 Mi characters.
BATCH_CHARS = 1 << 20
BATCH_DOCUMENTS = 1024


def text_pieces(text: str) -> Iterator[str]:
    """`text` in pieces of at most PIECE_CHARS characters, each cut before a single space that
    follows and precedes other characters (a boundary of Qwen2's pre-tokenizer); a stretch of
    half a piece without one is cut where the piece ends."""
    start = 0
    while len(text) - start > PIECE_CHARS:
        end = cut = start + PIECE_CHARS
        at = text.rfind(" ", start + PIECE_CHARS // 2, end)
        while at > 0:
            if not text[at - 1].isspace() and not text[at + 1].isspace():
                cut = at
                break
            at = text.rfind(" ", start + PIECE_CHARS // 2, at)
        yield text[start:cut]
        start = cut
    yield text[start:]


def token_arrays(tokenizer, documents: Iterable[str], eot: int) -> Iterator[np.ndarray]:
    """The uint32 ids of each document, then `eot`, in bounded batches (a long document in
    pieces, text_pieces): the memory this takes does not grow with a document's length."""
    batch: list[str] = []
    chars = 0

    def flush() -> Iterator[np.ndarray]:
        nonlocal chars
        for ids in tokenizer.encode_batch(batch, add_special_tokens=False):
            yield np.asarray(ids + [eot], dtype=np.uint32)
        batch.clear()
        chars = 0

    for doc in documents:
        if len(doc) > PIECE_CHARS:
            yield from flush()
            for piece in text_pieces(doc):
                yield np.asarray(tokenizer.encode_batch([piece], add_special_tokens=False)[0], dtype=np.uint32)
            yield np.asarray([eot], dtype=np.uint32)
            continue
        batch.append(doc)
        chars += len(doc)
        if len(batch) >= BATCH_DOCUMENTS or chars >= BATCH_CHARS:
            yield from flush()
    yield from flush()


def read_manifest(folder: Path) -> dict:
    """The manifest of a `duoka prepare` folder, refused with error/fix naming it when it is
    missing, truncated or lacks what training reads."""
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DuokaError(f"{path} is missing", PREPARE_AGAIN) from None
    except (OSError, ValueError) as e:  # ValueError: JSON (a truncated file) or UTF-8
        raise DuokaError(f"{path} is damaged ({e})", PREPARE_AGAIN) from None
    shards = manifest.get("shards") if isinstance(manifest, dict) else None
    if not (isinstance(shards, list) and "tokenizer" in manifest and "tokenizer_dir" in manifest
            and all(isinstance(s, dict) and isinstance(s.get("file"), str) and isinstance(s.get("tokens"), int)
                    for s in shards)):
        raise DuokaError(f"{path} is damaged (not the manifest `duoka prepare` writes)", PREPARE_AGAIN)
    return manifest


def open_tokens(path: Path, tokens: int | None = None, fix: str = PREPARE_AGAIN) -> np.ndarray:
    """A token file as a read-only memory map, refused with error/fix naming it when it is
    missing, truncated, not a 1-D integer array, or (given `tokens`) not that long."""
    try:
        array = np.load(path, mmap_mode="r")
    except FileNotFoundError:
        raise DuokaError(f"{path} is missing", fix) from None
    except (OSError, ValueError, EOFError) as e:  # numpy says "mmap length is greater than file size" etc.
        raise DuokaError(f"{path} is damaged ({str(e) or type(e).__name__})", fix) from None
    if array.ndim != 1 or array.dtype.kind not in "ui":
        raise DuokaError(f"{path} is damaged (a {array.dtype} array of shape {array.shape}, not 1-D token ids)", fix)
    if tokens is not None and len(array) != tokens:
        raise DuokaError(f"{path} holds {len(array):,} tokens, its manifest {tokens:,}", fix)
    return array


def _readable(path: Path) -> bool:
    try:
        open_tokens(path)
        return True
    except DuokaError:
        return False


# Token ids checked per slice of a memory map: a vectorised max over 64 MiB at a time reads
# the corpus once at memory speed without ever holding more than that slice.
TOKEN_CHECK_CHUNK = 16 * 2**20


def check_token_range(array: np.ndarray, vocab_size: int, name: Path, fix: str) -> None:
    """Every id in [0, vocab_size): an id beyond the embedding would crash a worker mid-run."""
    for start in range(0, len(array), TOKEN_CHECK_CHUNK):
        chunk = array[start : start + TOKEN_CHECK_CHUNK]
        low, high = int(chunk.min()) if chunk.dtype.kind == "i" else 0, int(chunk.max())
        if high >= vocab_size or low < 0:
            at = start + int(np.argmax((chunk >= vocab_size) | (chunk < 0)))
            raise DuokaError(f"{name} holds token id {int(array[at])} at position {at:,}, outside the model's "
                             f"vocabulary of {vocab_size:,}", fix)


class PackedWindows:
    """Window i = stream[i*seq_len : i*seq_len + seq_len + 1] (input and shifted label), where
    the stream is one cached token file or the shards of a `duoka prepare` folder in order.
    Given vocab_size (the launcher, once, before workers start), every token id is checked
    against it."""

    def __init__(self, token_path: Path, seq_len: int, vocab_size: int | None = None):
        if token_path.is_dir():  # a prepared folder
            files = [(token_path / s["file"], s["tokens"]) for s in read_manifest(token_path)["shards"] if s["tokens"]]
            # A shard of the right length with wrong ids looks complete to prepare: it must go first.
            fix, redo = PREPARE_AGAIN, f"delete that shard, then {PREPARE_AGAIN}"
        else:
            files = [(token_path, None)]
            fix = redo = f"delete {token_path} (a cache: the next run rebuilds it)"
        self.shards = [open_tokens(path, tokens, fix) for path, tokens in files]
        if vocab_size is not None:
            for (path, _), shard in zip(files, self.shards):
                check_token_range(shard, vocab_size, path, f"it is damaged or from another tokenizer: {redo}")
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
    of the given sizes (duoka.train.load_balance). With equal shares and full micro-batches
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
