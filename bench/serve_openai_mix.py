"""Issue 38's serving figures in one device call, against the transformers peer in the same call:

1. plain: the peer's workload (256 streamed requests, 128-1,024 random prompt tokens, 256
   output tokens, greedy, ignore_eos) through `duoka serve`;
2. mixed: the same prompts, half with response_format json_schema, a quarter chat requests
   with tools and tool_choice "required" (a grammar-forced call), a quarter plain;
3. adapters: the same prompts, each naming one of 4 random rank-16 LoRA adapters in turn
   (--lora a0=... --lora a3=...), against plain (the base) in the same server;
4. the mask's cost: 64 concurrent json_schema requests against 64 plain ones (the same
   prompts of 512 tokens, 256 output tokens): output tokens per second;
5. the peer (bench/peers/serve_peer.py) on the plain workload, after the server stopped.

Targets: mixed total tok/s >= 10x the peer's plain; adapters >= 80% of plain (both measured
twice, interleaved, after a warm-up with the whole plain workload); the 64 constrained
requests >= 90% of the plain ones' output tok/s.

    PYTHONPATH=$PWD python3 bench/serve_openai_mix.py --shape 7b --out $OUT/openai_mix_7b.json

Device kind nvidia-h100-x1 or nvidia-h200; carry .wheels (fastapi, uvicorn, httpx2, xgrammar,
apache-tvm-ffi, ...: install them with `pip install --no-index --no-deps .wheels/*.whl`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_models import make_folder  # noqa: E402

from duoka.bench import loadgen  # noqa: E402
from duoka.bench.serving import PEER_SCRIPT, StartedServer, run_peer  # noqa: E402
from duoka.data.tokenizer import load_tokenizer  # noqa: E402

ADAPTERS = 4
RANK = 16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Long free-text fields: a random model writes strings for most of its 256 tokens, so the
# constrained requests decode about as long as the plain ones and the mask runs every step.
ANSWER_SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "points": {
    "type": "array", "items": {"type": "string"}}, "done": {"type": "boolean"}},
    "required": ["title", "points", "done"]}
TOOL = {"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
    "required": ["query"]}}}


def make_adapter(folder: Path, base: Path, seed: int, b_scale: float = 0.01) -> Path:
    """A random PEFT LoRA adapter on every projection (B non-zero, so it changes the output)."""
    config = json.loads((base / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = hidden // heads
    shapes = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv * head_dim), "v_proj": (hidden, kv * head_dim),
              "o_proj": (hidden, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name in TARGETS:
            parent = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            d_in, d_out = shapes[name]
            key = f"base_model.model.model.layers.{layer}.{parent}.{name}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(RANK, d_in, generator=g) / d_in**0.5).to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(d_out, RANK, generator=g) * b_scale).to(torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 2 * RANK, "lora_dropout": 0.0,
        "target_modules": list(TARGETS), "base_model_name_or_path": str(base), "bias": "none"}))
    return folder


def workloads(prompts: list[list[int]], tokenizer, out_len: int) -> dict[str, list[loadgen.Request]]:
    texts = [tokenizer.decode(p) for p in prompts]
    plain = [loadgen.Request(p, out_len) for p in prompts]
    mixed = []
    for i, (p, text) in enumerate(zip(prompts, texts)):
        if i % 4 in (0, 1):
            mixed.append(loadgen.Request(p, out_len, fields={"response_format": {
                "type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}}))
        elif i % 4 == 2:
            mixed.append(loadgen.Request(text, out_len, chat=True, fields={"tools": [TOOL], "tool_choice": "required"}))
        else:
            mixed.append(loadgen.Request(p, out_len))
    adapters = [loadgen.Request(p, out_len, model=f"a{i % ADAPTERS}") for i, p in enumerate(prompts)]
    return {"plain": plain, "mixed": mixed, "adapters": adapters}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="7b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--peer-timeout", type=float, default=600)
    args = ap.parse_args()
    t0 = time.time()
    base = make_folder(args.shape)
    folders = [make_adapter(Path(f"/tmp/duoka-models/adapter-{args.shape}-{i}"), base, i) for i in range(ADAPTERS)]
    config = json.loads((base / "config.json").read_text())
    tokenizer = load_tokenizer(base)
    prompts = loadgen.random_prompts(args.requests, 128, 1024, config["vocab_size"], seed=0)
    loads = workloads(prompts, tokenizer, 256)
    short = loadgen.random_prompts(64, 512, 512, config["vocab_size"], seed=1)
    mask64 = {"plain64": [loadgen.Request(p, 256) for p in short],
              "json64": [loadgen.Request(p, 256, fields={"response_format": {
                  "type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}}) for p in short]}
    result = {"shape": args.shape, "command": " ".join(sys.argv), "setup_s": round(time.time() - t0, 1)}
    lora_args = [x for i, f in enumerate(folders) for x in ("--lora", f"a{i}={f}")]
    server = StartedServer(str(base), ["--max-model-len", "4096", *lora_args], 900, print)
    try:
        # Warm-up: the whole plain workload (every prefill and decode shape the compiled blocks
        # meet), then a few of the others; then plain and adapters twice each, interleaved.
        loadgen.run_load(server.url, str(base), loads["plain"])
        loadgen.run_load(server.url, str(base), loads["mixed"][:16] + loads["adapters"][:16])
        order = [("plain", loads["plain"]), ("adapters", loads["adapters"]), ("mixed", loads["mixed"]),
                 ("plain_again", loads["plain"]), ("adapters_again", loads["adapters"]), *mask64.items()]
        for name, requests in order:
            summary = loadgen.run_load(server.url, str(base), requests)
            result[name] = {k: summary[k] for k in ("completed", "failed", "wall_s", "total_tokens_per_s",
                                                   "output_tokens_per_s", "output_tokens", "prompt_tokens")}
            print(name, json.dumps(result[name]), flush=True)
            server.check_alive()
    finally:
        server.stop()
    plain = (result["plain"]["total_tokens_per_s"] + result["plain_again"]["total_tokens_per_s"]) / 2
    adapters = (result["adapters"]["total_tokens_per_s"] + result["adapters_again"]["total_tokens_per_s"]) / 2
    result["adapters_vs_plain"] = adapters / plain
    result["json64_vs_plain64_output"] = (result["json64"]["output_tokens_per_s"]
                                          / result["plain64"]["output_tokens_per_s"])
    if not args.no_peer:
        peer = run_peer(Path(__file__).resolve().parent / "peers" / PEER_SCRIPT, args.shape, args.requests, 128, 1024,
                        256, False, args.peer_timeout)
        result["peer"] = peer
        if peer.get("continuous"):
            result["peer_total_tokens_per_s"] = peer["continuous"]["total_tokens_per_s"]
            result["mixed_vs_peer"] = result["mixed"]["total_tokens_per_s"] / result["peer_total_tokens_per_s"]
            result["plain_vs_peer"] = plain / result["peer_total_tokens_per_s"]
    result["total_s"] = round(time.time() - t0, 1)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}, indent=1))


if __name__ == "__main__":
    main()
