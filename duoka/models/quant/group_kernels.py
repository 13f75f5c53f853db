"""Which layer serves a group-wise (GPTQ/AWQ) weight: gemlite on CUDA where it is installed
(every batch size, 4 and 8 bits), else PyTorch's tinygemm (4 bits, bf16; fast at a few token
rows only), else the reference layer that dequantizes per call (CPU, and what neither takes)."""

from __future__ import annotations

import logging

import torch

from duoka.models.quant.base import QuantizedLinear
from duoka.models.quant.gemlite_group import GemliteGroupLinear, gemlite_problem
from duoka.models.quant.groupwise import GroupInts, GroupQuantLinear
from duoka.models.quant.small_batch import load_gemlite
from duoka.models.quant.tinygemm import TinyGemmInt4Linear, tinygemm_problem

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'duoka[gpu]' (gemlite) for GPTQ/AWQ at every batch size at int4's weight-read speed"
_warned: set[str] = set()


def build_group_linear(ints: GroupInts, bits: int, device: torch.device, dtype: torch.dtype) -> QuantizedLinear:
    """The layer for `ints` (already on `device`); a fallback's `reason` names what kept the
    faster kernels out, and a CUDA fallback for want of gemlite is logged once with the fix."""
    problem = gemlite_problem(ints, bits, device, dtype)
    if problem is None:
        if load_gemlite() is not None:
            return GemliteGroupLinear(ints, bits, dtype)
        problem = "gemlite not installed"
        if "install" not in _warned:
            log.warning("GPTQ/AWQ layers fall back to tinygemm (slow beyond a few token rows): %s", INSTALL_HINT)
            _warned.add("install")
    tiny = tinygemm_problem(ints, bits, device, dtype)
    if tiny is None:
        return TinyGemmInt4Linear(ints)
    return GroupQuantLinear(ints, bits, dtype, f"{problem}; {tiny}" if device.type == "cuda" else tiny)
