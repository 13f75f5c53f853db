"""duoka plan across nodes: the collective cost formulas against hand counts, the planner's
monotonic behaviour in GPUs and network speed, the --scaling table at 80 columns, and the
published runs docs/plan.md sets beside the model."""

from __future__ import annotations

import io
import time

import pytest
from rich.console import Console

from duoka.errors import DuokaError
from duoka.models.qwen2.args import FLAVORS, ModelArgs
from duoka.plan.hardware import Hardware
from duoka.plan.memory import Layout
from duoka.plan.model_choice import resolve_model
from duoka.plan.network import NETWORKS, Fabric, group_shape, make_fabric
from duoka.plan.ranking import evaluate, make_plan, rank
from duoka.plan.scaling import plan_scaling, render_scaling, scaling_counts, scaling_hardware
from duoka.plan.step_time import estimate_step_time

US = 1e-6
# NVLink 350 GB/s; a 400 Gb/s NIC per GPU at 90%: 45 GB/s; NCCL's ring steps 3.4 us (NVLink)
# and 9.6 us (network), tree hops 28 and 50 us, 8.4 us per launch.
FAB = Fabric(8, 350e9, 45e9, 3.4 * US, 9.6 * US, 28 * US, 50 * US, 8.4 * US)


def hw(gpus, nodes=None, memory=80, **kw):
    return Hardware(gpus, nodes or max(1, gpus // 8), memory, "nvlink", **kw)


# ---------------------------------------------------------------- the formulas


def test_group_shapes_follow_the_mesh():
    assert group_shape(8, 1, 8) == (1, 8)  # a node's 8 GPUs
    assert group_shape(32, 1, 8) == (4, 8)  # flat over 4 nodes
    assert group_shape(16, 8, 8) == (16, 1)  # one per node: HSDP replicas of 8-GPU shards, fsdp under tp 8
    assert group_shape(8, 4, 8) == (4, 2)  # fsdp under tp 4: two ranks of each node


def test_ring_all_gather_by_hand():
    S = 8e9
    # one node: 7 steps over NVLink
    assert FAB.all_gather_s(S, 8) == pytest.approx(7 / 8 * S / 350e9 + 8.4 * US + 7 * 3.4 * US)
    # 32 ranks on 4 nodes: 8 NICs a node outrun NVLink, so NVLink bounds the ring; 28 NVLink
    # steps and 3 network steps
    assert FAB.all_gather_s(S, 32) == pytest.approx(31 / 32 * S / 350e9 + 8.4 * US + 28 * 3.4 * US + 3 * 9.6 * US)
    # one rank per node: each pulls through its own NIC; 15 network steps
    assert FAB.all_gather_s(S, 16, stride=8) == pytest.approx(15 / 16 * S / 45e9 + 8.4 * US + 15 * 9.6 * US)
    assert FAB.reduce_scatter_s(S, 16, 8) == FAB.all_gather_s(S, 16, 8)
    assert FAB.all_gather_s(S, 1) == 0.0


def test_all_reduce_takes_the_faster_of_ring_and_tree_latency():
    S = 1e9
    # 16 ranks on 2 nodes: ring 2 x (14 NVLink + 1 network) steps beats the tree's 2 x (7 x 28 + 1 x 50) us
    ring = 8.4 * US + 2 * (14 * 3.4 + 1 * 9.6) * US
    assert FAB.all_reduce_s(S, 16) == pytest.approx(2 * 15 / 16 * S / 350e9 + ring)
    # 1,024 ranks on 128 nodes: the ring's 2 x (896 x 3.4 + 127 x 9.6) us = 8.5 ms loses to the
    # tree's 2 x (7 x 28 + 7 x 50) us = 1.1 ms
    tree = 8.4 * US + 2 * (7 * 28 + 7 * 50) * US
    assert FAB.all_reduce_s(S, 1024) == pytest.approx(2 * 1023 / 1024 * S / 350e9 + tree)
    assert FAB.all_reduce_s(0.0, 1024) == pytest.approx(tree)


def test_point_to_point():
    assert FAB.send_s(1e8, crosses_nodes=True) == pytest.approx(1e8 / 45e9 + 8.4 * US + 9.6 * US)
    assert FAB.send_s(1e8, crosses_nodes=False) == pytest.approx(1e8 / 350e9 + 8.4 * US + 3.4 * US)


def test_networks_and_overrides():
    ndr = make_fabric(8, "nvlink", NETWORKS["ib-ndr"])
    assert (ndr.intra_bytes_per_s, ndr.inter_bytes_per_s, ndr.inter_step_s) == (350e9, pytest.approx(45e9), 9.6 * US)
    # one 100 GbE NIC for 8 GPUs over TCP: 12.5 Gb/s per GPU at 80%
    assert make_fabric(8, "nvlink", NETWORKS["eth-100"]).inter_bytes_per_s == pytest.approx(100e9 / 8 / 8 * 0.8)
    custom = make_fabric(8, "pcie", NETWORKS["ib-ndr"], intra_bytes_per_s=20e9, inter_gbps=200, inter_step_s=20 * US)
    assert custom.intra_bytes_per_s == 20e9 and custom.intra_step_s == 5.7 * US
    assert custom.inter_bytes_per_s == pytest.approx(200e9 / 8 * 0.9) and custom.inter_step_s == 20 * US
    assert custom.inter_tree_s == pytest.approx(50 * US * 20 / 9.6)  # tree hops scale with the ring step
    nolink = make_fabric(8, "ib", NETWORKS["ib-hdr"])  # no peer link: the NIC inside the node too
    assert nolink.intra_bytes_per_s == nolink.inter_bytes_per_s == pytest.approx(22.5e9)


def test_hardware_refuses_what_it_cannot_model():
    with pytest.raises(DuokaError, match="--network ib-xdr is unknown") as e:
        hw(16, network="ib-xdr")
    assert "ib-ndr" in e.value.fix
    with pytest.raises(DuokaError, match="--inter-bw -1 must be positive"):
        hw(16, inter_gbps=-1)
    with pytest.raises(DuokaError, match="--gpus 16384 is beyond what this cost model means") as e:
        hw(16384)
    assert "8,192" in e.value.fix
    assert hw(8192).gpus == 8192


# ---------------------------------------------------------------- the planner uses them

TINY = ModelArgs(vocab_size=100, dim=8, n_layers=2, n_heads=2, n_kv_heads=1, intermediate_size=16,
                 tie_word_embeddings=True)


def test_ddp_across_two_nodes_by_hand():
    """DDP over 2 nodes of 8: one all-reduce of the fp32 gradients of 2 x 608 + 800 = 2,016
    parameters (the tiny shape's blocks and tied embedding), ring over NVLink and one NIC hop."""
    t = estimate_step_time(TINY, Layout("ddp", 16), 1, 4, 16, False, hw(16, 2))
    ring = 8.4 * US + 2 * (14 * 3.4 + 1 * 9.6) * US
    assert t.data_parallel_s == pytest.approx(2 * 15 / 16 * 4 * 2016 / 350e9 + ring)
    assert t.dp_latency_s == pytest.approx(ring) and t.dp_across_nodes
    one_node = estimate_step_time(TINY, Layout("ddp", 8), 1, 4, 8, False, hw(8))
    assert not one_node.dp_across_nodes


def test_hsdp_replica_all_reduce_crosses_nodes_on_one_nic():
    """HSDP 4 x 8 on 4 nodes: the shards' reduce-scatter stays in a node, the all-reduce of
    each shard crosses nodes on one NIC per GPU; flat FSDP 32 crosses with every gather.
    A slower network slows both, and flat FSDP more; one node's traffic does not see it."""
    args = FLAVORS["qwen2-7b"]
    traffic = {}
    for net in ("ib-ndr", "eth-400"):
        h = hw(32, 4, network=net)
        traffic[net] = [estimate_step_time(args, lay, 1, 2048, 32, False, h) for lay in
                        (Layout("fsdp", 4, 8), Layout("fsdp", 1, 32))]
        assert all(t.dp_across_nodes for t in traffic[net])
    (hsdp_fast, fsdp_fast), (hsdp_slow, fsdp_slow) = traffic["ib-ndr"], traffic["eth-400"]
    # the replicas' all-reduce: 2 x 3/4 of the fp32 shard (1/8 of the weights) per NIC
    assert hsdp_slow.data_parallel_s - hsdp_fast.data_parallel_s > 0.5 * 2 * 3 / 4 * 4 * 7.6e9 / 8 * (1 / 5e9 - 1 / 45e9)
    assert fsdp_slow.data_parallel_s / fsdp_fast.data_parallel_s > 5 > hsdp_slow.data_parallel_s / \
        hsdp_fast.data_parallel_s
    inside = [estimate_step_time(args, Layout("fsdp", 1, 8), 1, 2048, 8, False, hw(8, network=net))
              for net in ("ib-ndr", "eth-400")]
    assert inside[0].data_parallel_s == inside[1].data_parallel_s and not inside[0].dp_across_nodes


def test_gradient_reduction_overlaps_only_the_last_backward():
    """Accumulating over more micro-batches does not hide more of the gradient all-reduce:
    the trainer syncs gradients in the last micro-batch's backward only, and four smaller
    micro-batches leave a shorter last backward to hide it under than one large one."""
    args, h = FLAVORS["qwen2-0.5b"], hw(64, network="eth-100")
    one = estimate_step_time(args, Layout("ddp", 64), 4, 2048, 256, False, h)
    many = estimate_step_time(args, Layout("ddp", 64), 1, 2048, 256, False, h)  # 4 micro-batches
    assert one.data_parallel_s == many.data_parallel_s
    assert one.exposed_dp_s > 0.5 * one.data_parallel_s  # 12.5 Gb/s per GPU: mostly exposed
    assert many.exposed_dp_s > one.exposed_dp_s
    assert many.compute_s > one.compute_s  # though the step computes longer (smaller matmuls)


def test_more_nodes_never_raise_tokens_per_gpu_at_fixed_per_gpu_work():
    """Weak scaling of a fixed kind of layout (the same work per GPU): DDP, and HSDP with its
    shards in a node, lose tokens/s per GPU as nodes are added, never gain; strictly where
    the network is slow enough for the traffic to show."""
    args = FLAVORS["qwen2-1.5b"]
    for net in ("ib-ndr", "eth-100"):
        for kind in ("ddp", "hsdp"):
            speeds = []
            for nodes in (1, 2, 4, 16, 64, 128):
                g = 8 * nodes
                lay = Layout("ddp", g) if kind == "ddp" else Layout("fsdp", nodes, 8)
                speeds.append(estimate_step_time(args, lay, 4, 2048, 4 * g, False,
                                                 hw(g, nodes, network=net)).tokens_per_s_per_gpu)
            assert all(b <= a for a, b in zip(speeds, speeds[1:])), (net, kind, speeds)
            if net == "eth-100":
                assert speeds[-1] < 0.8 * speeds[0], (kind, speeds)


def test_a_faster_network_never_slows_a_plan():
    """Every candidate of a 72B plan on 256 GPUs, and the fastest, is no slower on a faster
    network: more bandwidth per GPU, or less latency per step."""
    args = FLAVORS["qwen2-72b"]
    slow_to_fast = [dict(network="eth-100"), dict(network="eth-400"), dict(network="roce-200"),
                    dict(network="ib-ndr"), dict(network="ib-ndr", inter_step_s=2 * US),
                    dict(network="ib-ndr", inter_gbps=800, inter_step_s=2 * US)]
    runs = [evaluate(args, hw(256, **links), 2048, 256) for links in slow_to_fast]
    for before, after in zip(runs, runs[1:]):
        for a, b in zip(before, after):
            assert (a.layout, a.micro_batch, a.activation_checkpointing) == \
                   (b.layout, b.micro_batch, b.activation_checkpointing)
            assert b.time.total_s <= a.time.total_s * (1 + 1e-12), a.describe()
        assert min(c.time.total_s for c in rank(after)) <= min(c.time.total_s for c in rank(before))
    assert min(c.time.total_s for c in rank(runs[-1])) < 0.9 * min(c.time.total_s for c in rank(runs[0]))


def test_a_72b_plan_on_1024_gpus_takes_seconds_at_most():
    # This process's CPU seconds, not the wall clock's: other processes on a loaded machine
    # stretch the wall time (over 5 s in a full run) but not the search's own work.
    start = time.process_time()
    plan = make_plan(resolve_model("qwen2-72b"), hw(1024), 2048)
    elapsed = time.process_time() - start
    assert plan.best.fits and plan.considered > 1000
    # About 3 s on a 2-core Xeon (3,676 layouts): the bound catches a search grown out of hand.
    assert elapsed < 12, f"{elapsed:.1f} s of CPU"
    assert any("links: nvlink 350 GB/s; across nodes ib-ndr" in n and "(assumed" in n for n in plan.notes)
    assert not any("beyond 1,024 GPUs" in n for n in plan.notes)
    assert any("beyond 1,024 GPUs" in n for n in make_plan(resolve_model("qwen2-0.5b"), hw(2048), 2048).notes)


# ---------------------------------------------------------------- the scaling view


def test_scaling_rows_and_efficiency():
    assert scaling_counts(8, 1024) == [8, 16, 32, 64, 128, 256, 512, 1024]
    assert scaling_counts(8, 96) == [8, 16, 32, 64, 96]
    assert scaling_counts(8, 4) == [4]
    big = scaling_hardware(hw(8), None, None)
    assert (big.gpus, big.nodes) == (1024, 128)
    result = plan_scaling(resolve_model("qwen2-7b"), hw(256, network="eth-100"), 2048, 256, family="fsdp")
    assert [r.gpus for r in result.rows] == [8, 16, 32, 64, 128, 256]
    assert [r.global_batch for r in result.rows] == [8, 16, 32, 64, 128, 256]  # one sequence per GPU
    assert all(r.best.family == "fsdp" for r in result.rows)
    effs = [result.efficiency(r) for r in result.rows]
    assert effs[0] == 1.0 and effs[-1] < 0.5  # flat fsdp over 12.5 Gb/s per GPU
    assert result.rows[-1].best.time.limit()[0] == "dp bandwidth"
    assert "what grew most: exposed data-parallel traffic over the network" in result.why()
    strong = plan_scaling(resolve_model("qwen2-0.5b"), hw(64), 2048, 512, mode="strong")
    assert {r.global_batch for r in strong.rows} == {512}
    with pytest.raises(DuokaError, match="--family zero is unknown"):
        plan_scaling(resolve_model("qwen2-7b"), hw(64), family="zero")


def _table_lines(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["GPUs", "layout"])
    return lines[start:start + 2 + 8]


def test_scaling_table_renders_at_80_columns():
    result = plan_scaling(resolve_model("qwen2-72b"), hw(1024), 2048)
    console = Console(width=80, file=io.StringIO(), record=True, color_system=None)
    render_scaling(result, console)
    text = console.export_text()
    header, rule, *rows = _table_lines(text)
    assert len(header) <= 80 and set(rule.strip()) == {"─"}
    assert [row.split()[0] for row in rows] == ["8", "16", "32", "64", "128", "256", "512", "1,024"], text
    assert all(len(row.rstrip()) <= 80 and "…" not in row for row in rows), text
    first = next(r for r in result.rows if r.best)
    line = next(row for row in rows if row.split()[0] == f"{first.gpus:,}")
    assert first.best.layout.describe(compact=True) in line and line.rstrip().endswith("%")
    assert "no layout fits" in rows[0]  # 72B on one node of 80 GiB
    assert "why:" in text and "weak scaling: 8 sequence(s)" in text


def test_cli_scaling(monkeypatch, capsys):
    import json

    from duoka.cli import main

    monkeypatch.setenv("COLUMNS", "80")
    assert main(["plan", "--model", "qwen2-7b", "--gpus", "64", "--gpu-memory", "80", "--scaling",
                 "--network", "roce-200", "--inter-latency-us", "12"]) == 0
    out = capsys.readouterr().out
    assert all(len(line) <= 80 for line in out.splitlines()), out
    assert "roce-200" in out and "12.0 us per ring step" in out
    assert main(["plan", "--model", "qwen2-7b", "--gpus", "64", "--gpu-memory", "80", "--scaling", "strong",
                 "--global-batch", "512", "--family", "hsdp", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mode"] == "strong" and [r["gpus"] for r in data["rows"]] == [8, 16, 32, 64]
    assert all(r["family"] == "hsdp" for r in data["rows"] if "family" in r)
    assert main(["plan", "--model", "qwen2-7b", "--gpus", "64", "--gpu-memory", "80", "--scaling", "--out",
                 "x.toml"]) == 2
    assert "--out writes the config of one plan" in capsys.readouterr().err
    assert main(["plan", "--model", "qwen2-7b", "--gpus", "16", "--nodes", "2", "--gpu-memory", "80",
                 "--inter-bw", "100", "--intra-bw", "300", "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any("nvlink 300 GB/s" in n and "--inter-bw 100 Gb/s per GPU" in n for n in notes), notes


# ---------------------------------------------------------------- published runs


def test_published_shapes_have_their_published_sizes():
    from duoka.plan import published as pub

    # Llama 3.1: 8.03B, 70.6B, 405.9B (Meta's model cards); GPT-3 175B with a 131,072-token
    # vocabulary; Megatron's "1 trillion": 1,008.0B in Narayanan et al.'s Table 1
    for args, size in ((pub.LLAMA31_8B, 8.03e9), (pub.LLAMA31_70B, 70.6e9), (pub.LLAMA31_405B, 405.9e9),
                       (pub.GPT3_175B_V131K, 175e9 + (131072 - 50257) * 12288), (pub.GPT_1T, 1008.0e9)):
        assert args.num_params() == pytest.approx(size, rel=0.005)
    # Megatron 2021's per-GPU TFLOP/s: 52% of 312 at 3,072 GPUs is 502 PFLOP/s in all
    run = pub.RUNS[-1]
    per_gpu = run.published_tokens() * pub.megatron_flops_per_token(run.args, run.seq_len, run.table)
    assert per_gpu * run.gpus == pytest.approx(502e15, rel=0.01)


def test_scaling_predictions_beside_published_runs():
    """The fitted model (matmul efficiency fitted to a table's smallest run) against the
    larger runs of that table: the communication and pipeline model alone. Held within the
    margins docs/plan.md reports, so a change to the model that moves them fails here."""
    from duoka.plan import published as pub

    runs = [r for r in pub.RUNS if r.table in ("torchtitan-8b", "megatron-h100")]
    pred = {p.run.label: p for p in pub.predict(runs, best=False)}
    titan, megatron = pred["Llama 3.1 8B, 128 GPUs"], pred["GPT-3 175B, 4,608 GPUs"]
    assert pred["Llama 3.1 8B, 8 GPUs"].fitted == pytest.approx(5762, rel=1e-3)  # the anchor
    assert titan.fitted == pytest.approx(5605, rel=0.05)
    assert megatron.fitted == pytest.approx(megatron.published, rel=0.05)
    # and duoka's own kernels: eager tensor parallel costs it most of Megatron's speed
    assert megatron.duoka < 0.6 * megatron.published
