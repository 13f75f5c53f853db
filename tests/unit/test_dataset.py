import gzip
import json

import pytest
import torch

from duoka.data.dataset import (
    PackedWindows,
    corpus_files,
    global_batch_indices,
    iter_documents,
    rank_batches,
    tokenize_corpus,
)
from duoka.data.tokenizer import Tokenizer
from duoka.errors import DuokaError


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DUOKA_CACHE", str(tmp_path / "cache"))


def test_documents_from_text_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("first doc\nline two\n\n\nsecond doc\n")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": "third"}) + "\n\n" + json.dumps({"text": "fourth"}) + "\n")
    files = corpus_files(tmp_path)
    docs = [d for f in files for d in iter_documents(f, "text")]
    assert docs == ["first doc\nline two", "second doc", "third", "fourth"]


def test_malformed_jsonl_names_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(DuokaError, match=r"bad.jsonl:2 is not valid JSON") as e:
        list(iter_documents(p, "text"))
    # Where and what: json's message alone ("Expecting value") says neither.
    assert "at column 10, near '{\"text\": broken'" in e.value.cause
    p.write_text('{"text": "' + "x" * 10_000 + '", oops}\n')
    with pytest.raises(DuokaError, match="at column 10014, near ...'x+\", oops}'") as e:
        list(iter_documents(p, "text"))
    assert len(e.value.cause) < 300  # a megabyte line is not printed whole
    p.write_text('{"content": "no text field"}\n')
    with pytest.raises(DuokaError, match=r"bad.jsonl:1 has no string field 'text'") as e:
        list(iter_documents(p, "text"))
    assert "content" in e.value.fix


def test_tokenized_stream_and_windows(tmp_path, tokenizer_dir):
    tok = Tokenizer(tokenizer_dir)
    p = tmp_path / "c.jsonl"
    p.write_text("\n".join(json.dumps({"text": t}) for t in ["hello world", "the quick brown fox"] * 20))
    token_file = tokenize_corpus(p, tok)
    assert tokenize_corpus(p, tok) == token_file  # cached
    data = PackedWindows(token_file, seq_len=8)
    eot = tok.token_to_id("<|endoftext|>")
    stream = torch.cat([data[i][:-1] for i in range(len(data))])
    expected = (tok.encode("hello world", add_special_tokens=False) + [eot] +
                tok.encode("the quick brown fox", add_special_tokens=False) + [eot])
    assert stream[: len(expected)].tolist() == expected
    assert torch.equal(data[0][-1], data[1][0])  # the label of a window's last token is the next one's first


def test_global_batch_is_the_same_whatever_the_layout():
    data = [torch.full((5,), i) for i in range(37)]
    for step in range(6):
        whole = torch.cat(rank_batches(data, step, 8, 8, 0, 1, seed=3))
        for dp, micro in [(2, 2), (4, 1), (8, 1), (2, 4)]:
            parts = [torch.cat(rank_batches(data, step, 8, micro, r, dp, seed=3)) for r in range(dp)]
            assert torch.equal(torch.cat(parts), whole)
    # Each epoch is a permutation: 37 samples appear once in steps covering one epoch.
    seen = [i for s in range(5) for i in global_batch_indices(s, 8, 37, seed=3)][:37]
    assert sorted(seen) == list(range(37))
    assert global_batch_indices(0, 8, 37, seed=3) != global_batch_indices(0, 8, 37, seed=4)


def test_document_layout():
    from duoka.data.dataset import document_layout

    eot = 0
    x = torch.tensor([[5, 6, 0, 7, 8, 9, 0, 4], [0, 3, 3, 0, 0, 2, 2, 2]])
    doc, pos = document_layout(x, eot)
    assert doc.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2], [0, 1, 1, 1, 2, 3, 3, 3]]
    assert pos.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 0, 1, 2, 0, 0, 1, 2]]
    from duoka.models.qwen2.model import document_starts

    # varlen's offsets into the flattened 16 tokens: row 1 starts a new document at 8.
    assert document_starts(doc).tolist() == [0, 3, 7, 8, 9, 12, 13, 16]


@pytest.mark.parametrize("backend", [
    "sdpa", "flex",
    pytest.param("varlen", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="flash varlen is CUDA only")),
])
def test_packed_forward_equals_separate_documents(backend):
    """With document masking a packed window computes, for every token, exactly what the
    model computes on that token's document alone, whichever kernel applies the mask; two
    rows check that documents are told apart per row."""
    from duoka.data.dataset import document_layout
    from duoka.models.qwen2.args import ModelArgs, ModelOptions
    from duoka.models.qwen2.model import build_model, materialize

    args = ModelArgs(vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=96,
                     tie_word_embeddings=False)
    device = "cuda" if backend == "varlen" else "cpu"
    model = materialize(build_model(args, ModelOptions(document_masking=backend)), device,
                        torch.bfloat16 if device == "cuda" else None)
    model.init_weights(seed=1)
    eot = 299
    g = torch.Generator().manual_seed(0)
    rows = []
    for lengths in ((7, 12, 5), (3, 20, 1)):
        docs = [torch.randint(0, 299, (n,), generator=g) for n in lengths]
        rows.append([torch.cat([d, torch.tensor([eot])]).to(device) for d in docs])
    packed = torch.stack([torch.cat(docs) for docs in rows])
    doc_ids, positions = document_layout(packed, eot)
    tol = 1e-2 if device == "cuda" else 1e-5
    with torch.no_grad():
        together = model(packed, positions=positions, document_ids=doc_ids)
        apart = [torch.cat([model(d[None])[0] for d in docs]) for docs in rows]
        plain = model(packed)
    for row in range(len(rows)):
        assert ((together[row] - apart[row]).norm() / apart[row].norm()) <= tol
        assert ((plain[row] - apart[row]).norm() / apart[row].norm()) > 1e-2  # unmasked: later documents differ


class CountSpy:
    """multiprocessing.Value's surface, recording every value the worker sets."""

    def __init__(self):
        self.values = [0]

    def get_lock(self):
        import contextlib

        return contextlib.nullcontext()

    @property
    def value(self):
        return self.values[-1]

    @value.setter
    def value(self, v):
        self.values.append(v)


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_prepare_progress_counts_bytes_within_one_large_file(tmp_path, monkeypatch, suffix):
    """One large file moves the bar while it is read (it counted files: nothing until done),
    and ends at the file's size, a .gz file's uncompressed size."""
    from duoka.data import prepare
    from duoka.hub import bundled_model_dir

    text = "".join(json.dumps({"text": f"line {i}: the quick brown fox jumps over the lazy dog"}) + "\n"
                   for i in range(20_000))  # ~1.2 MB
    src = tmp_path / f"big{suffix}"
    if suffix.endswith(".gz"):
        with gzip.open(src, "wt") as f:
            f.write(text)
    else:
        src.write_text(text)
    assert prepare.input_size(src) == len(text.encode())
    monkeypatch.setattr(prepare, "REPORT_BYTES", 64 << 10)
    spy = CountSpy()
    monkeypatch.setattr(prepare, "_worker_progress", spy)
    monkeypatch.setattr(prepare, "_worker_tokenizer", Tokenizer(bundled_model_dir()))
    prepare._tokenize_file(str(src), str(tmp_path / "shard-00000.npy"), "text", 0, "fingerprint")
    assert spy.values == sorted(spy.values) and spy.values[-1] == len(text.encode())
    assert sum(0 < v < len(text.encode()) for v in spy.values) >= 10, spy.values  # moved while reading
