"""FP8 weights against bf16 activations for steps of few token rows (decode at small batch),
from gemlite's Triton kernels (Dropbox/Mobius Labs; what torchao and SGLang use for low-bit
GEMV): the weight's e4m3 codes widened in the kernel, scaled per output row, no activation
quantization.

Why not _scaled_mm there: at 1-32 rows the matmul is a weight read, and cuBLASLt's rowwise
FP8 GEMM is no GEMV. One H100, the 7B projections from CUDA graphs, one row
(bench/results/quant/kernels_7b.run1.txt): q/k/v 27.9 us with _scaled_mm, 9.1 bf16, 5.8
here; gate/up 82.6, 92.9, 45.2; down 75.7, 50.9, 27.0. At 64 rows the two FP8 paths are
even, so _scaled_mm keeps every step above SMALL_BATCH_ROWS (prefill and large batches).

The kernel shares the layer's buffers (the weight's transpose is a view) and is called as
gemlite's custom operator, which traces under torch.compile and replays in CUDA graphs.
gemlite tunes each (rows, shape) on first use; the tuned configurations are kept per GPU
model under the duoka cache (cache.py) so a second start does not tune again.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

import torch

from duoka.cache import cache_home

log = logging.getLogger(__name__)

# Steps of at most this many token rows take the weight-only kernel (the measurement above:
# faster than _scaled_mm on every 7B projection up to 32 rows, even at 64).
SMALL_BATCH_ROWS = 32
INSTALL_HINT = "pip install 'duoka[gpu]' (gemlite) for FP8 decode at small batch at FP8's weight-read speed"

_state: dict[str, object] = {"warned": False, "tuned_file": None}


class SmallBatchFp8(NamedTuple):
    """gemlite's operator arguments for one FP8 weight: y = x @ (q * scale).T."""
    tensor_args: list[torch.Tensor]
    meta_args: list[int]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.gemlite.forward_functional(x, None, self.tensor_args, self.meta_args)


def load_gemlite():
    """gemlite, its tuned configurations loaded and fp32 split-K sums set once per process;
    None where it is not installed."""
    try:
        import gemlite
    except ImportError:
        return None
    if _state["tuned_file"] is None:
        _state["tuned_file"] = tuned_configs_file()
        gemlite.load_config(str(_state["tuned_file"]), print_error=False)
        # Split-K partial sums added in fp32, not bf16 (gemlite's default on sm90 rounds each
        # partial to bf16: 2.0 off on an H100 where one output step is 0.0156). One cast
        # kernel more for 3-32 rows; one row takes a GEMV without atomics either way. fp16
        # outputs keep fp16 atomics (gemlite's choice for fp16): each partial rounded to fp16.
        gemlite.set_native_atomic_bfp16(False)
    return gemlite


def tuned_configs_file() -> Path:
    name = torch.cuda.get_device_name().lower().replace(" ", "_")
    return cache_home() / "gemlite" / f"{name}.json"


def build_small_batch_fp8(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype
                          ) -> SmallBatchFp8 | None:
    """The weight-only kernel for an e4m3 weight [N, K] and its fp32 row scales [N], on CUDA
    with bf16/fp16 activations; None where gemlite is not installed (logged once with the
    fix: steps then take _scaled_mm at every size, slower at small batch but equal in
    result up to activation rounding)."""
    if load_gemlite() is None:
        if not _state["warned"]:
            log.warning("FP8 at small batch uses _scaled_mm, which is slower than bf16 there: %s", INSTALL_HINT)
            _state["warned"] = True
        return None
    from gemlite.helper import A16W8_FP8
    # post_scale: the row scale multiplies the fp32 sums (exact e4m3 x bf16 products); the
    # default pre-scales the weight in the activations' dtype, which loses rows of tiny
    # scale in fp16 and rounds every weight to bf16 (errors 10-50x one output step on a GPU).
    layer = A16W8_FP8(device=weight.device, dtype=dtype, post_scale=True).from_weights(
        weight, None, weight_scale.reshape(-1, 1))
    # Plain tensors (gemlite wraps them as Parameters): the layer's own buffers, viewed.
    return SmallBatchFp8([t.detach() for t in layer.get_tensor_args()], list(layer.get_meta_args()))


def save_tuned_configs() -> None:
    """Keeps what gemlite tuned in this process (called once the engine has warmed up)."""
    if _state["tuned_file"] is None:
        return
    path = Path(_state["tuned_file"])
    path.parent.mkdir(parents=True, exist_ok=True)
    load_gemlite().cache_config(str(path))
