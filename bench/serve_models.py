"""Random Qwen2 model folders of published shapes for the benchmarks (transformers writes them,
bf16, seed 0, with the bundled tokenizer), config-only folders for `--load-format dummy`, and
the serving peer's workload."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

from duoka.hub import bundled_model_dir

# The serving peer's shapes, from the file bench/peers/serve_peer.py builds them from (its
# `tiny` shape only checks the peer on a CPU).
sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
from qwen2_shapes import COMMON, CONFIGS, MOE_TRAINING, hf_model, is_moe, shape as cut_shape  # noqa: E402

SHAPES = {name: shape for name, shape in CONFIGS.items() if name != "tiny"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def make_folder(shape: str, root: str | Path = "/tmp/duoka-models", layers: int = 0, train: bool = False) -> Path:
    """A random model of `shape` as a Hugging Face folder (made once, then reused). layers: that
    many decoder layers instead of the published count (0: all). train: a MoE's config turns on
    the router's load-balancing loss (qwen2_shapes.MOE_TRAINING), as duoka's MoE flavors do."""
    c = cut_shape(shape, layers)
    moe_training = train and is_moe(c)
    folder = Path(root) / f"qwen2-{shape}{f'-{layers}l' if layers else ''}{'-train' if moe_training else ''}-random"
    if (folder / "config.json").is_file():
        return folder
    extra = MOE_TRAINING if moe_training else {}
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = hf_model(c, bos_token_id=None, eos_token_id=None, pad_token_id=0, **extra).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="5GB")
    del model
    for name in TOKENIZER_FILES:
        shutil.copy(bundled_model_dir() / name, folder / name)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return folder


def config_folder(shape: str, root: str | Path = "/tmp/duoka-models", **fields) -> Path:
    """A folder of `shape`'s config.json and the bundled tokenizer, no weights: what `--load-format
    dummy` (EngineConfig(load_format="dummy")) builds a random model from on the device. The
    config is the published one's fields (qwen2_shapes.CONFIGS and COMMON, then `fields`), with no
    end-of-text token: a random model has none, and the benches' requests ignore it anyway."""
    c = CONFIGS[shape]
    moe = is_moe(c)
    config = {"architectures": ["Qwen2MoeForCausalLM" if moe else "Qwen2ForCausalLM"],
              "model_type": "qwen2_moe" if moe else "qwen2", **c, **COMMON, "hidden_act": "silu",
              "use_sliding_window": False, "torch_dtype": "bfloat16", "bos_token_id": None, "eos_token_id": None}
    if moe:  # published with the router's loss off (read, not used, when serving)
        config.update(router_aux_loss_coef=0.001, output_router_logits=False)
    config.update(fields)
    folder = Path(root) / f"qwen2-{shape}-config-only"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        shutil.copy(bundled_model_dir() / name, folder / name)
    return folder


def peer_workload(requests: int = 256, prompt_min: int = 128, prompt_max: int = 1024, vocab: int = 151936,
                  seed: int = 0) -> list[list[int]]:
    """The peer script's prompts (the same generator as `duoka bench serve`'s). Imported here:
    duoka.bench.loadgen needs httpx2 (not in the GPU machines' image: carried in .wheels), which
    the scripts that only write folders (bench/moe_vs_peer.py) do without."""
    from duoka.bench.loadgen import random_prompts

    return random_prompts(requests, prompt_min, prompt_max, vocab, seed)
