"""Does the CUDA-graph decode path run each request's adapter? One multi-LoRA engine with
CUDA graphs and compiled blocks against the same adapters with --enforce-eager (no graphs,
no compile) and against the base model: greedy tokens of strong random adapters (bf16), how
many leading tokens agree. Graphs that ignored the adapter index would agree with the base.

    PYTHONPATH=$PWD python3 bench/serve_lora_graphs.py --out $OUT/lora_graphs_0.5b.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_lora_check import run, strong_adapters  # noqa: E402
from serve_models import make_folder  # noqa: E402

from duoka.bench import loadgen  # noqa: E402
from duoka.serve.engine import LLM  # noqa: E402


def leading(a: list[int], b: list[int]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="0.5b")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    base = make_folder(args.shape)
    folders = strong_adapters(base, args.shape, 2)
    loras = tuple((f"a{i}", str(f)) for i, f in enumerate(folders))
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    prompts = loadgen.random_prompts(8, 16, 64, vocab, seed=5)
    requests = [(f"r{i}", p, f"a{i % 2}") for i, p in enumerate(prompts)]
    options = dict(max_model_len=512, gpu_memory_utilization=0.3, max_num_seqs=8)
    graphs = run(LLM(str(base), loras=loras, **options), requests)
    eager = run(LLM(str(base), loras=loras, cuda_graphs=False, compile=False, **options), requests)
    plain = run(LLM(str(base), **options), [(rid, p, None) for rid, p, _ in requests])
    rows = [{"id": rid, "graphs_vs_eager": leading(graphs[rid][0], eager[rid][0]),
             "graphs_vs_base": leading(graphs[rid][0], plain[rid][0])} for rid, _, _ in requests]
    result = {"shape": args.shape, "rows": rows,
              "mean_graphs_vs_eager": sum(r["graphs_vs_eager"] for r in rows) / len(rows),
              "mean_graphs_vs_base": sum(r["graphs_vs_base"] for r in rows) / len(rows)}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
