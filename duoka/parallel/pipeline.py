"""Pipeline parallelism for Qwen2 with torch.distributed.pipelining.

The model is cut by layers into pp x stages_per_rank stages (duoka.models.qwen2.stages
computes the split). Each stage is a Qwen2 built on the meta device with only the layers
it owns (StageSlice); the layers ModuleDict keeps the original names, so parameter names,
checkpoints and the layout-independent initialisation are those of the whole model. Rank r
owns stages r, r + pp, r + 2 pp, ... (the "loop" placement the interleaved schedules expect).

Tied input/output embeddings (Qwen2-0.5B, 1.5B) when the first and last stage live on
different ranks: the last stage keeps its own copy of the embedding weight under the same
name, `tok_embeddings.weight`, with the output head tied to it, so that checkpoints look
exactly like the single-process model's. After backward the two copies' gradients are
summed over a group of the two owning ranks (`TiedEmbeddingSync`); both copies then take
identical optimizer steps.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from duoka.models.qwen2.args import ModelArgs, ModelOptions
from duoka.models.qwen2.model import Qwen2, StageSlice, TransformerBlock, build_model
from duoka.models.qwen2.rope import rope_cos_sin
from duoka.parallel.dtensor import local_value
from duoka.timing import median_seconds

# The schedules by name (torch.distributed.pipelining's classes of these names).
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
             "zero_bubble": "ScheduleInterleavedZeroBubble"}
MULTI_STAGE = ("interleaved_1f1b", "zero_bubble")


def measure_stage_costs(args: ModelArgs, micro_batch: int, seq_len: int, device: torch.device,
                        dtype: torch.dtype, repeats: int = 5) -> tuple[float, float]:
    """Seconds for the forward and backward of one decoder block and of the output head
    with its cross-entropy, measured on this device at the training micro-batch: what
    pp_layers=measured balances. Random weights; the median of `repeats` after a warm-up."""
    block = TransformerBlock(args).to(device=device, dtype=dtype)
    head = torch.nn.Linear(args.dim, args.vocab_size, bias=False).to(device=device, dtype=dtype)
    x = torch.randn(micro_batch, seq_len, args.dim, device=device, dtype=dtype, requires_grad=True)
    rope = rope_cos_sin(torch.arange(seq_len, device=device), args.resolved_head_dim, args.rope_theta, dtype,
                        args.rope_scaling, args.max_seq_len)
    labels = torch.randint(0, args.vocab_size, (micro_batch * seq_len,), device=device)

    layer = median_seconds(lambda: block(x, rope).sum().backward(), device, repeats, warmup=1)
    head_s = median_seconds(lambda: F.cross_entropy(head(x).float().flatten(0, 1), labels).backward(), device,
                            repeats, warmup=1)
    return layer, head_s


def build_stage_model(args: ModelArgs, options: ModelOptions, stage: int, counts: list[int]) -> Qwen2:
    """The meta-device Qwen2 of stage `stage` of len(counts): its layers only; the
    embedding on the first stage, the final norm and head on the last (plus the tied
    weight's home, see above)."""
    start = sum(counts[:stage])
    return build_model(args, options, stage=StageSlice(start=start, stop=start + counts[stage], first=stage == 0,
                                                       last=stage == len(counts) - 1))


class ModelParts(torch.nn.Module):
    """The stages one rank owns, seen as one module with the whole model's parameter
    names (for the optimizer and for checkpoints). It is never called."""

    def __init__(self, parts: list[Qwen2]):
        super().__init__()
        self.layers = torch.nn.ModuleDict()
        for part in parts:
            for name, block in part.layers.items():
                self.layers[name] = block
            for name in ("tok_embeddings", "norm", "output"):
                if getattr(part, name) is not None and name not in self._modules:
                    setattr(self, name, getattr(part, name))
        self.parts = parts  # a plain list: not registered again under a second name

    def forward(self, *args, **kwargs):
        raise RuntimeError("ModelParts holds pipeline stages for naming only; run the pipeline schedule")


def build_schedule(parts: list[Qwen2], ids: list[int], n_stages: int, schedule: str, n_microbatches: int,
                   loss_fn, device: torch.device, pp_group):
    """The pipeline schedule over this rank's stages. Gradients are not scaled by the
    number of micro-batches (scale_grads=False): the loss is already normalised by the
    global token count, as in every other layout."""
    # Imported here: torch.distributed.pipelining imports torch._dynamo, over a second of every
    # rank's start-up that only a pipelined run needs (tests/unit/test_startup_imports.py).
    from torch.distributed.pipelining import PipelineStage, schedules

    stages = [PipelineStage(part, stage_index=s, num_stages=n_stages, device=device, group=pp_group)
              for part, s in zip(parts, ids)]
    cls = getattr(schedules, SCHEDULES[schedule])
    if schedule in MULTI_STAGE:
        return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


class TiedEmbeddingSync:
    """Sums the gradients of the two copies of a tied embedding weight (first stage's
    embedding, last stage's head) across their ranks. Every rank joins the creation of
    every pair group, as torch.distributed.new_group requires."""

    def __init__(self, pairs: list[tuple[int, int]], rank: int, backend: str | None = None):
        self.group = None
        for pair in pairs:
            group = dist.new_group(list(pair), backend=backend)
            if rank in pair:
                self.group = group

    def __call__(self, weight: torch.nn.Parameter | None) -> None:
        if self.group is None or weight is None or weight.grad is None:
            return
        dist.all_reduce(local_value(weight.grad), group=self.group)
