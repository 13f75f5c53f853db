"""Checkpoint integrity: a damaged checkpoint is named and skipped, a full disk is named and
leaves no .partial folder, a crafted .metadata pickle is never run. In process, on a
one-process gloo group, with a tiny Qwen2 saved once per module and copied per test."""

import contextlib
import errno
import io
import json
import os
import pickle
import shutil
import threading
import time
import zlib
from collections import namedtuple
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystem

from duoka.errors import DuokaError
from duoka.models.qwen2.args import ModelArgs
from duoka.models.qwen2.model import build_model, materialize
from duoka.train import checkpoint_io as checkpoint
from duoka.train.checkpoint_io import (
    async_stager,
    choose_resume_checkpoint,
    load_checkpoint,
    prune,
    save_checkpoint,
)
from duoka.train.export import export_checkpoint

ARGS = ModelArgs(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, intermediate_size=48, max_seq_len=64)


def _model_and_optimizer(seed: int):
    model = materialize(build_model(ARGS), "cpu", torch.float32)
    model.init_weights(seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, ARGS.vocab_size, (1, 8))).float().mean().backward()
    optimizer.step()  # the optimizer has state to save
    return model, optimizer


def _save(run_dir: Path, step: int, model, optimizer, **kwargs):
    return save_checkpoint(run_dir, step, model, optimizer, {"tokens": step, "model_args": asdict(ARGS)}, [],
                           **kwargs)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run with checkpoints step-2 and step-4, and the model and optimizer saved at 4."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    run = tmp_path_factory.mktemp("saved") / "run"
    model, optimizer = _model_and_optimizer(seed=1)
    _save(run, 2, model, optimizer)
    _save(run, 4, model, optimizer)
    yield run, model, optimizer
    if created:
        dist.destroy_process_group()


@pytest.fixture
def run(saved, tmp_path):
    """A copy of the saved run, to damage."""
    return Path(shutil.copytree(saved[0], tmp_path / "run"))


def _truncate(name):
    def damage(folder):
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[: len(data) // 2])
    return damage


def _flip_bit(name):
    def damage(folder):
        data = bytearray((folder / name).read_bytes())
        data[len(data) // 2] ^= 0x04
        (folder / name).write_bytes(bytes(data))
    return damage


DAMAGES = {
    "missing shard": (lambda folder: (folder / "__0_0.distcp").unlink(), "__0_0.distcp is missing"),
    "truncated shard": (_truncate("__0_0.distcp"), "__0_0.distcp is truncated"),
    "truncated metadata": (_truncate(".metadata"), ".metadata is truncated"),
    "truncated train state": (_truncate("train_state.json"), "train_state.json is truncated"),
    "flipped bit": (_flip_bit("__0_0.distcp"), "__0_0.distcp fails its checksum"),
    "damaged manifest": (_truncate("manifest.json"), "manifest.json is unreadable"),
}


def test_manifest_round_trip_and_export(saved, tmp_path):
    run, model, optimizer = saved
    step4 = run / "checkpoints" / "step-4"
    manifest = json.loads((step4 / "manifest.json").read_text())
    on_disk = {p.name: p.stat().st_size for p in step4.iterdir() if p.name != "manifest.json"}
    assert {name: entry["bytes"] for name, entry in manifest["files"].items()} == on_disk  # no sidecar left
    assert manifest["files"]["__0_0.distcp"]["crc32"] == f"{zlib.crc32((step4 / '__0_0.distcp').read_bytes()):08x}"
    assert choose_resume_checkpoint(run, "auto") == (step4, [])

    fresh, fresh_optimizer = _model_and_optimizer(seed=2)
    state = load_checkpoint(step4, fresh, fresh_optimizer)  # the real .metadata passes the restricted unpickler
    assert state["step"] == 4
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    assert fresh_optimizer.state_dict()["state"][0]["exp_avg"].equal(optimizer.state_dict()["state"][0]["exp_avg"])
    assert (export_checkpoint(step4, tmp_path / "hf", dtype="float32") / "config.json").is_file()


def test_export_keeps_the_checkpoint_s_dtype_and_says_which_it_wrote(saved, tmp_path, in_process):
    """`duoka export` of a float32 checkpoint writes float32 (what RUN/hf/step-N holds), unless
    --dtype names another; its line says which."""
    from safetensors import safe_open

    step4 = saved[0] / "checkpoints" / "step-4"
    for flags, dtype in (((), "float32"), (("--dtype", "bfloat16"), "bfloat16")):
        out = tmp_path / dtype
        proc = in_process("export", str(step4), "--out", str(out), *flags)
        assert proc.returncode == 0, proc.stderr
        assert f"-> {out} ({dtype}) in " in proc.stderr, proc.stderr
        assert json.loads((out / "config.json").read_text())["torch_dtype"] == dtype
        with safe_open(out / "model.safetensors", "pt") as f:
            names = f.keys()
            assert {f.get_slice(name).get_dtype() for name in names} == {"F32" if dtype == "float32" else "BF16"}


@pytest.mark.parametrize("damage", DAMAGES, ids=list(DAMAGES))
def test_damaged_newest_checkpoint_is_named_and_skipped(run, tmp_path, damage):
    make, expected = DAMAGES[damage]
    step4 = run / "checkpoints" / "step-4"
    make(step4)
    path, skipped = choose_resume_checkpoint(run, "auto")
    assert path == run / "checkpoints" / "step-2"
    assert len(skipped) == 1 and str(step4) in skipped[0] and expected in skipped[0], skipped
    with pytest.raises(DuokaError, match="is damaged") as e:
        choose_resume_checkpoint(run, str(step4))
    assert expected in e.value.cause and "checkpoint.resume=auto" in e.value.fix
    with pytest.raises(DuokaError, match="is damaged") as e:
        export_checkpoint(step4, tmp_path / "hf")
    assert expected in e.value.cause and not (tmp_path / "hf").exists()


def test_no_intact_checkpoint_is_an_error(run):
    for step in (2, 4):
        _flip_bit("__0_0.distcp")(run / "checkpoints" / f"step-{step}")
    with pytest.raises(DuokaError, match="no intact checkpoint") as e:
        choose_resume_checkpoint(run, "auto")
    assert "step-2" in e.value.cause and "step-4" in e.value.cause and "job.output_dir" in e.value.fix


def test_checkpoint_without_manifest_is_refused_unless_trusted(saved, run, tmp_path, in_process):
    """Without its manifest a checkpoint cannot be told from a damaged or altered one."""
    step4 = run / "checkpoints" / "step-4"
    (step4 / "manifest.json").unlink()  # as saved before duoka wrote manifests, or deleted
    path, skipped = choose_resume_checkpoint(run, "auto")
    assert path == run / "checkpoints" / "step-2" and "manifest.json is missing" in skipped[0]
    assert "trust_unverified" in skipped[0]
    with pytest.raises(DuokaError, match="manifest.json is missing") as e:
        choose_resume_checkpoint(run, str(step4))
    assert "--checkpoint.trust_unverified=true" in e.value.fix
    with pytest.raises(DuokaError, match="manifest.json is missing") as e:
        export_checkpoint(step4, tmp_path / "hf")
    assert "--trust-unverified" in e.value.fix and not (tmp_path / "hf").exists()
    proc = in_process("export", str(step4), "--out", str(tmp_path / "hf"))
    assert proc.returncode == 2 and "manifest.json is missing" in proc.stderr

    path, skipped = choose_resume_checkpoint(run, "auto", trust_unverified=True)
    assert path == step4 and "not verified" in skipped[0]
    proc = in_process("export", str(step4), "--out", str(tmp_path / "hf"), "--trust-unverified")
    assert proc.returncode == 0 and "not verified" in proc.stderr + proc.stdout
    _truncate("__0_0.distcp")(step4)  # unverified, so only DCP's load finds it
    with pytest.raises(DuokaError, match="could not load checkpoint") as e:
        load_checkpoint(step4, *_model_and_optimizer(seed=2))
    assert "checkpoint.resume=auto" in e.value.fix


def test_the_export_command_says_it_once(run, in_process):
    step4 = run / "checkpoints" / "step-4"
    _flip_bit("__0_0.distcp")(step4)
    proc = in_process("export", str(step4), "--out", str(run / "hf"))
    assert proc.returncode != 0
    assert proc.stderr.count("error:") == 1 and proc.stderr.count("fix:") == 1, proc.stderr
    assert "fails its checksum" in proc.stderr and "Traceback" not in proc.stderr


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_crafted_metadata_pickle_is_refused_never_run(run, tmp_path):
    marker = tmp_path / "marker"
    step4 = run / "checkpoints" / "step-4"
    crafted = pickle.dumps(_RunsCode(marker))
    (step4 / ".metadata").write_bytes(crafted)
    manifest = json.loads((step4 / "manifest.json").read_text())  # an attacker can rewrite the manifest too
    manifest["files"][".metadata"] = {"bytes": len(crafted), "crc32": f"{zlib.crc32(crafted):08x}"}
    (step4 / "manifest.json").write_text(json.dumps(manifest))

    with pytest.raises(DuokaError, match="refused to unpickle") as e:
        choose_resume_checkpoint(run, str(step4))
    assert "posix.system" in e.value.cause or "os.system" in e.value.cause
    path, skipped = choose_resume_checkpoint(run, "auto")
    assert path == run / "checkpoints" / "step-2" and "refused" in skipped[0]
    with pytest.raises(DuokaError, match="refused to unpickle"):
        export_checkpoint(step4, tmp_path / "hf")
    with pytest.raises(DuokaError, match="refused to unpickle"):
        load_checkpoint(step4, *_model_and_optimizer(seed=2))  # the trainer's own load, past any check
    assert not marker.exists()


def _craft_bytes_item(folder: Path, item: str, payload: bytes) -> None:
    """What an attacker does to a checkpoint: the payload appended to a shard, .metadata
    rewritten to declare `item` a bytes item stored there (DCP's own classes, pickled as DCP
    does), and the manifest's sums rewritten to match."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    from duoka.train.integrity import load_metadata

    metadata = load_metadata(folder)
    shard = folder / "__0_0.distcp"
    offset = shard.stat().st_size
    shard.write_bytes(shard.read_bytes() + payload)
    index = MetadataIndex(item)
    old = next(info for key, info in metadata.storage_data.items() if key.fqn == item)
    for key in [key for key in metadata.storage_data if key.fqn == item]:
        del metadata.storage_data[key]
    metadata.storage_data[index] = type(old)(relative_path=shard.name, offset=offset, length=len(payload))
    metadata.state_dict_metadata[item] = BytesStorageMetadata()
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    manifest = json.loads((folder / "manifest.json").read_text())
    for name in (shard.name, ".metadata"):
        data = (folder / name).read_bytes()
        manifest["files"][name] = {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    (folder / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("item", ["optimizer.param_groups.0.lr", "model.norm.weight"])
def test_crafted_bytes_item_in_a_shard_is_refused_never_run(run, tmp_path, in_process, item):
    """DCP's default planner unpickles a shard's bytes items with torch.load(weights_only=False):
    a shard can carry code that the manifest (rewritten by the attacker) does not catch."""
    marker = tmp_path / "marker"
    step4 = run / "checkpoints" / "step-4"
    payload = io.BytesIO()
    torch.save(_RunsCode(marker), payload)  # as DCP writes a bytes item
    _craft_bytes_item(step4, item, payload.getvalue())
    assert choose_resume_checkpoint(run, "auto") == (step4, [])  # every file matches its (rewritten) manifest
    with pytest.raises(DuokaError, match="refused to unpickle") as e:
        load_checkpoint(step4, *_model_and_optimizer(seed=2))  # the resume's load
    assert item in e.value.cause and "not written by duoka" in e.value.fix
    if item.startswith("model."):  # export reads the model's items only
        with pytest.raises(DuokaError, match="refused to unpickle"):
            export_checkpoint(step4, tmp_path / "hf")
        proc = in_process("export", str(step4), "--out", str(tmp_path / "hf2"))
        assert proc.returncode == 2 and "refused to unpickle" in proc.stderr and "Traceback" not in proc.stderr
    assert not marker.exists()


def _full_at_shards(monkeypatch, extra_thread_only: bool = False):
    """ENOSPC on opening a shard; extra_thread_only: only in DCP's second write thread, whose
    exception DCP itself would lose (the save would then seem to succeed)."""
    real = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "w" in mode and str(path).endswith(".distcp"):
            if not extra_thread_only or threading.current_thread() is not threading.main_thread():
                Path(path).write_bytes(b"partly written")
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            time.sleep(0.05)  # the second file is left for the extra thread
        with real(self, path, mode) as stream:
            yield stream

    monkeypatch.setattr(FileSystem, "create_stream", create_stream)


def _full_at_manifest(monkeypatch):
    def write_manifest(folder):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder / "manifest.json"))

    monkeypatch.setattr(checkpoint, "write_manifest", write_manifest)


def _nearly_full(monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 10**5, 10**5))


FULL_DISKS = {
    "shard": (_full_at_shards, {}),
    "shard, in a second write thread": (lambda m: _full_at_shards(m, extra_thread_only=True), {"write_threads": 2}),
    "shard, background save": (_full_at_shards, {"async_save": True}),
    "manifest": (_full_at_manifest, {}),
    "before writing": (_nearly_full, {}),
}


@pytest.mark.parametrize("where", FULL_DISKS, ids=list(FULL_DISKS))
def test_full_disk_is_named_and_leaves_no_partial_folder(saved, run, monkeypatch, where):
    fill, options = FULL_DISKS[where]
    _, model, optimizer = saved
    fill(monkeypatch)
    stager = None
    if options.pop("async_save", False):
        stager = async_stager(torch.device("cpu"))
        options.update(async_group=dist.new_group(backend="gloo"), stager=stager)
    try:
        with pytest.raises(DuokaError) as e:
            result = _save(run, 6, model, optimizer, **options)
            if stager is not None:
                result.finish()
    finally:
        if stager is not None:
            stager.close()
    assert e.value.cause.startswith("no space left on device: "), e.value.cause
    assert " needed, " in e.value.cause and f" free at {run / 'checkpoints'}" in e.value.cause
    assert "job.output_dir" in e.value.fix
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2", "step-4"]  # no .partial
    assert choose_resume_checkpoint(run, "auto")[0] == run / "checkpoints" / "step-4"


def test_retention_never_deletes_the_newest_healthy_checkpoint(tmp_path):
    def fake(step, healthy):
        folder = tmp_path / "checkpoints" / f"step-{step}"
        folder.mkdir(parents=True)
        (folder / ".metadata").write_bytes(b"")
        (folder / "train_state.json").write_text(json.dumps({"step": step, "healthy": healthy}))

    for step, healthy in [(1, True), (2, True), (3, False), (4, False)]:
        fake(step, healthy)
    prune(tmp_path, keep=1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-2", "step-4"]
    fake(5, True)
    prune(tmp_path, keep=2)  # the newest two, and the newest two healthy ones
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-2", "step-4", "step-5"]
