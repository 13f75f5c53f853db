"""`duoka prepare`: tokenize a corpus once into memory-mapped token shards with a manifest.

Each source file becomes one shard (`shard-00000.npy`, uint32 ids, documents separated by
the end-of-text token) with a small JSON record beside it (source, size and mtime,
documents, tokens, malformed lines). Files are tokenized in parallel worker processes.
A shard counts as done once its record exists (the record is written after the shard, both
atomically), so an interrupted run resumes where it stopped and a repeated run on
unchanged input with the same tokenizer does nothing. `manifest.json` is written last.

Training reads the folder with `data.path=DIR`: the shards in order form the same token
stream as tokenizing the files at launch would.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np

from duoka.data.dataset import TEXT_SUFFIXES, corpus_files, end_of_text_id, iter_documents, iter_jsonl
from duoka.data.tokenizer import Tokenizer
from duoka.errors import DuokaError

MANIFEST = "manifest.json"
_worker_tokenizer: Tokenizer | None = None


def source_files(path: Path) -> list[Path]:
    return corpus_files(path, TEXT_SUFFIXES + (".parquet",))


def _documents(path: Path, text_field: str, malformed: list):
    """Documents of one file; malformed records are noted (file:line, reason) and skipped."""
    if path.name.endswith(".txt"):
        yield from iter_documents(path, text_field)
        return
    if path.name.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DuokaError(f"{path} is Parquet, which needs pyarrow", "pip install pyarrow") from None
        table = pq.read_table(path, columns=[text_field]) if text_field in pq.read_schema(path).names else None
        if table is None:
            raise DuokaError(f"{path} has no column {text_field!r}", "set --text-field to the text column")
        for row, text in enumerate(table.column(text_field).to_pylist(), start=1):
            if isinstance(text, str):
                yield text
            else:
                malformed.append(f"{path}:row {row}: {text_field} is {type(text).__name__}, not text")
        return
    try:
        for lineno, record in iter_jsonl(path, malformed):
            text = record.get(text_field) if isinstance(record, dict) else None
            if isinstance(text, str):
                yield text
            else:
                malformed.append(f"{path}:{lineno}: no string field {text_field!r}")
    except UnicodeDecodeError as e:
        malformed.append(f"{path}: not UTF-8 ({e.reason}); the rest of the file was skipped")


def _init_worker(tokenizer_dir: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = Tokenizer(tokenizer_dir)


def _tokenize_file(source: str, shard: str, text_field: str, eot: int) -> dict:
    tok = _worker_tokenizer
    malformed: list[str] = []
    chunks, batch, docs = [], [], 0

    def flush():
        for ids in tok.encode_batch(batch, add_special_tokens=False):
            chunks.append(np.asarray(ids + [eot], dtype=np.uint32))
        batch.clear()

    for doc in _documents(Path(source), text_field, malformed):
        batch.append(doc)
        docs += 1
        if len(batch) >= 1024:
            flush()
    flush()
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint32)
    shard_path = Path(shard)
    tmp = shard_path.with_name(shard_path.name + f".{os.getpid()}.tmp.npy")
    np.save(tmp, tokens)
    os.replace(tmp, shard_path)
    st = Path(source).stat()
    record = {"source": source, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "shard": shard_path.name,
              "documents": docs, "tokens": int(len(tokens)), "malformed": malformed}
    _write_json(shard_path.with_suffix(".json"), record)  # last: marks the shard complete
    return record


def _write_json(path: Path, data) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def prepare(data: Path, out: Path, tokenizer_dir: Path, text_field: str = "text", workers: int | None = None,
            on_error: str = "skip", log=print, progress: bool = True) -> dict:
    tokenizer = Tokenizer(tokenizer_dir)
    eot = end_of_text_id(tokenizer)
    files = source_files(data)
    out.mkdir(parents=True, exist_ok=True)
    old = json.loads((out / MANIFEST).read_text()) if (out / MANIFEST).is_file() else None
    if old and old["tokenizer"] != tokenizer.fingerprint:
        raise DuokaError(f"{out} was prepared with another tokenizer ({old['tokenizer']})",
                         "prepare into a new folder, or delete this one")
    shards = [out / f"shard-{i:05d}.npy" for i in range(len(files))]
    todo = []
    for src, shard in zip(files, shards):
        rec_path = shard.with_suffix(".json")
        rec = json.loads(rec_path.read_text()) if rec_path.is_file() else None
        st = src.stat()
        if not (rec and rec["source"] == str(src) and rec["size"] == st.st_size and rec["mtime_ns"] == st.st_mtime_ns
                and shard.is_file()):
            todo.append((src, shard))
    if not todo and old is not None:
        log(f"duoka: {out} is up to date ({old['documents']:,} documents, {old['tokens']:,} tokens); nothing to do")
        return old

    workers = workers or min(len(todo), os.cpu_count() or 1) or 1
    log(f"duoka: tokenizing {len(todo)} of {len(files)} files with {workers} worker(s) into {out}")
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("prepare"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  disable=not progress, transient=True) as bar, \
            ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(str(tokenizer.folder),)) as pool:
        task = bar.add_task("files", total=len(todo))
        futures = [pool.submit(_tokenize_file, str(src), str(shard), text_field, eot) for src, shard in todo]
        for fut in as_completed(futures):
            fut.result()
            bar.advance(task)

    records = [json.loads(s.with_suffix(".json").read_text()) for s in shards]
    malformed = [m for r in records for m in r["malformed"]]
    for line in malformed[:20]:
        log(f"duoka: malformed: {line}")
    if len(malformed) > 20:
        log(f"duoka: ... and {len(malformed) - 20} more malformed records")
    if malformed and on_error == "fail":
        raise DuokaError(f"{len(malformed)} malformed record(s), first: {malformed[0]}",
                         "fix the input, or pass --on-error skip to leave them out")
    manifest = {"tokenizer": tokenizer.fingerprint, "tokenizer_dir": str(tokenizer.folder), "end_of_text": eot,
                "text_field": text_field, "documents": sum(r["documents"] for r in records),
                "tokens": sum(r["tokens"] for r in records), "malformed": len(malformed),
                "shards": [{"file": r["shard"], "source": r["source"], "documents": r["documents"],
                            "tokens": r["tokens"]} for r in records]}
    _write_json(out / MANIFEST, manifest)
    log(f"duoka: {manifest['documents']:,} documents, {manifest['tokens']:,} tokens in {len(records)} shard(s); "
        f"{len(malformed)} malformed record(s) skipped")
    return manifest


def is_prepared(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST).is_file()
