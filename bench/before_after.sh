#!/usr/bin/env bash
# Before/after speed check of a change that must not move speed (a refactor, a move of files):
# an older tree (in .before/, ignored by git) and this tree measured the same way, alternately,
# in one device call, each through its own CLI, and the ratio after / before printed for:
#   train: Qwen2-0.5B, `duoka bench --model qwen2-0.5b --layout ddp+compile --micro-batch 16
#          --nproc-per-node 1` (random tokens, seq 2048, bf16, global batch 16, duoka bench's
#          3 warm-up + 10 timed steps): tokens/s/GPU;
#   serve: Qwen2-7B (random bf16 weights, bench/serve_models.py), `duoka bench serve --model M
#          --serve-arg "--max-model-len 4096" --requests 1 --batch1`: one streamed request alone,
#          decode tokens/s (128-token prompt, 256 tokens; the median of 3 pairs of requests).
# The criterion: each ratio within 2% (TOLERANCE=0.02). Issue 36 (the move into duoka/bench/,
# duoka/launch/, ...) asks exactly this; issue 21's check (bench/results/refactor_speed/,
# bench/NOTES.md section 19) was this script's first form (bench/refactor_speed.sh, see git
# history).
#
# Method: the runs of each measurement go in the order ORDER (default before after after
# before for training, SERVE_ORDER before after for serving: a 7B server start takes minutes),
# so that a linear drift of the card favours neither side. Each side compiles into an inductor
# cache of its own (a cached graph can carry another run's kernel choice: bench/NOTES.md
# section 16). Neither tree is pip-installed: each runs from its own folder with PYTHONPATH set
# to it, and the script checks that each side imports its own duoka. Both trees are driven
# through `python -m duoka.cli bench ...` and `... bench serve ...`, whose flags are the same in
# both, never through imports (modules move between trees).
#
# Set up here (REV: the commit before the change; the before copy lives in an ignored folder
# and is carried):
#   rm -rf .before && mkdir .before && git archive REV duoka bench | tar -x -C .before \
#     && git rev-parse REV > .before/REV
# On the device (kind nvidia-h200 or nvidia-h100-x1; carry .before and .wheels, the wheels of
# fastapi, uvicorn and httpx2 and what they need that the device image lacks, for duoka serve):
#   bash bench/before_after.sh                   # writes under $OUT
#   PARTS=train bash bench/before_after.sh       # one measurement only (train | serve)
# Dry run on a CPU (debug flavor, the bundled tiny model served on the CPU; a few minutes):
#   BEFORE_AFTER_CPU=1 OUT=/tmp/ba bash bench/before_after.sh
#
# Results (at most 8 files come back from a device call): $OUT/summary.md (the table, also
# printed last), $OUT/summary.json (every run's figures), $OUT/console.log, $OUT/runs.tar.gz
# (each run's JSON and log, the trees' checks, nvidia-smi before and after). Refreshed after every
# run, so a call stopped at its limit still returns what finished; no run starts once BUDGET
# seconds (default 540) are used. Environment knobs: PARTS, ORDER, SERVE_ORDER, STEPS, WARMUP,
# BUDGET, TOLERANCE, BEFORE, MODEL_DIR.
set -u
ROOT=$(pwd)
OUT=${OUT:-/tmp/before_after}
BEFORE=${BEFORE:-$ROOT/.before}
PARTS=${PARTS:-train serve}
ORDER=${ORDER:-before after after before}
SERVE_ORDER=${SERVE_ORDER:-before after}
BUDGET=${BUDGET:-540}
TOLERANCE=${TOLERANCE:-0.02}
if [ "${BEFORE_AFTER_CPU:-0}" = 1 ]; then
  TRAIN_ARGS="--model debug --layout ddp --seq 64 --micro-batch 2 --steps ${STEPS:-3} --warmup ${WARMUP:-1}"
  SERVE_MODEL=""   # the bundled tiny model
  SERVE_ARGS="--device cpu --max-model-len 1024"
  SERVE_LOAD="--prompt-min 8 --prompt-max 16 --out-len 32"
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
else
  TRAIN_ARGS="--model qwen2-0.5b --layout ddp+compile --micro-batch 16${STEPS:+ --steps $STEPS}${WARMUP:+ --warmup $WARMUP}"
  SERVE_MODEL=7b
  SERVE_ARGS="--max-model-len 4096"
  SERVE_LOAD=""
fi
W=$(mktemp -d /tmp/before_after.XXXXXX)   # per-run files; packed into $OUT/runs.tar.gz
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
START=$SECONDS
say() { echo "[before_after +$((SECONDS - START))s] $*"; }

main() {
# --- checks: both trees present and different, each side imports its own duoka ----------------
for f in "$BEFORE/duoka/cli.py" "$ROOT/duoka/cli.py"; do
  [ -f "$f" ] || { say "missing $f (see the set-up lines at the top of this script)"; exit 2; }
done
tree_hash() { (cd "$1" && find duoka -name '*.py' | LC_ALL=C sort | xargs sha1sum | sha1sum | cut -c1-12); }
HB=$(tree_hash "$BEFORE"); HA=$(tree_hash "$ROOT")
say "before: $BEFORE (rev $(cat "$BEFORE/REV" 2>/dev/null || echo unknown), duoka/*.py hash $HB)"
say "after:  $ROOT (duoka/*.py hash $HA)"
[ "$HB" = "$HA" ] && say "WARNING: the before and after trees hold the same duoka/*.py"
for side in before after; do
  tree=$ROOT; [ $side = before ] && tree=$BEFORE
  got=$(cd "$tree" && PYTHONPATH=$tree python3 -c 'import duoka, os; print(os.path.realpath(duoka.__file__))')
  echo "$side imports $got" >> "$W/imports.txt"
  case "$got" in "$(realpath "$tree")"/duoka/*) say "$side imports $got";;
    *) say "ERROR: $side imports $got, not its own tree"; exit 3;; esac
done
if [ -d .wheels ] && ! python3 -c 'import fastapi, uvicorn, httpx2' 2>/dev/null; then
  python3 -m pip install -q --no-index --find-links .wheels fastapi uvicorn httpx2 2>&1 | tail -1
fi
{ nvidia-smi 2>&1; nvidia-smi --query-compute-apps=pid,used_memory --format=csv 2>&1
  python3 -c 'import torch; print("torch", torch.__version__)'
} > "$W/env_before.txt" 2>&1
grep -E "^torch|H100|H200|MiB /" "$W/env_before.txt" | head -5

pack() {  # summary and archive after every run
  python3 - "$W" "$OUT" "$TOLERANCE" <<'EOF'
import json, pathlib, statistics, sys
w, out, tolerance = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), float(sys.argv[3])
runs = [json.loads(p.read_text()) for p in sorted(w.glob("run-*.meta.json"))]
summary, lines, verdicts = {"runs": runs, "tolerance": tolerance, "measurements": {}}, [], []
lines.append("| measurement | side | runs | mean | after / before | largest same-side spread |")
lines.append("|---|---|---|---|---|---|")
for m in dict.fromkeys(r["measurement"] for r in runs):
    side = {}
    for s in ("before", "after"):
        ok = [r["value"] for r in runs if r["measurement"] == m and r["side"] == s and r.get("value") is not None]
        bad = [r["name"] for r in runs if r["measurement"] == m and r["side"] == s and r.get("value") is None]
        side[s] = {"values": ok, "mean": statistics.mean(ok) if ok else None, "failed": bad,
                   "spread": (max(ok) - min(ok)) / statistics.mean(ok) if len(ok) > 1 else None}
    b, a = side["before"]["mean"], side["after"]["mean"]
    ratio = a / b if a and b else None
    spread = max((side[s]["spread"] or 0) for s in side)
    unit = next(r["unit"] for r in runs if r["measurement"] == m)
    summary["measurements"][m] = {**side, "unit": unit, "after_over_before": ratio, "largest_spread": spread}
    for s in ("before", "after"):
        d = side[s]
        vals = ", ".join(f"{x:,.1f}" for x in d["values"])
        if d["failed"]:
            vals += f" ({len(d['failed'])} failed or skipped)"
        mean = "-" if d["mean"] is None else f"{d['mean']:,.1f}"
        ratio_text = f"{ratio:.4f}" if s == "after" and ratio else ""
        spread_text = f"{100 * spread:.2f}%" if s == "after" else ""
        lines.append(f"| {m} ({unit}) | {s} | {vals or '-'} | {mean} | {ratio_text} | {spread_text} |")
    verdicts.append(f"{m}: after/before " + ("not measured" if ratio is None else
                    f"{ratio:.4f} ({100 * (ratio - 1):+.2f}%): {'WITHIN' if abs(ratio - 1) <= tolerance else 'OUTSIDE'} "
                    f"{100 * tolerance:g}%; largest same-side spread {100 * spread:.2f}%"))
summary["verdicts"] = verdicts
text = "\n".join(lines + [""] + verdicts) + "\n"
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
(out / "summary.md").write_text(text)
print(text, end="")
EOF
  tar -czf "$OUT/runs.tar.gz.tmp" -C "$W" . && mv "$OUT/runs.tar.gz.tmp" "$OUT/runs.tar.gz"
}

record() {  # NAME MEASUREMENT SIDE RC WALL: the run's figure from its JSON into NAME.meta.json
  python3 - "$W/$1.json" "$W/$1.meta.json" "$@" <<'EOF'
import json, sys
src, dst, name, measurement, side, rc, wall = sys.argv[1:]
key, unit = {"train": ("tokens_per_s_per_gpu", "tok/s/GPU"), "serve": ("batch1_tokens_per_s", "batch-1 tok/s")}[measurement]
meta = {"name": name, "measurement": measurement, "side": side, "rc": int(rc), "wall_s": int(wall), "unit": unit,
        "value": None}
try:
    r = json.loads(open(src).read())
    meta["value"] = r[key]
    if measurement == "train":
        meta.update(mfu=r.get("mfu"), peak_gib=r.get("peak_mem_gib"), step_s=r.get("step_time_s"),
                    step_times_s=r.get("step_times_s"), breakdown_s=r.get("breakdown_s"))
    else:
        meta.update(batch1=r.get("batch1"), total_tokens_per_s=r.get("total_tokens_per_s"))
except Exception as e:
    meta["error"] = f"{type(e).__name__}: {e}"
open(dst, "w").write(json.dumps(meta) + "\n")
print(json.dumps({k: meta.get(k) for k in ("name", "rc", "wall_s", "value", "error") if k in meta}))
EOF
}

# --- the runs ----------------------------------------------------------------------------------
i=0
for part in $PARTS; do
  order=$ORDER; [ "$part" = serve ] && order=$SERVE_ORDER
  model_dir=""
  if [ "$part" = serve ] && [ -n "$SERVE_MODEL" ]; then  # one random model folder for both sides
    model_dir=${MODEL_DIR:-$(python3 -c "import sys; sys.path.insert(0, 'bench'); from serve_models import make_folder; print(make_folder('$SERVE_MODEL'))" 2>"$W/make_folder.log" | tail -1)}
    [ -f "$model_dir/config.json" ] || { say "no model folder for serving (see make_folder.log in runs.tar.gz)"; pack > /dev/null; continue; }
    say "serving $model_dir"
  fi
  for side in $order; do
    i=$((i + 1)); name=$(printf 'run-%02d-%s-%s' $i "$part" $side)
    left=$((BUDGET - (SECONDS - START)))
    if [ $left -lt 45 ]; then
      say "$name skipped: budget ($BUDGET s) used"
      echo "{\"name\": \"$name\", \"measurement\": \"$part\", \"side\": \"$side\", \"skipped\": true, \"unit\": \"\"}" \
        > "$W/$name.meta.json"
      continue
    fi
    limit=$(( left + 30 < 420 ? left + 30 : 420 ))
    say "$name: start (limit $limit s)"
    t0=$SECONDS
    tree=$ROOT; [ $side = before ] && tree=$BEFORE
    if [ "$part" = train ]; then
      # shellcheck disable=SC2086
      (cd "$tree" && PYTHONPATH=$tree TORCHINDUCTOR_CACHE_DIR=/tmp/ic_ba_$side timeout -k 15 $limit \
        python3 -m duoka.cli bench $TRAIN_ARGS --nproc-per-node 1 --timeout $limit --out "$W/$name.json") \
        > "$W/$name.log" 2>&1
    else
      # shellcheck disable=SC2086
      (cd "$tree" && PYTHONPATH=$tree TORCHINDUCTOR_CACHE_DIR=/tmp/ic_ba_$side timeout -k 15 $limit \
        python3 -m duoka.cli bench serve ${model_dir:+--model "$model_dir"} --serve-arg "$SERVE_ARGS" --requests 1 \
        $SERVE_LOAD --batch1 --out "$W/$name.json") > "$W/$name.log" 2>&1
    fi
    rc=$?
    record "$name" "$part" "$side" "$rc" "$((SECONDS - t0))"
    [ $rc -ne 0 ] && { say "$name failed (rc $rc); its log ends:"; tail -8 "$W/$name.log"; }
    pack > /dev/null
  done
done
nvidia-smi --query-compute-apps=pid,used_memory --format=csv > "$W/env_after.txt" 2>&1
say "done"
pack
}

main 2>&1 | tee -a "$OUT/console.log"   # tee inside the script: the table is printed before it returns
exit "${PIPESTATUS[0]}"
