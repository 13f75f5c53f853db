"""The flags of `duoka bench` and `duoka bench serve` (cli.py makes the commands and runs
them). This module imports no torch: `duoka --help` builds its parsers from it."""

from __future__ import annotations

import argparse

# What `duoka bench --help` and `duoka bench serve --help` show under "examples:".
BENCH_EXAMPLES = (
    "duoka bench --model qwen2-1.5b --layout fsdp+compile --micro-batch 8 --vs-peer",
    "duoka bench --model debug --seq 128 --micro-batch 4 --steps 5   # on CPU",
)
BENCH_SERVE_EXAMPLES = (
    "duoka bench serve --requests 16 --prompt-max 256 --out-len 32   # tiny model",
    "duoka bench serve --url http://127.0.0.1:8000 --concurrency 64",
    "duoka bench serve --model /models/Qwen2-7B --batch1 --vs-peer --out",
)


def add_bench_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen2-0.5b", help="flavor: qwen2-0.5b, qwen2-1.5b, qwen2-7b, ... (debug: the "
                                                         "small model of `duoka train`)")
    p.add_argument("--layout", default="ddp", help="parts joined by +: ddp | fsdp | hsdpR | tpN | ppN | ac | compile "
                                                   "| fused | reduce-every | noreshard")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per forward/backward on one GPU")
    p.add_argument("--steps", type=int, default=10, help="timed steps, after the warm-up")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, allocator warm-up)")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per optimizer step "
                   "(default: micro-batch x data-parallel ranks)")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="processes (default: one per visible GPU, or 1 on CPU)")
    p.add_argument("--vs-peer", action="store_true", help="also run the transformers peer in this call")
    p.add_argument("--peer", default=None,
                   help="peer script (default: bench/peers/train_peer.py of the repository duoka runs from; an "
                        "installed duoka has none, so give that script's path here)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="extra duoka train setting, e.g. --set parallel.reshard_after_forward=false (repeatable)")
    p.add_argument("--profile", action="store_true",
                   help="profile the last warm-up step; the top kernels by device time go into the JSON")
    p.add_argument("--timeout", type=int, default=1200, help="seconds each run (duoka's, the peer's) may take")
    p.add_argument("--out", default=None, help="write the JSON result here (default: print it on stdout)")


def add_bench_serve_flags(p: argparse.ArgumentParser, api_key_env: str) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("--model", default=None,
                       help="start `duoka serve MODEL` (folder or hub id; default: the bundled tiny model)")
    where.add_argument("--url", default=None, help="benchmark the server running at this base URL instead")
    p.add_argument("--model-name", default=None, help="the model name to send (default: the server's first model)")
    p.add_argument("--api-key", default=None, help=f"bearer key for the server (default: ${api_key_env})")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARGS",
                   help='extra flags for the duoka serve started here, e.g. --serve-arg "--device cpu" or '
                        "--serve-arg=--enforce-eager (repeatable)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests to send (default 256, or every line of --prompts)")
    p.add_argument("--prompt-min", type=int, default=128, help="shortest random prompt in tokens (default 128)")
    p.add_argument("--prompt-max", type=int, default=1024, help="longest random prompt in tokens (default 1024)")
    p.add_argument("--out-len", type=int, default=256, help="output tokens per request (default 256)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrivals (default 0, the peer's)")
    p.add_argument("--vocab", type=int, default=None,
                   help="draw prompt ids from [1, VOCAB) (default: the vocab_size the server's /v1/models reports, "
                        "else the model folder's config.json)")
    p.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                   help='send these prompts instead: one {"prompt": text or token ids} per line')
    p.add_argument("--concurrency", type=int, default=None, help="at most N requests in flight (default: all)")
    p.add_argument("--request-rate", type=float, default=None,
                   help="Poisson arrivals at R requests/s (seeded) instead of all at once")
    p.add_argument("--duration", type=float, default=None,
                   help="with --request-rate: send what arrives in this many seconds")
    p.add_argument("--warmup", type=int, default=1, help="untimed requests first (default 1)")
    p.add_argument("--batch1", action="store_true",
                   help="also one streamed request alone (128-token prompt): decode tokens/s, from the "
                        "difference of --out-len tokens and a quarter of them (prefill cancels out)")
    p.add_argument("--vs-peer", action="store_true",
                   help="also run the transformers peer on the same prompts, once the server is stopped")
    p.add_argument("--peer", default=None,
                   help="peer script (default: bench/peers/serve_peer.py of the repository duoka runs from; an "
                        "installed duoka has none, so give that script's path here)")
    p.add_argument("--peer-model", default=None, help="the peer's shape: 0.5b, 1.5b or 7b (default: from the model)")
    p.add_argument("--peer-timeout", type=float, default=1800.0, help="seconds for the peer run (default 1800)")
    p.add_argument("--start-timeout", type=float, default=900.0,
                   help="seconds the started server may take to be ready (default 900)")
    p.add_argument("--out", nargs="?", const="", default=None, metavar="FILE",
                   help="write the JSON result to FILE (no FILE: bench/results/serve/<model>-<load>-<time>.json); "
                        "default: stdout")
