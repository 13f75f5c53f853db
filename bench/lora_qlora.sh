#!/usr/bin/env bash
# LoRA and QLoRA on one GPU in one device call (device kind nvidia-h200; from the repository
# root; carry .wheels with torchao's wheel, and .before, an older tree's duoka/ and bench/,
# only for the optional A/B of part 3):
#   bash bench/lora_qlora.sh
#   1. QLoRA's loss criterion (Qwen2-0.5B, bf16 LoRA against NF4 QLoRA, 200 steps) and 7B
#      QLoRA's speed and memory: bench/qlora_loss.py -> $OUT/qlora_loss.json
#   2. LoRA 7B (rank 16, micro-batch 4) against transformers + peft (bench/peers/lora_peer.py):
#      bench/lora_vs_peer.py -> $OUT/lora_7b.json
#   3. if .before exists: the same duoka case from that tree (the A/B of a lever)
#      -> $OUT/lora_7b_before.json
# Reproduces docs/performance.md "LoRA and QLoRA" (the QLoRA paragraph and the `lora_7b` row;
# bench/results/lora/) and docs/lora.md's QLoRA loss figures. (It was bench/lora_issue26.sh.)
# Results (JSON and logs) under $OUT.
set -u
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -1
python3 -m pip install -q --no-index --no-deps .wheels/torchao-*.whl 2>&1 | tail -1
export PYTHONUNBUFFERED=1
PYTHONPATH=$PWD timeout "${QLORA_S:-250}" python3 bench/qlora_loss.py --out "$OUT/qlora_loss.json" \
  --speed-case 7b:4:2048 > "$OUT/qlora_loss.log" 2>&1; tail -4 "$OUT/qlora_loss.log"
PYTHONPATH=$PWD timeout 130 python3 bench/lora_vs_peer.py \
  --out "$OUT/lora_7b.json" --case peer:7b:4 --case duoka:7b:4 --budget-s 125 > "$OUT/lora_7b.log" 2>&1
tail -3 "$OUT/lora_7b.log"
if [ -d .before ]; then
  timeout 70 python3 .before/bench/lora_vs_peer.py --peer bench/peers/lora_peer.py \
    --out "$OUT/lora_7b_before.json" --case duoka:7b:4 --budget-s 65 > "$OUT/lora_7b_before.log" 2>&1
  tail -2 "$OUT/lora_7b_before.log"
fi
