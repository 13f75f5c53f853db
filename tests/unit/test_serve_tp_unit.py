"""Serving tensor parallelism without processes: which sizes split a model (and the error
that names the ones that do), which KV head each rank keeps, the checkpoint checks made
before any slice is read, and the step message's coverage of StepInputs.
tests/distributed/test_serve_tp.py runs the shards."""

from dataclasses import fields

import pytest
import torch

from duoka.errors import DuokaError
from duoka.models.qwen2.args import FLAVORS, ModelOptions
from duoka.models.qwen2.hf_adapter import load_hf_model, save_hf_checkpoint
from duoka.models.qwen2.model import build_model, materialize
from duoka.serve.runner import ARRAY_DTYPES, NUM_SIZES, SCALARS, StepInputs
from duoka.serve.step_channel import HEADER_LEN
from duoka.serve.tp_shard import (
    build_shard,
    check_tp_size,
    kv_head_range,
    load_shard,
    local_kv_heads,
    shard_args,
    shard_range,
    valid_tp_sizes,
)


def test_qwen2_1_5b_splits_over_4_with_replicated_kv_heads_but_not_over_5():
    args = FLAVORS["qwen2-1.5b"]  # 12 heads, 2 KV heads, MLP 8960
    check_tp_size(args, 4)
    assert local_kv_heads(args, 4) == 1
    # Query heads 0-2 and 3-5 read KV head 0, heads 6-8 and 9-11 KV head 1.
    assert [kv_head_range(args, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    with pytest.raises(DuokaError) as e:
        check_tp_size(args, 5)
    assert "12 attention heads are not divisible by 5" in e.value.cause
    assert e.value.fix.endswith(": 1, 2, 4")


@pytest.mark.parametrize("flavor, sizes", [("qwen2-7b", [1, 2, 4]), ("qwen2-72b", [1, 2, 4, 8, 16, 32, 64]),
                                           ("qwen2-0.5b", [1, 2]), ("qwen2-moe-a2.7b", [1, 2, 4, 8, 16]),
                                           ("qwen2-57b-a14b", [1, 2, 4])])
def test_valid_sizes_of_published_shapes(flavor, sizes):
    # 7B: 28 heads but 4 KV heads and an MLP of 18944 = 2^9 x 37, so neither 7 nor 8.
    # MoE-A2.7B: 16 heads, experts 1408 = 2^7 x 11 wide; 57B-A14B: its 7-way heads, not its experts (2560).
    assert valid_tp_sizes(FLAVORS[flavor]) == sizes


@pytest.mark.parametrize("tp, reason", [(0, "not a process count"), (3, "KV heads"), (8, "attention heads")])
def test_refusals_name_the_reason(tp, reason):
    with pytest.raises(DuokaError, match=reason):
        check_tp_size(FLAVORS["qwen2-7b"], tp)


def test_a_shard_is_a_model_of_the_shard_sizes():
    args = FLAVORS["qwen2-7b"]
    local = shard_args(args, 4)
    assert (local.n_heads, local.n_kv_heads, local.intermediate_size) == (7, 1, 4736)
    assert local.resolved_head_dim == args.resolved_head_dim == 128
    assert [kv_head_range(args, 2, r) for r in range(2)] == [(0, 2), (2, 4)]


def test_a_moe_shard_splits_every_expert_by_width():
    """Routed experts [E, out, in] by each expert's rows (gate/up) or columns (down), the shared
    expert as a dense MLP; the router and the shared expert's gate whole on every rank."""
    args = FLAVORS["qwen2-57b-a14b"]  # every layer sparse: 64 experts 2560 wide, a shared expert 20480 wide
    local = shard_args(args, 4)
    assert (local.num_experts, local.moe_intermediate_size, local.shared_expert_intermediate_size) == (64, 640, 5120)
    assert local.intermediate_size == args.intermediate_size  # no dense layer uses it: left whole
    assert shard_range("layers.3.feed_forward.experts.w1", args, 4, 1) == (1, 640, 1280)
    assert shard_range("layers.3.feed_forward.experts.w3", args, 4, 1) == (1, 640, 1280)
    assert shard_range("layers.3.feed_forward.experts.w2", args, 4, 1) == (2, 640, 1280)
    assert shard_range("layers.3.feed_forward.shared_expert.w1.weight", args, 4, 3) == (0, 15360, 20480)
    assert shard_range("layers.3.feed_forward.shared_expert.w2.weight", args, 4, 3) == (1, 15360, 20480)
    assert shard_range("layers.3.feed_forward.router.weight", args, 4, 1) is None
    assert shard_range("layers.3.feed_forward.shared_expert_gate.weight", args, 4, 1) is None
    with pytest.raises(DuokaError) as e:
        check_tp_size(FLAVORS["qwen2-moe-tiny"].replace(shared_expert_intermediate_size=126), 4)
    assert "shared expert's width (shared_expert_intermediate_size) 126 is not divisible by 4" in e.value.cause
    assert e.value.fix.endswith(": 1, 2")


def test_a_checkpoint_of_another_shape_is_refused_before_loading(tmp_path):
    args = FLAVORS["debug"]
    model = materialize(build_model(args), "cpu", torch.float32)
    model.init_weights()
    save_hf_checkpoint(model, tmp_path / "hf")
    wider = args.replace(intermediate_size=512)
    shard = build_shard(wider, 2, "cpu", torch.float32)
    with pytest.raises(DuokaError, match=r"does not match its config.json:(.|\n)*mlp.gate_proj.weight: checkpoint "
                                         r"\[384, 128\], model \[512, 128\]"):
        load_shard(shard, tmp_path / "hf", wider, 2, 0)


def test_every_step_input_travels_to_the_other_ranks():
    """A field added to StepInputs must be added to the tp message too (or the workers
    would run without it)."""
    assert {f.name for f in fields(StepInputs)} == set(ARRAY_DTYPES) | set(SCALARS)
    assert 1 + NUM_SIZES + len(SCALARS) <= HEADER_LEN


def test_packed_projections_load_the_same_model(tmp_path):
    """The serving engine's packed q/k/v and gate/up (ModelOptions.packed_projections) are the
    checkpoint's tensors concatenated: the same logits as the plain layout, whole and as tp
    shards (each shard's packed rows its own slices of q, k, v, gate and up)."""
    args = FLAVORS["debug"].replace(n_kv_heads=1)
    model = materialize(build_model(args), "cpu", torch.float32)
    model.init_weights(seed=3)
    save_hf_checkpoint(model, tmp_path / "hf")
    packed_options = ModelOptions(packed_projections=True)
    packed, _ = load_hf_model(tmp_path / "hf", options=packed_options)
    assert "layers.0.attention.wqkv.weight" in packed.state_dict()
    assert "layers.0.attention.wq.weight" not in packed.state_dict()
    tokens = torch.randint(0, args.vocab_size, (2, 12))
    torch.testing.assert_close(packed(tokens), model(tokens), rtol=0, atol=1e-5)

    for rank in range(2):
        plain, shard = build_shard(args, 2, "cpu", torch.float32), build_shard(args, 2, "cpu", torch.float32,
                                                                               packed_options)
        load_shard(plain, tmp_path / "hf", args, 2, rank)
        load_shard(shard, tmp_path / "hf", args, 2, rank)
        attn, packed_attn = plain.layers["1"].attention, shard.layers["1"].attention
        torch.testing.assert_close(packed_attn.wqkv.weight,
                                   torch.cat([attn.wq.weight, attn.wk.weight, attn.wv.weight]), rtol=0, atol=0)
        ffn, packed_ffn = plain.layers["1"].feed_forward, shard.layers["1"].feed_forward
        torch.testing.assert_close(packed_ffn.w13.weight, torch.cat([ffn.w1.weight, ffn.w3.weight]), rtol=0, atol=0)
        torch.testing.assert_close(shard(tokens), plain(tokens), rtol=0, atol=1e-5)
    with pytest.raises(KeyError, match="no Hugging Face name"):
        save_hf_checkpoint(packed, tmp_path / "out")
