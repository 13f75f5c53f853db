#!/usr/bin/env bash
# Where a compiled Qwen1.5-MoE-A2.7B training step spends its time (issue 40's training target),
# on one GPU, from the repository root (device kind nvidia-h100-x1; nothing to carry):
#   bash bench/moe_train_profile.sh            # -> $OUT/moe_profile/
#   OUT=/tmp/p SHAPE=moe-tiny LAYERS=2 bash bench/moe_train_profile.sh --training.dtype=fp32   # CPU smoke run
# The case is bench/moe_vs_peer.py's H100 one (the shape cut to 12 layers, FSDP2 over one GPU,
# micro-batch 4 x 2048 tokens, bf16, SGD without momentum, compiled), one step recorded with
# --metrics.profile_step: kernels-rank0.json (device time per kernel), the phases of the trace
# (bench/trace_summary.py) and the 30 costliest kernels (top_kernels.txt).
set -u
dir="$OUT/moe_profile"
mkdir -p "$dir"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
folder=$(python3 -c "import sys; sys.path.insert(0, 'bench'); from serve_models import make_folder; \
print(make_folder('${SHAPE:-moe-a2.7b}', layers=${LAYERS:-12}, train=True))")
run=$(mktemp -d)/run
timeout "${TRAIN_S:-300}" python3 -m duoka.cli train --job.output_dir="$run" --model.path="$folder" \
  --data.path=random --training.seq_len=2048 --training.micro_batch_size=4 --training.global_batch_size=4 \
  --training.steps=8 --training.dtype=bf16 --parallel.dp_mode=fsdp --training.compile=true \
  --checkpoint.enabled=false --checkpoint.export_final=false --metrics.log_interval=1 \
  --optimizer.warmup_steps=2 --optimizer.name=sgd --optimizer.sgd_momentum=0 --optimizer.nesterov=false \
  --optimizer.weight_decay=0 --optimizer.lr=1e-4 --metrics.profile_step=7 "$@" > "$dir/train.log" 2>&1
echo "train rc=$?"; tail -4 "$dir/train.log"
cp "$run/metrics.jsonl" "$dir/" 2>/dev/null
cp "$run/profile/kernels-rank0.json" "$dir/" 2>/dev/null
python3 bench/trace_summary.py "$run"/profile/trace-rank0.json* > "$dir/phases.txt" 2>&1; cat "$dir/phases.txt"
gzip -c "$run"/profile/trace-rank0.json > "$dir/trace-rank0.json.gz" 2>/dev/null
python3 - "$dir" <<'EOF' | tee "$dir/top_kernels.txt"
import json, sys
d = json.load(open(f"{sys.argv[1]}/kernels-rank0.json"))
print(d["device"], "total", round(d["total_ms"], 1), "ms of kernels")
for k in d["kernels"][:30]:
    print({key: (round(v, 3) if isinstance(v, float) else v) for key, v in k.items()})
EOF
