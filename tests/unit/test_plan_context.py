"""duoka plan with context parallelism (duoka.plan.context): what cp divides and adds in
memory, the key/value traffic on the step, where the search proposes it (long sequences of
dense models, with fsdp/hsdp only), and a 128K-token plan of a YaRN 7B-shaped config on
8 x 80 GiB."""

from __future__ import annotations

import dataclasses
import json

import pytest

from duoka.config import load_config
from duoka.errors import DuokaError
from duoka.models.qwen2.args import FLAVORS, to_hf_config
from duoka.models.qwen2.rope import RopeScaling
from duoka.parallel.dims import ParallelDims
from duoka.plan.context import (
    CONTEXT_MIN_SEQ,
    context_degrees,
    context_memory,
    context_traffic_s,
    kv_gathered_bytes,
    searches_context,
    ulysses_exchange_bytes,
)
from duoka.plan.hardware import Hardware
from duoka.plan.layouts import enumerate_layouts
from duoka.plan.memory import GIB, Layout, estimate_memory, layout_from_config
from duoka.plan.model_choice import resolve_model
from duoka.plan.ranking import make_plan
from duoka.plan.step_time import estimate_step_time

SEQ = 131072
SEVEN = FLAVORS["qwen2-7b"]
KV = SEVEN.n_kv_heads * SEVEN.resolved_head_dim


def hw(gpus, memory=80, nodes=1):
    return Hardware(gpus, nodes, memory, "nvlink")


@pytest.fixture(scope="module")
def yarn_7b(tmp_path_factory):
    """A Qwen2-7B-shaped config.json whose YaRN rope scaling (factor 4 over 32,768, as Qwen's
    model cards give it) reaches 131,072 positions: the planner reads only config.json."""
    folder = tmp_path_factory.mktemp("yarn-7b")
    args = dataclasses.replace(SEVEN, max_seq_len=32768, rope_scaling=RopeScaling("yarn", 4.0, 32768))
    (folder / "config.json").write_text(json.dumps(to_hf_config(args)))
    return resolve_model(str(folder))


def test_a_128k_sequence_on_8x80_plans_cp_and_fits(yarn_7b, tmp_path):
    assert yarn_7b.args.context_len == SEQ
    plan = make_plan(yarn_7b, hw(8), SEQ)
    best = plan.best
    assert best.layout.cp > 1 and best.fits and best.memory.reserved <= hw(8).usable_bytes
    assert best.layout.dp_mode == "fsdp" and best.layout.tp == best.layout.pp == best.layout.ep == 1
    # The default batch keeps about 16,384 tokens per GPU: one sequence for the cp group.
    assert plan.global_batch == 1 and best.accumulation == 1
    # Why: the same layout without cp, estimated at one sequence, is far over the GPU.
    assert "without cp" in plan.why and "> 72.0 usable" in plan.why
    assert any(n.startswith("context parallelism: cp ") and "cuDNN" in n for n in plan.notes)
    # cp 8 runs by all-gather (auto's choice, written out): Ulysses needs the 28 heads to divide by cp.
    assert "cp 8 by all-gather: the model's 28 attention heads do not divide by 8" in plan.why
    path = tmp_path / "plan.toml"
    path.write_text(plan.config_toml())
    cfg = load_config(path)
    assert cfg.parallel.cp == best.layout.cp and cfg.training.seq_len % (2 * cfg.parallel.cp) == 0
    assert cfg.parallel.cp_method == best.layout.cp_method == "allgather"
    assert layout_from_config(cfg.parallel, 8) == best.layout
    dims = ParallelDims.from_config(cfg.parallel, 8)  # the trainer's own checks of cp
    assert (dims.cp, dims.dp_size, dims.fsdp_size) == (best.layout.cp, best.layout.dp_size, best.layout.fsdp_size)
    assert plan.to_dict()["ranked"][0]["parallel"]["cp"] == best.layout.cp


def test_the_sequence_stays_within_the_models_context(yarn_7b, tmp_path):
    with pytest.raises(DuokaError, match=f"--seq {2 * SEQ} exceeds the model's {SEQ} positions"):
        make_plan(yarn_7b, hw(8), 2 * SEQ)
    plain = dataclasses.replace(SEVEN, max_seq_len=32768)  # no rope scaling: 32,768 positions
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config(plain)))
    with pytest.raises(DuokaError, match="exceeds the model's 32768 positions") as e:
        make_plan(resolve_model(str(tmp_path)), hw(8), SEQ)
    assert "rope_scaling yarn" in e.value.fix


@pytest.mark.parametrize("ac", [False, True])
def test_memory_per_gpu_falls_with_cp(ac):
    est = {cp: estimate_memory(SEVEN, Layout("fsdp", 1, 8, cp=cp), 1, SEQ, ac) for cp in (1, 2, 4, 8)}
    reserved = [est[cp].reserved for cp in (1, 2, 4, 8)]
    assert reserved == sorted(reserved, reverse=True) and len(set(reserved)) == 4
    for cp, m in est.items():
        # Per-token terms count the rank's seq / cp tokens; the state shards over all 8 ranks.
        assert m.logits == pytest.approx(est[1].logits / cp)
        assert (m.parameters, m.optimizer) == (est[1].parameters, est[1].optimizer)
        assert (m.context > 0) == (cp > 1)


def test_the_gathered_keys_values_mask_and_bias_by_hand():
    """At cp 8, 16,384 of 131,072 tokens per GPU; the peak is the loss's backward. Without
    checkpointing every layer keeps the whole sequence's keys and values (beyond its own) and
    SDPA's bf16 bias of the mask; with it only the boolean mask, kept by the blocks' saved
    inputs; the block recomputed in backward gathers one layer's again."""
    local = SEQ // 8
    kv_extra = 2 * 2 * KV * (SEQ - local)
    bias = 2 * local * SEQ
    plain = estimate_memory(SEVEN, Layout("fsdp", 1, 8, cp=8), 1, SEQ, False)
    assert plain.phase == "loss backward"
    assert plain.context == SEVEN.n_layers * (kv_extra + bias)
    ac = estimate_memory(SEVEN, Layout("fsdp", 1, 8, cp=8), 1, SEQ, True)
    assert ac.phase == "loss backward" and ac.context == local * SEQ == 2 * GIB
    ctx = context_memory(SEVEN, 2, SEQ, 8, 2)  # two sequences: twice each term
    assert (ctx.mask, ctx.bias, ctx.kv_layer, ctx.kv_grad) == (2 * local * SEQ, 2 * bias, 2 * kv_extra,
                                                              2 * 2 * 2 * KV * SEQ)
    assert ctx.recomputed(True) == ctx.kv_layer + ctx.bias and ctx.recomputed(False) == 0
    assert context_memory(SEVEN, 1, SEQ, 1, 2).held(28, False) == 0


def test_the_key_value_traffic_is_zero_without_cp_and_grows_with_it():
    h = hw(8)
    times = {cp: estimate_step_time(SEVEN, Layout("fsdp", 1, 8, cp=cp), 1, SEQ, 8, True, h) for cp in (1, 2, 4, 8)}
    traffic = [times[cp].context_parallel_s for cp in (1, 2, 4, 8)]
    assert traffic[0] == 0.0 and traffic == sorted(traffic) and len(set(traffic)) == 4
    # Per micro-batch and layer: K and V gathered forward, again in the recompute, their
    # gradients reduce-scattered: six collectives of the whole sequence's keys (or values).
    for cp in (2, 4, 8):
        m = 8 // (8 // cp)  # micro-batches per rank: the cp group shares the batch of 8
        one = h.fabric.all_gather_s(kv_gathered_bytes(SEVEN, 1, SEQ), cp)
        assert times[cp].context_parallel_s == pytest.approx(m * SEVEN.n_layers * 6 * one)
        assert times[cp].total_s > times[cp].compute_s + times[cp].context_parallel_s  # on the critical path
    # Compute per rank is the same share of the batch's: total / (dp x cp).
    assert times[8].compute_s == pytest.approx(times[1].compute_s, rel=0.02)


def test_cp_is_proposed_only_with_fsdp_and_never_for_moe():
    layouts = enumerate_layouts(SEVEN, 16, 8, context_seq=SEQ)
    with_cp = [lay for lay in layouts if lay.cp > 1]
    assert {lay.cp for lay in with_cp} == {2, 4, 8, 16}
    assert all(lay.dp_mode == "fsdp" and lay.tp == lay.pp == lay.ep == 1 and lay.dp_shard % lay.cp == 0
               for lay in with_cp)
    assert {lay.describe(compact=True) for lay in with_cp} >= {"fsdp16+cp8", "hsdp2x8+cp4-ulysses+noreshard"}
    # auto's method: Ulysses where the 28 heads divide by cp (2, 4), the all-gather where not (8, 16)
    assert all(lay.cp_method == ("ulysses" if lay.cp in (2, 4) else "allgather") for lay in with_cp)
    assert all(lay.cp == 1 for lay in enumerate_layouts(SEVEN, 16, 8))  # without context_seq
    moe = FLAVORS["qwen2-57b-a14b"]
    assert not searches_context(moe, SEQ) and all(lay.cp == 1 for lay in enumerate_layouts(moe, 16, 8, SEQ))
    with pytest.raises(DuokaError, match="mixture-of-experts"):
        estimate_memory(moe, Layout("fsdp", 1, 8, cp=2), 1, SEQ, True)
    for bad in ({"tp": 2}, {"pp": 2}, {"ep": 2}):
        with pytest.raises(DuokaError, match="does not combine with"):
            Layout("fsdp", 1, 8, cp=2, **bad)
    with pytest.raises(DuokaError, match="dp_mode=fsdp and a cp dividing dp_shard"):
        Layout("ddp", 8, cp=2)
    with pytest.raises(DuokaError, match="2 x cp = 16 equal chunks"):
        estimate_memory(SEVEN, Layout("fsdp", 1, 8, cp=8), 1, SEQ + 8, True)
    assert context_degrees(8, SEQ + 8) == [2, 4]  # 131,080 cuts into 4 and 8 chunks, not 16


def test_short_sequences_do_not_search_cp():
    assert not searches_context(SEVEN, CONTEXT_MIN_SEQ) and searches_context(SEVEN, 2 * CONTEXT_MIN_SEQ)
    plan = make_plan(resolve_model("qwen2-7b"), hw(8), CONTEXT_MIN_SEQ)
    assert all(c.layout.cp == 1 for c in plan.ranked + plan.rejected)
    assert plan.global_batch == 64  # 8 sequences per GPU, as before


def test_a_batch_too_large_for_one_node_names_one_sequence_per_cp_group():
    # 48 GiB: at 80 the fused loss (planned with checkpointing) lets 8 sequences fit, accumulated.
    with pytest.raises(DuokaError, match="does not fit on 8 x 48 GiB") as e:
        make_plan(resolve_model("qwen2-7b"), hw(8, memory=48), SEQ, 8)
    assert "one sequence per 4 GPUs (cp splits it) fits these GPUs: --global-batch 2" in e.value.fix


def test_the_plan_prints_the_cp_memory_row(capsys):
    from duoka.cli import main

    assert main(["plan", "--model", "qwen2-7b", "--gpus", "8", "--gpu-memory", "80", "--seq", str(SEQ)]) == 0
    out = capsys.readouterr().out
    assert "cp: gathered keys/values, attention mask and bias" in out and "cp = 8" in out


def test_ulysses_memory_and_traffic_by_hand():
    """By Ulysses, SDPA saves the whole sequence's q, k, v and output for 1/cp of the heads: as
    many elements as the rank's own tokens of every head, except KV heads repeated up to cp;
    no mask and no bias. A layer's backward holds the exchange's q/k/v gradients twice.
    Traffic: per layer two all-to-alls (q/k/v, output), forward, backward, recompute."""
    local = SEQ // 4
    head = 2 * SEVEN.resolved_head_dim * local  # one head of the rank's tokens, bf16
    ctx = context_memory(SEVEN, 1, SEQ, 4, 2, "ulysses")  # 4 KV heads over cp 4: none repeated
    assert (ctx.kv_layer, ctx.mask, ctx.bias, ctx.kv_grad) == (0, 0, 0, 2 * (28 + 2 * 4) * head)
    small = FLAVORS["qwen2-1.5b"]  # 12 heads, 2 KV heads: each repeated twice over cp 4
    one = 2 * small.resolved_head_dim * local
    assert context_memory(small, 1, SEQ, 4, 2, "ulysses").kv_layer == 2 * 2 * one
    assert ulysses_exchange_bytes(small, 4, 1, SEQ) == ((12 + 2 * 4) * one, 12 * one)
    gathered = context_memory(SEVEN, 1, SEQ, 4, 2)
    for ac in (False, True):
        ulysses, allgather = (estimate_memory(SEVEN, Layout("fsdp", 1, 8, cp=4, cp_method=m), 1, SEQ, ac)
                              for m in ("ulysses", "allgather"))
        assert ulysses.context < allgather.context and ulysses.reserved < allgather.reserved
        assert allgather.context >= (gathered.mask if ac else SEVEN.n_layers * gathered.bias)
    h = hw(8)
    qkv, out = ulysses_exchange_bytes(SEVEN, 4, 1, SEQ)
    for ac, passes in ((False, 2), (True, 3)):
        assert context_traffic_s(SEVEN, 4, 1, SEQ, ac, h.fabric, 1, "ulysses") == pytest.approx(
            SEVEN.n_layers * passes * (h.fabric.all_to_all_s(qkv, 4) + h.fabric.all_to_all_s(out, 4)))
    # What a rank sends stays the same as the sequence and cp double together (72B: 8 KV heads,
    # none repeated at cp 4 or 8); the all-gather's keys are the whole sequence's, and double.
    big = FLAVORS["qwen2-72b"]
    assert ulysses_exchange_bytes(big, 4, 1, SEQ // 2) == ulysses_exchange_bytes(big, 8, 1, SEQ)
    assert kv_gathered_bytes(big, 1, SEQ) == 2 * kv_gathered_bytes(big, 1, SEQ // 2)
    with pytest.raises(DuokaError, match="cp_method=allgather"):
        estimate_memory(SEVEN, Layout("fsdp", 1, 8, cp=8, cp_method="ulysses"), 1, SEQ, True)


def test_the_plan_takes_ulysses_where_the_heads_divide_and_says_why(tmp_path, capsys):
    """Qwen2-1.5B at 131,072 tokens, two sequences on 8 x 24 GiB: cp 4 by Ulysses (12 heads, 3 per
    GPU; its 2 KV heads repeated to 4), which fits where the all-gather's dense mask and biases
    would not; the plan gives both methods' memory and traffic, and the config it writes is the
    trainer's, the fused loss included."""
    h = hw(8, memory=24)
    plan = make_plan(resolve_model("qwen2-1.5b"), h, SEQ, 2)
    best = plan.best
    assert (best.layout.cp, best.layout.cp_method) == (4, "ulysses") and best.fits
    assert "cp 4 by Ulysses: the 12 attention heads divide by 4" in plan.why
    allgather = estimate_memory(plan.model.args, dataclasses.replace(best.layout, cp_method="allgather"),
                                best.micro_batch, SEQ, best.activation_checkpointing, best.accumulation,
                                fused_loss=best.fused_loss)
    assert best.fused_loss and allgather.reserved > h.usable_bytes >= best.memory.reserved
    assert f"the all-gather needs {allgather.reserved / GIB:.1f} GiB (> 21.6 usable)" in plan.why
    note = next(n for n in plan.notes if n.startswith("context parallelism"))
    assert "by Ulysses" in note and "2 KV heads repeated x2" in note and "no mask or bias" in note
    path = tmp_path / "plan.toml"
    path.write_text(plan.config_toml())
    cfg = load_config(path)
    assert (cfg.parallel.cp, cfg.parallel.cp_method, cfg.training.fused_loss) == (4, "ulysses", True)
    assert layout_from_config(cfg.parallel, 8) == best.layout
    assert ParallelDims.from_config(cfg.parallel, 8).context_method(plan.model.args.n_heads) == "ulysses"
    auto = dataclasses.replace(cfg.parallel, cp_method="auto")  # auto resolves to what the plan wrote
    assert layout_from_config(auto, 8, plan.model.args.n_heads) == best.layout
    assert plan.to_dict()["ranked"][0]["parallel"]["cp_method"] == "ulysses"
    from duoka.cli import main

    assert main(["plan", "--model", "qwen2-1.5b", "--gpus", "8", "--gpu-memory", "24", "--seq", str(SEQ),
                 "--global-batch", "2"]) == 0
    out = capsys.readouterr().out
    # With the fused loss the peak is a block's backward, which holds the exchange's q/k/v
    # gradients (duoka.plan.context): the table has a cp row.
    assert best.memory.phase == "block backward" and best.memory.context > 0
    assert "cp: " in out and 'cp_method = "ulysses"' in out and "fused_loss = true" in out
