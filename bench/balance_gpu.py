"""Load balancing on 2 GPUs with one GPU slowed (issue 7): throughput with balance off and
auto, against the ideal (the sum of each GPU's solo speed under the same slowdown).

    python bench/balance_gpu.py --out $OUT/balance.json [--model qwen2-0.5b] [--competitor]

Slowdown by the option (`--debug.slow_ranks=1:0.5`) and, with --competitor, by a real
competing process running bf16 matrix products on GPU 1. Throughput is taken over the
last --last steps, from the second step on the final shares at the earliest (auto), or the
same late steps (off). Reproduces bench/results/balance_gpu.md (runs 10-12: device kind
nvidia-h200-x2, `--competitor --steps 30`), which README.md ("Load balancing") and
docs/training.md ("Load balancing") cite.

    python bench/balance_gpu.py --one-gpu --out $OUT/balance_one_gpu.json

--one-gpu (one GPU; it was bench/balance_one_gpu.py): does the balancer's measured speed
follow the whole step's? Four runs of the model (compiled, micro-batch 8, global batch 32,
24 steps, the last 12 timed): plain; with the balance timer on; slowed by
`--debug.slow_ranks=0:0.5`; sharing the GPU with a competing matmul loop. For the last two,
the ratio of the timer's speed to the timed-only run's should equal the ratio of their
tokens/s: that is what lets the balancer pick the right shares on 2 GPUs
(`balance_one_gpu.run*.json`; balance_gpu.md, "One-GPU check of the change").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from duoka.bench.training import run_process_group, stop_process_groups_on_signal

COMPETITOR = """
import torch, time
a = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16)
end = time.time() + {seconds}
while time.time() < end:
    for _ in range(20):
        a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()
"""


def train(run: Path, model: str, nproc: int, extra: list[str], steps: int, devices: str, mb: int,
          window: int, seq: int, compile_flag: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "duoka.cli", "train", f"--job.output_dir={run}", f"--model.flavor={model}",
           "--data.path=random", f"--training.seq_len={seq}", f"--training.micro_batch_size={mb}",
           f"--training.global_batch_size={4 * mb * nproc}", f"--training.steps={steps}",
           "--checkpoint.enabled=false", "--checkpoint.export_final=false", "--metrics.log_interval=5",
           f"--nproc-per-node={nproc}", f"--parallel.balance_window={window}", *compile_flag, *extra]
    # Recompilations (a new micro-batch size recompiles the blocks) are logged to the case's log.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": devices, "TORCH_LOGS": "recompiles"}
    # A session of its own, killed whole on any exit: a case cut off by a time limit must not
    # leave its training workers on the GPUs (one did, and voided the measurements after it).
    proc = run_process_group(cmd, 600, env)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    (run.parent / f"{run.name}.log").write_text(proc.stderr)
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def timed_steps(recs: list[dict], last: int) -> list[dict]:
    """The last `last` steps, but none before the second step on the final shares: the
    first step on new shares meets new micro-batch sizes (the loss recompiles for them;
    run 5's blocks recompiled too, a 27 s step, before the batch dimension was marked
    dynamic)."""
    shares = [r.get("balance", {}).get("shares") for r in recs]
    changes = [i for i in range(1, len(recs)) if shares[i] != shares[i - 1]]
    first = max(len(recs) - last, changes[-1] + 1 if changes else 0)
    return recs[first:]


def throughput(recs: list[dict], last: int) -> float:
    return _rate(timed_steps(recs, last))


def throughput_all(recs: list[dict], warmup: int = 2) -> float:
    """Every step after the compile warm-up, share changes and their stalls included: what
    a short run gets, beside the steady state that `throughput` measures."""
    return _rate(recs[warmup:])


def _rate(recs: list[dict]) -> float:
    return sum(r["tokens_per_s"] * r["step_time_s"] for r in recs) / sum(r["step_time_s"] for r in recs)


TIMER = ["--parallel.balance=static", "--parallel.balance_weights=1"]  # the block timer on, shares fixed


def one_gpu(a: argparse.Namespace) -> None:
    """--one-gpu: the timer's speed ratio against the whole step's, on one GPU."""
    work = Path(tempfile.mkdtemp(prefix="duoka-balance1-"))
    only = set(a.only.split(",")) if a.only else None
    result: dict = {"model": a.model, "steps": a.steps, "timed_last": a.last, "cases": {}}
    for name, extra, competitor in (("plain", [], False), ("timer", TIMER, False),
                                    ("timer_slow_option", [*TIMER, "--debug.slow_ranks=0:0.5"], False),
                                    ("timer_competitor", TIMER, True)):
        if only is not None and name not in only:
            continue
        comp = None
        if competitor:
            comp = subprocess.Popen([sys.executable, "-c", COMPETITOR.format(seconds=300)])
            time.sleep(5)
        try:
            recs = train(work / name, a.model, 1, [*extra, *(f"--{kv}" for kv in a.set)], a.steps, "0",
                         a.micro_batch, a.window, a.seq, [] if a.eager else ["--training.compile=true"])
        finally:
            if comp is not None:
                comp.kill()
                comp.wait(timeout=60)  # gone from the GPU before the next case starts
        tail = recs[-a.last:]
        speeds = [r["balance"]["speed"][0] for r in tail if r.get("balance")]
        result["cases"][name] = {"tokens_per_s": throughput(recs, a.last),
                                 "timer_speed": statistics.median(speeds) if speeds else None,
                                 "step_time_s": [r["step_time_s"] for r in recs],
                                 "phase_s": [r.get("phase_s") for r in recs]}
        shown = {k: v for k, v in result["cases"][name].items() if k in ("tokens_per_s", "timer_speed")}
        print(name, json.dumps(shown), flush=True)
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    c = result["cases"]
    base = c.get("timer")
    for name in ("timer_slow_option", "timer_competitor"):
        if base is None or name not in c:
            continue
        result[name] = {"whole_step_ratio": c[name]["tokens_per_s"] / base["tokens_per_s"],
                        "timer_ratio": c[name]["timer_speed"] / base["timer_speed"]}
    if base is not None and "plain" in c:
        result["timer_overhead"] = 1 - base["tokens_per_s"] / c["plain"]["tokens_per_s"]
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "cases"}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen2-0.5b")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 20; --one-gpu: 24)")
    ap.add_argument("--last", type=int, default=None, help="timed steps at the end (default 8; --one-gpu: 12)")
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--eager", action="store_true", help="no torch.compile (run 1 was eager and launch-bound)")
    ap.add_argument("--competitor", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every case, e.g. parallel.dp_mode=fsdp (repeatable)")
    ap.add_argument("--one-gpu", action="store_true",
                    help="instead: the one-GPU check of the balancer's timer (plain, timer, slowed, competitor)")
    a = ap.parse_args()
    a.steps = a.steps or (24 if a.one_gpu else 20)
    a.last = a.last or (12 if a.one_gpu else 8)
    stop_process_groups_on_signal()
    if a.one_gpu:
        one_gpu(a)
        return
    work = Path(tempfile.mkdtemp(prefix="duoka-balance-"))
    result = {"model": a.model, "micro_batch": a.micro_batch, "steps": a.steps, "timed_last": a.last,
              "set": a.set, "cases": {}}

    def case(name, nproc, extra, devices, competitor_gpu=None):
        comp = None
        if competitor_gpu is not None:
            # It ends by itself after 300 s, so a killed script cannot leave it running for long.
            comp = subprocess.Popen([sys.executable, "-c", COMPETITOR.format(seconds=300)],
                                    env={**os.environ, "CUDA_VISIBLE_DEVICES": competitor_gpu})
            time.sleep(5)
        try:
            t0 = time.time()
            recs = train(work / name, a.model, nproc, [*extra, *(f"--{kv}" for kv in a.set)], a.steps, devices,
                         a.micro_batch, a.window, a.seq, [] if a.eager else ["--training.compile=true"])
        finally:
            if comp is not None:
                comp.kill()
                comp.wait(timeout=60)  # gone from the GPU before the next case starts
        per_rank = [x.get("per_rank", {}) for x in recs]
        r = {"tokens_per_s": throughput(recs, a.last), "timed_steps": len(timed_steps(recs, a.last)),
             "tokens_per_s_all_steps": throughput_all(recs),
             "wall_s": time.time() - t0,
             "shares": [x.get("balance", {}).get("shares") for x in recs],
             "speed": [x.get("balance", {}).get("speed") for x in recs],
             # Where each step's time went, to explain a gap to the ideal.
             "step_time_s": [x["step_time_s"] for x in recs], "phase_s_rank0": [x.get("phase_s") for x in recs],
             "rank_step_time_s": [p.get("step_time_s") for p in per_rank],
             "rank_data_time_s": [p.get("data_time_s") for p in per_rank],
             "rank_alloc_retries": [p.get("alloc_retries") for p in per_rank],
             # Clocks and power per GPU and step: a rank slowed by its GPU's clock shows here.
             "sm_clock_mhz": [[g.get("sm_clock_mhz") for g in x.get("gpus", [])] for x in recs],
             "power_w": [[g.get("power_w") for g in x.get("gpus", [])] for x in recs]}
        result["cases"][name] = r
        print(name, f"{r['tokens_per_s']:,.0f} tok/s, {r['wall_s']:.0f} s, final shares", r["shares"][-1],
              flush=True)
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
        return r

    only = set(a.only.split(",")) if a.only else None

    def wanted(name):
        return only is None or name in only

    def ratios(kind, slowed_solo):
        cases = result["cases"]
        if not all(k in cases for k in (f"{kind}_off", f"{kind}_auto", "solo_gpu0", slowed_solo)):
            return
        ideal = cases["solo_gpu0"]["tokens_per_s"] + cases[slowed_solo]["tokens_per_s"]
        auto, off = cases[f"{kind}_auto"]["tokens_per_s"], cases[f"{kind}_off"]["tokens_per_s"]
        auto_all = cases[f"{kind}_auto"]["tokens_per_s_all_steps"]
        result[kind] = {"auto_vs_off": auto / off, "auto_vs_ideal": auto / ideal, "ideal_tokens_per_s": ideal,
                        # the same over all steps after warm-up, share changes included
                        "all_steps_auto_vs_off": auto_all / cases[f"{kind}_off"]["tokens_per_s_all_steps"],
                        "all_steps_auto_vs_ideal": auto_all / ideal}

    def in_parallel(*cases):
        """One-GPU cases on different GPUs, at the same time."""
        with ThreadPoolExecutor(len(cases)) as pool:
            for f in [pool.submit(case, *c) for c in cases if wanted(c[0])]:
                f.result()

    # Solo speeds under the same slowdown, both at once (one GPU each): GPU 0 normal, GPU 1 slowed.
    in_parallel(("solo_gpu0", 1, [], "0"), ("solo_gpu1_slow_option", 1, ["--debug.slow_ranks=0:0.5"], "1"))
    # What the balanced path itself costs on one GPU (block timer, whole-block compile with a
    # dynamic batch dimension), beside GPU 1's solo speed with the competitor; then what two
    # equal GPUs reach evenly split. Together they explain a gap between auto and the ideal.
    in_parallel(("solo_gpu0_timer", 1, ["--parallel.balance=static", "--parallel.balance_weights=1"], "0"),
                *([("solo_gpu1_competitor", 1, [], "1", "1")] if a.competitor else []))
    if wanted("even_off"):
        case("even_off", 2, [], "0,1")
    # Two equal GPUs split unevenly on purpose: what an uneven split itself costs, with
    # partly filled micro-batches ([43, 21] of 64 at micro-batch 8) and with full ones ([48, 16]).
    for name, weights in (("static_partial", "0.67,0.33"), ("static_full", "0.75,0.25")):
        if wanted(name):
            case(name, 2, ["--parallel.balance=static", f"--parallel.balance_weights={weights}"], "0,1")
    if wanted("option_off"):
        case("option_off", 2, ["--debug.slow_ranks=1:0.5"], "0,1")
    if wanted("option_auto"):
        case("option_auto", 2, ["--debug.slow_ranks=1:0.5", "--parallel.balance=auto"], "0,1")
    ratios("option", "solo_gpu1_slow_option")
    if a.competitor:
        if wanted("competitor_off"):
            case("competitor_off", 2, [], "0,1", competitor_gpu="1")
        if wanted("competitor_auto"):
            case("competitor_auto", 2, ["--parallel.balance=auto"], "0,1", competitor_gpu="1")
        ratios("competitor", "solo_gpu1_competitor")
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("option", "competitor") if k in result}))


if __name__ == "__main__":
    main()
