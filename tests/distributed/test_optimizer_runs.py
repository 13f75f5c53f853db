"""Every optimizer (optimizer.name) through the real worker (duoka.train.entrypoint.worker_main, the
trainer, its checkpoints and export), fp32 on CPU over gloo: DDP and FSDP2 on 2 processes
compute what one process computes, muon under tensor parallelism too, a resume continues bit
for bit, and the sharded state of adamw8bit and muon saved by 2 FSDP2 ranks resumes on one.

One group of 2 processes runs every job of the module in turn (a `duoka train` launch costs
~3 s here, a run in the started workers well under 1 s); the one-process jobs run on rank 0
alone. adamw has its own layout tests (test_layouts.py)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from duoka.config import load_config
from duoka.models.qwen2.args import FLAVORS
from duoka.train.integrity import load_metadata
from duoka.train.spec import RunSpec

STEPS, SAVED = 4, 2
COMMON = (f"--training.steps={STEPS}", "--training.seq_len=32", "--training.global_batch_size=8",
          "--training.dtype=fp32", "--optimizer.warmup_steps=2", "--metrics.log_interval=100", "--data.path=random")
SAVES = (f"--checkpoint.interval={SAVED}",)  # runs that another resumes from; the others save nothing
NO_SAVES = ("--checkpoint.enabled=false",)
# The debug flavor with 2 of its 4 layers and a quarter of its vocabulary: the low-bit
# optimizers' eager steps on CPU cost time in proportion to the parameters. Every matrix keeps
# at least 4,096 values per FSDP2 shard, in whole blocks of 256, so 8-bit and 4-bit state is
# quantized in the same blocks on one process and on two.
ARGS = dataclasses.replace(FLAVORS["debug"], n_layers=2, vocab_size=1024)
NAMES = ("adamw8bit", "adamw4bit", "adafactor", "muon", "sgd")
LAYOUTS = {"ddp": ("--parallel.dp_mode=ddp",), "fsdp": ("--parallel.dp_mode=fsdp",), "tp": ("--parallel.tp=2",)}
# PyTorch's Adafactor runs on plain tensors only (refused under FSDP2, tp and pp: test_optimizers.py).
RUNS = {name: ("ddp",) if name == "adafactor" else ("ddp", "fsdp") for name in NAMES} | {"muon": ("ddp", "fsdp", "tp")}
# Relative differences of the final weights allowed against one process, per optimizer; each
# run's loss (1e-5) and gradient norm (1e-4) are held as in conftest.py. Measured here: sgd and
# adafactor 1e-8 to 2e-8. adamw8bit 3e-5 and adamw4bit 7e-5: an fp32 rounding difference moves a
# moment across a quantization boundary, and that element's step by a code (1% of it at 8 bits,
# ~10% at 4). muon 2.8e-4 to 3.3e-4: Newton-Schulz runs in bf16 (as PyTorch's Muon), so the
# same rounding flips bf16 roundings, which its matmuls spread. Each is under a fifth of what a
# wrong update does: over these steps the weights move 10-14% (sgd 0.14%), and a step on the
# wrong slice or scale moves them by that order.
WEIGHTS = {"adamw8bit": 2e-4, "adamw4bit": 3e-4, "adafactor": 1e-6, "muon": 1e-3, "sgd": 1e-6}
TIMEOUT_S = 300


def _spec(run_dir: Path, world: int, args: tuple[str, ...], resume: Path | None = None) -> RunSpec:
    """What `duoka train` hands its workers for these flags (random data, a model of ARGS's shape)."""
    cfg = load_config(overrides=[*COMMON, *args, f"--job.output_dir={run_dir}"])
    run_dir.mkdir(parents=True)
    return RunSpec(config=cfg.to_dict(), run_dir=str(run_dir), model_args=dataclasses.asdict(ARGS),
                   world_size=world, model_dir=None, token_file=None, tokenizer_files=(), end_of_text=None,
                   resume_from=str(resume) if resume else None, resume_step=SAVED if resume else 0, micro_batch=None,
                   fsdp_blocks_per_unit=None, stage_layers=None)


def _worker(rank: int, jobs: list[tuple[int, RunSpec]], root: str) -> None:
    """Each job in a process group of its own (worker_main leaves it destroyed), met through a
    file rather than a port that another test on the machine could take first."""
    from duoka.train.entrypoint import worker_main

    torch.set_num_threads(1)  # the two processes share the test machine's cores
    os.environ["RANK"] = str(rank)  # where worker_main files an error report
    # The hang watchdog shares the elastic agent's store (MASTER_ADDR:MASTER_PORT); there is no
    # agent here, and an earlier in-process launch of this session may have left its address.
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    for i, (world, spec) in enumerate(jobs):
        if rank < world:
            dist.init_process_group("gloo", init_method=f"file://{root}/init-{i}", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=120))  # a mismatch fails, not hangs
            worker_main(spec)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """(optimizer, job) -> run directory, for jobs one, resumed (one process from its step-2
    checkpoint), each layout of RUNS, and fsdp-to-one (one process from the fsdp run's)."""
    root = tmp_path_factory.mktemp("optimizers")
    jobs, dirs = [], {}

    def add(name: str, job: str, world: int, args: tuple[str, ...], resume: Path | None = None) -> None:
        dirs[name, job] = root / f"{name}-{job}"
        jobs.append((world, _spec(dirs[name, job], world, (f"--optimizer.name={name}", *args), resume)))

    resharded = ("adamw8bit", "muon")
    for name in NAMES:
        add(name, "one", 1, SAVES)
        add(name, "resumed", 1, NO_SAVES, dirs[name, "one"] / "checkpoints" / f"step-{SAVED}")
        for layout in RUNS[name]:
            add(name, layout, 2, LAYOUTS[layout] + (SAVES if layout == "fsdp" and name in resharded else NO_SAVES))
        if name in resharded:
            add(name, "fsdp-to-one", 1, NO_SAVES, dirs[name, "fsdp"] / "checkpoints" / f"step-{SAVED}")
    ctx = mp.start_processes(_worker, args=(jobs, str(root)), nprocs=2, start_method="spawn", join=False)
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"the optimizer runs did not finish within {TIMEOUT_S} s")
    return dirs


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "hf" / f"step-{STEPS}" / "model.safetensors")


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The whole model's relative difference (conftest.py says why not per element)."""
    assert a.keys() == b.keys()
    return float(sum(((a[k] - b[k]) ** 2).sum() for k in a).sqrt() / sum((b[k] ** 2).sum() for k in b).sqrt())


def _assert_close_runs(run: Path, ref: Path, weights: float, steps: slice = slice(None)) -> None:
    a, b = _records(run), _records(ref)[steps]
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * y["loss"], (a, b)
        assert abs(x["grad_norm"] - y["grad_norm"]) <= 1e-4 * y["grad_norm"], (a, b)
    assert _distance(_weights(run), _weights(ref)) <= weights


@pytest.mark.parametrize("name", NAMES)
def test_each_layout_computes_what_one_process_computes(runs, name):
    one = runs[name, "one"]
    for layout in RUNS[name]:
        _assert_close_runs(runs[name, layout], one, WEIGHTS[name])


@pytest.mark.parametrize("name", NAMES)
def test_a_resume_continues_bit_for_bit(runs, name):
    """The checkpoint holds the optimizer's own state (muon: the matrices' momentum beside
    AdamW's moments for the rest), and the resumed run continues the same numbers."""
    resumed, one = runs[name, "resumed"], runs[name, "one"]
    assert [(r["loss"], r["grad_norm"]) for r in _records(resumed)] == \
           [(r["loss"], r["grad_norm"]) for r in _records(one)[SAVED:]]
    a, b = _weights(resumed), _weights(one)
    assert all(torch.equal(a[k], b[k]) for k in b)
    keys = load_metadata(one / "checkpoints" / f"step-{SAVED}").state_dict_metadata.keys()
    state = {k.split(".", 2)[2] for k in keys if k.startswith("optimizer.state.")}
    matrix, norm = "layers.0.attention.wq.weight", "layers.0.attention_norm.weight"
    expected = {"adamw8bit": {"exp_avg", "exp_avg_sq"}, "adamw4bit": {"exp_avg", "exp_avg_sq"},
                "adafactor": {"row_var", "col_var"}, "muon": {"momentum_buffer"}, "sgd": {"momentum_buffer"}}[name]
    assert {f"{matrix}.{s}" for s in expected} <= state
    assert (f"{norm}.exp_avg" in state) == (name in ("adamw8bit", "adamw4bit", "muon"))  # muon's AdamW part


@pytest.mark.parametrize("name", ("adamw8bit", "muon"))
def test_state_sharded_by_fsdp2_resumes_on_one_process(runs, name):
    """DCP reshards the state: the 8-bit moments' blocks and the momentum saved as two FSDP2
    shards continue on one process as the 2-rank run continued."""
    _assert_close_runs(runs[name, "fsdp-to-one"], runs[name, "fsdp"], WEIGHTS[name], steps=slice(SAVED, None))
