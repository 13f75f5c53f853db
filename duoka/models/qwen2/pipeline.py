"""Pipeline parallelism for Qwen2 with torch.distributed.pipelining.

The model is cut by layers into pp x stages_per_rank stages. Each stage is a Qwen2 built
on the meta device with the layers it does not own deleted (the layers ModuleDict keeps
the original names, so parameter names, checkpoints and the layout-independent
initialisation are those of the whole model). Rank r owns stages r, r + pp, r + 2 pp, ...
(the "loop" placement the interleaved schedules expect).

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
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from duoka.errors import DuokaError
from duoka.models.qwen2.args import ModelArgs
from duoka.models.qwen2.model import Qwen2, build_model

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
             "zero_bubble": ScheduleInterleavedZeroBubble}
MULTI_STAGE = ("interleaved_1f1b", "zero_bubble")


def layer_counts(args: ModelArgs, n_stages: int, spec: str, seq_len: int = 2048) -> list[int]:
    """Decoder layers per stage (for pp_layers=measured see measure_stage_costs).

    even: the n_layers + 2 units (the embedding and the output head counted as one layer
      each, torchtitan's convention) spread evenly, extra layers to the middle stages.
    flops: balanced by training FLOPs per token (PaLM's 6N + 12·L·H·S split by piece): a
      layer costs 6·(its matmul weights) + 12·H·S, the output head 6·vocab·dim, which for
      small models is worth many layers (Qwen2-0.5B at seq 2048: about 8).
    "a,b,c": explicit counts, one per stage, summing to n_layers."""
    n = args.n_layers
    if spec == "even":
        from duoka.plan.memory import stage_layer_counts  # the planner's split is the one the trainer uses

        return stage_layer_counts(n, n_stages)
    if spec == "flops":
        head = 6 * args.vocab_size * args.dim
        layer = (6 * args.matmul_params() - head) / n + 12 * args.n_heads * args.resolved_head_dim * seq_len
        return balanced_counts(n, n_stages, layer, head)
    if spec == "measured":
        raise ValueError("pp_layers=measured is resolved by the trainer (measure_stage_costs), not here")
    try:
        counts = [int(x) for x in spec.split(",")]
    except ValueError:
        counts = []
    if len(counts) != n_stages or sum(counts) != n or min(counts, default=-1) < 0:
        raise DuokaError(f"parallel.pp_layers={spec!r} must be `even`, `flops`, `measured` or {n_stages} "
                         "comma-separated layer "
                         f"counts summing to the model's {n} layers",
                         f"e.g. --parallel.pp_layers={','.join(map(str, layer_counts(args, n_stages, 'even')))}")
    return counts


def balanced_counts(n_layers: int, n_stages: int, layer_cost: float, head_cost: float) -> list[int]:
    """Contiguous split of equal-cost layers with the output head on the last stage that
    minimises the largest stage's cost: the last stage takes the best number of layers,
    the others share the rest evenly (extra layers to the later ones)."""
    if n_stages == 1:
        return [n_layers]

    def largest_stage(last: int) -> float:
        return max(-(-(n_layers - last) // (n_stages - 1)) * layer_cost, last * layer_cost + head_cost)

    last = min(range(n_layers + 1), key=largest_stage)
    base, extra = divmod(n_layers - last, n_stages - 1)
    return [base + (1 if i >= n_stages - 1 - extra else 0) for i in range(n_stages - 1)] + [last]


def balanced_counts_uneven(n_layers: int, layer_costs: list[float], head_cost: float) -> list[int]:
    """Contiguous split when stage s costs layer_costs[s] per layer (GPUs of different
    speed), the head on the last stage: the split whose slowest stage is fastest, found by
    dynamic programming over (stages, layers). Every stage but the last keeps a layer."""
    n_stages = len(layer_costs)
    inf = float("inf")
    # best[k]: the smallest achievable slowest-stage cost for the first k layers on the stages so far
    best = [0.0] + [inf] * n_layers
    choice: list[list[int]] = []
    for s, cost in enumerate(layer_costs):
        last = s == n_stages - 1
        new, took = [inf] * (n_layers + 1), [0] * (n_layers + 1)
        for k in range(n_layers + 1):
            for m in range(0 if last else 1, k + 1):
                if best[k - m] == inf:
                    continue
                value = max(best[k - m], m * cost + (head_cost if last else 0.0))
                if value < new[k]:
                    new[k], took[k] = value, m
        best = new
        choice.append(took)
    counts, k = [], n_layers
    for s in reversed(range(n_stages)):
        counts.append(choice[s][k])
        k -= choice[s][k]
    return counts[::-1]


def measure_stage_costs(args: ModelArgs, micro_batch: int, seq_len: int, device: torch.device,
                        dtype: torch.dtype, repeats: int = 5) -> tuple[float, float]:
    """Seconds for the forward and backward of one decoder block and of the output head
    with its cross-entropy, measured on this device at the training micro-batch: what
    pp_layers=measured balances. Random weights; the median of `repeats` after a warm-up."""
    import torch.nn.functional as F

    from duoka.models.qwen2.model import TransformerBlock, rope_cos_sin
    from duoka.train.profiling import median_seconds

    block = TransformerBlock(args).to(device=device, dtype=dtype)
    head = torch.nn.Linear(args.dim, args.vocab_size, bias=False).to(device=device, dtype=dtype)
    x = torch.randn(micro_batch, seq_len, args.dim, device=device, dtype=dtype, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(seq_len, device=device), args.resolved_head_dim, args.rope_theta, dtype)
    labels = torch.randint(0, args.vocab_size, (micro_batch * seq_len,), device=device)

    layer = median_seconds(lambda: block(x, cos, sin).sum().backward(), device, repeats, warmup=1)
    head_s = median_seconds(lambda: F.cross_entropy(head(x).float().flatten(0, 1), labels).backward(), device,
                            repeats, warmup=1)
    return layer, head_s


def stage_ids(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def build_stage_model(args: ModelArgs, stage: int, counts: list[int]) -> Qwen2:
    """The meta-device Qwen2 of one stage: its layers only; the embedding on the first
    stage, the final norm and head on the last (plus the tied weight's home, see above)."""
    model = build_model(args)
    start = sum(counts[:stage])
    keep = {str(i) for i in range(start, start + counts[stage])}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    first, last = stage == 0, stage == len(counts) - 1
    if not first:
        model.takes_tokens = False
        if not (last and args.tie_word_embeddings):
            model.tok_embeddings = None
    if not last:
        model.norm = None
        model.output = None
    model.tie_weights()
    return model


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
    stages = [PipelineStage(part, stage_index=s, num_stages=n_stages, device=device, group=pp_group)
              for part, s in zip(parts, ids)]
    cls = SCHEDULES[schedule]
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
        grad = weight.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        dist.all_reduce(local, group=self.group)
