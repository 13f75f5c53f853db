"""The LoRA peer: Hugging Face transformers' Qwen2ForCausalLM with a peft LoRA adapter on every
linear layer, one GPU, random tokens, bf16 base weights, AdamW on the adapters only.
bench/lora_vs_peer.py runs it (its default --peer) beside `duoka train --lora.rank=16`:

    python bench/peers/lora_peer.py --model 7b --rank 16 --mbs 4 --seq 2048 --compile
    python bench/peers/lora_peer.py --model 1.5b --mbs 8 --compile
    python bench/peers/lora_peer.py --model tiny --mbs 2 --seq 64 --steps 2 --warmup 1   # CPU (fp32)

Workload: the shape's Qwen2 (bench/peers/qwen2_shapes.py) built on the device from seed 0 and
cast to bf16 (fp32 on a CPU), SDPA attention; peft's LoraConfig(r=--rank, lora_alpha=2 x rank,
lora_dropout=0, target_modules="all-linear": the seven linear layers of every block, the head
frozen); fused AdamW (lr 1e-4) on the adapters. One batch of random tokens (--mbs x --seq,
its own labels) is drawn once and used for every step. `--compile` compiles each decoder layer
(`layer.compile()`, the peer's best configuration), `--ac` turns on gradient checkpointing
(with the input gradients peft's frozen embedding needs). Each step is timed between two
synchronisations; the figure is the median of the --steps timed ones after --warmup.

Prints one JSON line: tokens_per_s (mbs x seq / the median step), mfu (over --peak; FLOPs per
token 4 x the frozen 2-D weights, the embedding table included, + 6 x the adapters + 12 x
layers x hidden x seq: a frozen weight costs its forward and its input's gradient, not its
own gradient), trainable_params, peak_mem_gib (torch.cuda.max_memory_allocated, whole run)
and the versions. bench/lora_vs_peer.py reads tokens_per_s, mfu, peak_mem_gib and
trainable_params.

The figures it reproduces (the recorded LoRA peer: one H200, 2026-12-01, torch 2.11,
transformers 5.17, peft 0.21, seq 2048, rank 16; bold: the peer's best configurations):

| model | peer configuration | micro-batch | tok/s | peak GiB |
|---|---|---|---|---|
| Qwen2-7B | eager | 4 | 9,968 | 97.3 |
| **Qwen2-7B** | **each layer compiled** | 4 | **13,955** | 77.0 |
| Qwen2-7B | compiled + gradient checkpointing | 8 | 10,089 | 45.9 |
| **Qwen2-1.5B** | **each layer compiled** | 8 | **41,470** | 75.4 |

In the same calls as duoka (docs/performance.md "LoRA and QLoRA", bench/results/lora/), each
layer compiled: Qwen2-7B micro-batch 4 13,335 and 13,694 tok/s (77.0 GiB), Qwen2-1.5B
micro-batch 8 40,379 (75.4 GiB), Qwen2-0.5B micro-batch 8 83,302 (50.1 GiB).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from qwen2_shapes import COMMON, CONFIGS, is_moe


def main() -> None:
    p = argparse.ArgumentParser(description="transformers + peft LoRA on random tokens, one GPU")
    # Dense shapes only: duoka refuses LoRA for MoE models, so there is nothing to compare.
    p.add_argument("--model", default="7b", choices=sorted(k for k, c in CONFIGS.items() if not is_moe(c)))
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=8, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    p.add_argument("--ac", action="store_true", help="gradient checkpointing")
    p.add_argument("--peak", type=float, default=989e12, help="bf16 dense peak FLOP/s, for MFU")
    a = p.parse_args()

    import peft
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    c = CONFIGS[a.model]
    cfg = Qwen2Config(**c, **COMMON, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    with dev:
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16 if cuda else torch.float32)
    if a.ac:
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
    lora = LoraConfig(r=a.rank, lora_alpha=2 * a.rank, lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    if a.compile:
        for layer in model.base_model.model.model.layers:
            layer.compile()
    trainable = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4, fused=cuda)
    n_base = sum(q.numel() for q in model.parameters() if not q.requires_grad and q.dim() == 2)
    n_lora = sum(q.numel() for q in trainable)
    L, h = c["num_hidden_layers"], c["hidden_size"]
    flops_tok = 4 * n_base + 6 * n_lora + 12 * L * h * a.seq  # frozen base: forward + input gradients only
    ids = torch.randint(0, c["vocab_size"], (a.mbs, a.seq), device=dev)
    times = []
    for i in range(a.warmup + a.steps):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if i >= a.warmup:
            times.append(time.perf_counter() - t)
    step = sorted(times)[len(times) // 2]
    tps = a.mbs * a.seq / step
    print(json.dumps(dict(peer="transformers+peft", model=a.model, rank=a.rank, mbs=a.mbs, seq=a.seq,
                          compile=a.compile, ac=a.ac, tokens_per_s=tps, mfu=tps * flops_tok / a.peak if cuda else None,
                          trainable_params=n_lora,
                          peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                          torch=torch.__version__, transformers=transformers.__version__,
                          peft=peft.__version__)), flush=True)


if __name__ == "__main__":
    main()
