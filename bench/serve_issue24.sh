#!/usr/bin/env bash
# Issue 24's measurements for one model shape, on one GPU, in one device call each:
#   bash bench/serve_issue24.sh 7b "http engine"      # the peer's workload through HTTP (+ the peer), the engine alone
#   bash bench/serve_issue24.sh 7b "latency generate" # Poisson arrivals for 2 minutes; duoka generate at batch 1
#   LATENCY_S=60 bash bench/serve_issue24.sh 0.5b "http latency"   # a shorter latency run
# Needs .wheels (fastapi, uvicorn, httpx2 and their dependencies) and .peer (the peer scripts)
# carried; writes JSON and logs under $OUT (copy them to bench/results/serve/ with the command).
set -uo pipefail
SHAPE=${1:-7b}
PARTS=${2:-"http engine latency generate"}
LATENCY_S=${LATENCY_S:-120}
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -1
python3 -m pip install -q --no-index --find-links .wheels fastapi uvicorn httpx2 2>&1 | tail -1
MODEL=$(python3 -c "import sys; sys.path.insert(0, 'bench'); from serve_models import make_folder; print(make_folder('$SHAPE'))" 2>/dev/null | tail -1)
SERVE="--max-model-len 4096"
for part in $PARTS; do
  case $part in
    http)  # 256 concurrent streamed requests of the peer's workload, batch-1, the peer on the same prompts
      duoka bench serve --model "$MODEL" --serve-arg "$SERVE" --batch1 --vs-peer --peer .peer/hf_qwen2_serve_baseline.py \
        --peer-model "$SHAPE" --out "$OUT/http_$SHAPE.json" 2> "$OUT/http_$SHAPE.log"; tail -25 "$OUT/http_$SHAPE.log" ;;
    engine)  # the same workload through LLM.generate, no HTTP
      python3 bench/serve_profile.py --shape "$SHAPE" --out "$OUT/engine_$SHAPE.json" 2>&1 | grep '^{' | tail -1 ;;
    latency)  # Poisson arrivals at 4 requests/s (seed 0), 1,024-token prompts, 256 output tokens, 2 minutes
      duoka bench serve --model "$MODEL" --serve-arg "$SERVE" --request-rate 4 --duration "$LATENCY_S" --prompt-min 1024 \
        --prompt-max 1024 --out-len 256 --out "$OUT/latency_$SHAPE.json" 2> "$OUT/latency_$SHAPE.log"; tail -20 "$OUT/latency_$SHAPE.log" ;;
    generate)  # duoka generate: batch-1 decode as a user runs it
      duoka generate --model "$MODEL" --prompt "hello" --max-new-tokens 256 --ignore-eos > /dev/null 2> "$OUT/generate_$SHAPE.log"
      tail -1 "$OUT/generate_$SHAPE.log" ;;
  esac
done
