"""The training peer: Hugging Face transformers' Qwen2ForCausalLM (Qwen2MoeForCausalLM for the
MoE shapes) trained with plain PyTorch DDP or FSDP2 on random tokens, as a user of today's
standard stack would. `duoka bench --vs-peer` runs it (its default --peer), and so do
bench/speed_sweep.py's `peer` cases, bench/train_vs_peer.py and bench/moe_vs_peer.py. Run it
under torchrun, one process per GPU:

    torchrun --nproc-per-node=1 bench/peers/train_peer.py --model 0.5b --mode ddp --mbs 8 --compile
    torchrun --nproc-per-node=2 bench/peers/train_peer.py --model 7b --mode fsdp2 --mbs 4 --compile
    torchrun --nproc-per-node=1 bench/peers/train_peer.py --model moe-a2.7b --mode fsdp2 --mbs 4 --optimizer sgd
    torchrun --nproc-per-node=1 bench/peers/train_peer.py --model tiny --seq 64 --mbs 2 --steps 2 --warmup 1  # CPU
    torchrun --nproc-per-node=1 bench/peers/train_peer.py --model moe-tiny --mode fsdp2 --seq 64 --mbs 2 \
        --steps 2 --warmup 1 --optimizer sgd  # CPU

Workload: the shape's Qwen2 (bench/peers/qwen2_shapes.py) built on the device from seed 0,
SDPA attention; each rank draws its own random tokens (generator seeded with its rank),
`--mbs` x `--seq` a step, the tokens their own labels. DDP keeps fp32 weights under bf16
autocast; FSDP2 shards every decoder layer and the root with bf16 parameters and fp32
gradient reduction. Fused AdamW (lr 1e-4) on CUDA, no gradient clipping, no accumulation:
the global batch is --mbs x processes. `--compile` compiles each decoder layer
(`layer.compile()`), `--liger` applies Liger kernels (pip install liger-kernel; fused
cross-entropy, RMSNorm, RoPE, SwiGLU), `--ac` turns on transformers' gradient checkpointing.
`--warmup` untimed steps, then `--steps` timed ones between two synchronisations.
`--optimizer sgd`: plain SGD (no momentum, no weight decay, foreach) instead of AdamW, for a
model whose AdamW state does not fit (Qwen1.5-MoE-A2.7B on one GPU: bench/moe_vs_peer.py).
`--layers N`: the shape with N decoder layers instead of its published count.

MoE shapes (`moe-*`): transformers' Qwen2MoeForCausalLM with output_router_logits on and
router_aux_loss_coef 0.001 (qwen2_shapes.MOE_TRAINING, as duoka's MoE flavors train from
scratch), so its loss adds the router's load-balancing term; its experts run through
transformers' default experts implementation (grouped_mm since transformers 5; `--experts`
picks another) in the weights' dtype, which is why they train under `--mode fsdp2` (bf16
parameters; DDP keeps fp32 ones). The FLOPs count the active weights (the top-k routed
experts, the shared expert, the router), duoka's convention.

Prints one line on rank 0: `RESULT {json}` with tok_s_gpu (tokens per second per GPU: mbs x
seq / mean step time), tflops_gpu and mfu_pct (flops_per_token: PaLM's convention, over
--peak, 989e12 for H100/H200 SXM bf16), peak_mem_gib (torch.cuda.max_memory_allocated over
the timed steps), step_s, the last loss (and for a MoE its aux_loss and the experts
implementation that ran) and the versions. duoka/bench/training.py's run_peer
reads tok_s_gpu, mfu_pct, peak_mem_gib and step_s.

The figures it reproduces (the recorded peer, 2 x H200 over NVLink, torch 2.11,
transformers 5.17, seq 2048, bf16, per GPU; the table's date was not recorded; its bold rows
are the tuned peer duoka is compared with):

| model | peer configuration | micro-batch | tok/s/GPU | MFU | peak GiB |
|---|---|---|---|---|---|
| Qwen2-0.5B | DDP, 1 GPU | 8 | 76,753 | 27.1% | 60.6 |
| Qwen2-0.5B | DDP | 8 | 74,219 | 26.2% | 60.6 |
| Qwen2-0.5B | FSDP2 | 8 | 62,707 | 22.1% | 52.1 |
| Qwen2-0.5B | DDP + Liger | 8 | 67,733 | 23.9% | 27.5 |
| **Qwen2-0.5B** | **DDP + compile** | 8 | **96,075** | **33.9%** | 52.5 |
| Qwen2-1.5B | DDP | 4 | 31,209 | 32.6% | 65.4 |
| Qwen2-1.5B | FSDP2 | 4 | 26,653 | 27.8% | 45.3 |
| Qwen2-1.5B | DDP + Liger | 4 | 29,506 | 30.8% | 46.4 |
| Qwen2-1.5B | DDP + compile | 4 | 38,532 | 40.2% | 61.5 |
| **Qwen2-1.5B** | **FSDP2 + compile** | 8 | **45,447** | **47.4%** | 68.5 |
| Qwen2-7B | FSDP2 + full AC | 2 | 6,951 | 31.5% | 62.0 |
| Qwen2-7B | FSDP2 + full AC + Liger | 2 | 7,517 | 34.1% | 62.0 |
| Qwen2-7B | FSDP2 | 4 | 9,417 | 42.7% | 107.5 |
| Qwen2-7B | FSDP2 + Liger | 4 | 10,929 | 49.6% | 81.2 |
| **Qwen2-7B** | **FSDP2 + compile** | 4 | **11,060** | **50.2%** | 93.3 |
| Qwen2-7B, seq 4096 | FSDP2 + Liger | 2 | 10,583 | 50.7% | 81.2 |

Liger combined with --compile failed to compile on that stack. On one H200 (torch 2.11,
transformers 5.17, 2026-12-01, in the same call as duoka; bench/results/refactor_speed/):
Qwen2-0.5B DDP + compile, micro-batch 8: 105,184-106,708 tok/s, 52.5 GiB; Qwen2-1.5B DDP +
compile, micro-batch 8: 45,143-45,214 tok/s, 97.0 GiB (47,085 on another H200 the same day,
bench/results/speed.md "Session 9"). The peer's own speed varies between calls more than
duoka's (Qwen2-0.5B, FSDP2 + compile, 2 x H200: 86,222 to 99,875 tok/s/GPU over session 7
and 8's calls), so compare it only with a run in the same call. docs/performance.md's tables
were measured against this peer in the same calls (its earlier copy outside the repository: the
same workload, flags and output).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from qwen2_shapes import CONFIGS, MOE_TRAINING, flops_per_token, hf_model, is_moe, shape


def main() -> None:
    p = argparse.ArgumentParser(description="transformers Qwen2 under DDP or FSDP2 on random tokens (torchrun)")
    p.add_argument("--model", default="0.5b", choices=sorted(CONFIGS))
    p.add_argument("--mode", default="ddp", choices=("ddp", "fsdp2"))
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--mbs", type=int, default=4, help="micro-batch per process")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps first")
    p.add_argument("--ac", action="store_true", help="gradient checkpointing of every decoder layer")
    p.add_argument("--peak", type=float, default=989e12, help="bf16 dense peak FLOP/s per GPU, for MFU")
    p.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    p.add_argument("--liger", action="store_true", help="Liger kernels (fused CE, RMSNorm, RoPE, SwiGLU)")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"),
                   help="adamw (fused on CUDA), or plain SGD: no momentum or weight decay, no state")
    p.add_argument("--layers", type=int, default=0, help="decoder layers (0: the shape's published count)")
    p.add_argument("--experts", default=None, choices=("eager", "grouped_mm", "batched_mm"),
                   help="MoE: transformers' experts implementation (default: transformers' own default)")
    a = p.parse_args()
    if a.liger and is_moe(CONFIGS[a.model]):
        p.error("--liger patches transformers' Qwen2 classes, not Qwen2-MoE's")

    import transformers

    if a.liger:
        from liger_kernel.transformers import apply_liger_kernel_to_qwen2

        apply_liger_kernel_to_qwen2()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    c = shape(a.model, a.layers)
    moe = is_moe(c)
    extra = dict(MOE_TRAINING, experts_implementation=a.experts) if moe else {}
    torch.manual_seed(0)
    with torch.device(dev):
        model = hf_model(c, attn_implementation="sdpa", use_cache=False, **extra)  # fp32 weights
    experts = model.config._experts_implementation if moe else None
    if a.ac:
        model.gradient_checkpointing_enable()
    if a.compile:
        for layer in model.model.layers:
            layer.compile()
    amp = torch.autocast("cuda" if cuda else "cpu", dtype=torch.bfloat16)
    if a.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[dev.index] if cuda else None)
    else:  # fsdp2: bf16 parameters, fp32 reduction; autocast off (the policy casts)
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        amp = torch.autocast("cuda" if cuda else "cpu", enabled=False)
    if a.optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    else:  # in place, no state and no transient copy (a weight decay would copy every gradient)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.0, foreach=True)
    g = torch.Generator(device=dev).manual_seed(rank)

    def step():
        x = torch.randint(0, c["vocab_size"], (a.mbs, a.seq), device=dev, generator=g)
        with amp:
            out = model(input_ids=x, labels=x)  # a MoE's loss includes coef x out.aux_loss
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss.detach(), out.aux_loss.detach() if moe else None

    for _ in range(a.warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        loss, aux = step()
    if cuda:
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / a.steps
    tps = a.mbs * a.seq / dt
    fpt = flops_per_token(c, a.seq)
    mem = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0
    if rank == 0:
        moe_fields = dict(experts=experts, aux_loss=round(aux.item(), 4)) if moe else {}
        print("RESULT " + json.dumps(dict(
            peer="hf-transformers", model=a.model, mode=a.mode, ac=a.ac, compile=a.compile, liger=a.liger,
            optimizer=a.optimizer, layers=c["num_hidden_layers"], world=world, seq=a.seq, mbs=a.mbs,
            step_s=round(dt, 4), tok_s_gpu=round(tps), flops_per_token=fpt,
            tflops_gpu=round(fpt * tps / 1e12, 1), mfu_pct=round(100 * fpt * tps / a.peak, 1),
            peak_mem_gib=round(mem, 1), loss=round(loss.item(), 3), **moe_fields, torch=torch.__version__,
            transformers=transformers.__version__)), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
