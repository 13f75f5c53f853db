"""Shared by the distributed tests: `duoka train` runs of one configuration, the runs that
several tests compare with (each trained once per test session, by whichever test asks
first), and the layout comparison itself."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

# The layout configuration (test_layouts.py, test_model_parallel.py): 5 steps, fp32.
STEPS = 5
COMMON = (f"--training.steps={STEPS}", "--training.seq_len=64", "--training.global_batch_size=8",
          "--training.dtype=fp32", "--optimizer.warmup_steps=2", "--metrics.log_interval=100")


def read_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def read_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "hf" / f"step-{step}" / "model.safetensors")


def stderr_of(once_run: Path) -> Path:
    """Where Training.once keeps a run's console output (beside the run directory)."""
    return once_run.parent / "stderr.txt"


class Training:
    """`duoka train` with fixed common flags (`common`, a run of `steps` steps) and
    environment. `once(*args)` is the run with those arguments, trained once per session:
    the same configuration is never trained twice, whichever modules compare with it."""

    def __init__(self, cli, common: tuple[str, ...], steps: int, env: dict[str, str], made: dict, tmp_path_factory):
        self.cli, self.common, self.steps, self.env = cli, common, steps, env
        self._made, self._tmp = made, tmp_path_factory

    def variant(self, env: dict[str, str], common: tuple[str, ...] = (), steps: int | None = None) -> Training:
        """This configuration under more environment variables and common flags, and over
        `steps` steps when given (its runs stored apart from this one's)."""
        steps_flag = () if steps is None else (f"--training.steps={steps}",)
        return Training(self.cli, self.common + tuple(common) + steps_flag, steps or self.steps,
                        {**self.env, **env}, self._made, self._tmp)

    def command(self, run_dir: Path, *args: str) -> list[str]:
        return self.cli.command("train", f"--job.output_dir={run_dir}", *self.common, *args)

    def __call__(self, run_dir: Path, *args: str) -> subprocess.CompletedProcess:
        """Train into run_dir; the run must succeed."""
        return self.cli.ok("train", f"--job.output_dir={run_dir}", *self.common, *args, env=self.env)

    def once(self, *args: str) -> Path:
        """The run with these arguments; its console output is in stderr_of(run)."""
        key = (self.common, tuple(sorted(self.env.items())), args)
        if key not in self._made:
            run = self._tmp.mktemp("once") / "run"
            try:
                proc = self(run, *args)
            except Exception as e:  # a failed run fails every test that needs it, without a retry each
                self._made[key] = e
                raise
            stderr_of(run).write_text(proc.stderr)
            self._made[key] = run
        if isinstance(self._made[key], Exception):
            raise self._made[key]
        return self._made[key]


@pytest.fixture(scope="session")
def training(duoka, tmp_path_factory):
    """Factory: training(common, steps, env=None) -> Training; all share one store of runs made once."""
    made: dict = {}

    def make(common, steps: int, env: dict[str, str] | None = None) -> Training:
        return Training(duoka, tuple(common), steps, dict(env or {}), made, tmp_path_factory)

    return make


@pytest.fixture(scope="session")
def once_stderr():
    """once_stderr(run): the console output of a run made by Training.once."""
    return lambda run: stderr_of(run).read_text()


@pytest.fixture(scope="session")
def records():
    """records(run_dir): the run's metrics.jsonl, one dict per step."""
    return read_records


@pytest.fixture(scope="session")
def weights():
    """weights(run_dir, step): the run's exported model at `step`, name -> tensor."""
    return read_weights


@pytest.fixture(scope="session")
def layout_runs(training) -> Training:
    """The layout configuration (COMMON): layout_runs(run_dir, *args) trains,
    layout_runs.once(*args) is a run shared by every test that asks for it."""
    return training(COMMON, STEPS)


@pytest.fixture(scope="session")
def reference(layout_runs) -> Path:
    """The layout configuration on one process: what every layout must compute."""
    return layout_runs.once("--nproc-per-node=1")


@pytest.fixture(scope="session")
def fsdp_accumulation_run(layout_runs) -> Path:
    """FSDP2 on 2 ranks, one sample per micro-batch (gradient accumulation), with a
    checkpoint at step 3: checked against one process (test_layouts.py) and resumed under
    tp x pp (test_model_parallel.py)."""
    return layout_runs.once("--nproc-per-node=2", "--parallel.dp_mode=fsdp", "--training.micro_batch_size=1",
                       "--checkpoint.interval=3")


def _assert_same_run(run: Path, ref: Path, loss: float = 1e-5, grad_norm: float = 1e-4, weights: float = 1e-5,
                     steps: int = STEPS):
    """The keyword arguments: the relative differences allowed, and the runs' length."""
    a, b = read_records(run), read_records(ref)
    assert len(a) == len(b) == steps
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= loss * abs(y["loss"]), (a, b)
        # Adam is blind to a constant factor on the gradient, so the weights alone would not
        # catch a normalisation error (say, a forgotten x dp_size); the gradient norm does.
        # 1e-4: the norm is a sum of 1.3M squares, reduced in another order per layout
        # (up to 1.6e-5 under FSDP2); a scale error would be 50% or more.
        assert abs(x["grad_norm"] - y["grad_norm"]) <= grad_norm * y["grad_norm"], (a, b)
    wa, wb = read_weights(run, steps), read_weights(ref, steps)
    assert wa.keys() == wb.keys()
    # The whole model's relative difference. No per-element or per-tensor bound: where a
    # gradient is zero up to rounding (the k-projection bias: a constant key shift barely
    # moves softmax), Adam rescales that rounding noise to lr-sized steps whose signs
    # depend on the reduction order, so single elements legitimately differ by ~lr.
    diff = sum(((wa[k] - wb[k]) ** 2).sum() for k in wa).sqrt()
    norm = sum((wb[k] ** 2).sum() for k in wb).sqrt()
    assert diff / norm <= weights


@pytest.fixture(scope="session")
def assert_same_run():
    """assert_same_run(run, ref): two runs of the layout configuration compute the same
    (per-step loss and gradient norm, final weights)."""
    return _assert_same_run


# Compiled against eager, fp32 on CPU: Inductor's fused kernels sum in another order. Measured
# (tp2, pp2): loss 1.5e-7, gradient norm 2.1e-5, weights 2.1e-6; about ten times the last two
# is allowed (the loss keeps the layouts' bound), still far below a normalisation error (50%+).
COMPILED_TOLERANCE = {"loss": 1e-5, "grad_norm": 2e-4, "weights": 2e-5}


@pytest.fixture(scope="session")
def assert_compiled_run():
    """assert_compiled_run(run, ref): a compiled run of the layout configuration computes
    what the eager one does, to COMPILED_TOLERANCE."""
    return functools.partial(_assert_same_run, **COMPILED_TOLERANCE)


@pytest.fixture
def resumed_equals(records, assert_same_run, tmp_path):
    """resumed_equals(training, first, reference, *layout): `first`'s step-3 checkpoint continued
    by `training` (a Training) under `layout`: steps 4 and 5 and the final weights equal the
    uninterrupted `reference`."""

    def check(training: Training, first: Path, reference: Path, *layout: str) -> None:
        second = tmp_path / "second"
        training(second, f"--checkpoint.resume={first / 'checkpoints' / 'step-3'}", *layout)
        got, ref = records(second), records(reference)
        assert [r["step"] for r in got] == [4, 5]
        # assert_same_run reads whole runs: give the resumed run the first three records.
        full = tmp_path / "full"
        shutil.copytree(second, full)
        (full / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ref[:3] + got))
        assert_same_run(full, reference)

    return check
