"""How the decoder layers split into pipeline stages: pure arithmetic, shared by the
planner (its memory and time estimates) and the trainer (the stages it builds), so both
always see the same split."""

from __future__ import annotations

import functools

from duoka.errors import DuokaError
from duoka.models.qwen2.args import ModelArgs


def stage_layer_counts(n_layers: int, n_stages: int) -> list[int]:
    """Decoder layers per pipeline stage under parallel.pp_layers=even, as the trainer
    splits them: n_layers + 2 units (the embedding and the output head count as one layer
    each, torchtitan's convention) spread evenly, the extra units to the middle stages."""
    return list(_even_counts(n_layers, n_stages))


@functools.cache  # the planner asks for the same few splits ~150K times in one scaling table
def _even_counts(n_layers: int, n_stages: int) -> tuple[int, ...]:
    if n_stages == 1:
        return (n_layers,)
    base, extra = divmod(n_layers + 2, n_stages)
    counts = [base] * n_stages
    order = list(range(1, n_stages - 1)) + [0, n_stages - 1] if n_stages > 2 else list(range(n_stages))
    for i in range(extra):
        counts[order[i % len(order)]] += 1
    counts[0] -= 1
    counts[-1] -= 1
    # A stage left with -1 layers (more stages than layers allow) gives one to a neighbour.
    for i, c in enumerate(counts):
        if c < 0:
            counts[i] = 0
            counts[i + 1 if i + 1 < n_stages else i - 1] += c
    return tuple(counts)


def layer_counts(args: ModelArgs, n_stages: int, spec: str, seq_len: int = 2048) -> list[int]:
    """Decoder layers per stage (pp_layers=measured: duoka.parallel.pipeline.measure_stage_costs).

    even: the n_layers + 2 units (the embedding and the output head counted as one layer
      each, torchtitan's convention) spread evenly, extra layers to the middle stages.
    flops: balanced by training FLOPs per token (PaLM's 6N + 12·L·H·S split by piece): a
      layer costs 6·(its matmul weights) + 12·H·S, the output head 6·vocab·dim, which for
      small models is worth many layers (Qwen2-0.5B at seq 2048: about 8).
    "a,b,c": explicit counts, one per stage, summing to n_layers."""
    n = args.n_layers
    if spec == "even":
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


def stage_ids(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The stages pp rank `pp_rank` owns: r, r + pp, r + 2 pp, ... (the "loop" placement
    the interleaved schedules expect)."""
    return [pp_rank + k * pp for k in range(stages_per_rank)]
