"""Random Qwen2 model folders of published shapes for the serving benchmarks (transformers
writes them, bf16, seed 0, with the bundled tokenizer), and the serving peer's workload."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

from duoka.hub import bundled_model_dir
from duoka.bench.loadgen import random_prompts

# The serving peer's shapes, from the file bench/peers/serve_peer.py builds them from (its
# `tiny` shape only checks the peer on a CPU).
sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
from qwen2_shapes import CONFIGS  # noqa: E402

SHAPES = {name: shape for name, shape in CONFIGS.items() if name != "tiny"}


def make_folder(shape: str, root: str | Path = "/tmp/duoka-models") -> Path:
    """A random model of `shape` as a Hugging Face folder (made once, then reused)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    folder = Path(root) / f"qwen2-{shape}-random"
    if (folder / "config.json").is_file():
        return folder
    cfg = Qwen2Config(**SHAPES[shape], rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768,
                      bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="5GB")
    del model
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled_model_dir() / name, folder / name)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return folder


def peer_workload(requests: int = 256, prompt_min: int = 128, prompt_max: int = 1024, vocab: int = 151936,
                  seed: int = 0) -> list[list[int]]:
    """The peer script's prompts (the same generator as `duoka bench serve`'s)."""
    return random_prompts(requests, prompt_min, prompt_max, vocab, seed)
