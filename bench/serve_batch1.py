"""Batch-1 decode on the GPU: where a step's time goes, against the weight-read ceiling.

    python bench/serve_batch1.py --shape 7b --out $OUT/batch1_7b.json [--skip-gemv]

1. The ceiling: the device's copy bandwidth (a 4 GiB buffer copied) and the bytes a decode
   step must read (every weight but the embedding table, which is only indexed).
2. One-row matmuls of the shape's projections, each replayed from a CUDA graph (no launch
   gaps): cuBLAS (F.linear) against inductor's tuned reduction (compiled with
   coordinate-descent tuning), q/k/v and gate/up also as one matmul over fused weights.
3. The engine at batch 1 (128-token prompt, 256 tokens): the step's wall time, the runner's
   replay alone (synchronised), and the kernels of the decode steps from torch.profiler
   (time per kernel name per step), whose sum against the wall time is the host's gap.

Reproduces docs/performance.md "Serving"'s batch-1 breakdown (bench/results/serve/
batch1_7b.run*.json); device kind nvidia-h200, from the repository root, .wheels carried as
for bench/serve_vs_peer.sh:

    python3 bench/serve_batch1.py --shape 7b --out $OUT/batch1_7b.json
    python3 bench/serve_batch1.py --shape moe-a2.7b --out $OUT/batch1_moe.json  # a MoE shape: no GEMV table
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_table import kernel_table  # noqa: E402
from serve_models import SHAPES, config_folder, is_moe, make_folder, peer_workload  # noqa: E402

from duoka.serve.config import EngineConfig  # noqa: E402
from duoka.serve.engine import LLMEngine  # noqa: E402
from duoka.serve.params import SamplingParams  # noqa: E402
from duoka.serve.runner import decode_first, prepare_inputs  # noqa: E402


def copy_bandwidth() -> float:
    """Bytes moved per second (read + write) copying a 4 GiB buffer, the median of 10."""
    n = 4 << 30
    a, b = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del a, b
    return 2 * n / sorted(times)[5]


def graph_time(fn, x: torch.Tensor, reps: int = 20) -> float:
    """Seconds per call of fn(x), `reps` calls captured in one CUDA graph, median of 10 replays."""
    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn(x)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000 / reps)
    return sorted(times)[5]


def gemv_table(shape: dict) -> list[dict]:
    dim, hidden = shape["hidden_size"], shape["intermediate_size"]
    head_dim = dim // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head_dim
    cases = {  # name: (in, out, bias)
        "q": (dim, dim, True), "k": (dim, kv, True), "qkv_fused": (dim, dim + 2 * kv, True), "o": (dim, dim, False),
        "gate": (dim, hidden, False), "gate_up_fused": (dim, 2 * hidden, False), "down": (hidden, dim, False),
        "head": (dim, shape["vocab_size"], False),
    }
    rows = []
    for name, (fan_in, fan_out, bias) in cases.items():
        w = torch.randn(fan_out, fan_in, device="cuda", dtype=torch.bfloat16) * 0.02
        b = torch.zeros(fan_out, device="cuda", dtype=torch.bfloat16) if bias else None
        x = torch.randn(1, fan_in, device="cuda", dtype=torch.bfloat16)
        nbytes = w.numel() * 2

        def linear(t, w=w, b=b):
            return F.linear(t, w, b)

        row = dict(case=name, fan_in=fan_in, fan_out=fan_out, mbytes=nbytes / 1e6)
        row["cublas_us"] = graph_time(linear, x) * 1e6
        tuned = torch.compile(linear, dynamic=False, options={"coordinate_descent_tuning": True})
        row["tuned_us"] = graph_time(tuned, x) * 1e6
        row["cublas_tb_s"] = nbytes / row["cublas_us"] / 1e6
        row["tuned_tb_s"] = nbytes / row["tuned_us"] / 1e6
        rows.append(row)
        print(json.dumps(row), flush=True)
        del w, b, x, tuned
    return rows


def engine_batch1(shape_name: str) -> dict:
    # A MoE shape's random weights are built on the device (tens of GB written to disk otherwise).
    moe = is_moe(SHAPES[shape_name])
    folder = config_folder(shape_name) if moe else make_folder(shape_name)
    vocab = SHAPES[shape_name]["vocab_size"]
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=folder, max_model_len=4096, load_format="dummy" if moe else "auto"))
    res = {"start_s": time.perf_counter() - t0}
    prompt = peer_workload(1, 128, 128, vocab)[0]

    def run(out_len: int, rid: str, profiler=None):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True))
        stamps = []
        while engine.has_unfinished():
            engine.step()
            stamps.append(time.perf_counter())
            if profiler is not None:
                profiler.step()
        return stamps

    run(32, "warm")
    stamps = run(256, "timed")
    steps = sorted(b - a for a, b in zip(stamps[2:], stamps[3:]))  # decode steps only
    res["step_ms_median"] = steps[len(steps) // 2] * 1000
    res["tokens_per_s"] = (len(stamps) - 3) / (stamps[-1] - stamps[2])

    # The runner's replay alone: a decode step of the same request, synchronised.
    engine.add_request("alone", prompt, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    batch = engine.scheduler.schedule()
    inputs = prepare_inputs(decode_first(batch.items), engine.shape.block_size)
    times = []
    for _ in range(20):
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.worker.runner.execute(inputs)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    res["execute_ms_median"] = sorted(times)[10] * 1000
    engine.abort("alone")
    while engine.has_unfinished():
        engine.step()

    # Kernels per decode step.
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        stamps = run(40, "profiled")
    n_steps = len(stamps)
    table = kernel_table(prof, n_steps)
    res["profiled_steps"] = n_steps
    res["kernel_us_per_step"] = table["kernel_ms"] * 1000
    res["profiled_wall_ms_per_step"] = (stamps[-1] - stamps[0]) / (n_steps - 1) * 1000
    res["kernel_ms_by_kind"] = table["by_kind_ms"]
    res["top_kernels"] = [{"name": k["name"], "us_per_step": k["ms"] * 1000, "calls_per_step": k["calls"]}
                          for k in table["top"]]
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="7b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip-gemv", action="store_true")
    a = ap.parse_args()
    shape = SHAPES[a.shape]
    res = {"shape": a.shape, "copy_tb_s": copy_bandwidth() / 1e12}
    moe = is_moe(shape)
    if moe:  # the active weights: attention, router, the k routed experts, the shared expert, head
        from serve_moe import active_bytes

        res["weight_bytes_per_token"] = active_bytes(config_folder(a.shape))["bytes_per_token"]
    else:
        dim, hidden, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
        kv = shape["num_key_value_heads"] * dim // shape["num_attention_heads"]
        per_layer = dim * (2 * dim + 2 * kv) + 3 * dim * hidden
        res["weight_bytes_per_token"] = 2 * (layers * per_layer + dim * shape["vocab_size"])
    res["ceiling_tokens_per_s"] = res["copy_tb_s"] * 1e12 / res["weight_bytes_per_token"]
    print(json.dumps(res), flush=True)
    if not a.skip_gemv and not moe:  # the table's projections are a dense layer's
        res["gemv"] = gemv_table(shape)
    res["engine"] = engine_batch1(a.shape)
    if moe:  # the routed experts' GEMV tiles the autotuner picked (duoka.models.moe_gemv)
        from dataclasses import asdict

        from duoka.models.moe_gemv import chosen_tiles

        res["moe_gemv_tiles"] = {name: tiles and asdict(tiles) for name, tiles in chosen_tiles().items()}
    print(json.dumps(res["engine"], indent=1), flush=True)
    print(json.dumps(res.get("moe_gemv_tiles")), flush=True)
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
