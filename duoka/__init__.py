"""duoka (多卡): train and serve Qwen2-family language models on many GPUs."""

__version__ = "0.1.0"
