"""The accuracy cost of each quantization: perplexity of the bundled tiny model (trained on the
bundled corpus) on that corpus, unquantized and in each format duoka serves, on CPU in fp32
(the quantized layers' reference paths compute the same function as their GPU kernels, up to
accumulation order). GPTQ/AWQ folders here are round-to-nearest, not calibrated: an upper
bound on what Qwen's calibrated checkpoints lose.

    PYTHONPATH=$PWD python bench/quant_perplexity.py --out bench/results/quant/perplexity_tiny.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import tempfile
from pathlib import Path

import torch

from duoka.data.tokenizer import load_tokenizer
from duoka.hub import bundled_model_dir
from duoka.models.qwen2.args import ModelOptions
from duoka.models.qwen2.hf_adapter import load_hf_model, read_config
from duoka.models.quant.base import QuantScheme
from duoka.models.quant.folders import write_quantized_folder
from duoka.serve.quant_load import load_quantized_model, read_scheme

WINDOW = 512
CORPUS = Path(__file__).resolve().parents[1] / "duoka" / "assets" / "corpus" / "stdlib_docstrings.jsonl.gz"


def corpus_ids(limit_tokens: int) -> list[int]:
    tokenizer = load_tokenizer(bundled_model_dir())
    ids: list[int] = []
    with gzip.open(CORPUS, "rt") as f:
        for line in f:
            ids += tokenizer.encode(json.loads(line)["text"])
            if len(ids) >= limit_tokens:
                break
    return ids[:limit_tokens]


@torch.inference_mode()
def perplexity(model, ids: list[int]) -> float:
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, WINDOW):
        window = torch.tensor(ids[start:start + WINDOW + 1])
        if len(window) < 2:
            break
        logits = model(window[None, :-1]).float()[0]
        nll += torch.nn.functional.cross_entropy(logits, window[1:], reduction="sum").item()
        count += len(window) - 1
    return math.exp(nll / count)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=20_000)
    args = ap.parse_args()
    ids = corpus_ids(args.tokens)
    folder = bundled_model_dir()
    options = ModelOptions(packed_projections=True)
    cpu = torch.device("cpu")
    result = {"tokens": len(ids), "window": WINDOW}
    base, _ = load_hf_model(folder, dtype=torch.float32, options=options)
    result["unquantized"] = perplexity(base, ids)
    fp8 = load_quantized_model(folder, read_config(folder), QuantScheme("fp8"), cpu, torch.float32, options)
    result["fp8"] = perplexity(fp8, ids)
    with tempfile.TemporaryDirectory() as tmp:
        for name, method, bits in (("gptq_int8", "gptq", 8), ("gptq_int4", "gptq", 4), ("awq_int4", "awq", 4)):
            out = write_quantized_folder(folder, Path(tmp) / name, method, bits, group_size=64)
            model = load_quantized_model(out, read_config(out), read_scheme(out, None), cpu, torch.float32, options)
            result[name] = perplexity(model, ids)
    for key in ("fp8", "gptq_int8", "gptq_int4", "awq_int4"):
        result[f"{key}_increase_pct"] = 100 * (result[key] / result["unquantized"] - 1)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
