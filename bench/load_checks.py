"""What the model-folder checks cost at load time (docs/reliability.md, "Model folders"): a
random Qwen2 folder of a published shape loaded the way `duoka serve` and `duoka generate`
load it (bf16 on the GPU, q/k/v and gate/up packed), with the finite check of every weight
tensor and without it (--skip-weight-check), and the check alone on the loaded model
(`nonfinite_names`: one max-norm per tensor on the device, one wait).

Command (device kind nvidia-h200 or nvidia-h100-x1, from the repository root):
    PYTHONPATH=$PWD python3 bench/load_checks.py --shape 7b --out $OUT/load_checks_7b.json
Loads alternate (checked, unchecked, checked, ...) so that the page cache serves both alike
after the first, which is discarded as the cold read.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_models import make_folder  # noqa: E402

from duoka.models.qwen2.args import ModelOptions  # noqa: E402
from duoka.models.qwen2.hf_adapter import load_hf_model, nonfinite_names  # noqa: E402


def timed_load(folder: Path, check: bool) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    model, _ = load_hf_model(folder, "cuda", torch.bfloat16, ModelOptions(packed_projections=True),
                             check_weights=check)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    del model
    torch.cuda.empty_cache()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="7b", choices=("0.5b", "1.5b", "7b"))
    parser.add_argument("--pairs", type=int, default=3, help="checked/unchecked load pairs after the cold one")
    parser.add_argument("--out", required=True)
    a = parser.parse_args()
    folder = make_folder(a.shape)
    timed_load(folder, True)  # cold: reads the files from disk into the page cache
    loads = {True: [], False: []}
    for _ in range(a.pairs):
        for check in (True, False):
            loads[check].append(timed_load(folder, check))
    model, _ = load_hf_model(folder, "cuda", torch.bfloat16, ModelOptions(packed_projections=True))
    tensors = dict(model.state_dict())
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    alone = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        assert nonfinite_names(tensors) == []
        alone.append(time.perf_counter() - t)
    result = {"shape": a.shape, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "weights_gb": nbytes / 1e9, "tensors": len(tensors),
              "load_checked_s": loads[True], "load_unchecked_s": loads[False],
              "load_checked_median_s": statistics.median(loads[True]),
              "load_unchecked_median_s": statistics.median(loads[False]),
              "check_alone_s": alone, "check_alone_median_s": statistics.median(alone),
              "check_gb_per_s": nbytes / 1e9 / statistics.median(alone)}
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{a.shape}: {nbytes / 1e9:.1f} GB in {len(tensors)} tensors; load checked "
          f"{result['load_checked_median_s']:.2f} s, unchecked {result['load_unchecked_median_s']:.2f} s; "
          f"the check alone {1e3 * result['check_alone_median_s']:.1f} ms ({result['check_gb_per_s']:.0f} GB/s)")


if __name__ == "__main__":
    main()
