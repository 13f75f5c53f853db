"""Quantized serving end to end on CPU: the scheme a folder asks for, the weight estimate that
refuses a model before it loads, and tiny GPTQ (4/8 bit, act-order), AWQ, FP8-at-load and
FP8 compressed-tensors checkpoints written here, whose served logits equal the dequantized
model's and whose greedy text equals transformers' on the dequantized weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from duoka.errors import DuokaError
from duoka.models.qwen2.args import FLAVORS, from_hf_config
from duoka.models.qwen2.hf_adapter import open_safetensors, weight_files
from duoka.models.quant.base import QuantScheme
from duoka.models.quant.folders import PROJECTION_SUFFIXES, write_quantized_folder
from duoka.serve.engine import LLM
from duoka.serve.params import SamplingParams
from duoka.serve.quant_load import check_quantizable, estimated_weight_bytes, read_scheme

QWEN2_7B = {"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
            "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": False,
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
    schemes = (None, QuantScheme("fp8"), QuantScheme("gptq", 4))
    bf16, fp8, int4 = (estimated_weight_bytes(args, s) / 1e9 for s in schemes)
    assert 15.0 < bf16 < 15.5 and 8.5 < fp8 < 8.9 and 5.2 < int4 < 5.8
    assert estimated_weight_bytes(args, None, tp=2) < 0.6 * estimated_weight_bytes(args, None)


def test_a_moe_model_counts_every_expert_and_is_served_unquantized_only(tmp_path):
    """Qwen1.5-MoE-A2.7B: 14.3B parameters, ~28.6 GB in bf16 (all 60 experts per layer). The
    quantized loader reads dense projections only: a MoE model is refused before loading."""
    args = FLAVORS["qwen2-moe-a2.7b"]
    assert 28.0 < estimated_weight_bytes(args, None) / 1e9 < 29.5
    check_quantizable(args, None, tmp_path)
    check_quantizable(from_hf_config(QWEN2_7B), QuantScheme("fp8"), tmp_path)
    with pytest.raises(DuokaError, match="mixture-of-experts model") as e:
        check_quantizable(args, QuantScheme("fp8"), tmp_path)
    assert "without --quantization" in e.value.fix


# ---------------------------------------------------------------- tiny checkpoints end to end
GROUP = 32  # the tiny model's widths (64, 96) are multiples of it


def _dequantized_folder(quantized, out):
    """The quantized folder with each projection's stored weight dequantized (fp32): the model
    the quantized one stands for, for transformers and duoka alike."""
    from safetensors.torch import save_file

    from duoka.models.quant.base import Part
    from duoka.serve.quant_load import _source, reader_for

    scheme = read_scheme(quantized, None)
    source, read = _source(quantized), reader_for(scheme)
    out.mkdir()
    tensors = {}
    for name, path in weight_files(quantized).items():
        module, _, kind = name.rpartition(".")
        if kind in ("qweight", "weight") and module.rsplit(".", 1)[-1] in PROJECTION_SUFFIXES:
            layer = read(source, [Part(module)], scheme, False, torch.device("cpu"), torch.float32)
            tensors[f"{module}.weight"] = layer.dequantize().float().contiguous()
        elif kind not in ("qzeros", "scales", "g_idx", "weight_scale", "input_scale", "qweight"):
            tensors[name] = open_safetensors(path).get_tensor(name).float()
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((quantized / "config.json").read_text())
    config.pop("quantization_config")
    config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(quantized / name, out / name)
    return out


def _greedy_and_logprobs(folder, prompts, **options):
    llm = LLM(str(folder), device="cpu", max_model_len=128, log=lambda m: None, **options)
    outs = {}
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                                logprobs=3))
    while llm.engine.has_unfinished():
        for o in llm.engine.step():
            ids, lps = outs.get(o.request_id, ([], []))
            outs[o.request_id] = (ids + o.new_token_ids, lps + [lp.logprob for lp in o.new_logprobs or []])
    return outs


@pytest.fixture(scope="module")
def tiny(saved_hf_model, tokenizer_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny") / "model"
    shutil.copytree(saved_hf_model(seed=21, vocab_size=600), folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return folder


@pytest.mark.parametrize("method, bits, desc_act", [("gptq", 4, False), ("gptq", 8, True), ("awq", 4, False)])
def test_a_quantized_checkpoint_serves_its_dequantized_model(tiny, tmp_path, method, bits, desc_act):
    """Logits equal the dequantized model's (the same fp32 function); greedy text equals
    transformers' on the dequantized weights."""
    from transformers import Qwen2ForCausalLM

    quantized = write_quantized_folder(tiny, tmp_path / "q", method, bits, GROUP, desc_act, seed=3)
    plain = _dequantized_folder(quantized, tmp_path / "deq")
    prompts = [[5, 17, 42, 99, 3], [250, 7, 7, 31]]
    got, want = _greedy_and_logprobs(quantized, prompts), _greedy_and_logprobs(plain, prompts)
    for rid in got:
        assert got[rid][0] == want[rid][0]
        assert max(abs(a - b) for a, b in zip(got[rid][1], want[rid][1])) < 1e-4
    reference = Qwen2ForCausalLM.from_pretrained(plain, torch_dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        hf = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
        assert hf[0, len(prompt):].tolist() == got[f"r{i}"][0]
    # The quantized model differs from the original by the format's error, not by a bug.
    original = _greedy_and_logprobs(tiny, prompts)
    assert any(original[r][1] != got[r][1] for r in got)


def test_fp8_at_load_stays_within_the_format_s_error(tiny):
    """--quantization fp8: every projection FP8 (per-row weight scales, per-token activation
    scales), the rest fp32 here; the logprobs move by FP8's error only, and the weights shrink."""
    from duoka.models.quant.fp8 import Fp8Linear
    from duoka.serve.quant_load import weight_bytes

    prompts = [[5, 17, 42, 99, 3], [250, 7, 7, 31]]
    llm = LLM(str(tiny), device="cpu", max_model_len=128, log=lambda m: None, quantization="fp8")
    projections = [m for m in llm.engine.worker.model.modules() if isinstance(m, Fp8Linear)]
    assert len(projections) == 4 * 2  # four per layer, two layers
    original = LLM(str(tiny), device="cpu", max_model_len=128, log=lambda m: None)
    assert weight_bytes(llm.engine.worker.model) < weight_bytes(original.engine.worker.model)
    # The loader's wiring: each projection holds its checkpoint modules in order, each row
    # within e4m3's rounding (2^-4 of the row's largest weight) of the original.
    source = {n: open_safetensors(p).get_tensor(n) for n, p in weight_files(tiny).items()}
    block = llm.engine.worker.model.layers["1"]
    for module, parts in ((block.attention.wqkv, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                          (block.feed_forward.w13, ("mlp.gate_proj", "mlp.up_proj")),
                          (block.feed_forward.w2, ("mlp.down_proj",))):
        whole = torch.cat([source[f"model.layers.1.{part}.weight"] for part in parts]).float()
        bound = whole.abs().amax(dim=1, keepdim=True) / 16
        assert ((module.dequantize().float() - whole).abs() <= bound + 1e-6).all()
    # End to end: the same leading candidates, logprobs within the error two layers of FP8
    # weights and activations make on this noisy tiny model (measured up to ~0.55).
    for prompt in prompts:
        got, want = (_top5(engine, prompt) for engine in (llm, original))
        shared = set(got) & set(want)
        assert len(shared) >= 3 and max(abs(got[t] - want[t]) for t in shared) < 1.0, (got, want)
        assert got != want  # quantized: not the same function
    assert read_scheme(tiny, "fp8").method == "fp8"


def _top5(llm, prompt) -> dict[int, float]:
    engine = llm.engine
    engine.add_request("top5", prompt, SamplingParams(max_tokens=1, temperature=0, logprobs=5))
    outs = [o for _ in range(8) for o in engine.step() if o.new_logprobs]
    return dict(outs[0].new_logprobs[0].top)


def test_dummy_weights_need_no_weight_files(tiny, tmp_path):
    """--load-format dummy: the folder's config.json and tokenizer only; random weights made on
    the device, repeatable, in bf16 or quantized to FP8 at load; a quantized folder is refused."""
    from duoka.models.quant.fp8 import Fp8Linear
    from duoka.serve.dummy_weights import random_source

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, bare / name)
    logs: list[str] = []
    prompts = [[5, 17, 42, 99, 3]]
    first = LLM(str(bare), device="cpu", max_model_len=128, log=logs.append, load_format="dummy")
    assert any("RANDOM weights" in line for line in logs)
    params = dict(first.engine.worker.model.named_parameters())
    assert all(bool(torch.isfinite(p).all()) for p in params.values())
    norm = next(p for n, p in params.items() if n.endswith("attention_norm.weight"))
    assert bool((norm == 1).all())
    runs = [_greedy_and_logprobs(bare, prompts, load_format="dummy") for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]["r0"][0]) == 8  # the same weights each time
    fp8 = LLM(str(bare), device="cpu", max_model_len=128, log=lambda m: None, load_format="dummy",
              quantization="fp8")
    assert len([m for m in fp8.engine.worker.model.modules() if isinstance(m, Fp8Linear)]) == 4 * 2
    args = first.engine.worker.args
    source = random_source(args, torch.device("cpu"), torch.bfloat16)
    q = source("model.layers.0.self_attn.q_proj.weight")
    assert q.shape == (args.n_heads * args.resolved_head_dim, args.dim) and 0.015 < float(q.float().std()) < 0.025
    assert torch.equal(q, source("model.layers.0.self_attn.q_proj.weight"))
    assert not torch.equal(q, source("model.layers.1.self_attn.q_proj.weight"))
    with pytest.raises(KeyError):
        source("model.layers.0.self_attn.o_proj.bias")  # Qwen2's o projection has none
    gptq = write_quantized_folder(tiny, tmp_path / "q", "gptq", 4, GROUP, False, seed=3)
    with pytest.raises(DuokaError, match="--load-format dummy"):
        LLM(str(gptq), device="cpu", max_model_len=128, log=lambda m: None, load_format="dummy")
