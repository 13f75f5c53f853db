"""Start-up cost: what the processes of `duoka train`, `serve` and `generate` import before they
need it. torch._dynamo alone is over a second of each process's start (a 2-rank 5-step run on 2
cores: 4.8 s -> 3.7 s without it), so it waits for the first compile. (A training worker needs
it before that: torch 2.13's optimizers, DDP and FSDP2 import it as they are built, and so does
initialising a parameter on the meta device. The worker server imports it once for all of its
workers: duoka/launch/training.py, start_worker_server.)"""

import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

# The modules a training rank, a serving rank and the CLI import before their first step.
START_PATHS = ("duoka.cli", "duoka.train.entrypoint", "duoka.train.trainer", "duoka.train.export",
               "duoka.serve.engine", "duoka.serve.worker", "duoka.serve.server", "duoka.serve.rank_process",
               "duoka.models.qwen2", "duoka.parallel.pipeline")


def test_starting_a_process_does_not_import_the_compiler():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in START_PATHS)
            + "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor'))))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", "a module on the start path imports the compiler: import it where it is used"


def test_the_moe_capability_check_carries_the_marker_assume_constant_result_sets():
    """duoka.models.qwen2.moe marks its capability check as torch.compiler.assume_constant_result
    would, without importing torch._dynamo: that function must still set exactly this marker."""
    from duoka.models.qwen2.moe import _cuda_grouped_mm_capable

    def probe(index: int) -> bool:
        return True

    torch.compiler.assume_constant_result(probe)
    assert vars(probe) == {"_dynamo_marked_constant": True}
    assert vars(_cuda_grouped_mm_capable) == vars(probe)


def test_the_marked_check_compiles_in_one_graph(monkeypatch):
    """Under torch.compile (fullgraph: no break around it) the check runs at trace time."""
    from duoka.models.qwen2 import moe

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))

    @torch.compile(backend="eager", fullgraph=True)
    def f(x):
        return x * 2 if moe._cuda_grouped_mm_capable(0) else x

    assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0))
