"""duoka plan with other optimizers than AdamW: each one's state bytes counted by hand on known
shapes, the step's temporaries, CPU offload, and the proposal when AdamW does not fit
(Qwen2-7B on one 139 GiB GPU), through the library and the command."""

from __future__ import annotations

import pytest

from duoka.config import load_config
from duoka.errors import DuokaError
from duoka.models.qwen2.args import FLAVORS
from duoka.plan.hardware import Hardware
from duoka.plan.memory import GIB, Layout, estimate_memory, largest_fitting_micro_batch
from duoka.plan.model_choice import resolve_model
from duoka.plan.optimizer_costs import (
    HOST_ADAMW_BYTES_PER_S,
    PCIE_BYTES_PER_S,
    OptimizerChoice,
    ParamTensor,
    footprint,
    optimizer_from_config,
)
from duoka.plan.ranking import make_plan
from duoka.plan.step_time import estimate_step_time

MATRIX = ParamTensor("matrix", 1024, 512, 1, 1024, 512)  # 524,288 elements: 2,048 blocks of 256
BIAS = ParamTensor("vector", 512, 1, 1, 512, 1)  # under torchao's 4,096-element floor
EMBEDDING = ParamTensor("embedding", 2048, 512, 1, 2048, 512)
SHAPES = [MATRIX, BIAS, EMBEDDING]
M, B, E = 1024 * 512, 512, 2048 * 512


def state(name, shard=1, **kw):
    return footprint(SHAPES, OptimizerChoice(name, **kw), shard).gpu_state


def test_state_bytes_per_optimizer_by_hand():
    assert state("adamw") == 8 * (M + B + E)
    # torchao 8-bit: two uint8 moments, an fp32 scale per 256 elements and a 256-entry fp32
    # map each; the bias stays fp32 (too small to quantize)
    assert state("adamw8bit") == 2 * (M + 4 * M / 256 + 4 * 256) + 8 * B + 2 * (E + 4 * E / 256 + 4 * 256)
    # 4-bit: half a byte per moment element, a scale per 128, 16-entry maps
    assert state("adamw4bit") == 2 * (M / 2 + 4 * M / 128 + 4 * 16) + 8 * B + 2 * (E / 2 + 4 * E / 128 + 4 * 16)
    # Adafactor: a row and a column vector per matrix, the bias whole; no first moment
    assert state("adafactor") == 4 * (1024 + 512) + 4 * B + 4 * (2048 + 512)
    # Muon: one fp32 momentum for the block's matrix, AdamW for the bias and the embedding
    assert state("muon") == 4 * M + 8 * B + 8 * E
    assert state("sgd") == 4 * (M + B + E)
    assert state("sgd", sgd_momentum=0.0) == 0
    # per parameter on a large matrix: 2 + 8/256 (8-bit), 1 + 8/128 (4-bit)
    big = [MATRIX]
    assert footprint(big, OptimizerChoice("adamw8bit")).gpu_state / M == pytest.approx(2 + 8 / 256, abs=0.01)
    assert footprint(big, OptimizerChoice("adamw4bit")).gpu_state / M == pytest.approx(1 + 8 / 128, abs=0.01)


def test_state_shards_with_the_parameters_and_torchao_decides_per_shard():
    assert state("adamw", shard=4) == state("adamw") / 4
    assert state("muon", shard=2) == state("muon") / 2
    # 64 x 64 = 4,096 elements is quantized whole; its half on each of 2 ranks is not
    small = [ParamTensor("matrix", 64, 64, 1, 64, 64)]
    assert footprint(small, OptimizerChoice("adamw8bit")).gpu_state < 4096 * 3
    assert footprint(small, OptimizerChoice("adamw8bit"), shard=2).gpu_state == 8 * 2048


def test_step_temporaries():
    # fused AdamW: none; foreach SGD with weight decay: a decayed fp32 copy of the 2-D tensors'
    # gradients (none without decay); torchao: fp32 copies of the largest quantized tensor;
    # Adafactor (foreach): a variance estimate of every matrix at once; Muon: its largest
    # whole matrix (fp32 update, bf16 copy and iterate) and the Gram matrix
    assert footprint(SHAPES, OptimizerChoice("adamw")).step_transient == 0
    assert footprint(SHAPES, OptimizerChoice("sgd")).step_transient == 4 * (M + E)  # the embedding decays too
    assert footprint(SHAPES, OptimizerChoice("sgd", weight_decay=0.0)).step_transient == 0
    assert footprint(SHAPES, OptimizerChoice("adamw8bit")).step_transient == 8 * E
    assert footprint(SHAPES, OptimizerChoice("adafactor")).step_transient == 4 * (M + E)
    muon = footprint([MATRIX], OptimizerChoice("muon"))
    assert muon.step_transient == 8 * M + 4 * 512 ** 2
    assert muon.matmul_flops == 5 * (4 * 512 ** 2 * 1024 + 2 * 512 ** 3)
    # sharded: the local update and the gathered whole, and the whole is gathered (all-gather)
    sharded = footprint([MATRIX], OptimizerChoice("muon"), shard=4)
    assert sharded.step_transient == 4 * M / 4 + 8 * M + 4 * 512 ** 2 and sharded.gathered == ((4 * M, 1),)
    # The step's moment is a peak of its own only where it allocates something.
    args = FLAVORS["qwen2-7b"]
    assert estimate_memory(args, Layout(), 1, 2048, True).phase == "end of backward"
    ada = estimate_memory(args, Layout(), 1, 2048, True, optimizer=OptimizerChoice("adafactor"))
    hd = args.resolved_head_dim
    vectors = args.n_layers * (2 * args.dim + (args.n_heads + 2 * args.n_kv_heads) * hd) + args.dim
    assert ada.phase == "optimizer step" and ada.optimizer_step == 4 * (args.num_params() - vectors)


def test_cpu_offload_moves_the_state_to_the_host():
    args = FLAVORS["qwen2-7b"]
    p = args.num_params()
    adamw = estimate_memory(args, Layout(), 1, 2048, True)
    off = estimate_memory(args, Layout(), 1, 2048, True, optimizer=OptimizerChoice("adamw", "cpu"))
    assert off.optimizer < 1e-3 * p  # only the tensors under 4,096 elements: norms, k/v biases
    assert adamw.allocated - off.allocated == pytest.approx(8 * p, rel=1e-3)
    assert off.host == pytest.approx(16 * p, rel=1e-3) and off.host > 0 == adamw.host  # weights, grads, moments
    # its step: the host's AdamW (28 bytes an element) and the weights back over PCIe
    hw = Hardware(1, 1, 139, "nvlink")
    slow = estimate_step_time(args, Layout(), 1, 2048, 8, True, hw, OptimizerChoice("adamw", "cpu"))
    fast = estimate_step_time(args, Layout(), 1, 2048, 8, True, hw)
    assert slow.optimizer_s - fast.optimizer_s >= 28 * p / HOST_ADAMW_BYTES_PER_S * 0.99
    assert slow.optimizer_s > 4 * p / PCIE_BYTES_PER_S
    # one GPU and AdamW only, as the trainer refuses the rest
    with pytest.raises(DuokaError, match="offload=cpu runs on one GPU"):
        make_plan(resolve_model("qwen2-7b"), Hardware(2, 1, 139, "nvlink"), optimizer=OptimizerChoice("adamw", "cpu"))
    with pytest.raises(DuokaError, match="does not apply to adamw8bit"):
        OptimizerChoice("adamw8bit", "cpu")
    # and where the host cannot hold it, it does not fit
    tight = Hardware(1, 1, 139, "nvlink", host_memory_gib=64)
    plan = make_plan(resolve_model("qwen2-0.5b"), tight, optimizer=OptimizerChoice("adamw", "cpu"))
    assert plan.best.memory.host <= tight.usable_host_bytes
    with pytest.raises(DuokaError, match="of host memory against"):
        make_plan(resolve_model("qwen2-7b"), tight, optimizer=OptimizerChoice("adamw", "cpu"))


def test_qwen2_7b_on_one_h200_proposes_an_optimizer_that_fits(tmp_path):
    """On a 130 GiB GPU AdamW needs 119.8 GiB reserved at its smallest (micro-batch 8,
    checkpointing, fused loss) against 0.9 x 130 = 117.0 usable (on one H200, 139 GiB, it fits:
    measured 117.9 GiB allocated, docs/training.md): the plan trains with 8-bit AdamW instead,
    says why, lists every optimizer that fits, and writes a config that selects it."""
    plan = make_plan(resolve_model("qwen2-7b"), Hardware(1, 1, 130, "nvlink"), 2048, 8)
    assert plan.optimizer == OptimizerChoice("adamw8bit") and plan.best.optimizer == plan.optimizer
    assert plan.best.fits and plan.best.memory.reserved <= 0.9 * 130 * GIB
    assert plan.proposal.startswith("AdamW does not fit (at least 119.8 GiB") and 'optimizer.name = "adamw8bit"' \
        in plan.proposal
    names = [c.optimizer.describe() for c in plan.alternatives]
    assert names == ["adamw8bit", "adamw4bit", "adamw + cpu offload", "adafactor", "muon"]  # sgd: 113.5 too
    assert all(c.fits for c in plan.alternatives)
    path = tmp_path / "plan.toml"
    path.write_text(plan.config_toml())
    cfg = load_config(path)
    assert cfg.optimizer.name == "adamw8bit" and optimizer_from_config(cfg.optimizer) == plan.optimizer
    # Asked for AdamW, the plan refuses and names what fits.
    with pytest.raises(DuokaError) as e:
        make_plan(resolve_model("qwen2-7b"), Hardware(1, 1, 130, "nvlink"), 2048, 8, optimizer=OptimizerChoice())
    assert "AdamW state alone are 7.6B x 16 bytes" in e.value.cause and "113.5 allocated" in e.value.cause
    assert e.value.fix.startswith("an optimizer with less state fits: adamw8bit")
    # Where AdamW fits, it stays: no proposal.
    roomy = make_plan(resolve_model("qwen2-7b"), Hardware(2, 1, 139, "nvlink"), 2048, 16)
    assert roomy.optimizer == OptimizerChoice() and not roomy.proposal and "[optimizer]" not in roomy.config_toml()


def test_a_pinned_point_prints_its_estimate():
    """--micro-batch and --activation-checkpointing keep one value: what the GPU measurement
    compares against."""
    plan = make_plan(resolve_model("qwen2-7b"), Hardware(1, 1, 139, "nvlink"), 2048, 8,
                     OptimizerChoice("adamw8bit"), micro_batch=2, activation_checkpointing=True)
    assert all(c.micro_batch == 2 and c.activation_checkpointing for c in plan.ranked)
    assert plan.best.fused_loss  # planned with every checkpointed layout that runs it
    assert plan.best.memory.allocated == estimate_memory(FLAVORS["qwen2-7b"], Layout(), 2, 2048, True, 4,
                                                         optimizer=OptimizerChoice("adamw8bit"),
                                                         fused_loss=True).allocated
    with pytest.raises(DuokaError, match="--micro-batch 3 divides none of the per-GPU batches"):
        make_plan(resolve_model("qwen2-7b"), Hardware(1, 1, 139, "nvlink"), 2048, 8, micro_batch=3)


def test_trainer_auto_micro_batch_takes_the_optimizer():
    args = FLAVORS["qwen2-7b"]
    assert largest_fitting_micro_batch(args, 8, 2048, 1, True, 139 * GIB) == 1
    assert largest_fitting_micro_batch(args, 8, 2048, 1, True, 139 * GIB,
                                       optimizer=OptimizerChoice("adamw8bit")) == 8


def test_cli_proposes_and_refuses_in_process(capsys):
    from duoka.cli import main

    assert main(["plan", "--model", "qwen2-7b", "--gpus", "1", "--gpu-memory", "130"]) == 0
    out = capsys.readouterr().out
    assert "optimizer: AdamW does not fit" in out and "optimizers that fit" in out
    assert "[optimizer]" in out and 'name = "adamw8bit"' in out and "AdamW moments (8-bit" in out
    assert main(["plan", "--model", "qwen2-7b", "--gpus", "1", "--gpu-memory", "130", "--optimizer", "adamw"]) == 2
    assert "fix: an optimizer with less state fits: adamw8bit" in capsys.readouterr().err
    assert main(["plan", "--model", "qwen2-7b", "--gpus", "1", "--gpu-memory", "139", "--optimizer", "adamw",
                 "--offload", "cpu", "--host-memory", "160"]) == 0
    out = capsys.readouterr().out
    assert "host memory for the offloaded AdamW: 113.5 GiB per GPU" in out and 'offload = "cpu"' in out
    assert main(["plan", "--model", "qwen2-7b", "--gpus", "2", "--gpu-memory", "139", "--offload", "cpu"]) == 2
    assert "runs on one GPU" in capsys.readouterr().err
    # 16 bytes a parameter on the host: more than 0.8 x 126 GiB, an H200 server's RAM per GPU
    assert main(["plan", "--model", "qwen2-7b", "--gpus", "1", "--gpu-memory", "139", "--offload", "cpu",
                 "--host-memory", "126"]) == 2
    assert "113.5 GiB of host memory against 100.8 usable" in capsys.readouterr().err
