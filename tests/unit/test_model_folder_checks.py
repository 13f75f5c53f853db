"""A model folder is untrusted input: weights that hold NaN or infinity, and safetensors files
whose size is not what their own header describes, are refused with the tensor or file named
(and the way to load them anyway); an index entry outside the folder is refused before it is
opened; every config.json field is type- and range-checked, and the size it implies checked
against the weights on disk, before anything is built; a tokenizer that does not cover the
model's vocabulary or lacks its eos token is warned about."""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from duoka.data.tokenizer import Tokenizer
from duoka.errors import DuokaError
from duoka.hub import bundled_model_dir
from duoka.models.qwen2 import hf_adapter
from duoka.models.qwen2.hf_adapter import INDEX_FILE, load_hf_model


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
def test_nonfinite_weights_are_refused_naming_the_tensor(hf_folder, value):
    _, folder = hf_folder()
    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors["model.norm.weight"][3] = value
    tensors["model.layers.1.mlp.down_proj.weight"][0, 0] = value
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(DuokaError) as e:
        load_hf_model(folder)
    assert "2 weight tensor(s) hold NaN or infinite values" in e.value.cause
    assert "norm.weight" in e.value.cause and "layers.1.feed_forward.w2.weight" in e.value.cause
    assert "--skip-weight-check" in e.value.fix and "model.check_weights=false" in e.value.fix
    model, _ = load_hf_model(folder, check_weights=False)  # the user knows better
    assert not torch.isfinite(model.norm.weight).all()


@pytest.mark.parametrize("change, said", [
    (lambda data: data + b"\0" * 7, "not fully covered"),
    (lambda data: data[:-5], "not a readable safetensors file"),
], ids=["padded", "cut"])
def test_a_safetensors_file_of_the_wrong_size_is_refused(hf_folder, change, said):
    _, folder = hf_folder()
    path = folder / "model.safetensors"
    path.write_bytes(change(path.read_bytes()))
    with pytest.raises(DuokaError, match=said) as e:
        load_hf_model(folder)
    assert str(path) in e.value.cause and "download" in e.value.fix


def test_generate_refuses_nonfinite_weights_unless_told_to_skip_the_check(tmp_path, in_process):
    folder = Path(shutil.copytree(bundled_model_dir(), tmp_path / "model"))
    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors["model.norm.weight"][0] = math.nan
    save_file(tensors, path, metadata={"format": "pt"})
    args = ("generate", "--model", str(folder), "--prompt", "hi", "--max-new-tokens", "2", "--device", "cpu")
    proc = in_process(*args)
    assert proc.returncode == 2 and "hold NaN or infinite values: norm.weight" in proc.stderr, proc.stderr
    assert in_process(*args, "--skip-weight-check").returncode == 0


# ---------------------------------------------------------------- the index names files in the folder


@pytest.fixture
def sharded(hf_folder):
    """A model saved in several shards, with model.safetensors.index.json."""
    _, folder = hf_folder(max_shard_size="200KB")
    assert (folder / INDEX_FILE).is_file()
    return folder


def _entry(folder: Path) -> tuple[dict, str, str]:
    index = json.loads((folder / INDEX_FILE).read_text())
    name, shard = next(iter(index["weight_map"].items()))
    return index, name, shard


@pytest.mark.parametrize("how", ["absolute path to a valid shard", "../ to a valid shard", "../../../etc/passwd",
                                 "a link out of the folder", "a number", "null", "a list"])
def test_an_index_entry_outside_the_folder_is_refused_before_it_is_opened(sharded, tmp_path, monkeypatch, how):
    index, name, shard = _entry(sharded)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(sharded / shard, elsewhere / shard)  # a shard that would load
    value = {"absolute path to a valid shard": str(elsewhere / shard),
             "../ to a valid shard": os.path.relpath(elsewhere / shard, sharded),
             "../../../etc/passwd": "../../../etc/passwd", "a link out of the folder": "linked.safetensors",
             "a number": 5, "null": None, "a list": [shard]}[how]
    (sharded / "linked.safetensors").symlink_to(elsewhere / shard)
    index["weight_map"][name] = value
    (sharded / INDEX_FILE).write_text(json.dumps(index))
    opened = []
    real_open = hf_adapter.safe_open
    monkeypatch.setattr(hf_adapter, "safe_open", lambda path, **kw: opened.append(path) or real_open(path, **kw))
    with pytest.raises(DuokaError) as e:
        load_hf_model(sharded)
    assert e.value.cause.startswith(f"{sharded / INDEX_FILE}: the entry for {name!r} ")
    said = "not a file name" if how in ("a number", "null", "a list") else "which lies outside the model folder"
    assert said in e.value.cause and "restore model.safetensors.index.json" in e.value.fix
    assert opened == []  # refused before any shard, inside or out, was opened


def test_an_index_that_is_not_a_map_is_refused(sharded):
    (sharded / INDEX_FILE).write_text(json.dumps({"weight_map": ["model-00001-of-00003.safetensors"]}))
    with pytest.raises(DuokaError, match="weight_map is a list, not an object"):
        load_hf_model(sharded)


def test_a_hub_snapshot_s_links_into_its_blobs_load(sharded, tmp_path):
    """The Hugging Face cache keeps each file once under blobs/, and a snapshot of links to them."""
    repo = tmp_path / "hub" / "models--someone--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(sharded.iterdir())):
        shutil.copy(f, repo / "blobs" / f"blob{i}")
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / f"blob{i}")
    model, _ = load_hf_model(snapshot)
    reference, _ = load_hf_model(sharded)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))


# ---------------------------------------------------------------- config.json fields


def _yarn(**fields):
    return {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, **fields}}


CONFIGS = {
    "2e9 layers": ({"num_hidden_layers": 2_000_000_000}, "num_hidden_layers is 2,000,000,000, outside 1..1,024"),
    "rope_theta a string": ({"rope_parameters": {"rope_theta": "NaN"}}, "rope_theta is 'NaN', not a number"),
    "rope_theta NaN": ({"rope_parameters": {"rope_theta": math.nan}}, "rope_theta is nan; it must be a finite number"),
    "rope_theta negative": ({"rope_parameters": {"rope_theta": -1}}, "rope_theta is -1; it must be a finite number"),
    "rms_norm_eps NaN": ({"rms_norm_eps": "NaN"}, "rms_norm_eps is 'NaN', not a number"),
    "head_dim negative": ({"head_dim": -4}, "head_dim is -4, outside 1..16,777,216"),
    "torch_dtype a function": ({"dtype": None, "torch_dtype": "load"},
                               "torch_dtype is 'load', not one of bfloat16, float16, float32"),
    "vocab_size a string": ({"vocab_size": "1001"}, "vocab_size is '1001', not an integer"),
    "tie_word_embeddings a string": ({"tie_word_embeddings": "false"}, "tie_word_embeddings is 'false', not true or"),
    "eos_token_id a string": ({"eos_token_id": "</s>"}, "eos_token_id is '</s>'; it must be a token id"),
    "yarn factor NaN": (_yarn(factor=math.nan), "rope scaling factor nan must be >= 1"),
    "yarn beta 0": (_yarn(beta_fast=0), "beta_fast 0 must be a finite number > 0"),
    "yarn factor 1e9": (_yarn(factor=1e9), "extends the context to 128,000,000,000 positions"),
    "llama3 factors equal": ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                               "high_freq_factor": 4.0}}, "high_freq_factor 4.0 must be above"),
    "rope_scaling a list": ({"rope_scaling": [4.0]}, "rope_scaling is [4.0], not an object"),
    "1000 layers on 2 layers' weights": ({"num_hidden_layers": 1000}, "parameters, but its weight files hold"),
}


@pytest.mark.parametrize("changes, said", CONFIGS.values(), ids=CONFIGS.keys())
def test_every_config_field_is_checked_before_anything_is_built(saved_hf_model, tmp_path, changes, said):
    folder = Path(shutil.copytree(saved_hf_model(), tmp_path / "model"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))
    start = time.process_time()  # CPU seconds: the refusal's own work, whatever else the machine runs
    with pytest.raises(DuokaError) as e:
        load_hf_model(folder)
    assert time.process_time() - start < 2
    assert said in e.value.cause and str(folder / "config.json") in e.value.cause, e.value.cause
    assert "config.json" in e.value.fix or "transformers documents" in e.value.fix


def test_generate_on_a_config_of_2e9_layers_is_one_error_at_once(saved_hf_model, tokenizer_dir, tmp_path, in_process):
    folder = Path(shutil.copytree(saved_hf_model(), tmp_path / "model"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 2_000_000_000}))
    start = time.process_time()  # CPU seconds (building 2e9 layers would take hours of them)
    proc = in_process("generate", "--model", str(folder), "--prompt", "hi", "--device", "cpu")
    assert proc.returncode == 2 and proc.stderr.count("error:") == 1 and "Traceback" not in proc.stderr
    assert "num_hidden_layers is 2,000,000,000" in proc.stderr and time.process_time() - start < 10


# ---------------------------------------------------------------- the tokenizer beside the model


def test_a_tokenizer_short_of_the_vocabulary_or_without_its_eos_is_warned_about(saved_hf_model, tokenizer_dir,
                                                                               tmp_path, in_process):
    folder = Path(shutil.copytree(saved_hf_model(vocab_size=4096), tmp_path / "model"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "eos_token": "<|not-a-token|>"}))
    proc = in_process("generate", "--model", str(folder), "--prompt", "hi", "--max-new-tokens", "2",
                      "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    ids = Tokenizer(tokenizer_dir).vocab_size
    assert (f"duoka: warning: the tokenizer in {folder} has {ids} ids but the model 4,096: the {4096 - ids:,} ids "
            "above decode to empty text") in proc.stderr
    assert "duoka: warning: the eos_token '<|not-a-token|>' of" in proc.stderr
    padded = Path(shutil.copytree(saved_hf_model(), tmp_path / "padded"))  # 1,001 rows: what padding explains
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, padded / name)
    quiet = in_process("generate", "--model", str(padded), "--prompt", "hi", "--max-new-tokens", "2", "--device", "cpu")
    assert quiet.returncode == 0 and "warning" not in quiet.stderr, quiet.stderr
