"""The optimizers (duoka.train.optimizers), in one process: what each is built from, Muon's
step against PyTorch's, the schedule's lr reaching every group, the fused hooks, 8-bit and
4-bit AdamW against fp32 AdamW over 200 steps, and the combinations refused before launch.
The layouts, checkpoints and resumes: tests/distributed/test_optimizer_runs.py."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.distributed as dist

from duoka.config import OptimizerConfig, ReliabilityConfig, load_config
from duoka.errors import DuokaError
from duoka.models.loss import cross_entropy_sum
from duoka.models.qwen2.args import FLAVORS
from duoka.models.qwen2.model import build_model, materialize
from duoka.parallel.dims import ParallelDims
from duoka.train.health import Health
from duoka.train.lr_schedule import lr_at
from duoka.train.optimizers import (
    TrainingOptimizer,
    WholeMatrixMuon,
    build_optimizer,
    check_optimizer,
    check_resume,
    clip_to_norm,
    hidden_matrices,
)


@pytest.fixture(scope="module")
def one_thread():
    """Small eager steps (the low-bit optimizers dispatch per element group) run several
    times faster on one thread than on threads fighting over the shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def debug_model(args=FLAVORS["debug"]):
    model = materialize(build_model(args), "cpu")
    model.init_weights(0)
    return model


def test_muon_steps_plain_tensors_exactly_as_pytorch_s_muon():
    """WholeMatrixMuon is PyTorch's Muon plus the gather of sharded matrices: on whole
    tensors the same numbers (a missing private helper fails here, naming it)."""
    torch.manual_seed(0)
    shapes = [(64, 32), (32, 96)]
    runs = []
    for cls in (torch.optim.Muon, WholeMatrixMuon):
        torch.manual_seed(1)
        params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
        opt = cls(params, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5,
                  adjust_lr_fn="match_rms_adamw")
        for step in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step * 7 + p.shape[0]))
            opt.step()
        runs.append([p.detach().clone() for p in params] + [opt.state[p]["momentum_buffer"] for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    model = debug_model()
    cfg = OptimizerConfig(name="muon", lr=0.02, muon_adamw_lr=0.004, muon_momentum=0.9, muon_ns_steps=4,
                          nesterov=False)
    opt = build_optimizer(model, cfg, 0.02, "cpu")
    muon, adamw = opt.parts
    assert isinstance(muon, WholeMatrixMuon) and type(adamw) is torch.optim.AdamW
    matrices = {p for g in muon.param_groups for p in g["params"]}
    assert matrices == hidden_matrices(model)
    assert len(matrices) == 4 * 7 and model.layers["0"].attention.wq.weight in matrices
    rest = {p for g in adamw.param_groups for p in g["params"]}
    assert model.tok_embeddings.weight in rest and model.norm.weight in rest  # the tied head is the embedding
    assert model.layers["0"].attention.wq.bias in rest and not matrices & rest
    assert len(matrices | rest) == len({id(p) for p in model.parameters()})
    group = muon.param_groups[0]
    assert (group["momentum"], group["nesterov"], group["ns_steps"]) == (0.9, False, 4)
    opt.set_lr(0.01)  # the schedule's lr: muon's own, and muon_adamw_lr / lr of it for the rest
    assert group["lr"] == 0.01 and all(g["lr"] == pytest.approx(0.002) for g in adamw.param_groups)
    assert not opt.defaults["fused"]


@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "adamw4bit", "adafactor", "sgd"])
def test_every_optimizer_gets_the_configured_hyperparameters(name):
    model = debug_model()
    cfg = OptimizerConfig(name=name, weight_decay=0.05, beta1=0.8, beta2=0.9, eps=1e-6, sgd_momentum=0.7)
    opt = build_optimizer(model, cfg, 1e-3, "cpu")
    (part,) = opt.parts
    decayed, plain = part.param_groups
    assert (decayed["weight_decay"], plain["weight_decay"]) == (0.05, 0.0)
    assert all(p.dim() >= 2 for p in decayed["params"]) and all(p.dim() == 1 for p in plain["params"])
    if name.startswith("adamw"):
        assert (decayed["betas"], decayed["eps"]) == ((0.8, 0.9), 1e-6)
    if name == "sgd":
        assert (decayed["momentum"], decayed["nesterov"]) == (0.7, True)
    opt.set_lr(2e-4)
    assert all(float(g["lr"]) == pytest.approx(2e-4) for g in part.param_groups)
    if name in ("adamw8bit", "adamw4bit"):
        assert isinstance(decayed["lr"], torch.Tensor)  # torchao's lr, filled in place
        assert type(part).__name__ == "Eager" + {"adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit"}[name]


def test_a_fused_optimizer_takes_the_clip_and_the_skip_inside_its_kernel(tmp_path):
    """The GPU path (fused AdamW, which runs on CPU too): clip_to_norm's divisor and Health's
    skip flag reach the part through the TrainingOptimizer, and act as on the plain optimizer."""
    mine = not dist.is_initialized()  # Health's collectives, on a group of one
    if mine:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        results = []
        for wrapped in (True, False):
            torch.manual_seed(0)
            params = [torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(8))]
            adamw = torch.optim.AdamW(params, lr=1e-2, eps=1e-3, fused=wrapped, foreach=None if wrapped else True)
            opt = TrainingOptimizer([adamw], "adamw", fused=wrapped) if wrapped else adamw
            health = Health(ReliabilityConfig(), 0, torch.nn.Linear(1, 1), tmp_path, torch.device("cpu"), True, 0)
            for step, scale in enumerate([10.0, math.nan, 20.0]):
                for p in params:
                    p.grad = torch.full_like(p, scale)
                norm = torch.nn.utils.get_total_norm([p.grad for p in params])
                clip_to_norm(opt, params, norm, 1.0)
                if health.allow_update(step, opt, norm, torch.tensor(1.0), torch.tensor(1.0)):
                    opt.step()
                opt.zero_grad()
            results.append(torch.cat([p.detach().flatten() for p in params]))
            assert int(adamw.state[params[0]]["step"]) == 2  # the NaN step skipped
        torch.testing.assert_close(results[0], results[1], rtol=0, atol=1e-6)
    finally:
        if mine:
            dist.destroy_process_group()


# A Markov chain of 512 tokens, each followed by one of 4: an endless stream the model learns
# (the loss falls towards log 4) and cannot memorise.
VOCAB, FAN, STEPS = 512, 4, 200
# The debug flavor shrunk to a quarter of its width and one layer: eager 8-bit steps on CPU
# cost ~0.3 s each at the debug flavor's size, 200 of them more than this test may take. The
# embedding, the query and output projections and the MLP keep quantized state (4,096 values
# or more); the 2,048-value key and value projections keep fp32 state, as torchao keeps it for
# small tensors.
SMALL = dataclasses.replace(FLAVORS["debug"], vocab_size=VOCAB, dim=64, n_layers=1, intermediate_size=128)


def _markov_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    successors = torch.randint(0, VOCAB, (VOCAB, FAN), generator=g)
    batches = []
    for _ in range(STEPS):
        seq = torch.empty(8, 17, dtype=torch.long)
        seq[:, 0] = torch.randint(0, VOCAB, (8,), generator=g)
        for t in range(1, 17):
            seq[:, t] = successors[seq[:, t - 1], torch.randint(0, FAN, (8,), generator=g)]
        batches.append(seq)
    return batches


def _train(name: str, batches: list[torch.Tensor]) -> list[float]:
    """The trainer's step in one process: clip to 1, the cosine schedule, duoka's default lr."""
    model = debug_model(SMALL)
    cfg = OptimizerConfig(name=name, warmup_steps=10)
    opt = build_optimizer(model, cfg, cfg.lr, "cpu")
    params = list(model.parameters())
    losses = []
    for step, batch in enumerate(batches):
        loss = cross_entropy_sum(model(batch[:, :-1]), batch[:, 1:]) / batch[:, 1:].numel()
        loss.backward()
        clip_to_norm(opt, params, torch.nn.utils.get_total_norm([p.grad for p in params]), 1.0)
        opt.set_lr(lr_at(step, STEPS, cfg.lr, cfg))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_low_bit_adamw_follows_fp32_adamw_over_200_steps(one_thread):
    """Tolerances on the mean loss of each 20 steps, relative to fp32 AdamW's. Measured: 8-bit
    within 2e-4 in every window; 4-bit learns a little slower, 0.3% behind after 20 steps and
    3.4% after 200 (its 16 levels round the second moment coarsely). Allowed: 0.2% and 5%.
    A wiring error (betas, eps, decay, the lr never reaching torchao's tensor) moves the curve
    by far more; the per-group hyperparameters are checked directly above."""
    batches = _markov_batches()
    ref = _train("adamw", batches)
    windows = range(0, STEPS, 20)

    def means(losses):
        return [sum(losses[i:i + 20]) / 20 for i in windows]

    assert means(ref)[-1] < 0.7 * means(ref)[0]  # it learns
    for name, tolerance in (("adamw8bit", 2e-3), ("adamw4bit", 5e-2)):
        losses = _train(name, batches)
        assert losses != ref  # quantized state, not fp32 under another name
        deviation = [abs(a - b) / b for a, b in zip(means(losses), means(ref))]
        assert max(deviation) <= tolerance, (name, deviation)


def dims(world: int = 1, **parallel) -> ParallelDims:
    return ParallelDims.from_config(load_config(overrides=[f"--parallel.{k}={v}" for k, v in parallel.items()]).parallel,
                                    world)


@pytest.mark.parametrize("flags, layout, on_gpu, lora, cause, fix", [
    (["--optimizer.offload=cpu", "--optimizer.name=muon"], dims(), True, False,
     "optimizer.offload=cpu offloads AdamW only, not optimizer.name=muon", "use optimizer.name=adamw"),
    (["--optimizer.offload=cpu"], dims(), False, False, "this run has no GPU", "optimizer.offload=none"),
    (["--optimizer.offload=cpu"], dims(2, dp_mode="fsdp"), True, False, "is for one GPU",
     "parallel.dp_mode=fsdp (with optimizer.name=adamw8bit"),
    (["--optimizer.name=adafactor"], dims(2, dp_mode="fsdp"), False, False,
     "PyTorch's Adafactor cannot step parameters sharded as DTensors, as FSDP2 x2 holds them",
     "use parallel.dp_mode=ddp without tp or pp"),
    (["--optimizer.name=adafactor"], dims(2, tp=2), False, False, "as TP x2 holds them", "dp_mode=ddp"),
    (["--optimizer.name=adafactor"], dims(2, pp=2), False, False, "as PP x2 holds them", "dp_mode=ddp"),
    (["--optimizer.name=muon", "--lora.rank=8"], dims(), False, True, "LoRA (lora.rank=8) trains low-rank factors",
     "use optimizer.name=adamw (or adamw8bit) for LoRA runs"),
    (["--optimizer.name=sgd", "--optimizer.sgd_momentum=0"], dims(), False, False,
     "Nesterov momentum needs momentum", "optimizer.nesterov=false"),
])
def test_combinations_that_cannot_work_are_refused(flags, layout, on_gpu, lora, cause, fix):
    with pytest.raises(DuokaError) as e:
        check_optimizer(load_config(overrides=flags), layout, on_gpu=on_gpu, lora=lora)
    assert cause in e.value.cause and fix in e.value.fix


@pytest.mark.parametrize("flags, layout", [
    (["--optimizer.name=adafactor"], dims(2)),  # DDP: whole tensors
    (["--optimizer.name=muon"], dims(4, tp=2, dp_mode="fsdp")),
    (["--optimizer.name=adamw8bit", "--lora.rank=8"], dims(2, dp_mode="fsdp")),
    (["--optimizer.name=sgd", "--optimizer.sgd_momentum=0", "--optimizer.nesterov=false"], dims()),
])
def test_combinations_that_work_pass(flags, layout):
    check_optimizer(load_config(overrides=flags), layout, on_gpu=False, lora="--lora.rank=8" in flags)


def test_a_checkpoint_resumes_only_with_its_own_optimizer(tmp_path):
    state = {"config": {"optimizer": {"name": "adamw8bit"}}}
    check_resume(tmp_path, state, load_config(overrides=["--optimizer.name=adamw8bit"]))
    with pytest.raises(DuokaError, match="was saved by optimizer.name=adamw8bit") as e:
        check_resume(tmp_path, state, load_config(overrides=["--optimizer.name=muon"]))
    assert "--optimizer.name=adamw8bit" in e.value.fix
    check_resume(tmp_path, {"config": {"optimizer": {}}}, load_config())  # saved before optimizer.name existed


def test_the_launcher_refuses_before_any_worker_starts(in_process, tmp_path):
    run = tmp_path / "run"
    proc = in_process("train", f"--job.output_dir={run}", "--training.steps=2", "--nproc-per-node=2",
                      "--parallel.dp_mode=fsdp", "--optimizer.name=adafactor")
    assert proc.returncode == 2 and "PyTorch's Adafactor cannot step parameters sharded" in proc.stderr
    assert not (run / "metrics.jsonl").exists()
    proc = in_process("train", f"--job.output_dir={run}", "--training.steps=2", "--optimizer.offload=cpu")
    assert proc.returncode == 2 and "fix: use optimizer.offload=none" in proc.stderr


def test_resuming_with_another_optimizer_is_refused_before_launch(in_process, tmp_path):
    run = tmp_path / "run"
    common = (f"--job.output_dir={run}", "--training.steps=2", "--training.seq_len=16", "--training.dtype=fp32",
              "--data.path=random", "--training.global_batch_size=2", "--checkpoint.export_final=false")
    assert in_process("train", *common, "--optimizer.name=sgd").returncode == 0
    assert json.loads((run / "checkpoints" / "step-2" / "train_state.json").read_text())["config"]["optimizer"][
        "name"] == "sgd"
    proc = in_process("train", *common, "--training.steps=3", "--optimizer.name=muon", "--checkpoint.resume=auto")
    assert proc.returncode == 2 and "was saved by optimizer.name=sgd" in proc.stderr
