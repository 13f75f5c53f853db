"""The flags of `duoka plan` (cli.py makes the command and runs it). This module imports no
torch: `duoka --help` builds its parsers from it (duoka.config's OptimizerConfig, not
duoka.plan.optimizer_costs, for the optimizer choices; duoka.plan.network is torch-free)."""

from __future__ import annotations

import argparse
from dataclasses import fields

from duoka.config import OptimizerConfig
from duoka.plan.network import DEFAULT_NETWORK, NETWORKS

# What `duoka plan --help` shows under "examples:".
PLAN_EXAMPLES = (
    "duoka plan --model Qwen/Qwen2.5-7B --out 7b.toml   # this machine's GPUs",
    "duoka plan --model qwen2-72b --gpus 64 --nodes 8 --gpu-memory 80",
    "duoka plan --model qwen2-7b --gpus 1024 --scaling",
)


def add_plan_flags(p: argparse.ArgumentParser) -> None:
    choices = {f.name: f.metadata["choices"] for f in fields(OptimizerConfig)}
    p.add_argument("--model", required=True, help="flavor (qwen2-7b, or 7b for short) or a Hugging Face folder / hub id")
    p.add_argument("--gpus", type=int, default=None, help="GPUs of the whole job, all nodes together "
                   "(default: this node's visible GPUs x --nodes)")
    p.add_argument("--nodes", type=int, default=None, help="nodes the GPUs are spread over (default 1; with "
                   "--scaling, nodes of 8)")
    p.add_argument("--gpu-memory", type=float, default=None, metavar="GiB",
                   help="memory of one GPU in GiB (default: read from this machine's GPUs)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048, or the model's "
                   "context when shorter)")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per optimizer step (default 8 per GPU)")
    p.add_argument("--micro-batch", type=int, default=None, help="plan only with this micro-batch (default: every "
                   "power of two dividing the per-GPU batch)")
    p.add_argument("--activation-checkpointing", choices=("none", "full"), default=None,
                   help="plan only with (full) or without (none) checkpointing (default: both)")
    choices = {f.name: f.metadata["choices"] for f in fields(OptimizerConfig)}
    p.add_argument("--optimizer", choices=choices["name"], default=None,
                   help="optimizer.name to plan with (default adamw; when AdamW fits nowhere, the plan proposes one "
                        "that fits)")
    p.add_argument("--offload", choices=choices["offload"], default=None,
                   help="optimizer.offload: cpu puts AdamW's state and step on the host (one GPU; default none)")
    p.add_argument("--sgd-momentum", type=float, default=None,
                   help="optimizer.sgd_momentum with --optimizer sgd (0: no momentum buffer; default 0.9)")
    p.add_argument("--host-memory", type=float, default=None, metavar="GiB",
                   help="host RAM per GPU, the limit of an offloaded optimizer (default: this machine's RAM per GPU "
                        "when its GPUs are planned for, else unchecked)")
    p.add_argument("--interconnect", choices=("nvlink", "pcie", "ib"), default=None,
                   help="link between the GPUs of one node (default: detected, else nvlink); ib: none but the NIC")
    p.add_argument("--network", choices=tuple(NETWORKS), default=None,
                   help=f"the network between nodes (default {DEFAULT_NETWORK}): ib-ndr/ib-hdr/roce-400/roce-200 a "
                        "NIC of 400/200 Gb/s per GPU with RDMA; eth-400/200/100 one NIC per node, TCP")
    p.add_argument("--intra-bw", type=float, default=None, metavar="GB/s",
                   help="bus bandwidth per GPU inside a node, as nccl-tests reports it (default: 350 nvlink, 25 pcie)")
    p.add_argument("--inter-bw", type=float, default=None, metavar="Gb/s",
                   help="NIC line rate per GPU across nodes (default: the --network's; e.g. one 100 Gb/s NIC shared "
                        "by 8 GPUs is 12.5)")
    p.add_argument("--inter-latency-us", type=float, default=None, metavar="us",
                   help="one ring step across nodes (default 9.6, NCCL's figure for RDMA networks)")
    p.add_argument("--scaling", nargs="?", const="weak", default=None, choices=("weak", "strong"),
                   help="a table from one node to --gpus (default 1024): step time, tokens/s per GPU, efficiency "
                        "and the largest overhead per size; weak (default): batch per GPU fixed, strong: global "
                        "batch fixed")
    p.add_argument("--family", choices=("ddp", "fsdp", "hsdp", "tp", "pp"), default=None,
                   help="with --scaling: only layouts of this family at every size (default: the plan's first)")
    p.add_argument("--top", type=int, default=10, help="layouts to show (default 10)")
    p.add_argument("--json", action="store_true", help="print the whole plan as JSON instead of tables")
    p.add_argument("--out", default=None, help="write the recommended config to this TOML file")
