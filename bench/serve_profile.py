"""The serving engine alone (LLM's engine in this process, no HTTP) on the serving peer's
workload, and where a serving step's time goes on the GPU. Reproduces docs/performance.md
"Serving", the "engine alone" rows (bench/results/serve/engine_7b.run1.json,
profile_7b.run*.json); bench/serve_vs_peer.sh's `engine` part runs it (device kind
nvidia-h200; the random model folder is made by bench/serve_models.py).

    python bench/serve_profile.py --shape 7b --out $OUT/engine_7b.json [--cprofile]

Batch 1 (128-token prompt, 256 tokens): per-step wall time; then the peer's workload (256
requests): wall time, steps, and the decode step's GPU time alone (runner.execute,
synchronised) against the whole step's. --cprofile prints the host's hottest functions too
(their timing then slows the steps it measures)."""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_models import SHAPES, make_folder, peer_workload  # noqa: E402

from duoka.serve.config import EngineConfig  # noqa: E402
from duoka.serve.engine import LLMEngine  # noqa: E402
from duoka.serve.params import SamplingParams  # noqa: E402


def top(profile: cProfile.Profile, n: int = 25) -> str:
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(n)
    return out.getvalue()


def run(engine: LLMEngine, prompts, out_len: int, profile: bool):
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    prof = cProfile.Profile() if profile else None
    stamps = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    while engine.has_unfinished():
        engine.step()
        stamps.append(time.perf_counter())
    if prof:
        prof.disable()
    return time.perf_counter() - t0, stamps, prof


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="7b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--cprofile", action="store_true")
    a = ap.parse_args()
    res = {"shape": a.shape}
    folder = make_folder(a.shape)
    engine = LLMEngine(EngineConfig(model=folder, max_model_len=4096))
    vocab = SHAPES[a.shape]["vocab_size"]
    run(engine, peer_workload(4, vocab=vocab), 32, False)  # warm-up

    wall, stamps, prof = run(engine, [peer_workload(1, 128, 128, vocab)[0]], 256, a.cprofile)
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    res["batch1_tokens_per_s"] = (len(stamps) - 2) / (stamps[-1] - stamps[1])
    res["batch1_step_ms_median"] = sorted(steps)[len(steps) // 2] * 1000
    print(json.dumps(res), flush=True)
    if prof:
        print(top(prof, 30), flush=True)

    prompts = peer_workload(256, vocab=vocab)
    wall, stamps, prof = run(engine, prompts, 256, a.cprofile)
    total = sum(map(len, prompts)) + 256 * 256
    res["peer_workload"] = dict(wall_s=wall, steps=len(stamps), total_tokens_per_s=total / wall,
                                output_tokens_per_s=256 * 256 / wall)
    print(json.dumps(res), flush=True)
    if prof:
        print(top(prof, 30), flush=True)

    # One 256-way decode step: the GPU alone against the whole step.
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for i, p in enumerate(peer_workload(256, 512, 512, vocab, seed=1)):
        engine.add_request(f"d{i}", p, params)
    while engine.scheduler.num_waiting or any(s.num_computed < s.num_prompt_tokens
                                              for s in engine.scheduler.running):
        engine.step()
    times = []
    for _ in range(10):
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    res["decode256_step_ms"] = sorted(times)[5] * 1000
    from duoka.serve.runner import decode_first, prepare_inputs
    batch = engine.scheduler.schedule()
    inputs = prepare_inputs(decode_first(batch.items), engine.shape.block_size)
    gpu = []
    for _ in range(10):
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.worker.runner.execute(inputs)
        torch.cuda.synchronize()
        gpu.append(time.perf_counter() - t)
    res["decode256_execute_ms"] = sorted(gpu)[5] * 1000
    t = time.perf_counter()
    for _ in range(10):
        prepare_inputs(decode_first(batch.items), engine.shape.block_size)
    res["decode256_prepare_ms"] = (time.perf_counter() - t) * 100
    print(json.dumps(res), flush=True)
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
