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
