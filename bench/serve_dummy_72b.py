"""Qwen2-72B in FP8 on one GPU with random weights (issue 39): `--load-format dummy` builds the
weights on the device from the folder's config.json alone (no 145 GB download), quantized to
FP8 projection by projection. Reports what `duoka serve` prints at start (weight memory, KV
capacity), batch-1 decode and a 64-request batch.

    PYTHONPATH=$PWD python3 bench/serve_dummy_72b.py --out $OUT/dummy_72b_fp8.json

Device kind nvidia-h200 (72 GB of FP8 weights leave ~55 GB of cache on 141 GB; an 80 GB H100
is refused at start with the fix named); .wheels carried as for serve_openai_mix.py.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_models import peer_workload

from duoka.hub import bundled_model_dir
from duoka.serve.config import EngineConfig
from duoka.serve.engine import LLMEngine
from duoka.serve.params import SamplingParams

# Qwen2-72B's config.json (the published one, less its weights).
QWEN2_72B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 8192,
             "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
             "intermediate_size": 29568, "vocab_size": 152064, "tie_word_embeddings": False,
             "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
             "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": None, "eos_token_id": None}


def config_folder(root: Path) -> Path:
    folder = root / "qwen2-72b-config-only"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(QWEN2_72B, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled_model_dir() / name, folder / name)
    return folder


def decode_rate(engine: LLMEngine, prompts: list[list[int]], out_len: int, tag: str) -> float:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}{i}", prompt, SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True))
    stamps = []
    while engine.has_unfinished():
        engine.step()
        stamps.append(time.perf_counter())
    return len(prompts) * (len(stamps) - 3) / (stamps[-1] - stamps[2])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--root", default="/tmp/duoka-models")
    args = ap.parse_args()
    folder = config_folder(Path(args.root))
    logs: list[str] = []
    t = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=str(folder), quantization="fp8", load_format="dummy",
                                    max_model_len=8192, max_num_seqs=64), log=logs.append)
    result = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "start_s":
              round(time.perf_counter() - t, 1), "start_log": logs,
              "memory_allocated_gib": torch.cuda.memory_allocated() / 2**30}
    print("\n".join(logs), flush=True)
    prompt = peer_workload(1, 128, 128, QWEN2_72B["vocab_size"])
    decode_rate(engine, prompt, 16, "warm")
    result["batch1_tokens_per_s"] = decode_rate(engine, prompt, 128, "b1_")
    result["batch64_tokens_per_s"] = decode_rate(engine, peer_workload(64, 128, 128, QWEN2_72B["vocab_size"]),
                                                 128, "b64_")
    print(json.dumps(result), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
