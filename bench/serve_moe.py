"""Qwen2-MoE serving on one GPU (issue 40): duoka's engine on random weights of the published
shape (`--load-format dummy`: made on the device from a config-only folder, no weight files),
batch 1 against the active-weight read bound, a 64-request batch and the serving peer's
256-request workload; then the transformers peer (bench/peers/serve_peer.py, its
`generate_batch` continuous batching) on the same workload, in the same call.

    python3 -m pip install -q --no-index --find-links .wheels httpx2   # once per machine
    PYTHONPATH=$PWD python3 bench/serve_moe.py --shape moe-a2.7b --out $OUT/serve_moe_a2.7b.json
    PYTHONPATH=$PWD python3 bench/serve_moe.py --shape moe-57b --no-peer --out $OUT/serve_moe_57b.json
    PYTHONPATH=$PWD .venv/bin/python bench/serve_moe.py --shape moe-tiny --requests 8 --prompt-min 8 \
        --prompt-max 64 --out-len 16 --batch 4 --out /tmp/serve_moe_tiny.json  # CPU smoke run

Device kind: nvidia-h200 for both (Qwen1.5-MoE-A2.7B's 28.6 GB of bf16 weights also fit
nvidia-h100-x1; Qwen2-57B-A14B's 114.8 GB need the H200's 141 GB, and duoka refuses them at
start on an 80 GB card, naming the fix). Carry .wheels: the prompts come from
duoka.bench.loadgen (bench/serve_models.peer_workload), which imports httpx2, not in the image.

1. The bound. A decode step of one token reads, in bf16, every layer's attention
   projections, of each MoE layer the router, the shared expert and its gate and the k routed
   experts the token goes to, and the output head: duoka's ModelArgs.matmul_params (the
   embedding is only indexed; biases and norms add < 0.01%). Divided by the GPU's bandwidth,
   measured in the same run (a 4 GiB device-to-device copy, read + written bytes over time,
   bench/serve_batch1.py's copy_bandwidth) and by the datasheet's (SPEC_BANDWIDTH), that is
   the most tokens per second batch 1 can make.
2. duoka, in a process of its own (so that all of its memory, CUDA graph pools included, is
   back before the peer starts), stopped after --duoka-timeout s: the copy bandwidth, the
   engine's start line (weights GiB, KV cache tokens and GiB), batch 1 (a 128-token prompt,
   256 tokens, greedy, ignore_eos; the median of 3 runs, the first two steps, prefill
   included, left out), a --batch-request batch (128-token prompts, 128 tokens each) and the
   peer's workload (--requests prompts of --prompt-min to --prompt-max random tokens,
   --out-len tokens each; bench/peers/serve_peer.py's prompts), after a 16-request warm-up.
3. The peer: `serve_peer.py --model SHAPE --case continuous` (`--peer-batch1`: its batch-1
   static-cache decode too, which compiles for minutes), stopped after --peer-timeout s.

Writes --out (JSON, rewritten after each part; duoka's part keeps each stage it finished, in
a file of its own under the temporary folder until it ends, so a stopped part still reports):
`bound` (bytes per token by part, bandwidths, tokens/s bounds), `duoka` (start_log,
kv_cache, batch1_tokens_per_s and its ratio to each bound, batch_tokens_per_s, workload),
`peer` (its JSON lines, or the error) and `vs_peer` (duoka's workload tok/s over the peer's,
total and output). The issue's targets: the workload at >= 10x the peer, batch 1 near the
measured bound; for the 57B, that it loads and serves, and its KV capacity.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_models import CONFIGS, config_folder, is_moe, peer_workload  # noqa: E402

from duoka.models.qwen2.hf_adapter import read_config  # noqa: E402

PEER = ROOT / "bench" / "peers" / "serve_peer.py"
# max_position_embeddings of the published base checkpoints' config.json (the peers' COMMON
# has 32768): Qwen/Qwen1.5-MoE-A2.7B 8192, Qwen/Qwen2-57B-A14B 131072; duoka's flavors agree.
PUBLISHED_CONTEXT = {"moe-a2.7b": 8192, "moe-57b": 131072}
# HBM bandwidth from the datasheets, bytes/s: H200 4.8 TB/s, H100 SXM 3.35 TB/s, H100 PCIe
# 2.0 TB/s (the first key found in the device's name, upper-cased, wins: PCIE before H100).
SPEC_BANDWIDTH = {"H200": 4.8e12, "H100 PCIE": 2.0e12, "H100": 3.35e12}
BF16_BYTES = 2


def active_bytes(folder: Path) -> dict:
    """Bytes one decoded token reads, by part, for the folder's config (bf16)."""
    args = read_config(folder)
    hd = args.resolved_head_dim
    moe = len(args.moe_layers)
    parts = {
        "attention": args.n_layers * (args.dim * hd * (args.n_heads + 2 * args.n_kv_heads)
                                      + args.n_heads * hd * args.dim),
        "router": moe * args.dim * args.num_experts,
        "routed_experts_active": moe * args.num_experts_per_tok * 3 * args.dim * args.moe_intermediate_size,
        "shared_expert_and_gate": moe * (3 * args.dim * args.shared_expert_intermediate_size + args.dim),
        "dense_mlp": (args.n_layers - moe) * 3 * args.dim * args.intermediate_size,
        "head": args.vocab_size * args.dim,
    }
    # The same sum as ModelArgs.matmul_params, the MFU's N: the two must not drift apart.
    assert sum(parts.values()) == args.matmul_params(), (parts, args.matmul_params())
    kv_per_token = 2 * args.n_layers * args.n_kv_heads * hd * BF16_BYTES
    return {"params_by_part": parts, "active_params": args.matmul_params(), "total_params": args.num_params(),
            "bytes_per_token": BF16_BYTES * args.matmul_params(), "kv_bytes_per_context_token": kv_per_token,
            "vocab_size": args.vocab_size}


def spec_bandwidth(name: str) -> float | None:
    upper = name.upper()
    return next((bw for key, bw in SPEC_BANDWIDTH.items() if key in upper), None)


def decode_rate(engine, prompts: list[list[int]], out_len: int, tag: str) -> float:
    """Tokens per second over the decode steps of one batch of requests (the first two steps,
    which prefill, left out)."""
    from duoka.serve.params import SamplingParams

    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}{i}", prompt, SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True))
    stamps = []
    while engine.has_unfinished():
        engine.step()
        stamps.append(time.perf_counter())
    return len(prompts) * (len(stamps) - 3) / (stamps[-1] - stamps[2])


def run_workload(engine, prompts: list[list[int]], out_len: int) -> dict:
    from duoka.serve.params import SamplingParams

    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    produced = 0
    t = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"w{i}", prompt, params)
    while engine.has_unfinished():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    wall = time.perf_counter() - t
    prompt_tokens = sum(map(len, prompts))
    return {"requests": len(prompts), "prompt_tokens": prompt_tokens, "output_tokens": produced, "wall_s": wall,
            "output_tokens_per_s": produced / wall, "total_tokens_per_s": (prompt_tokens + produced) / wall,
            "preemptions": engine.stats().num_preemptions}


def duoka_part(a: argparse.Namespace) -> None:
    """The engine's figures, written to --part-out after each stage (a run stopped at its
    timeout keeps the stages it finished); runs in its own process (--part duoka)."""
    from duoka.serve.config import EngineConfig
    from duoka.serve.engine import LLMEngine

    cuda = torch.cuda.is_available()
    result: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu"}

    def save() -> None:
        Path(a.part_out).write_text(json.dumps(result))

    if cuda:
        from serve_batch1 import copy_bandwidth

        result["copy_bytes_per_s"] = copy_bandwidth()
        save()
        # The copy's 8 GiB must not count as this process's peak when the engine sizes its cache.
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    logs: list[str] = []
    t = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=a.folder, load_format="dummy", max_model_len=a.max_model_len,
                                    max_num_seqs=a.max_num_seqs, gpu_memory_utilization=a.gpu_memory_utilization),
                       log=logs.append)
    shape = engine.shape
    result.update(start_s=time.perf_counter() - t, start_log=logs,
                  memory_allocated_gib=torch.cuda.memory_allocated() / 2**30 if cuda else None,
                  kv_cache={"tokens": shape.tokens, "blocks": shape.num_blocks,
                            "gib": shape.num_blocks * shape.bytes_per_block / 2**30})
    print("\n".join(logs), flush=True)
    save()
    vocab = engine.vocab_size
    prompt = peer_workload(1, 128, 128, vocab)
    decode_rate(engine, prompt, 32, "warm")
    runs = [decode_rate(engine, prompt, 256, f"b1_{k}_") for k in range(3)]
    result.update(batch1_runs=runs, batch1_tokens_per_s=sorted(runs)[1])
    print("batch1", runs, flush=True)
    save()
    result["batch_requests"] = a.batch
    result["batch_tokens_per_s"] = decode_rate(engine, peer_workload(a.batch, 128, 128, vocab), 128, "batch_")
    print("batch", a.batch, result["batch_tokens_per_s"], flush=True)
    save()
    if a.requests:
        warm = peer_workload(16, 16, 64, vocab, seed=1)  # other prompts than the timed ones: no prefix hits
        run_workload(engine, warm, 16)
        result["workload"] = run_workload(engine, peer_workload(a.requests, a.prompt_min, a.prompt_max, vocab),
                                          a.out_len)
        print("workload", json.dumps(result["workload"]), flush=True)
        save()


def run_peer(a: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(PEER), "--model", a.shape, "--case", "both" if a.peer_batch1 else "continuous",
           "--requests", str(a.requests), "--prompt-min", str(a.prompt_min), "--prompt-max", str(a.prompt_max),
           "--out-len", str(a.out_len)]
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.peer_timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {a.peer_timeout} s", "command": " ".join(cmd)}
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    out = {"command": " ".join(cmd), "wall_s": time.perf_counter() - t, "cases": lines}
    if proc.returncode != 0 or not lines:
        out["error"] = (proc.stderr or proc.stdout)[-2000:]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description="Qwen2-MoE serving: duoka (dummy weights) against the transformers peer")
    ap.add_argument("--shape", default="moe-a2.7b", choices=sorted(k for k, c in CONFIGS.items() if is_moe(c)))
    ap.add_argument("--out", required=True)
    ap.add_argument("--root", default="/tmp/duoka-models", help="where the config-only folder is written")
    ap.add_argument("--requests", type=int, default=256, help="the peer's workload (0: none)")
    ap.add_argument("--prompt-min", type=int, default=128)
    ap.add_argument("--prompt-max", type=int, default=1024)
    ap.add_argument("--out-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64, help="requests of the one-batch decode")
    # 4096: the workload's longest request (1,024 + 256) with room; the KV cache's size in
    # tokens does not depend on it, only the concurrency the start line quotes.
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=256, help="the workload's requests all decode at once")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--no-peer", action="store_true", help="duoka only (the 57B: no peer run)")
    ap.add_argument("--peer-batch1", action="store_true", help="also the peer's batch-1 static-cache decode")
    ap.add_argument("--duoka-timeout", type=int, default=300, help="seconds for duoka's part")
    ap.add_argument("--peer-timeout", type=int, default=330, help="seconds for the peer's part")
    ap.add_argument("--part", choices=("duoka",), help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--part-out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.part == "duoka":
        duoka_part(a)
        return

    out = Path(a.out)
    folder = config_folder(a.shape, a.root, max_position_embeddings=PUBLISHED_CONTEXT.get(a.shape, 32768))
    result: dict = {"command": " ".join(sys.argv), "shape": a.shape, "folder": str(folder),
                    "config": json.loads((folder / "config.json").read_text()), "torch": torch.__version__,
                    "bound": active_bytes(folder)}

    def save() -> None:
        out.write_text(json.dumps(result, indent=1) + "\n")

    save()
    part_out = Path(tempfile.gettempdir()) / f"{out.name}.duoka-part.json"
    part_out.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--part", "duoka", "--folder", str(folder), "--part-out", str(part_out),
           "--out", "-"]
    for flag in ("requests", "prompt_min", "prompt_max", "out_len", "batch", "max_model_len", "max_num_seqs",
                 "gpu_memory_utilization"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(a, flag))]
    try:  # its output goes to ours as it comes
        status = subprocess.run(cmd, cwd=ROOT, timeout=a.duoka_timeout).returncode
    except subprocess.TimeoutExpired:
        status = f"timed out after {a.duoka_timeout} s"
    duoka = result["duoka"] = json.loads(part_out.read_text()) if part_out.is_file() else {}
    part_out.unlink(missing_ok=True)
    if status != 0:
        duoka["error"] = f"exit status {status}" if isinstance(status, int) else status
    bound = result["bound"]
    bound["bandwidth_bytes_per_s"] = {"measured_copy": duoka.pop("copy_bytes_per_s", None),
                                      "datasheet": spec_bandwidth(duoka.get("device", ""))}
    for name, bw in bound["bandwidth_bytes_per_s"].items():
        if bw:
            bound[f"tokens_per_s_{name}"] = bw / bound["bytes_per_token"]
            if "batch1_tokens_per_s" in duoka:
                duoka[f"batch1_vs_bound_{name}"] = duoka["batch1_tokens_per_s"] / bound[f"tokens_per_s_{name}"]
    print(json.dumps({k: v for k, v in result.items() if k != "config"}, indent=1), flush=True)
    save()

    if not a.no_peer and a.requests:
        result["peer"] = run_peer(a)
        save()
        cont = next((c for c in result["peer"].get("cases", []) if c.get("case") == "continuous_batching"
                     and "error" not in c), None)
        work = result.get("duoka", {}).get("workload")
        if cont and work:
            result["vs_peer"] = {k: work[k] / cont[k] for k in ("total_tokens_per_s", "output_tokens_per_s")}
        print(json.dumps({"peer": result["peer"], "vs_peer": result.get("vs_peer")}, indent=1), flush=True)
        save()


if __name__ == "__main__":
    main()
