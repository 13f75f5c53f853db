#!/usr/bin/env bash
# Issue 26's GPU measurements in one device call, on one GPU (carry .wheels with torchao's
# wheel, .peer = ../shared/peer, .before = an older tree's duoka/ and bench/):
#   1. QLoRA's loss criterion and 7B QLoRA speed: bench/qlora_loss.py
#   2. LoRA 7B against transformers + peft, this tree, then the tree in .before (A/B of a lever)
# Results (JSON and logs) under $OUT.
set -u
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -1
python3 -m pip install -q --no-index --no-deps .wheels/torchao-*.whl 2>&1 | tail -1
export PYTHONUNBUFFERED=1
PYTHONPATH=$PWD timeout "${QLORA_S:-250}" python3 bench/qlora_loss.py --out "$OUT/qlora_loss.json" \
  --speed-case 7b:4:2048 > "$OUT/qlora_loss.log" 2>&1; tail -4 "$OUT/qlora_loss.log"
PYTHONPATH=$PWD timeout 130 python3 bench/lora_vs_peer.py --peer .peer/hf_qwen2_lora_baseline.py \
  --out "$OUT/lora_7b.json" --case peer:7b:4 --case duoka:7b:4 --budget-s 125 > "$OUT/lora_7b.log" 2>&1
tail -3 "$OUT/lora_7b.log"
if [ -d .before ]; then
  timeout 70 python3 .before/bench/lora_vs_peer.py --peer .peer/hf_qwen2_lora_baseline.py \
    --out "$OUT/lora_7b_before.json" --case duoka:7b:4 --budget-s 65 > "$OUT/lora_7b_before.log" 2>&1
  tail -2 "$OUT/lora_7b_before.log"
fi
