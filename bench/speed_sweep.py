"""Several `duoka bench` cases in one GPU session, each written to its own JSON as soon
as it finishes, stopping before a time budget runs out (a device call has a hard limit).

    python bench/speed_sweep.py --out-dir $OUT/speed --budget 400 \
        --case "qwen2-0.5b ddp+compile 8 peer" --case "qwen2-7b fsdp+compile+fused 4 seq=4096 profile"

A case is `MODEL LAYOUT MICRO_BATCH` and options: `seq=S`, `gb=G` (global batch), `gpus=N`,
`steps=N`, `peer` (the transformers peer in the same call), `profile` (top kernels; the
Chrome traces go to OUT_DIR/<case name>-trace/), `set:SECTION.KEY=VALUE` (extra train
setting). Results: OUT_DIR/<case name>.json and a
summary table OUT_DIR/summary.json. The peer is bench/peers/train_peer.py (--peer for another).

It reproduces docs/performance.md's training tables (bf16 and float8 against the peer, one GPU,
scaling; the record with every call's command: bench/results/speed.md), which README.md and
docs/bench.md cite. The bf16 table's first four rows are session 8's call 1, its bf16 cases (device
kind nvidia-h200-x2, from the repository root, PYTHONPATH=$PWD):

    python bench/speed_sweep.py --out-dir $OUT/s8c1 --budget 540 \
        --case "qwen2-7b fsdp+compile+noreshard 4 peer" --case "qwen2-1.5b fsdp+compile+noreshard 8 peer" \
        --case "qwen2-0.5b fsdp+compile+noreshard 16 gb=32 peer" --case "qwen2-0.5b fsdp+compile+noreshard 8 peer"

One profiled step of one GPU and its phases (what bench/profile_train.sh did, see git history;
bench/results/profiles/): `--case "qwen2-0.5b ddp+compile 8 gpus=1 profile"`, then
`python bench/trace_summary.py OUT_DIR/<case name>-trace/trace-rank0.json*`.
"""

from __future__ import annotations

import argparse
import json
import re
import time
import traceback
from pathlib import Path

from duoka.bench.training import TRAIN_PEER, bench, stop_process_groups_on_signal


def parse_case(text: str) -> dict:
    model, layout, micro, *opts = text.split()
    case = {"model": model, "layout": layout, "micro_batch": int(micro), "seq": 2048, "global_batch": None,
            "gpus": None, "steps": 8, "peer": False, "profile": False, "settings": []}
    for o in opts:
        if o in ("peer", "profile"):
            case[o] = True
        elif o.startswith("set:"):
            case["settings"].append(o[4:])
        else:
            key, value = o.split("=", 1)
            case[{"seq": "seq", "gb": "global_batch", "gpus": "gpus", "steps": "steps"}[key]] = int(value)
    case["name"] = re.sub(r"[^A-Za-z0-9._-]+", "_", text.replace("+", "-"))  # names the device tool returns
    return case


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", action="append", required=True)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--budget", type=float, required=True, help="seconds; no case starts after 80%% of it")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--peer", default=str(Path(__file__).resolve().parent / "peers" / TRAIN_PEER))
    a = ap.parse_args()
    stop_process_groups_on_signal()
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    summary = []
    for text in a.case:
        case = parse_case(text)
        elapsed = time.monotonic() - start
        if elapsed > 0.8 * a.budget:
            summary.append({"case": text, "skipped": f"budget: {elapsed:.0f} of {a.budget:.0f} s used"})
            continue
        t0 = time.monotonic()
        try:
            r = bench(case["model"], case["layout"], case["seq"], case["micro_batch"], case["steps"], a.warmup,
                      case["global_batch"], case["peer"], Path(a.peer), case["gpus"],
                      int(max(60, a.budget - elapsed)), case["settings"], case["profile"],
                      out / f"{case['name']}-trace" if case["profile"] else None)
        except Exception as e:  # one failing case must not lose the others' results
            summary.append({"case": text, "error": f"{type(e).__name__}: {e}"[-2000:]})
            traceback.print_exc()
            continue
        r["wall_s"] = time.monotonic() - t0
        (out / f"{case['name']}.json").write_text(json.dumps(r, indent=1) + "\n")
        row = {"case": text, "tok_s_gpu": round(r["tokens_per_s_per_gpu"]),
               "mfu": r["mfu"] and round(r["mfu"], 4), "peak_gib": round(r["peak_mem_gib"], 1),
               "step_s": round(r["step_time_s"], 4), "breakdown_ms": {k: round(v * 1e3, 1)
                                                                     for k, v in r["breakdown_s"].items()},
               "host_ms": r.get("host_s") and {k: round(v * 1e3, 1) for k, v in r["host_s"].items()},
               "wall_s": round(r["wall_s"])}
        if "peer" in r:
            row.update(peer_tok_s_gpu=r["peer"]["tokens_per_s_per_gpu"], peer_peak_gib=r["peer"]["peak_mem_gib"],
                       vs_peer=round(r["vs_peer"], 3))
        summary.append(row)
        print(json.dumps(row), flush=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
