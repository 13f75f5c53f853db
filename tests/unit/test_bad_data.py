"""Malformed data ends in error/fix naming the file (and line), or is skipped and counted
exactly: binary files, non-UTF-8 lines, damaged prepared folders and caches, token ids
beyond the vocabulary, malformed SFT messages, bad generation flags. A byte-order mark is
accepted, a FIFO or device is named as such, and a huge line costs the tokenizer no more
memory than a short one."""

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from duoka.data import dataset
from duoka.data.dataset import PackedWindows, Skipped, iter_documents, tokenize_corpus
from duoka.data.prepare import prepare
from duoka.data.sft import prepare_sft
from duoka.data.tokenizer import Tokenizer
from duoka.errors import DuokaError
from duoka.serve.params import SamplingParams

BAD = b"caf\xe9"  # Latin-1, not UTF-8


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DUOKA_CACHE", str(tmp_path / "cache"))


def jsonl(docs) -> bytes:
    return b"".join(json.dumps({"text": d}).encode() + b"\n" for d in docs)


def test_binary_file_is_an_error_naming_it(tmp_path):
    p = tmp_path / "model.jsonl"
    p.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    for skipped in (None, Skipped()):  # training and prepare alike
        with pytest.raises(DuokaError, match=r"model.jsonl is a binary file, not UTF-8 text") as e:
            list(iter_documents(p, "text", skipped))
        assert "iconv" in e.value.fix
    gz = tmp_path / "cut.jsonl.gz"
    gz.write_bytes(gzip.compress(jsonl(["a document"] * 200))[:-30])  # truncated
    with pytest.raises(DuokaError, match=r"cut.jsonl.gz cannot be read"):
        list(iter_documents(gz, "text"))


def test_non_utf8_line_names_file_and_line_or_is_counted(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_bytes(jsonl(["one", "two"]) + b'{"text": "' + BAD + b'"}\n' + jsonl(["four"]))
    with pytest.raises(DuokaError, match=r"c.jsonl:3: not UTF-8 \(byte 0xe9 at character 14\)"):
        list(iter_documents(p, "text"))  # training: an error, as a line that is not JSON is
    skipped = Skipped()
    assert list(iter_documents(p, "text", skipped)) == ["one", "two", "four"]  # only its line is lost
    assert skipped.count == 1 and skipped.first == [f"{p}:3: not UTF-8 (byte 0xe9 at character 14)"]

    t = tmp_path / "d.txt"  # .txt: the document holding the line is left out, counted once
    t.write_bytes(b"first doc\n\nsecond " + BAD + b"\nmore " + BAD + b"\n\nthird\n\n" + BAD + b"\n")
    skipped = Skipped()
    assert list(iter_documents(t, "text", skipped)) == ["first doc", "third"]
    assert skipped.count == 2
    assert skipped.first[0] == f"{t}:3: not UTF-8 (byte 0xe9 at character 11); its document was left out"


def test_prepare_counts_every_skip_exactly(tmp_path, tokenizer_dir):
    """A bad byte on line 43 of 100 documents cost the rest of the file and was counted once."""
    src = tmp_path / "src"
    src.mkdir()
    lines = jsonl([f"document {i}" for i in range(100)]).splitlines(keepends=True)
    lines[42] = b'{"text": "' + BAD + b'"}\n'
    lines[70] = b"{not json\n"
    (src / "a.jsonl").write_bytes(b"".join(lines))
    out = tmp_path / "p"
    logged = []
    manifest = prepare(src, out, tokenizer_dir, workers=1, log=logged.append, progress=False)
    assert (manifest["documents"], manifest["malformed"]) == (98, 2)
    assert f"duoka: malformed: {src / 'a.jsonl'}:43: not UTF-8 (byte 0xe9 at character 14)" in logged
    assert any(f"{src / 'a.jsonl'}:71: not valid JSON" in line for line in logged)
    assert logged[-1].endswith("2 malformed record(s) skipped")


def test_prepare_of_nothing_but_malformed_records_fails(tmp_path, tokenizer_dir, in_process):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text('{"content": "the text is elsewhere"}\n' * 5)
    proc = in_process("prepare", "--data", str(src), "--out", str(tmp_path / "p"), "--tokenizer", str(tokenizer_dir))
    assert proc.returncode == 2 and "nothing to train on" in proc.stderr and "all 5 records are malformed" in proc.stderr
    assert "--text-field" in proc.stderr and not (tmp_path / "p" / "manifest.json").exists()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tokenizer_dir):
    """A prepared folder of two shards, kept pristine; tests damage copies of it."""
    src = tmp_path_factory.mktemp("src")
    for name in ("a", "b"):
        (src / f"{name}.jsonl").write_bytes(jsonl([f"{name} document {i}, the quick brown fox" for i in range(40)]))
    out = tmp_path_factory.mktemp("prepared") / "p"
    prepare(src, out, tokenizer_dir, workers=1, log=lambda _: None, progress=False)
    return src, out


def cut(path, keep):
    path.write_bytes(path.read_bytes()[:keep])


@pytest.mark.parametrize("damage, names, redone", [
    (lambda d: cut(d / "manifest.json", 40), r"manifest.json is damaged \(", 0),
    (lambda d: (d / "manifest.json").write_text("[]"), r"manifest.json is damaged \(not the manifest", 0),
    (lambda d: (d / "shard-00001.npy").unlink(), "shard-00001.npy is missing", 1),
    (lambda d: cut(d / "shard-00001.npy", -100), r"shard-00001.npy is damaged \(mmap length is greater", 1),
    (lambda d: cut(d / "shard-00000.npy", 60), r"shard-00000.npy is damaged \(EOF", 1),
], ids=["manifest-cut", "manifest-not-object", "shard-missing", "shard-cut", "shard-header-cut"])
def test_damaged_prepared_folder_is_named_and_prepare_repairs_it(prepared, tmp_path, tokenizer_dir, damage, names,
                                                                  redone):
    src, pristine = prepared
    out = tmp_path / "p"
    shutil.copytree(pristine, out)
    damage(out)
    with pytest.raises(DuokaError, match=names) as e:
        PackedWindows(out, 16)
    assert "run `duoka prepare` again" in e.value.fix
    logged = []
    prepare(src, out, tokenizer_dir, workers=1, log=logged.append, progress=False)
    assert any(f"tokenizing {redone} of 2 files" in line for line in logged)  # only what was damaged
    repaired = PackedWindows(out, 16)
    assert [len(s) for s in repaired.shards] == [len(s) for s in PackedWindows(pristine, 16).shards]


def test_token_ids_beyond_the_vocabulary(prepared, tmp_path, monkeypatch, tokenizer_dir):
    _, pristine = prepared
    out = tmp_path / "p"
    shutil.copytree(pristine, out)
    vocab = Tokenizer(tokenizer_dir).vocab_size
    PackedWindows(out, 16, vocab_size=vocab)  # sound
    shard = np.load(out / "shard-00001.npy")
    shard[77] = vocab + 5
    np.save(out / "shard-00001.npy", shard)
    monkeypatch.setattr(dataset, "TOKEN_CHECK_CHUNK", 32)  # the position is found across chunks
    with pytest.raises(DuokaError, match=rf"shard-00001.npy holds token id {vocab + 5} at position 77, outside "
                                         rf"the model's vocabulary of {vocab}") as e:
        PackedWindows(out, 16, vocab_size=vocab)
    assert "delete that shard, then run `duoka prepare` again" in e.value.fix
    PackedWindows(out, 16)  # workers open it without the check: the launcher made it once


def test_damaged_token_cache_is_rebuilt(tmp_path, tokenizer_dir):
    tok = Tokenizer(tokenizer_dir)
    p = tmp_path / "c.jsonl"
    p.write_bytes(jsonl(["hello world", "the quick brown fox"] * 20))
    cache = tokenize_corpus(p, tok)
    good = np.load(cache)
    cache.write_bytes(cache.read_bytes()[:-16])
    with pytest.raises(DuokaError, match=rf"{cache.name} is damaged") as e:
        PackedWindows(cache, 8)
    assert "a cache: the next run rebuilds it" in e.value.fix
    assert tokenize_corpus(p, tok) == cache and np.array_equal(np.load(cache), good)


@pytest.mark.parametrize("message, cause, fix", [
    ({"role": "asistant", "content": "4"}, r"bad.jsonl:2: message 2 has role 'asistant', which no chat template knows",
     "did you mean 'assistant'?"),
    ({"role": "assistant"}, r"bad.jsonl:2: message 2 \(assistant\) has no content", '"content": "..."'),
    ({"role": "assistant", "content": 4}, r"bad.jsonl:2: message 2 \(assistant\) has content of type int", "string"),
    # Null content is valid with tool calls, but Qwen2's ChatML template cannot render it.
    ({"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]},
     r"bad.jsonl:2: the chat template rejected these messages: can only concatenate", "check the roles"),
], ids=["misspelt-role", "no-content", "int-content", "template-error"])
def test_malformed_sft_message_names_file_and_line(tokenizer_dir, tmp_path, message, cause, fix):
    good = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": good}) + "\n" + json.dumps({"messages": [good[0], message]}) + "\n")
    with pytest.raises(DuokaError, match=cause) as e:
        prepare_sft(path, Tokenizer(tokenizer_dir), 64)
    assert fix in e.value.fix


def test_damaged_sft_cache_is_rebuilt(tokenizer_dir, tmp_path):
    tok = Tokenizer(tokenizer_dir)
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    tokens, stats = prepare_sft(path, tok, 64)
    tokens.write_bytes(tokens.read_bytes()[:-4])
    again, stats_again = prepare_sft(path, tok, 64)
    assert again == tokens and stats_again == stats and np.load(again).shape == (stats.windows, 65)


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -0.5])
def test_sampling_temperature_must_be_finite(temperature, in_process):
    with pytest.raises(DuokaError, match="must be a finite number >= 0"):
        SamplingParams(temperature=temperature)
    proc = in_process("generate", "--prompt", "hi", "--temperature", str(temperature))
    assert proc.returncode == 2 and "must be a finite number >= 0" in proc.stderr and "Traceback" not in proc.stderr


def test_train_names_the_bad_line(tmp_path, tokenizer_dir, in_process):
    """`duoka train` through the launcher in this process: one error/fix line, no traceback."""
    data = tmp_path / "c.jsonl"
    data.write_bytes(jsonl(["one", "two"]) + b'{"text": "' + BAD + b'"}\n')
    train = ("train", f"--model.tokenizer={tokenizer_dir}", f"--job.output_dir={tmp_path / 'run'}")
    proc = in_process(*train, f"--data.path={data}")
    assert proc.returncode == 2 and f"{data}:3: not UTF-8" in proc.stderr and "Traceback" not in proc.stderr
    sft = tmp_path / "s.jsonl"
    sft.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "asistant", "content": "ok"}]}))
    proc = in_process(*train, f"--data.path={sft}", "--data.mode=sft")
    assert proc.returncode == 2 and f"{sft}:1: message 2 has role 'asistant'" in proc.stderr


def test_train_refuses_a_damaged_prepared_folder_before_workers_start(prepared, tmp_path, tokenizer_dir, in_process):
    """Through the launcher in this process: a truncated manifest, then a shard whose ids lie
    beyond the debug model's 4096-token vocabulary, each one error/fix naming the file."""
    _, pristine = prepared
    out = tmp_path / "p"
    shutil.copytree(pristine, out)
    train = ("train", f"--model.tokenizer={tokenizer_dir}", f"--data.path={out}", f"--job.output_dir={tmp_path / 'run'}")
    cut(out / "manifest.json", 40)
    proc = in_process(*train)
    assert proc.returncode == 2 and "manifest.json is damaged" in proc.stderr and "Traceback" not in proc.stderr
    shutil.copy(pristine / "manifest.json", out)
    shard = np.load(out / "shard-00000.npy")
    shard[3] = 5000
    np.save(out / "shard-00000.npy", shard)
    proc = in_process(*train)
    assert proc.returncode == 2 and "shard-00000.npy holds token id 5000 at position 3" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_byte_order_mark_at_the_start_is_accepted(tmp_path, tokenizer_dir):
    """Windows tools start UTF-8 files with a byte-order mark: it is no part of the first record."""
    for name, write in (("c.jsonl", lambda p, b: p.write_bytes(b)), ("c.jsonl.gz", lambda p, b: p.write_bytes(
            gzip.compress(b)))):
        p = tmp_path / name
        write(p, b"\xef\xbb\xbf" + jsonl(["first", "second"]))
        assert list(iter_documents(p, "text")) == ["first", "second"]
    t = tmp_path / "d.txt"
    t.write_bytes(b"\xef\xbb\xbfone\n\ntwo\n")
    assert list(iter_documents(t, "text")) == ["one", "two"]
    conv = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    sft = tmp_path / "s.jsonl"
    sft.write_bytes(b"\xef\xbb\xbf" + json.dumps(conv).encode() + b"\n")
    assert prepare_sft(sft, Tokenizer(tokenizer_dir), 128)[1].conversations == 1


def test_a_data_path_that_is_no_regular_file_is_named_as_what_it_is(tmp_path, in_process):
    fifo = tmp_path / "stream.jsonl"
    os.mkfifo(fifo)
    for path, what in ((fifo, "is a FIFO (named pipe), not a regular file"),
                       (Path("/dev/zero"), "is a character device, not a regular file")):
        with pytest.raises(DuokaError, match=re.escape(f"data.path {path} {what}")) as e:
            dataset.corpus_files(path)
        assert "save the data to a file first" in e.value.fix
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.jsonl").write_bytes(jsonl(["one"]))
    os.mkfifo(folder / "b.jsonl")  # read, it would block for ever
    with pytest.raises(DuokaError, match="b.jsonl is a FIFO"):
        dataset.corpus_files(folder)
    proc = in_process("train", "--training.steps=1", f"--data.path={fifo}", f"--job.output_dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and proc.stderr.count("error:") == 1 and "is a FIFO" in proc.stderr, proc.stderr


# Every kind of pre-token boundary of Qwen2's split, around the places a long text is cut.
VARIED = ("It's 2024: café — naïve 12,345 items!\n\n  indented\tcode(x)  ==  y;  中文分词测试，你好。 "
          "emoji 🙂🚀 'quoted' \"double\" end.   ")


def test_a_long_document_is_tokenized_in_pieces_to_the_same_tokens(tokenizer_dir, monkeypatch):
    tok = Tokenizer(tokenizer_dir)
    monkeypatch.setattr(dataset, "PIECE_CHARS", 2000)
    text = VARIED * 300  # 36,000 characters: ~20 pieces, cut at many different places
    pieces = list(dataset.text_pieces(text))
    assert "".join(pieces) == text and len(pieces) > 15 and max(map(len, pieces)) <= 2000
    whole = tok.encode(text, add_special_tokens=False)
    docs = ["short one", text, "short two"]
    arrays = list(dataset.token_arrays(tok, docs, 7))
    assert np.concatenate(arrays).tolist() == (tok.encode("short one", add_special_tokens=False) + [7] + whole + [7]
                                               + tok.encode("short two", add_special_tokens=False) + [7])


MEASURE = """
import resource, sys
from pathlib import Path
from duoka.data.dataset import tokenize_corpus
from duoka.data.tokenizer import Tokenizer
tok = Tokenizer(sys.argv[2])
tok.encode_batch(["warm up " * 1000], add_special_tokens=False)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
tokenize_corpus(Path(sys.argv[1]), tok)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""


def test_the_memory_a_long_line_takes_does_not_follow_its_length(tmp_path, tokenizer_dir):
    """A 2 MB line: tokenized whole, ~580 MB of the tokenizer's (~200 bytes a character, so a
    40 MB line took 6.3 GiB); in pieces ~100 MB, the piece's and the line's own text."""
    p = tmp_path / "long.jsonl"
    p.write_bytes(jsonl(["short"]) + jsonl([VARIED * 16_500]) + jsonl(["short again"]))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "DUOKA_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", MEASURE, str(p), str(tokenizer_dir)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    grew = float(out.stdout.split()[-1])
    assert grew < 200, f"tokenizing a 2 MB line took {grew:.0f} MB"
