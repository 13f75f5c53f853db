"""duoka's cost model beside published multi-node training runs (docs/plan.md, "Scaling on
paper"): torchtitan's Llama 3.1 runs on 8 to 512 H100s and Megatron-LM's GPT runs on up to
4,608 H100s (and 3,072 A100s in 2021).

Each run is planned with the same model shape (ModelArgs built from the published shape:
the planner counts FLOPs, memory and traffic from shapes, so a Llama or GPT shape plans
as well as a Qwen2 one), the same GPUs, network, batch and, where duoka runs it, the same
layout. Three predictions per run:
- duoka: duoka's own kernels (its measured matmul efficiency and eager tensor-parallel
  overhead), the peer's layout: what duoka would do on that cluster;
- fitted: the matmul efficiency fitted so that the peer's smallest run of a table comes
  out as published, no tensor-parallel overhead (the peers' tp is compiled or fused), then
  the larger runs predicted from it: this tests the communication and pipeline model alone;
- best: duoka's own first layout for those GPUs and batch, with duoka's kernels.

`python -m duoka.plan.published` prints the table docs/plan.md shows.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

from duoka.models.qwen2.args import ModelArgs
from duoka.plan.hardware import Hardware, Kernels
from duoka.plan.memory import GIB, Layout
from duoka.plan.model_choice import ModelChoice
from duoka.plan.ranking import evaluate, make_plan, rank

TORCHTITAN = ("pytorch/torchtitan docs/performance.md (commit eaea6f6; runs of 2024-12, "
              "https://github.com/pytorch/torchtitan/blob/main/docs/performance.md)")
MEGATRON = "NVIDIA/Megatron-LM README.md, 'Training Speed and Scalability' (https://github.com/NVIDIA/Megatron-LM)"
MEGATRON_2021 = ("Narayanan et al. 2021, arXiv:2104.04473 (SC'21), and the Megatron-LM README of 2021: 1T "
                 "parameters at 502 petaFLOP/s on 3,072 A100s, 52% of peak")


def llama3(dim: int, layers: int, heads: int, ffn: int) -> ModelArgs:
    """A Llama 3.1 shape (torchtitan's llama3_configs): GQA with 8 KV heads, SwiGLU, a
    128,256-token vocabulary, untied head. Qwen2 adds q/k/v biases, 0.01% of the weights."""
    return ModelArgs(vocab_size=128256, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=8,
                     intermediate_size=ffn, tie_word_embeddings=False, max_seq_len=131072, rope_theta=500000.0)


def gpt(dim: int, layers: int, heads: int, vocab: int, seq: int) -> ModelArgs:
    """A Megatron GPT shape: multi-head attention and a 4h GELU MLP of two matrices (8h²
    weights), written as a SwiGLU of width 8h/3 (three matrices, the same 8h² weights and
    FLOPs); the output head shares the embedding, as Megatron's GPT does by default."""
    return ModelArgs(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=heads,
                     intermediate_size=round(8 * dim / 3), tie_word_embeddings=True, max_seq_len=seq)


LLAMA31_8B = llama3(4096, 32, 32, 14336)
LLAMA31_70B = llama3(8192, 80, 64, 28672)
LLAMA31_405B = llama3(16384, 126, 128, 53248)
GPT3_175B_V131K = gpt(12288, 96, 96, 131072, 4096)  # "slightly more than 175B parameters due to larger vocabulary"
GPT_1T = gpt(25600, 128, 160, 51200, 2048)

# torchtitan's cluster (Grand Teton): H100 SXM with 96 GB HBM2e at 2.4 TB/s, capped at 500 W
# (its peak lies between SXM and NVL, unknown; torchtitan's MFU uses the SXM figure, as here),
# 8 per host on NVLink, 400 Gb/s per GPU of RDMA network.
GRAND_TETON = Hardware(8, 1, 96e9 / GIB, "nvlink", "H100 (500 W, HBM2e)", 989e12, 2.4e12, network="roce-400")
# Megatron-LM's H100 runs: DGX H100 (80 GB, 3.35 TB/s), 8 x 400 Gb/s InfiniBand per node.
DGX_H100 = Hardware(8, 1, 80, "nvlink", "H100", 989e12, 3.35e12, network="ib-ndr")
# Selene (2021): DGX A100 80 GB, 8 x 200 Gb/s HDR InfiniBand per node; 312 TFLOP/s bf16.
SELENE = Hardware(8, 1, 80, "nvlink", "A100", 312e12, 2.0e12, network="ib-hdr")
# What the peers' code costs beyond its matmuls: no eager tensor-parallel overhead (torchtitan
# compiles its tp, with async tp in the large runs; Megatron's is fused and overlapped);
# torchtitan runs FSDP2 as duoka does (its per-unit host cost stays), Megatron has no
# per-module hooks and splits pipeline stages by layers alone (torchtitan, like duoka, counts
# the embedding and the head as a layer each). The matmul efficiency is fitted per table
# (`fit_efficiency`).
PEER_KERNELS = {"torchtitan": Kernels(tp_block_overhead_s=0.0),
                "megatron": Kernels(tp_block_overhead_s=0.0, fsdp_unit_s=0.0, pp_split="layers")}


@dataclass(frozen=True)
class Run:
    """One published run and what it measured."""

    table: str  # runs of one table share a fitted matmul efficiency (its first run is the anchor)
    label: str
    source: str
    args: ModelArgs
    hardware: Hardware  # one node of it; gpus set below
    gpus: int
    seq_len: int
    global_batch: int
    layout: Layout  # theirs, as duoka names it
    theirs: str  # their layout and switches, in their words
    tokens_per_s_per_gpu: float | None = None
    mfu: float | None = None  # as published (Megatron 2021: hardware FLOPs, recompute included)
    micro_batch: int | None = None  # theirs, where known; else duoka picks
    peer: str = "torchtitan"

    def hw(self, kernels: Kernels | None = None) -> Hardware:
        node = self.hardware
        return replace(node, gpus=self.gpus, nodes=self.gpus // node.gpus_per_node,
                       kernels=kernels or node.kernels)

    def peer_kernels(self, gemm_efficiency: float) -> Kernels:
        return replace(PEER_KERNELS[self.peer], gemm_efficiency=gemm_efficiency)

    def published_tokens(self) -> float:
        """Tokens/s per GPU, from the MFU where only that is published."""
        if self.tokens_per_s_per_gpu is not None:
            return self.tokens_per_s_per_gpu
        return self.mfu * self.hardware.peak_flops / megatron_flops_per_token(self.args, self.seq_len, self.table)


def megatron_flops_per_token(args: ModelArgs, seq: int, table: str) -> float:
    """FLOPs per token behind a published Megatron utilisation. 2021 (Narayanan et al., eq. 3):
    96·l·h²·(1 + s/6h + V/16lh) per token, full recomputation counted (4 passes, not 3) and
    the logit layer once; the README's H100 MFU (2023-): the model's FLOPs without recompute,
    which PaLM's 6N + 12·L·H·S (duoka's convention) is."""
    if table == "megatron-2021":
        h, l, v = args.dim, args.n_layers, args.vocab_size
        return 96 * l * h * h * (1 + seq / (6 * h) + v / (16 * l * h))
    return args.flops_per_token(seq)


TT_PP = ("torchtitan's default of as many micro-batches as pipeline ranks (8 of 4 sequences) assumed: it "
         "gives the published 1.28x of interleaved over 1F1B")
RUNS = (
    Run("torchtitan-8b", "Llama 3.1 8B, 8 GPUs", TORCHTITAN + ", Table 1", LLAMA31_8B, GRAND_TETON, 8, 8192, 16,
        Layout("fsdp", 1, 8), "FSDP 8, local batch 2, selective AC, bf16, eager", 5762, micro_batch=2),
    Run("torchtitan-8b", "Llama 3.1 8B, 128 GPUs", TORCHTITAN + ", Table 3", LLAMA31_8B, GRAND_TETON, 128, 8192,
        256, Layout("fsdp", 1, 128), "FSDP 128, as above", 5605, micro_batch=2),
    Run("torchtitan-fp8", "Llama 3.1 8B, 8 GPUs", TORCHTITAN + ", Table 1", LLAMA31_8B, GRAND_TETON, 8, 8192, 16,
        Layout("fsdp", 1, 8), "FSDP 8, local batch 2, selective AC, compile + float8", 8532, micro_batch=2),
    Run("torchtitan-fp8", "Llama 3.1 8B, 128 GPUs", TORCHTITAN + ", Table 3", LLAMA31_8B, GRAND_TETON, 128, 8192,
        256, Layout("fsdp", 1, 128), "FSDP 128, as above", 8380, micro_batch=2),
    Run("torchtitan-fp8", "Llama 3.1 70B, 256 GPUs", TORCHTITAN + ", Table 4", LLAMA31_70B, GRAND_TETON, 256, 8192,
        512, Layout("fsdp", 1, 32, tp=8), "FSDP 32 + TP 8, local batch 16, full AC, compile + float8", 829,
        micro_batch=16),
    Run("torchtitan-fp8", "Llama 3.1 405B, 512 GPUs", TORCHTITAN + ", Table 5", LLAMA31_405B, GRAND_TETON, 512, 8192,
        256, Layout("fsdp", 1, 8, tp=8, pp=8), "FSDP 8 + TP 8 + PP 8 1F1B, local batch 32, full AC, compile + "
        "float8 + async TP", 100, micro_batch=4),
    Run("torchtitan-fp8", "Llama 3.1 405B, 512 GPUs", TORCHTITAN + ", Table 5", LLAMA31_405B, GRAND_TETON, 512, 8192,
        256, Layout("fsdp", 1, 8, tp=8, pp=8, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2),
        "as above, PP 8 interleaved 1F1B", 128, micro_batch=4),
    Run("megatron-h100", "GPT-3 175B, 96 GPUs", MEGATRON + ", strong scaling", GPT3_175B_V131K, DGX_H100, 96, 4096,
        1152, Layout("fsdp", 1, 3, tp=4, pp=8, pp_schedule="interleaved_1f1b", pp_stages_per_rank=12),
        "global batch 1,152 (layout only in the README's figure: TP 4 x PP 8 interleaved x12, micro-batch 1, "
        "distributed optimizer assumed)", mfu=0.47, micro_batch=1, peer="megatron"),
    Run("megatron-h100", "GPT-3 175B, 4,608 GPUs", MEGATRON + ", strong scaling", GPT3_175B_V131K, DGX_H100, 4608,
        4096, 1152, Layout("fsdp", 1, 144, tp=4, pp=8, pp_schedule="interleaved_1f1b", pp_stages_per_rank=12),
        "as above, DP 144: 8 micro-batches per pipeline", mfu=0.42, micro_batch=1, peer="megatron"),
    Run("megatron-2021", "GPT 1T, 3,072 A100s", MEGATRON_2021, GPT_1T, SELENE, 3072, 2048, 3072,
        Layout("ddp", 6, 1, tp=8, pp=64), "TP 8 x PP 64 x DP 6, full recompute, batch 3,072 (1F1B, micro-batch 1 "
        "assumed)", mfu=0.52, micro_batch=1, peer="megatron"),
)


@dataclass
class Prediction:
    run: Run
    published: float  # tokens/s per GPU
    duoka: float  # duoka's kernels, their layout
    fitted: float | None  # the table's fitted matmul efficiency and the peer's kernels, their layout
    best: float | None  # duoka's own plan
    best_layout: str
    efficiency: float | None  # the fitted matmul efficiency of the run's table; None: unreachable
    note: str = ""  # e.g. their layout does not fit duoka's memory estimate


def layout_speed(run: Run, hw: Hardware) -> tuple[float, str]:
    """Tokens/s per GPU of the run's layout at its micro-batch (duoka's choice where the run
    does not say) with the fastest checkpointing that fits, and a note; where no variant
    fits duoka's memory estimate, the fastest variant's speed and the memory it needs."""
    cands = [c for c in evaluate(run.args, hw, run.seq_len, run.global_batch, [run.layout])
             if run.micro_batch is None or c.micro_batch == run.micro_batch]
    if not cands:
        raise ValueError(f"{run.label}: the batch does not split into micro-batches of {run.micro_batch}")
    fitting = rank(cands)
    if fitting:
        return fitting[0].time.tokens_per_s_per_gpu, ""
    fastest = min(cands, key=lambda c: c.time.total_s)
    return fastest.time.tokens_per_s_per_gpu, (f"needs {fastest.memory.reserved / GIB:.0f} GiB in duoka's estimate, "
                                                f"over {hw.usable_bytes / GIB:.0f} usable")


def fit_efficiency(run: Run, target: float) -> float | None:
    """The matmul efficiency (fraction of peak on large matmuls) at which the run's layout,
    with the peer's kernels, reaches `target` tokens/s per GPU (bisection); None when even
    the peak does not."""
    if layout_speed(run, run.hw(run.peer_kernels(1.0)))[0] < target:
        return None
    lo, hi = 0.01, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        speed, _ = layout_speed(run, run.hw(run.peer_kernels(mid)))
        lo, hi = (mid, hi) if speed < target else (lo, mid)
    return (lo + hi) / 2


def predict(runs=RUNS, best: bool = True) -> list[Prediction]:
    out, fitted = [], {}
    for run in runs:
        if run.table not in fitted:
            fitted[run.table] = fit_efficiency(run, run.published_tokens())
        eff = fitted[run.table]
        mine, note = layout_speed(run, run.hw())
        fit = layout_speed(run, run.hw(run.peer_kernels(eff)))[0] if eff is not None else None
        own, own_layout = None, ""
        if best:
            plan = make_plan(ModelChoice(run.label, run.args, {}), run.hw(), run.seq_len, run.global_batch)
            own, own_layout = plan.best.time.tokens_per_s_per_gpu, plan.best.describe()
        out.append(Prediction(run, run.published_tokens(), mine, fit, own, own_layout, eff, note))
    return out


def markdown(predictions: list[Prediction]) -> str:
    lines = ["| run | theirs | published tok/s/GPU | duoka, their layout | fitted | duoka's own plan |",
             "|---|---|---:|---:|---:|---|"]

    def num(x):
        return f"{x:,.0f}" if x is not None else "-"

    anchors = {}
    for p in predictions:
        anchors.setdefault(p.run.table, p.run)
    for p in predictions:
        r = p.run
        pub = num(p.published) + (f" ({r.mfu:.0%} {'HFU' if r.table == 'megatron-2021' else 'MFU'})"
                                  if r.mfu is not None else "")
        mine = num(p.duoka) + (f" ({p.note})" if p.note else "")
        if p.efficiency is None:
            fit = "unreachable"
        elif anchors[r.table] is r:
            fit = f"{num(p.fitted)} (anchor, efficiency {p.efficiency:.2f})"
        else:
            fit = f"{num(p.fitted)} ({p.fitted / p.published - 1:+.0%})"
        lines.append(f"| {r.label} | {r.theirs} | {pub} | {mine} | {fit} | {num(p.best)}: {p.best_layout} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(markdown(predict()) + "\n")
