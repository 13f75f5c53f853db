#!/usr/bin/env bash
# The serving engine's GPU checks in one device call: bench/serve_gpu_check.py (kernels and
# logits against the reference, the 0.5B engine's speed), then `duoka generate` and `duoka serve`
# on the GPU through their real commands (64 streamed requests through the openai client).
# Reproduces docs/serving.md's "On one H200" figures (bench/results/serve/gpu_check_0.5b.*,
# gpu_smoke_0.5b.*). Device kind nvidia-h200, from the repository root, carrying .wheels
# (wheels of fastapi, uvicorn and openai and what they need that the device image lacks):
#   bash bench/serve_gpu_smoke.sh   (writes $OUT)
set -uo pipefail
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -1
python3 -m pip install -q --no-index --find-links .wheels fastapi uvicorn openai 2>&1 | tail -1
python3 bench/serve_gpu_check.py --out "$OUT/serve_gpu_check.json" --shape 0.5b 2>&1 | grep -v "Writing model"
MODEL=/tmp/duoka-models/qwen2-0.5b-random
duoka generate --model $MODEL --prompt "hello" --max-new-tokens 200 > /dev/null 2> "$OUT/generate.log"; tail -2 "$OUT/generate.log"
duoka serve $MODEL --port 8321 --max-model-len 4096 > "$OUT/serve.log" 2>&1 &
for _ in $(seq 120); do grep -q "serving " "$OUT/serve.log" && break; sleep 1; done
python3 - <<'PY' 2>&1 | tee "$OUT/serve_client.txt"
import concurrent.futures as cf, time, openai
c = openai.OpenAI(base_url="http://127.0.0.1:8321/v1", api_key="x", max_retries=0, timeout=120)
m = c.models.list().data[0].id
def one(i):
    s = c.completions.create(model=m, prompt=[1 + i] * 512, max_tokens=128, temperature=0, stream=True,
                             stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    return [ch for ch in s]
t = time.perf_counter()
with cf.ThreadPoolExecutor(64) as pool:
    outs = list(pool.map(one, range(64)))
wall = time.perf_counter() - t
toks = sum(o[-1].usage.completion_tokens for o in outs)
print(f"64 streamed requests, 512-token prompts, {toks} output tokens in {wall:.2f} s: {toks / wall:.0f} output tok/s")
PY
kill -TERM %1; wait %1; echo "serve exit $?"; tail -3 "$OUT/serve.log"
