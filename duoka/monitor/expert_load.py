"""A mixture-of-experts run's expert load, summarised for metrics.jsonl's `expert_load`.

From a step's routed assignments per expert ([MoE layers, E] counts, every micro-batch and
rank summed), per layer: the `imbalance` (largest share x E: 1.0 is an even load, E/k the
most a layer can reach, k = num_experts_per_tok, since an expert takes at most one of a
token's k assignments) and the `effective_experts` (exp of the entropy of the shares: E when
even, never below k). The full shares are added only on the steps asked for (docs/monitoring.md).
"""

from __future__ import annotations

import torch

# Shares rounded to 5 decimals: a 57B model's 28 x 64 shares stay ~13 KB a line.
SHARE_DIGITS = 5


def summarize(counts: torch.Tensor, layers: tuple[int, ...], shares: bool = False) -> dict:
    """counts: [len(layers), E] assignments per expert. A layer with no assignment (none
    recorded) counts as even, so that it raises nothing."""
    counts = counts.double()
    n = counts.shape[1]
    totals = counts.sum(dim=1, keepdim=True)
    share = torch.where(totals > 0, counts / totals.clamp_min(1e-30), torch.full_like(counts, 1.0 / n))
    imbalance = (share.max(dim=1).values * n).tolist()
    # 0 log 0 = 0: an idle expert adds nothing to the entropy.
    entropy = -(share * torch.where(share > 0, share.log(), torch.zeros_like(share))).sum(dim=1)
    effective = entropy.exp().tolist()
    out = {
        "layers": list(layers),
        "imbalance": [round(x, 4) for x in imbalance],
        "effective_experts": [round(x, 3) for x in effective],
        "max_imbalance": round(max(imbalance), 4),
        "min_effective_experts": round(min(effective), 3),
    }
    if shares:
        out["shares"] = [[round(x, SHARE_DIGITS) for x in row] for row in share.tolist()]
    return out
