"""`duoka prepare` end to end: shards, manifest, malformed lines, resume, no-op, training."""

import json

import pytest


@pytest.fixture
def corpus(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    docs = [f"Document {i}: the quick brown fox jumps over the lazy dog, {i} times." for i in range(300)]
    (src / "a.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs[:150]) + "\n"
                                 + "{broken json\n" + json.dumps({"body": "no text field"}) + "\n")
    (src / "b.txt").write_text("\n\n".join(docs[150:]) + "\n")
    return src


def test_prepare_then_train(duoka, corpus, tmp_path):
    out = tmp_path / "prepared"
    proc = duoka("prepare", "--data", str(corpus), "--out", str(out), "--workers", "2")
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["documents"] == 300 and manifest["malformed"] == 2
    assert [s["source"] for s in manifest["shards"]] == [str(corpus / "a.jsonl"), str(corpus / "b.txt")]
    assert f"{corpus / 'a.jsonl'}:151: not valid JSON" in proc.stderr
    assert f"{corpus / 'a.jsonl'}:152: no string field 'text'" in proc.stderr

    # Unchanged input: nothing to do, shards untouched.
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = duoka("prepare", "--data", str(corpus), "--out", str(out))
    assert "nothing to do" in again.stderr
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes

    # An interrupted run (one shard without its record) redoes only that shard.
    (out / "shard-00001.json").unlink()
    resumed = duoka("prepare", "--data", str(corpus), "--out", str(out))
    assert "tokenizing 1 of 2 files" in resumed.stderr
    assert (out / "shard-00000.npy").stat().st_mtime_ns == mtimes["shard-00000.npy"]

    # Training on the prepared folder sees the same stream as tokenizing at launch.
    common = ["--training.steps=3", "--training.seq_len=32", "--training.global_batch_size=4", "--metrics.log_interval=9"]
    a = duoka("train", f"--job.output_dir={tmp_path / 'from-prepared'}", f"--data.path={out}", *common)
    assert a.returncode == 0, a.stderr[-2000:]
    clean = tmp_path / "clean"
    clean.mkdir()
    (clean / "a.jsonl").write_text("\n".join(line for line in (corpus / "a.jsonl").read_text().splitlines()[:150]) + "\n")
    (clean / "b.txt").write_text((corpus / "b.txt").read_text())
    b = duoka("train", f"--job.output_dir={tmp_path / 'from-raw'}", f"--data.path={clean}", *common,
              env={"DUOKA_CACHE": str(tmp_path / "cache")})
    assert b.returncode == 0, b.stderr[-2000:]
    losses = [[json.loads(x)["loss"] for x in (tmp_path / r / "metrics.jsonl").read_text().splitlines()]
              for r in ("from-prepared", "from-raw")]
    assert losses[0] == losses[1]


def test_fail_on_malformed(duoka, corpus, tmp_path):
    proc = duoka("prepare", "--data", str(corpus), "--out", str(tmp_path / "p"), "--on-error", "fail")
    assert proc.returncode == 2 and "error: 2 malformed record(s)" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "p" / "manifest.json").exists()


def test_prepared_with_another_tokenizer_is_refused(duoka, in_process, corpus, tmp_path, tokenizer_dir):
    out = tmp_path / "p"
    assert duoka("prepare", "--data", str(corpus), "--out", str(out), "--tokenizer", str(tokenizer_dir)).returncode == 0
    # The launcher refuses it before any worker starts: through the entry point in this
    # process (a Python start would cost 4 s).
    proc = in_process("train", f"--job.output_dir={tmp_path / 'run'}", f"--data.path={out}")
    assert proc.returncode == 2 and "was prepared with the tokenizer" in proc.stderr


def test_parquet_input(duoka, tmp_path):
    pa = pytest.importorskip("pyarrow")  # listed in the test extras; optional for users
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["first parquet document", None, "second one"]}), tmp_path / "d.parquet")
    out = tmp_path / "p"
    proc = duoka("prepare", "--data", str(tmp_path / "d.parquet"), "--out", str(out), "--text-field", "content")
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["documents"] == 2 and manifest["malformed"] == 1
    assert "d.parquet:row 2: content is NoneType, not text" in proc.stderr
    missing = duoka("prepare", "--data", str(tmp_path / "d.parquet"), "--out", str(tmp_path / "q"))
    assert missing.returncode == 2 and "has no column 'text'" in missing.stderr
    assert "\n  fix: set --text-field" in missing.stderr  # the error crossed the process pool intact
