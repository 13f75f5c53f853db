"""Model FLOPs utilisation: the GPUs' datasheet peaks and the PaLM-convention MFU."""

from __future__ import annotations

# Dense bf16 tensor-core peaks from the vendors' datasheets, FLOP/s per device (no sparsity).
PEAK_BF16 = {
    "H200": 989e12, "H100": 989e12, "H800": 989e12, "GH200": 989e12,
    "A100": 312e12, "A800": 312e12, "L40S": 362e12, "L40": 181e12, "A10": 125e12,
    "B200": 2250e12, "B100": 1750e12, "RTX 4090": 165e12, "A6000": 155e12,
}


def peak_flops(device_name: str | None, override_tflops: float = 0.0) -> float | None:
    """Per-device dense bf16 peak; None where unknown (CPU), so MFU is reported as null
    rather than as a made-up number."""
    if override_tflops:
        return override_tflops * 1e12
    if not device_name:
        return None
    name = device_name.upper()
    if "H100" in name and "PCIE" in name:
        return 756e12  # H100 PCIe has a lower clock and power limit than the SXM part
    for key, peak in PEAK_BF16.items():
        if key in name:
            return peak
    return None


def mfu(flops_per_token: float, tokens_per_s: float, n_devices: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation, PaLM convention (Chowdhery et al., arXiv:2204.02311, app. B)."""
    if peak is None or tokens_per_s <= 0:
        return None
    return flops_per_token * tokens_per_s / (peak * n_devices)
