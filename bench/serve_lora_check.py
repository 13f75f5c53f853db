"""On the GPU (CUDA graphs and compiled blocks on): several --lora adapters served in one
engine give each request what that adapter merged and served alone gives. Greedy decoding of
a random model in bf16: the merged weights round W + BA once, the batched path adds BA's
product to W's, so tokens may part after a few steps; the figure is the first token's logprob
difference and how many leading tokens agree.

    PYTHONPATH=$PWD python3 bench/serve_lora_check.py --shape 0.5b --out $OUT/lora_check_0.5b.json

Uses bench/serve_openai_mix.py's random adapters (made on the first run).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_models import make_folder  # noqa: E402
from serve_openai_mix import ADAPTERS, make_adapter  # noqa: E402

from duoka.bench import loadgen  # noqa: E402
from duoka.serve.engine import LLM  # noqa: E402
from duoka.serve.params import SamplingParams  # noqa: E402


def run(llm: LLM, requests: list[tuple[str, list[int], str | None]]) -> dict[str, tuple[list[int], float]]:
    engine, out = llm.engine, {}
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=0)
    for rid, prompt, lora in requests:
        engine.add_request(rid, prompt, params, lora=lora)
    while engine.has_unfinished():
        for o in engine.step():
            tokens, first = out.get(o.request_id, ([], None))
            if first is None and o.new_logprobs:
                first = o.new_logprobs[0].logprob
            out[o.request_id] = (tokens + o.new_token_ids, first)
    return out


def strong_adapters(base: Path, shape: str, count: int) -> list[Path]:
    """Random adapters whose B is 20x the throughput benchmark's: their effect on the output
    must dwarf bf16's rounding (made once, then reused)."""
    return [make_adapter(Path(f"/tmp/duoka-models/strong-adapter-{shape}-{i}"), base, i, b_scale=0.2)
            for i in range(count)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="0.5b")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    base = make_folder(args.shape)
    folders = strong_adapters(base, args.shape, ADAPTERS)
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    prompts = loadgen.random_prompts(16, 32, 256, vocab, seed=3)
    requests = [(f"r{i}", p, None if i % 4 == 3 else f"a{i % 4}") for i, p in enumerate(prompts)]
    # Few graph buckets: four engines start in this script, each compiling and capturing.
    options = dict(max_model_len=1024, gpu_memory_utilization=0.4, max_num_seqs=16)
    multi = LLM(str(base), loras=tuple((f"a{i}", str(f)) for i, f in enumerate(folders)), **options)
    batched = run(multi, requests)
    del multi
    result = {"shape": args.shape, "requests": []}
    for i, folder in enumerate(folders[:2]):  # a2 and a3 run in the batch, unchecked: two suffice
        mine = [(rid, prompt, None) for rid, prompt, lora in requests if lora == f"a{i}"]  # merged: no name
        alone = run(LLM(str(base), adapter=str(folder), **options), mine)
        for rid, (tokens, first) in alone.items():
            other, other_first = batched[rid]
            agree = next((k for k, (a, b) in enumerate(zip(tokens, other)) if a != b), len(tokens))
            result["requests"].append({"id": rid, "adapter": f"a{i}", "leading_tokens_equal": agree,
                                       "first_logprob_diff": abs(first - other_first)})
    # The base model on every request: how far an adapter moves the first token's logprob, the
    # scale the differences above are to be read against.
    base_alone = run(LLM(str(base), **options), [(rid, prompt, None) for rid, prompt, _ in requests])
    result["base_requests_first_logprob_diff"] = max(abs(base_alone[rid][1] - batched[rid][1])
                                                     for rid, _, lora in requests if lora is None)
    result["adapter_effect_first_logprob"] = min(abs(base_alone[rid][1] - batched[rid][1])
                                                 for rid, _, lora in requests if lora is not None)
    rows = result["requests"]
    result["min_leading_equal"] = min(r["leading_tokens_equal"] for r in rows)
    result["max_first_logprob_diff"] = max(r["first_logprob_diff"] for r in rows)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "requests"}))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
