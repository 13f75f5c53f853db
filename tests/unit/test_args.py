import pytest
import torch

from duoka.errors import DuokaError
from duoka.models.qwen2.args import FLAVORS, ModelArgs, from_hf_config, get_flavor, to_hf_config
from duoka.models.qwen2.model import build_model, num_params

# Parameter counts published on the Hugging Face model cards, in billions (rounded as there).
PUBLISHED_BILLIONS = {
    "qwen2-0.5b": 0.49, "qwen2-1.5b": 1.54, "qwen2-7b": 7.62, "qwen2-72b": 72.71,
    "qwen2.5-0.5b": 0.49, "qwen2.5-1.5b": 1.54, "qwen2.5-3b": 3.09, "qwen2.5-7b": 7.62,
    "qwen2.5-14b": 14.77, "qwen2.5-32b": 32.76, "qwen2.5-72b": 72.71,
}


# Mixture-of-experts flavors: (total, activated) billions as their model cards give them
# ("14.3B parameters in total and 2.7B activated"; 57B-A14B's card: 57.4B, A14B).
PUBLISHED_MOE_BILLIONS = {"qwen2-moe-a2.7b": (14.3, 2.7), "qwen2-57b-a14b": (57.4, 14)}


@pytest.mark.parametrize("name", [n for n in FLAVORS if n != "debug"])
def test_flavor_matches_transformers_parameter_count(name):
    """Our module built on meta, transformers' module built from our exported config, and
    the published count must agree: a wrong head count or width shows up here."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    args = FLAVORS[name]
    ours = num_params(build_model(args))
    model, config = (Qwen2MoeForCausalLM, Qwen2MoeConfig) if args.num_experts else (Qwen2ForCausalLM, Qwen2Config)
    with torch.device("meta"):
        theirs = model(config(**to_hf_config(args)))
    assert ours == num_params(theirs) == args.num_params()
    if name in PUBLISHED_BILLIONS:
        assert round(ours / 1e9, 2) == pytest.approx(PUBLISHED_BILLIONS[name], abs=0.011)


@pytest.mark.parametrize("name", list(PUBLISHED_MOE_BILLIONS))
def test_moe_flavors_total_and_activated_parameters(name):
    args = FLAVORS[name]
    total, active = PUBLISHED_MOE_BILLIONS[name]
    activated = args.matmul_params() + args.vocab_size * args.dim  # with the embedding, as the cards count
    assert round(args.num_params() / 1e9, 1) == total
    assert round(activated / 1e9, 1 if active < 10 else 0) == active
    assert args.vocab_size == 151936 and not args.tie_word_embeddings and args.moe_layers == tuple(range(args.n_layers))


def test_vocab_and_tie_follow_published_split():
    for name, args in FLAVORS.items():
        if name == "debug" or args.num_experts:
            continue
        big = name.endswith(("7b", "14b", "32b", "72b"))
        assert args.vocab_size == (152064 if big else 151936), name
        assert args.tie_word_embeddings == (not big), name


def test_get_flavor_shorthand_and_unknown():
    assert get_flavor("7b") is FLAVORS["qwen2-7b"]
    assert get_flavor("Qwen2.5-3B") is FLAVORS["qwen2.5-3b"]
    with pytest.raises(DuokaError, match="unknown model flavor 'qwen3-8b'") as e:
        get_flavor("qwen3-8b")
    assert "qwen2.5-72b" in e.value.fix


def test_flops_per_token_follows_palm_convention():
    a = FLAVORS["qwen2-7b"]
    n = a.matmul_params()
    # N counts the output head (3584 x 152064) and not the embedding lookup.
    assert n == a.num_params() - a.vocab_size * a.dim - a.n_layers * (2 * a.dim + a.dim + 2 * 512) - a.dim
    assert a.flops_per_token(2048) == 6 * n + 12 * 28 * 3584 * 2048


def test_hf_config_round_trip():
    for args in FLAVORS.values():
        assert from_hf_config(to_hf_config(args, dtype="bfloat16")) == args


def _cfg(**changes):
    cfg = to_hf_config(FLAVORS["debug"])
    cfg.update(changes)
    return cfg


@pytest.mark.parametrize("changes, field", [
    ({"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window"),
    ({"model_type": "qwen2_moe"}, "model_type"),
    ({"model_type": "llama"}, "model_type"),
    ({"architectures": ["Qwen2ForSequenceClassification"]}, "architectures"),
    ({"rope_scaling": {"type": "longrope", "factor": 4.0}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6}}, "rope_parameters"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_unsupported_config_is_refused_naming_the_field(changes, field):
    with pytest.raises(DuokaError) as e:
        from_hf_config(_cfg(**changes))
    assert field in e.value.cause
    assert e.value.fix


def test_missing_field_named():
    cfg = _cfg()
    del cfg["num_hidden_layers"]
    with pytest.raises(DuokaError, match="num_hidden_layers is missing"):
        from_hf_config(cfg)


def test_old_style_rope_theta_is_read():
    cfg = _cfg(rope_theta=12345.0)
    del cfg["rope_parameters"]
    assert from_hf_config(cfg).rope_theta == 12345.0


def test_heads_not_multiple_of_kv_heads():
    with pytest.raises(DuokaError, match="not a multiple"):
        ModelArgs(n_heads=6, n_kv_heads=4)
