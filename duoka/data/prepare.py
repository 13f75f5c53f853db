"""`duoka prepare`: tokenize a corpus once into memory-mapped token shards with a manifest.

Each source file becomes one shard (`shard-00000.npy`, uint32 ids, documents separated by
the end-of-text token) with a small JSON record beside it (source, size and mtime,
documents, tokens, the count of malformed records and the first few). Files are tokenized
in parallel worker processes. A shard counts as done once its record exists (the record is
written after the shard, both atomically), names the source as it is now, the tokenizer and
the text field, and the shard has the recorded length; so an interrupted run resumes where
it stopped, a damaged or missing shard is redone, and a repeated run on unchanged input
does nothing. `manifest.json` is written last.

Each malformed record (a JSONL line that is not UTF-8 or not JSON or lacks the text field,
a .txt document with a line that is not UTF-8, a Parquet row that is not text) is counted
and left out, or with on_error="fail" ends the run; a binary or unreadable file is an error.

Training reads the folder with `data.path=DIR`: the shards in order form the same token
stream as tokenizing the files at launch would.

The progress bar counts input bytes as the workers read them (a single large file moves it
too): each worker adds the size of the text it has read to a shared counter, at most the
file's size, and the rest once the file is done. A .gz file counts its uncompressed size
(the gzip trailer's, modulo 4 GiB).
"""

from __future__ import annotations

import json
import multiprocessing
import os
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path

import numpy as np

from duoka.data.dataset import (
    MANIFEST,
    TEXT_SUFFIXES,
    Skipped,
    corpus_files,
    end_of_text_id,
    iter_documents,
    open_tokens,
    read_manifest,
    token_arrays,
)
from duoka.data.tokenizer import Tokenizer
from duoka.errors import DATA_INSTALL, DuokaError

_worker_tokenizer: Tokenizer | None = None
_worker_progress = None  # the shared count of input bytes read (multiprocessing.Value)
# A worker adds to the shared count once per this many bytes read (a lock each time).
REPORT_BYTES = 1 << 20
# How often the bar redraws from the shared count while the workers run.
BAR_REFRESH_S = 0.25


def source_files(path: Path) -> list[Path]:
    return corpus_files(path, TEXT_SUFFIXES + (".parquet",))


def _documents(path: Path, text_field: str, skipped: Skipped):
    """Documents of one file; each malformed record (a JSONL line, a .txt document, a Parquet
    row) is counted in `skipped` and left out."""
    if not path.name.endswith(".parquet"):
        yield from iter_documents(path, text_field, skipped)
        return
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DuokaError(f"{path} is Parquet, which needs pyarrow", DATA_INSTALL) from None
    try:
        table = pq.read_table(path, columns=[text_field]) if text_field in pq.read_schema(path).names else None
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise DuokaError(f"{path} cannot be read as Parquet ({e})", "check the file; copy it again if it is damaged") \
            from None
    if table is None:
        raise DuokaError(f"{path} has no column {text_field!r}", "set --text-field to the text column")
    for row, text in enumerate(table.column(text_field).to_pylist(), start=1):
        if isinstance(text, str):
            yield text
        else:
            skipped.add(f"{path}:row {row}: {text_field} is {type(text).__name__}, not text")


def input_size(path: Path) -> int:
    """The bytes of text a file holds, for the progress bar: its size, or a .gz file's
    uncompressed size from the gzip trailer (modulo 4 GiB; the file's size where that is less)."""
    size = path.stat().st_size
    if path.name.endswith(".gz") and size >= 4:
        with open(path, "rb") as f:
            f.seek(-4, os.SEEK_END)
            return max(size, int.from_bytes(f.read(4), "little"))
    return size


class _ReadBytes:
    """A worker's share of the shared count for one file: the text read, at most the file's
    size, added in steps of REPORT_BYTES; the rest when the file is done."""

    def __init__(self, total: int):
        self.total, self.pending, self.added = total, 0, 0

    def _add(self, n: int) -> None:
        n = min(n, self.total - self.added)
        if n > 0 and _worker_progress is not None:
            with _worker_progress.get_lock():
                _worker_progress.value += n
        self.added += max(n, 0)

    def read(self, text: str) -> None:
        self.pending += len(text) + 1  # characters: bytes for ASCII, an estimate otherwise; its line end
        if self.pending >= REPORT_BYTES:
            self._add(self.pending)
            self.pending = 0

    def done(self) -> None:
        self._add(self.total - self.added)


def _init_worker(tokenizer_dir: str, progress=None) -> None:
    global _worker_tokenizer, _worker_progress
    _worker_tokenizer = Tokenizer(tokenizer_dir)
    _worker_progress = progress


def _tokenize_file(source: str, shard: str, text_field: str, eot: int, tokenizer: str) -> dict:
    skipped = Skipped()
    docs = 0
    read = _ReadBytes(input_size(Path(source)))

    def counted():
        nonlocal docs
        for doc in _documents(Path(source), text_field, skipped):
            docs += 1
            read.read(doc)
            yield doc

    chunks = list(token_arrays(_worker_tokenizer, counted(), eot))
    read.done()
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint32)
    shard_path = Path(shard)
    tmp = shard_path.with_name(shard_path.name + f".{os.getpid()}.tmp.npy")
    np.save(tmp, tokens)
    os.replace(tmp, shard_path)
    st = Path(source).stat()
    record = {"source": source, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "shard": shard_path.name,
              "tokenizer": tokenizer, "text_field": text_field, "documents": docs, "tokens": int(len(tokens)),
              "malformed_count": skipped.count, "malformed": skipped.first}
    _write_json(shard_path.with_suffix(".json"), record)  # last: marks the shard complete
    return record


def _write_json(path: Path, data) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _read_record(path: Path) -> dict | None:
    """A shard's record, or None when it is missing or damaged (the shard is then redone)."""
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def _shard_done(rec: dict | None, src: Path, shard: Path, tokenizer: str, text_field: str, old: dict | None) -> bool:
    """The shard is the tokenization of src as it is now, with this tokenizer and field, and intact.
    Records of older versions name neither tokenizer nor field: those of their manifest apply."""
    if rec is None:
        return False
    st = src.stat()
    old = old or {}
    try:
        same = (rec["source"] == str(src) and rec["size"] == st.st_size and rec["mtime_ns"] == st.st_mtime_ns
                and rec.get("tokenizer", old.get("tokenizer")) == tokenizer
                and rec.get("text_field", old.get("text_field")) == text_field)
        if same and rec["tokens"]:
            open_tokens(shard, rec["tokens"])
        return same and shard.is_file()
    except (KeyError, TypeError, DuokaError):  # a record of another shape, or a truncated or missing shard
        return False


def prepare(data: Path, out: Path, tokenizer_dir: Path, text_field: str = "text", workers: int | None = None,
            on_error: str = "skip", log=print, progress: bool = True) -> dict:
    tokenizer = Tokenizer(tokenizer_dir)
    eot = end_of_text_id(tokenizer)
    files = source_files(data)
    out.mkdir(parents=True, exist_ok=True)
    old = None
    if (out / MANIFEST).is_file():
        try:
            old = read_manifest(out)
        except DuokaError as e:  # rewritten at the end; the records alone say which shards are sound
            log(f"duoka: {e.cause}; it is written again")
    if old and old["tokenizer"] != tokenizer.fingerprint:
        raise DuokaError(f"{out} was prepared with another tokenizer ({old['tokenizer']})",
                         "prepare into a new folder, or delete this one")
    shards = [out / f"shard-{i:05d}.npy" for i in range(len(files))]
    todo = [(src, shard) for src, shard in zip(files, shards)
            if not _shard_done(_read_record(shard.with_suffix(".json")), src, shard, tokenizer.fingerprint,
                               text_field, old)]
    if not todo and old is not None:
        log(f"duoka: {out} is up to date ({old['documents']:,} documents, {old['tokens']:,} tokens); nothing to do")
        return old

    workers = workers or min(len(todo), os.cpu_count() or 1) or 1
    total = sum(input_size(src) for src, _ in todo)
    log(f"duoka: tokenizing {len(todo)} of {len(files)} files ({total / 1e6:,.1f} MB) with {workers} worker(s) into "
        f"{out}")
    _tokenize_files(todo, text_field, eot, tokenizer, workers, total, progress)

    records = [json.loads(s.with_suffix(".json").read_text()) for s in shards]
    # Records before malformed_count listed every malformed record.
    skipped = sum(r.get("malformed_count", len(r["malformed"])) for r in records)
    first = [m for r in records for m in r["malformed"]][: Skipped.SHOWN]
    for line in first:
        log(f"duoka: malformed: {line}")
    if skipped > len(first):
        log(f"duoka: ... and {skipped - len(first):,} more malformed records")
    if skipped and on_error == "fail":
        raise DuokaError(f"{skipped:,} malformed record(s), first: {first[0]}",
                         "fix the input, or pass --on-error skip to leave them out")
    if not sum(r["documents"] for r in records):
        what = f"all {skipped:,} records are malformed (first: {first[0]})" if skipped else "it holds no text"
        raise DuokaError(f"nothing to train on in {data}: {what}",
                         f"check the input's format (one JSON object per line with a string field {text_field!r}, "
                         "or plain .txt)" + ("; or set --text-field to the field that holds the text" if skipped else ""))
    manifest = {"tokenizer": tokenizer.fingerprint, "tokenizer_dir": str(tokenizer.folder), "end_of_text": eot,
                "text_field": text_field, "documents": sum(r["documents"] for r in records),
                "tokens": sum(r["tokens"] for r in records), "malformed": skipped,
                "shards": [{"file": r["shard"], "source": r["source"], "documents": r["documents"],
                            "tokens": r["tokens"]} for r in records]}
    _write_json(out / MANIFEST, manifest)
    log(f"duoka: {manifest['documents']:,} documents, {manifest['tokens']:,} tokens in {len(records)} shard(s); "
        f"{skipped:,} malformed record(s) skipped")
    return manifest


def _tokenize_files(todo: list[tuple[Path, Path]], text_field: str, eot: int, tokenizer: Tokenizer, workers: int,
                    total: int, progress: bool) -> None:
    """The files in worker processes, with a bar of the input bytes read (progress: shown)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    read = multiprocessing.Value("q", 0)
    with Progress(TextColumn("prepare"), BarColumn(), DownloadColumn(), TextColumn("{task.fields[files]}"),
                  TimeElapsedColumn(), TimeRemainingColumn(), disable=not progress, transient=True) as bar, \
            ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(str(tokenizer.folder), read)) as pool:
        task = bar.add_task("bytes", total=total, files=f"0/{len(todo)} files")
        pending = {pool.submit(_tokenize_file, str(src), str(shard), text_field, eot, tokenizer.fingerprint)
                   for src, shard in todo}
        while pending:
            finished, pending = wait(pending, timeout=BAR_REFRESH_S, return_when=FIRST_COMPLETED)
            for fut in finished:
                fut.result()
            bar.update(task, completed=read.value, files=f"{len(todo) - len(pending)}/{len(todo)} files")


def is_prepared(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST).is_file()
