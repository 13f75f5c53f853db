"""Plain tensors from values that may be DTensors (tensor parallelism, FSDP2), in one place."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def full_value(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor gathered across its mesh (a collective: every rank of
    the mesh must call it), anything else as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local_value(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard: a DTensor's local tensor (no communication; in-place changes reach
    the DTensor), anything else as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def total_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all `tensors` together, a plain scalar. DTensors of different meshes
    (the experts' under expert parallelism and the rest's) cannot meet in one op: each mesh's
    tensors are normed together, gathered, and the squares summed. The groups are taken in
    the order the list first names their meshes, the same on every rank, so every rank runs
    the same collectives in the same order."""
    norms = [full_value(torch.nn.utils.get_total_norm(group, foreach=True)) for group in by_mesh(tensors)]
    if len(norms) == 1:
        return norms[0]
    return torch.stack([n.float() for n in norms]).square().sum().sqrt()


def by_mesh(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` grouped by their DTensor mesh (plain tensors together), in the order the list
    first names each mesh: ops that mix DTensors with one scalar tensor need a single mesh."""
    groups: dict[object, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
    return list(groups.values())
