"""duoka plan for mixture-of-experts models (duoka.plan.moe): the parameter split, what
expert parallelism divides and what it costs, the layouts proposed, and Qwen2-57B-A14B's
plans on 8 and on 2 GPUs."""

from __future__ import annotations

import pytest

from duoka.config import load_config
from duoka.errors import DuokaError
from duoka.models.qwen2.args import FLAVORS
from duoka.parallel.dims import ParallelDims
from duoka.plan.hardware import Hardware
from duoka.plan.layouts import enumerate_layouts
from duoka.plan.memory import GIB, Layout, estimate_memory, layout_from_config, saved_per_token
from duoka.plan.model_choice import resolve_model
from duoka.plan.moe import expert_degrees, expert_split
from duoka.plan.network import make_fabric, preset
from duoka.plan.optimizer_costs import rank_tensors
from duoka.plan.ranking import make_plan
from duoka.plan.step_time import estimate_step_time

MOE = ("qwen2-moe-tiny", "qwen2-moe-a2.7b", "qwen2-57b-a14b")
BIG = FLAVORS["qwen2-57b-a14b"]
TINY = FLAVORS["qwen2-moe-tiny"]


def hw(gpus, memory=80, nodes=1):
    return Hardware(gpus, nodes, memory, "nvlink")


@pytest.mark.parametrize("name", MOE)
def test_the_split_and_the_optimizer_tensors_count_every_parameter(name):
    args = FLAVORS[name]
    split = expert_split(args)
    vocab = args.vocab_size * args.dim * (1 if args.tie_word_embeddings else 2)
    assert split.blocks + vocab + args.dim == args.num_params()
    assert split.experts == len(args.moe_layers) * args.num_experts * 3 * args.dim * args.moe_intermediate_size
    tensors = rank_tensors(args, args.n_layers, True, True)
    assert sum(t.numel * t.count for t in tensors) == args.num_params()
    # The stacked experts are 3-D: Muon leaves them to its AdamW (not "matrix")
    assert sum(t.numel * t.count for t in tensors if t.role == "experts") == split.experts


def test_qwen2_57b_has_its_published_sizes():
    split = expert_split(BIG)
    assert BIG.num_params() / 1e9 == pytest.approx(57.41, abs=0.01)
    assert split.experts / 1e9 == pytest.approx(49.33, abs=0.01)  # 28 layers x 64 experts x 3 x 3584 x 2560
    active = BIG.num_params() - split.experts * (1 - 8 / 64)
    assert active / 1e9 == pytest.approx(14.2, abs=0.1)  # "A14B"


def test_a_moe_layer_saves_by_hand():
    """qwen2-moe-tiny in bf16 (FSDP2): h 128, top-2 of 8 experts of width 64, a shared expert
    of width 128, 4 heads of 32 (2 KV heads)."""
    h, k, moe_i, shared_i, experts, e = 128, 2, 64, 128, 8, 2
    sparse = (4 * experts  # the router's fp32 probabilities
              + e * k * h + 4 * e * k * moe_i + e * k * h + e * k  # dispatched rows, SwiGLU, combined rows, weights
              + 4 * e * shared_i + e * h + e  # the shared expert, its output, its gate
              + 24 * k)  # int64 indices: topk, the gather, index_copy
    assert sparse == 3414
    attention = e * (2 * 128 + 2 * 64) + 4 * 4  # q, out, k, v + logsumexp
    block = 2 * (4 * h + 2 * h) + attention + 2 * h + 2 * h  # norms, attention, its input, the MLP input
    saved = saved_per_token(TINY, "bf16")
    assert saved.moe_block == block + sparse == 6246
    assert saved_per_token(TINY, "bf16", ep=2).moe_block == saved.moe_block + 16 * k  # the dispatch's indices
    # 1 dense layer (layer 0) and 3 MoE layers, 1024 tokens, plus the final norm and head input
    b = estimate_memory(TINY, Layout("fsdp", 1, 2), 1, 1024, False)
    assert b.phase == "loss backward"
    assert b.activations == 1024 * (saved.block + 3 * saved.moe_block + saved.final_norm)


def test_expert_parallelism_divides_what_fsdp_holds_unsharded():
    """The experts' fp32 weights, gradients and AdamW state are experts / dp_shard per GPU
    whatever ep (ep ranks x dp_shard / ep shards); a gathered block and the fp32 gradients
    kept while accumulating hold num_experts / ep experts per layer."""
    experts = expert_split(BIG).experts
    est = {ep: estimate_memory(BIG, Layout("fsdp", 1, 8, ep=ep), 1, 2048, True, accumulation=2) for ep in (1, 2, 4)}
    assert all(b.phase in ("loss backward", "block backward") for b in est.values())
    for ep, b in est.items():
        assert b.parameters == pytest.approx(4 * BIG.num_params() / 8)
        assert b.optimizer == pytest.approx(est[1].optimizer)
        # unsharded fp32 gradients while accumulating: the experts' share divides by ep
        assert est[1].gradients - b.gradients == pytest.approx(4 * experts * (1 - 1 / ep))
    assert est[1].allocated > est[2].allocated > est[4].allocated
    kept = {ep: estimate_memory(BIG, Layout("fsdp", 1, 8, reshard_after_forward=False, ep=ep), 1, 2048, True)
            for ep in (1, 2, 4)}
    for ep, b in kept.items():  # every block kept gathered (bf16): the experts' share divides by ep
        assert kept[1].gathered_parameters - b.gathered_parameters == pytest.approx(2 * experts * (1 - 1 / ep))


def test_all_to_all_by_hand():
    fab = make_fabric(8, "nvlink", preset("ib-ndr"))
    assert fab.all_to_all_s(1e9, 1) == 0
    # 2 ranks in a node: half the bytes go to the other over NVLink, one step
    assert fab.all_to_all_s(1e9, 2) == pytest.approx(0.5e9 / 350e9 + 8.4e-6 + 3.4e-6)
    # 16 ranks over 2 nodes: 8/16 of the bytes leave the node through the rank's own NIC
    # (45 GB/s), 7/16 stay on NVLink, at once; 14 NVLink steps and one network step
    fab16 = make_fabric(8, "nvlink", preset("ib-ndr"))
    assert fab16.all_to_all_s(1e9, 16) == pytest.approx(8 / 16 * 1e9 / 45e9 + 8.4e-6 + 14 * 3.4e-6 + 9.6e-6)


def test_all_to_all_is_zero_without_ep_and_grows_with_it():
    h = hw(8, 141)
    times = {ep: estimate_step_time(BIG, Layout("fsdp", 1, 8, ep=ep), 1, 2048, 16, False, h) for ep in (1, 2, 4, 8)}
    assert times[1].expert_parallel_s == 0
    assert 0 < times[2].expert_parallel_s < times[4].expert_parallel_s < times[8].expert_parallel_s
    # ep 2 by hand: per MoE layer and micro-batch 4 all-to-alls of 2048 tokens x 8 copies x
    # 3584 x 2 bytes, half of it to the other rank, and the sizes' exchange (latency only)
    rows = 2048 * 8 * 3584 * 2
    step = 8.4e-6 + 3.4e-6
    per_layer = 4 * (rows / 2 / 350e9 + step) + step
    assert times[2].expert_parallel_s == pytest.approx(2 * 28 * per_layer)  # 2 micro-batches of 28 layers
    # and the experts' FSDP2 traffic shrinks: num_experts / ep experts over dp_shard / ep ranks
    assert times[1].data_parallel_s > times[2].data_parallel_s > times[4].data_parallel_s > times[8].data_parallel_s
    checkpointed = estimate_step_time(BIG, Layout("fsdp", 1, 8, ep=2), 1, 2048, 16, True, h)
    assert checkpointed.expert_parallel_s == pytest.approx(2 * 28 * (6 * (rows / 2 / 350e9 + step) + 2 * step))


def test_compute_counts_the_active_experts():
    h = hw(8, 141)
    t = estimate_step_time(BIG, Layout("fsdp", 1, 8, ep=8), 1, 2048, 8, False, h)
    tokens = 8 * 2048
    assert t.mfu * 8 * h.peak_flops * t.total_s == pytest.approx(BIG.flops_per_token(2048) * tokens, rel=1e-9)


def test_layouts_proposed_for_moe_models():
    """Data parallelism only (the trainer refuses tp and pp for MoE), every ep dividing
    dp_shard and num_experts; dense models keep ep 1."""
    layouts = enumerate_layouts(BIG, 16, 8)
    assert all(lay.tp == lay.pp == 1 for lay in layouts)
    assert {lay.ep for lay in layouts if lay.dp_shard == 16} == {1, 2, 4, 8, 16}
    assert all(BIG.num_experts % lay.ep == 0 and lay.dp_shard % lay.ep == 0 for lay in layouts)
    assert expert_degrees(FLAVORS["qwen2-moe-a2.7b"], 8) == [1, 2, 4]  # 60 experts
    assert all(lay.ep == 1 for lay in enumerate_layouts(FLAVORS["qwen2-7b"], 16, 8))
    assert Layout("fsdp", 1, 8, ep=4).describe() == "fsdp 8 + ep 4"
    assert Layout("fsdp", 2, 4, ep=2, reshard_after_forward=False).describe(compact=True) == "hsdp2x4+ep2+noreshard"
    with pytest.raises(DuokaError, match="trains with data parallelism only"):
        estimate_memory(BIG, Layout("fsdp", 1, 4, tp=2), 1, 2048, True)
    with pytest.raises(DuokaError, match="has none"):
        estimate_memory(FLAVORS["qwen2-7b"], Layout("fsdp", 1, 8, ep=2), 1, 2048, True)
    with pytest.raises(DuokaError, match="needs|splits the experts"):
        Layout("ddp", 8, ep=2)


def test_57b_on_one_node_of_h200():
    """8 x 141 GiB hold Qwen2-57B-A14B's 855 GiB of AdamW training state; at one sequence per
    GPU the experts' FSDP2 traffic (49B weights gathered twice and reduced per step) is not
    hidden by the compute, and splitting the experts wins."""
    plan = make_plan(resolve_model("qwen2-57b-a14b"), hw(8, 141), 2048, 8)
    best = plan.best
    assert plan.optimizer.name == "adamw" and best.fits and best.memory.reserved <= 0.9 * 141 * GIB
    assert all(c.layout.tp == c.layout.pp == 1 and c.layout.fsdp for c in plan.ranked)
    assert best.layout.ep > 1 and "ep" in plan.config_toml()
    plain = [c for c in plan.ranked + plan.rejected if c.layout == Layout("fsdp", 1, 8)]
    assert plain and (not plain[0].fits or plain[0].time.total_s > 1.1 * best.time.total_s)
    assert any("mixture of experts" in n and "routed experts" in n for n in plan.notes)
    assert best.time.expert_parallel_s > 0


def test_57b_on_one_node_of_h100_needs_less_optimizer_state():
    """8 x 80 GiB cannot hold AdamW's 16 bytes a parameter (107 GiB per GPU); at seq 4096 and
    the default 8 sequences a GPU nothing fits, and the error names what would; at one sequence
    per GPU the plan proposes quantized state."""
    model = resolve_model("qwen2-57b-a14b")
    with pytest.raises(DuokaError) as e:
        make_plan(model, hw(8), 4096)
    assert "does not fit on 8 x 80 GiB" in e.value.cause
    assert "--global-batch 8" in e.value.fix
    n = int(e.value.fix.split("use at least ")[1].split(" GPUs")[0])
    assert n > 8 and n % 8 == 0
    plan = make_plan(model, hw(8), 2048, 8)
    assert plan.proposal and plan.optimizer.name in ("adamw8bit", "adamw4bit")
    assert plan.best.fits and plan.best.layout.tp == plan.best.layout.pp == 1


@pytest.mark.parametrize("memory", (80, 141))
def test_57b_on_two_gpus_does_not_fit_and_says_what_would(memory):
    with pytest.raises(DuokaError) as e:
        make_plan(resolve_model("qwen2-57b-a14b"), hw(2, memory), 2048)
    cause, fix = e.value.cause, e.value.fix
    assert f"does not fit on 2 x {memory} GiB" in cause and "no other optimizer fits either" in cause
    assert "fp32 weights and gradients alone are 57.4B x 8 bytes" in cause  # 214 GiB per GPU, beyond any
    n = int(fix.split("use at least ")[1].split(" GPUs")[0])
    assert n >= 8


def test_emitted_moe_config_loads_and_the_trainer_accepts_its_layout(tmp_path):
    plan = make_plan(resolve_model("qwen2-57b-a14b"), hw(8, 141), 2048, 8)
    path = tmp_path / "plan.toml"
    path.write_text(plan.config_toml())
    cfg = load_config(path)
    assert cfg.parallel.ep == plan.best.layout.ep > 1
    assert layout_from_config(cfg.parallel, 8) == plan.best.layout
    dims = ParallelDims.from_config(cfg.parallel, 8)
    dims.check_model(BIG.n_heads, BIG.n_kv_heads, BIG.n_layers, num_experts=BIG.num_experts)
    assert plan.to_dict()["ranked"][0]["parallel"]["ep"] == plan.best.layout.ep
