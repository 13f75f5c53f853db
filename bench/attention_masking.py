"""Document masking on GPU: which exact kernel is fastest for packed pretraining windows.

    python bench/attention_masking.py --out $OUT/attention_masking.json

For each model shape, a training step (forward, cross-entropy, backward; bf16 weights, one
GPU) on packed windows of real documents, with attention masked per document by each
backend of duoka.models.qwen2.model.document_mask (sdpa dense mask, flex block mask,
flash varlen), eager and with each decoder block compiled. "causal" (no document mask,
attention crosses documents) is the speed ceiling, not an exact alternative. Every
backend's loss and logits are compared with the sdpa backend's on the same batch.

Reproduces bench/results/attention_masking.md, which docs/config.md (`document_masking_kernel`)
and docs/training.md (document masking) cite; device kind nvidia-h200-x2 (one of its GPUs) or
nvidia-h200, from the repository root:

    CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD python bench/attention_masking.py --out $OUT/attention_masking.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from duoka.data.dataset import step_inputs
from duoka.models.qwen2.args import FLAVORS, ModelOptions
from duoka.models.qwen2.model import build_model, materialize

EOT = 151643


def packed_batches(lengths: np.ndarray, batch: int, seq: int, n: int, vocab: int, seed: int) -> list[torch.Tensor]:
    """n batches [batch, seq + 1] of documents with the given lengths, end-of-text after each."""
    g = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        stream = []
        while len(stream) < batch * (seq + 1):
            doc = g.integers(0, vocab - 1000, int(g.choice(lengths)))
            stream.extend(doc.tolist() + [EOT])
        out.append(torch.tensor(stream[: batch * (seq + 1)]).view(batch, seq + 1))
    return out


def corpus_lengths() -> np.ndarray:
    """Document lengths of the bundled corpus under the bundled tokenizer (docstrings)."""
    from duoka.data.dataset import iter_documents
    from duoka.data.tokenizer import Tokenizer
    from duoka.hub import bundled_corpus, bundled_model_dir

    tok = Tokenizer(bundled_model_dir())
    return np.array([len(tok.encode(d)) for d in iter_documents(bundled_corpus(), "text")])


def step(model, batch: dict) -> torch.Tensor:
    logits = model(**{k: v for k, v in batch.items() if k != "labels"})
    loss = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())
    loss.backward()
    return loss.detach()


def measure(flavor: str, mode: str, compiled: bool, batches, timed: int) -> dict:
    torch._dynamo.reset()  # each measurement compiles afresh, never against another's recompile budget
    torch.manual_seed(0)
    backend = None if mode == "causal" else mode
    model = materialize(build_model(FLAVORS[flavor], ModelOptions(document_masking=backend or "sdpa")), "cuda",
                        torch.bfloat16)
    model.init_weights(seed=0)
    if compiled:
        for block in model.layers.values():
            block.compile(fullgraph=False)
    # As the trainer does: document layout and varlen offsets on the host, then copied.
    batches = [{k: t.pin_memory().cuda(non_blocking=True)
                for k, t in step_inputs(b, -100, EOT if backend else None, backend == "varlen").items()}
               for b in batches]
    t0 = time.perf_counter()
    first_loss = step(model, batches[0]).item()
    warmup_s = time.perf_counter() - t0
    # The logits from the same forward as training (grad on: no recompile for no_grad).
    logits = model(**{k: v for k, v in batches[0].items() if k != "labels"})[0].detach().float().cpu()
    model.zero_grad(set_to_none=True)
    for b in batches[1:3]:
        step(model, b)
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(timed):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(model, batches[3 + i % (len(batches) - 3)])
        end.record()
        model.zero_grad(set_to_none=True)
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    tokens = batches[0]["tokens"].numel()
    med = float(np.median(times))
    return {"flavor": flavor, "mode": mode, "compiled": compiled, "step_s": med, "tokens_per_s": tokens / med,
            "first_loss": first_loss, "warmup_s": warmup_s,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "_logits": logits}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--flavors", default="qwen2-0.5b,qwen2-1.5b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--timed", type=int, default=8)
    a = p.parse_args()
    short = corpus_lengths()
    regimes = {"corpus": short, "long": np.clip(np.random.default_rng(1).exponential(800, 4096), 16, 8192).astype(int)}
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "seq": a.seq,
           "micro_batch": a.micro_batch, "regimes": {k: {"mean_doc_tokens": float(v.mean())} for k, v in regimes.items()},
           "runs": []}
    for regime, lengths in regimes.items():
        for flavor in a.flavors.split(","):
            batches = packed_batches(lengths, a.micro_batch, a.seq, 3 + a.timed, FLAVORS[flavor].vocab_size, seed=0)
            ref = None
            for compiled in (False, True):
                for mode in ("sdpa", "flex", "varlen", "causal"):
                    try:
                        r = measure(flavor, mode, compiled, batches, a.timed)
                    except Exception as e:  # recorded, so one failing backend does not hide the others
                        r = {"flavor": flavor, "mode": mode, "compiled": compiled, "error": repr(e)[:500]}
                    logits = r.pop("_logits", None)
                    if logits is not None:
                        if mode == "sdpa" and not compiled:
                            ref = logits
                        if ref is not None:
                            r["max_abs_logit_diff_vs_sdpa"] = float((logits - ref).abs().max())
                    r["regime"] = regime
                    res["runs"].append(r)
                    a.out.write_text(json.dumps(res, indent=2) + "\n")
                    print(json.dumps(r), flush=True)
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
