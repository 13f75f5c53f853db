"""Every malformed checkpoint gives one DuokaError naming the offending files or tensors."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from duoka.errors import DuokaError
from duoka.models.qwen2.hf_adapter import load_hf_model


def _rewrite(folder, edit):
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_missing_folder(tmp_path):
    with pytest.raises(DuokaError, match="does not exist"):
        load_hf_model(tmp_path / "nope")


def test_missing_config(hf_folder):
    _, folder = hf_folder()
    (folder / "config.json").unlink()
    with pytest.raises(DuokaError, match="has no config.json"):
        load_hf_model(folder)


def test_broken_config_json(hf_folder):
    _, folder = hf_folder()
    (folder / "config.json").write_text("{not json")
    with pytest.raises(DuokaError, match="not valid JSON"):
        load_hf_model(folder)


def test_sliding_window_refused(hf_folder):
    _, folder = hf_folder()
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(use_sliding_window=True, sliding_window=64)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DuokaError, match="use_sliding_window"):
        load_hf_model(folder)


def test_no_weights(hf_folder):
    _, folder = hf_folder()
    (folder / "model.safetensors").unlink()
    with pytest.raises(DuokaError, match="has no model.safetensors"):
        load_hf_model(folder)


def test_pickle_weights_are_never_opened(hf_folder, monkeypatch):
    _, folder = hf_folder()
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not even a pickle")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load must not be called"))
    with pytest.raises(DuokaError, match="never unpickles") as e:
        load_hf_model(folder)
    assert "pytorch_model.bin" in e.value.cause and "save_pretrained" in e.value.fix


def test_missing_unexpected_and_misshaped_tensors_listed_together(hf_folder):
    _, folder = hf_folder()

    def edit(t):
        del t["model.layers.1.mlp.up_proj.weight"]
        del t["model.norm.weight"]
        t["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
        t["model.layers.0.self_attn.k_proj.bias"] = torch.zeros(7)

    _rewrite(folder, edit)
    with pytest.raises(DuokaError) as e:
        load_hf_model(folder)
    msg = e.value.cause
    assert "missing tensors (2): model.layers.1.mlp.up_proj.weight, model.norm.weight" in msg
    assert "unexpected tensors (1): model.layers.0.self_attn.extra.weight" in msg
    assert "model.layers.0.self_attn.k_proj.bias: checkpoint [7], model [32]" in msg


def test_untied_model_without_head_is_missing_lm_head(hf_folder):
    _, folder = hf_folder(tie_word_embeddings=False)
    _rewrite(folder, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(DuokaError, match=r"missing tensors \(1\): lm_head.weight"):
        load_hf_model(folder)


def test_tied_model_accepts_an_explicit_head(hf_folder):
    hf, folder = hf_folder(tie_word_embeddings=True)
    _rewrite(folder, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))
    model, _ = load_hf_model(folder)
    assert model.output.weight is model.tok_embeddings.weight


def test_index_naming_a_missing_shard(hf_folder):
    _, folder = hf_folder(max_shard_size="100KB")
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(DuokaError, match=f"not in .*: {shard.name}"):
        load_hf_model(folder)


def test_index_pointing_at_the_wrong_shard(hf_folder):
    _, folder = hf_folder(max_shard_size="100KB")
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in index["weight_map"].items() if f == shards[0])
    index["weight_map"][name] = shards[1]
    index_path.write_text(json.dumps(index))
    with pytest.raises(DuokaError, match=f"absent from their file: {name}"):
        load_hf_model(folder)


def test_truncated_safetensors(hf_folder):
    _, folder = hf_folder()
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(DuokaError, match="not a readable safetensors file") as e:
        load_hf_model(folder)
    assert "download it again" in e.value.fix


def test_interrupted_save_leaves_no_folder(hf_folder, tmp_path, monkeypatch):
    from duoka.models.qwen2 import hf_adapter

    _, folder = hf_folder()
    model, _ = load_hf_model(folder)
    calls = []

    def failing_save(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        return save_file(tensors, path, metadata=metadata)

    monkeypatch.setattr(hf_adapter, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        hf_adapter.save_hf_checkpoint(model, tmp_path / "out", max_shard_size="60KB")
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.partial-*"))
