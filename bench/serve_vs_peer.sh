#!/usr/bin/env bash
# Serving a random Qwen2 of a published shape on one GPU against the transformers peer
# (bench/peers/serve_peer.py), each part in the device call it is given. Reproduces
# docs/performance.md "Serving" (the Qwen2-7B table; bench/results/serve/http_7b.*,
# engine_7b.*, latency_7b.*):
#   bash bench/serve_vs_peer.sh 7b "http latency"      # duoka serve + duoka bench serve --batch1 --vs-peer; the latency run
#   bash bench/serve_vs_peer.sh 7b "engine generate"   # LLM.generate alone (bench/serve_profile.py); duoka generate at batch 1
#   LATENCY_S=60 bash bench/serve_vs_peer.sh 0.5b "http latency"   # a shorter latency run
#   SERVE_EXTRA="--max-prefill-beside-decodes 0" TAG=_cap0 bash bench/serve_vs_peer.sh 7b latency
#                                                  # more serve flags; TAG goes into the output names
# Parts: http (the peer's workload, 256 streamed requests of 128-1,024 random prompt tokens and
# 256 output tokens, through duoka serve's HTTP API, then one request alone, then the peer on
# the same prompts once the server has stopped), engine (the same workload through
# LLM.generate, no HTTP), latency (Poisson arrivals at 4 requests/s, seed 0, 1,024-token
# prompts, 256 output tokens, LATENCY_S seconds), generate (duoka generate at batch 1).
# Device kind nvidia-h200 (7B's KV cache for 256 streams wants its memory); run from the
# repository root; carry .wheels (wheels of fastapi, uvicorn and httpx2 and the packages they
# need that the device image lacks: see the device notes on carrying wheels). The model folder
# (transformers writes it, bf16, seed 0, bench/serve_models.py) goes to /tmp/duoka-models.
# Writes JSON and logs under $OUT; copy them to bench/results/serve/ with the command.
set -uo pipefail
SHAPE=${1:-7b}
PARTS=${2:-"http engine latency generate"}
LATENCY_S=${LATENCY_S:-120}
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -1
python3 -m pip install -q --no-index --find-links .wheels fastapi uvicorn httpx2 2>&1 | tail -1
MODEL=$(python3 -c "import sys; sys.path.insert(0, 'bench'); from serve_models import make_folder; print(make_folder('$SHAPE'))" 2>/dev/null | tail -1)
SERVE="--max-model-len 4096 ${SERVE_EXTRA:-}"
TAG=${TAG:-}
for part in $PARTS; do
  case $part in
    http)  # 256 concurrent streamed requests of the peer's workload, batch-1, the peer on the same prompts
      duoka bench serve --model "$MODEL" --serve-arg "$SERVE" --batch1 --vs-peer \
        --peer-model "$SHAPE" --out "$OUT/http_$SHAPE$TAG.json" 2> "$OUT/http_$SHAPE$TAG.log"; tail -25 "$OUT/http_$SHAPE$TAG.log" ;;
    engine)  # the same workload through LLM.generate, no HTTP
      python3 bench/serve_profile.py --shape "$SHAPE" --out "$OUT/engine_$SHAPE.json" 2>&1 | grep '^{' | tail -1 ;;
    latency)  # Poisson arrivals at 4 requests/s (seed 0), 1,024-token prompts, 256 output tokens, 2 minutes
      duoka bench serve --model "$MODEL" --serve-arg "$SERVE" --request-rate 4 --duration "$LATENCY_S" --prompt-min 1024 \
        --prompt-max 1024 --out-len 256 --out "$OUT/latency_$SHAPE$TAG.json" 2> "$OUT/latency_$SHAPE$TAG.log"
      tail -20 "$OUT/latency_$SHAPE$TAG.log" ;;
    generate)  # duoka generate: batch-1 decode as a user runs it
      duoka generate --model "$MODEL" --prompt "hello" --max-new-tokens 256 --ignore-eos > /dev/null 2> "$OUT/generate_$SHAPE.log"
      tail -1 "$OUT/generate_$SHAPE.log" ;;
  esac
done
