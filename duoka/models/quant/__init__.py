"""Quantized linear layers for serving: FP8 (quantized at load, or from compressed-tensors
checkpoints), GPTQ and AWQ; base.py holds the interface every format implements."""
