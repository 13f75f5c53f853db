"""Quantized model folders written from a bf16/fp32 one, in the layout Qwen's published GPTQ
and AWQ checkpoints use (round-to-nearest: the tests' and benchmarks' checkpoints, not a
calibrated quantizer): every decoder projection quantized, everything else copied as it is,
config.json given the format's quantization_config."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from duoka.models.quant.writers import quantize_to_awq, quantize_to_gptq
from duoka.models.qwen2.hf_adapter import CONFIG_FILE, open_safetensors, weight_files

PROJECTION_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Files of a model folder other than its weights, copied as they are.
_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
               "special_tokens_map.json")


def _quantization_config(method: str, bits: int, group_size: int, desc_act: bool) -> dict:
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": True,
                "checkpoint_format": "gptq", "damp_percent": 0.01, "true_sequential": True}
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "version": "gemm", "zero_point": True}


def write_quantized_folder(source: Path, out: Path, method: str, bits: int = 4, group_size: int = 128,
                           desc_act: bool = False, device: str | torch.device = "cpu", seed: int = 0) -> Path:
    """`source` quantized with `method` ("gptq" or "awq") into `out`; returns `out`. Quantizes
    on `device` one projection at a time (a GPU writes a 7B folder in seconds)."""
    out.mkdir(parents=True, exist_ok=True)
    files = weight_files(source)
    tensors = {}
    for name, path in files.items():
        value = open_safetensors(path).get_tensor(name)
        module, _, kind = name.rpartition(".")
        if kind == "weight" and module.rsplit(".", 1)[-1] in PROJECTION_SUFFIXES:
            weight = value.to(device=device, dtype=torch.float32)
            packed = (quantize_to_gptq(weight, bits, group_size, sym=True, desc_act=desc_act, seed=seed)
                      if method == "gptq" else quantize_to_awq(weight, group_size))
            tensors.update({f"{module}.{k}": v.cpu().contiguous() for k, v in packed.items()})
        else:
            tensors[name] = value.to(torch.float16) if value.is_floating_point() else value
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((source / CONFIG_FILE).read_text())
    config["quantization_config"] = _quantization_config(method, bits, group_size, desc_act)
    config["torch_dtype"] = "float16"
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    for name in _SIDE_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    return out
