"""A model folder is untrusted input: weights that hold NaN or infinity, and safetensors files
whose size is not what their own header describes, are refused with the tensor or file named
(and the way to load them anyway)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from duoka.errors import DuokaError
from duoka.hub import bundled_model_dir
from duoka.models.qwen2.hf_adapter import load_hf_model


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
