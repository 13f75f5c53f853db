#!/usr/bin/env bash
# One profiled training step (the 8th) of a one-GPU `duoka train` on random tokens, bf16,
# default settings (compile auto), with extra flags appended: its per-kernel table and the
# phase summary of bench/trace_summary.py go to $OUT/<tag>/.
#   bash bench/profile_train.sh TAG --model.flavor=qwen2-0.5b --training.micro_batch_size=8 [...]
set -euo pipefail
TAG=$1; shift
RUN=$(mktemp -d)/run
duoka train --job.output_dir="$RUN" --data.path=random --training.seq_len=2048 --training.steps=8 \
  --training.global_batch_size=8 --checkpoint.enabled=false --checkpoint.export_final=false \
  --metrics.log_interval=1 --metrics.profile_step=8 "$@" 2> "$OUT/$TAG.log"
mkdir -p "$OUT/$TAG"
cp "$RUN/profile/kernels-rank0.json" "$RUN/metrics.jsonl" "$OUT/$TAG/"
python3 bench/trace_summary.py "$RUN"/profile/trace-rank0.json* > "$OUT/$TAG/phases.txt" 2>&1
tail -2 "$OUT/$TAG.log"
