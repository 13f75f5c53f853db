"""Rope scaling (YaRN, linear, llama3) as transformers computes it: the frequencies and the
attention factor, a tiny Qwen2 whose config sets YaRN read to the same logits past its
original context, greedy generation through the serving engine equal to transformers', and
the scaled context in the limits that training and serving check."""

import json
import shutil
from dataclasses import asdict

import pytest
import torch

from duoka.errors import DuokaError
from duoka.models.qwen2.args import ModelArgs, from_hf_config, to_hf_config
from duoka.models.qwen2.hf_adapter import load_hf_model
from duoka.models.qwen2.rope import RopeScaling, read_rope_scaling, rope_frequencies

HEAD_DIM, THETA, ORIGINAL = 16, 10000.0, 128
VOCAB = 600  # the tests' tokenizer's
SCALINGS = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL, "mscale": 0.7,
                    "mscale_all_dim": 1.0, "beta_fast": 16.0, "beta_slow": 2.0},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": ORIGINAL,
                              "attention_factor": 1.3, "truncate": False},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
}


def _hf_config(params: dict, **overrides):
    from transformers import Qwen2Config

    base = {"vocab_size": 1001, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": ORIGINAL,
            "tie_word_embeddings": True, "rope_parameters": {**params, "rope_theta": THETA}, "attn_implementation": "sdpa"}
    return Qwen2Config(**{**base, **overrides})


@pytest.mark.parametrize("name", SCALINGS)
def test_frequencies_and_attention_factor_equal_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = SCALINGS[name]
    want, want_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](_hf_config(params), "cpu")
    got, factor = rope_frequencies(HEAD_DIM, THETA, read_rope_scaling(params, "test"), ORIGINAL)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(want_factor, rel=1e-12)


@pytest.fixture(scope="module")
def yarn_folder(tmp_path_factory, tokenizer_dir):
    """A tiny Qwen2 whose config.json sets Qwen's YaRN (factor 4 over 128 positions), weights
    perturbed away from their init, with the tests' tokenizer."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(_hf_config(SCALINGS["yarn"], vocab_size=VOCAB)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    folder = tmp_path_factory.mktemp("yarn")
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return model, folder


def test_a_yarn_model_gives_transformers_logits_past_its_original_context(yarn_folder, tmp_path):
    hf, folder = yarn_folder
    ours, _ = load_hf_model(folder)
    assert ours.args.rope_scaling.rope_type == "yarn" and ours.args.context_len == 4 * ORIGINAL
    tokens = torch.randint(0, VOCAB, (2, 3 * ORIGINAL), generator=torch.Generator().manual_seed(1))
    got, want = ours(tokens), hf(tokens).logits
    assert ((got - want).norm() / want.norm()).item() <= 1e-5
    # The scaling is not a no-op here: the same weights under the plain rope give other logits.
    plain = tmp_path / "plain"
    shutil.copytree(folder, plain)
    config = json.loads((plain / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": THETA}
    (plain / "config.json").write_text(json.dumps(config))
    unscaled, _ = load_hf_model(plain)
    assert ((unscaled(tokens) - want).norm() / want.norm()).item() > 1e-2


def test_duoka_generate_equals_transformers_on_a_yarn_model(yarn_folder):
    """Through the serving engine (paged cache, chunked prefill), past the original context."""
    from duoka.serve.engine import LLM
    from duoka.serve.params import SamplingParams

    hf, folder = yarn_folder
    prompt = torch.randint(1, VOCAB, (ORIGINAL + 40,), generator=torch.Generator().manual_seed(2)).tolist()
    llm = LLM(str(folder), device="cpu", log=lambda m: None, max_num_batched_tokens=64)
    assert llm.engine.worker.max_model_len == 4 * ORIGINAL  # the scaled context is the default
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert out.token_ids == want[0, len(prompt):].tolist()


def test_the_scaling_survives_config_and_spec_round_trips():
    args = ModelArgs(rope_scaling=RopeScaling("yarn", 4.0, 32768), max_seq_len=32768)
    assert args.context_len == 131072
    assert from_hf_config(to_hf_config(args)).rope_scaling == args.rope_scaling
    assert ModelArgs(**asdict(args)) == args  # a run's spec and checkpoints keep ModelArgs as a dict
    # The transformers 4 spelling (rope_scaling with "type") reads the same.
    old = {**to_hf_config(args), "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 32768}}
    del old["rope_parameters"]
    assert from_hf_config(old).rope_scaling == args.rope_scaling


@pytest.mark.parametrize("params, message", [
    ({"rope_type": "dynamic", "factor": 2.0}, "cached keys would not match"),
    ({"rope_type": "yarn"}, "factor is missing"),
    ({"rope_type": "yarn", "factor": 0.5}, "must be >= 1"),
    ({"rope_type": "su", "factor": 2.0}, "does not know"),
])
def test_scalings_duoka_cannot_compute_are_refused(params, message):
    with pytest.raises(DuokaError, match=message):
        read_rope_scaling(params, "config.json: rope_scaling")
