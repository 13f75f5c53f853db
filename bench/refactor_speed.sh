#!/usr/bin/env bash
# Issue 21's speed check: duoka before the refactor (a copy of commit f9c9b36's duoka/ in
# .before/), duoka after it (this tree) and the transformers peer (.peer/, a copy of
# ../shared/peer/), Qwen2-0.5B and Qwen2-1.5B, DDP + compile, micro-batch 8, seq 2048, bf16,
# random tokens, one GPU, global batch 8 on every side, all in one device call.
#
# Method (session 9's, bench/results/speed.md): each duoka run is one `duoka bench` of its own
# tree (3 warm-up + 8 timed steps; tokens/s/GPU = timed tokens / timed time); the peer is
# ../shared/peer/hf_qwen2_baseline.py under torchrun with --compile and the same counts.
# Per model the runs go peer, before, after, after, before, peer: every side's mean position is
# the same, so a linear drift of the card favours none. Each side compiles into its own
# inductor cache (a cached graph can carry another run's kernel choice: bench/NOTES.md section
# 16). Neither tree is pip-installed: each runs from its own folder with PYTHONPATH set to it,
# and the script checks which duoka each side imports.
#
# Set up here (the before copy must be in an ignored folder and carried):
#   rm -rf .before .peer && mkdir .before && git archive f9c9b36 duoka | tar -x -C .before \
#     && git rev-parse f9c9b36 > .before/REV && cp -r ../shared/peer .peer
# On the device (carry .before and .peer):
#   bash bench/refactor_speed.sh                      # writes under $OUT
# Dry run on CPU (debug flavor / the peer's tiny model, eager, a few steps, about a minute):
#   REFSPEED_CPU=1 OUT=/tmp/rs bash bench/refactor_speed.sh
#
# Results (at most 8 files come back from the device): $OUT/summary.md (the table, also printed
# last), $OUT/summary.json (every run's figures), $OUT/console.log, $OUT/runs.tar.gz (each run's
# JSON and log, the trees' checks, nvidia-smi before and after). Refreshed after every run, so a
# call stopped at its limit still returns what finished. Environment knobs: MODELS, ORDER,
# STEPS, WARMUP, BUDGET (seconds; no run starts once it is used up; default 540), BEFORE, PEER.
set -u
ROOT=$(pwd)
OUT=${OUT:-/tmp/refactor_speed}
BEFORE=${BEFORE:-$ROOT/.before}
PEER=${PEER:-$ROOT/.peer/hf_qwen2_baseline.py}
ORDER=${ORDER:-peer before after after before peer}
BUDGET=${BUDGET:-540}
if [ "${REFSPEED_CPU:-0}" = 1 ]; then
  MODELS=${MODELS:-debug:tiny}; LAYOUT=ddp; SEQ=64; MB=2; STEPS=${STEPS:-3}; WARMUP=${WARMUP:-1}; PEER_COMPILE=
  ORDER=${REFSPEED_CPU_ORDER:-before after peer}
else
  MODELS=${MODELS:-qwen2-1.5b:1.5b qwen2-0.5b:0.5b}; LAYOUT=ddp+compile; SEQ=2048; MB=8
  STEPS=${STEPS:-8}; WARMUP=${WARMUP:-3}; PEER_COMPILE=--compile
fi
W=$(mktemp -d /tmp/refactor_speed.XXXXXX)   # per-run files; packed into $OUT/runs.tar.gz
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
START=$SECONDS
say() { echo "[refactor_speed +$((SECONDS - START))s] $*"; }

main() {
# --- checks: both trees present and different, each side imports its own duoka ----------------
for f in "$BEFORE/duoka/cli.py" "$ROOT/duoka/cli.py" "$PEER"; do
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
{ nvidia-smi 2>&1; nvidia-smi --query-compute-apps=pid,used_memory --format=csv 2>&1
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
} > "$W/env_before.txt" 2>&1
cat "$W/env_before.txt" | grep -E "torch|H200|MiB /" | head -5

pack() {  # summary and archive after every run
  python3 - "$W" "$OUT" "$ORDER" <<'EOF'
import json, pathlib, statistics, sys
w, out, order = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3].split()
runs = [json.loads(p.read_text()) for p in sorted(w.glob("run-*.meta.json"))]
models = list(dict.fromkeys(r["model"] for r in runs))
summary, lines = {"runs": runs, "models": {}}, []
def mean(xs): return statistics.mean(xs) if xs else None
def f(x, fmt): return "-" if x is None else format(x, fmt)
lines.append("| model | side | runs: tok/s/GPU | mean tok/s/GPU | MFU | peak GiB | after / before | duoka / peer |")
lines.append("|---|---|---|---|---|---|---|---|")
for m in models:
    side = {}
    for s in ("before", "after", "peer"):
        ok = [r for r in runs if r["model"] == m and r["side"] == s and r.get("tok_s") is not None]
        bad = [r for r in runs if r["model"] == m and r["side"] == s and r.get("tok_s") is None]
        side[s] = {"tok_s": [round(r["tok_s"]) for r in ok], "mean_tok_s": mean([r["tok_s"] for r in ok]),
                   "mfu": mean([r["mfu"] for r in ok if r.get("mfu") is not None]),
                   "peak_gib": max((r["peak_gib"] for r in ok if r.get("peak_gib") is not None), default=None),
                   "failed": [r["name"] for r in bad]}
    b, a, p = (side[s]["mean_tok_s"] for s in ("before", "after", "peer"))
    ratio = {"after_over_before": a / b if a and b else None,
             "before_over_peer": b / p if b and p else None, "after_over_peer": a / p if a and p else None}
    if b and len(side["before"]["tok_s"]) > 1:
        ratio["before_spread"] = (max(side["before"]["tok_s"]) - min(side["before"]["tok_s"])) / b
    if a and len(side["after"]["tok_s"]) > 1:
        ratio["after_spread"] = (max(side["after"]["tok_s"]) - min(side["after"]["tok_s"])) / a
    summary["models"][m] = {**side, **ratio}
    for s in ("before", "after", "peer"):
        d = side[s]
        vs = {"before": f(ratio["before_over_peer"], ".3f"), "after": f(ratio["after_over_peer"], ".3f"), "peer": ""}[s]
        ab = f(ratio["after_over_before"], ".4f") if s == "after" else ""
        runs_txt = ", ".join(f"{x:,}" for x in d["tok_s"]) + (f" ({len(d['failed'])} failed or skipped)" if d["failed"] else "")
        lines.append(f"| {m} | {s} | {runs_txt or '-'} | {f(d['mean_tok_s'], ',.0f')} | "
                     f"{f(d['mfu'] and 100 * d['mfu'], '.1f')}{'%' if d['mfu'] else ''} | {f(d['peak_gib'], '.1f')} | {ab} | {vs} |")
verdicts = []
for m, d in summary["models"].items():
    r = d["after_over_before"]
    spread = max(d.get("before_spread") or 0, d.get("after_spread") or 0)
    verdicts.append(f"{m}: after/before " + ("not measured" if r is None else
                    f"{r:.4f} ({100 * (r - 1):+.2f}%): {'WITHIN' if abs(r - 1) <= 0.01 else 'OUTSIDE'} 1%"
                    f"; largest same-side spread {100 * spread:.2f}%"))
summary["verdicts"] = verdicts
text = "\n".join(lines + [""] + verdicts) + "\n"
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
(out / "summary.md").write_text(text)
print(text, end="")
EOF
  tar -czf "$OUT/runs.tar.gz.tmp" -C "$W" . && mv "$OUT/runs.tar.gz.tmp" "$OUT/runs.tar.gz"
}

# --- the runs ----------------------------------------------------------------------------------
i=0
for mp in $MODELS; do
  model=${mp%%:*}; peer_model=${mp##*:}
  for side in $ORDER; do
    i=$((i + 1)); name=$(printf 'run-%02d-%s-%s' $i "$model" $side)
    left=$((BUDGET - (SECONDS - START)))
    if [ $left -lt 45 ]; then
      say "$name skipped: budget ($BUDGET s) used"
      echo "{\"name\": \"$name\", \"model\": \"$model\", \"side\": \"$side\", \"skipped\": true}" > "$W/$name.meta.json"
      continue
    fi
    limit=$(( left + 30 < 240 ? left + 30 : 240 ))
    say "$name: start (limit $limit s)"
    t0=$SECONDS
    if [ $side = peer ]; then
      TORCHINDUCTOR_CACHE_DIR=/tmp/ic_peer timeout -k 15 $limit python3 -m torch.distributed.run \
        --nproc-per-node=1 --master-port=29517 "$PEER" --model="$peer_model" --mode=ddp --seq=$SEQ --mbs=$MB \
        --steps=$STEPS --warmup=$WARMUP $PEER_COMPILE > "$W/$name.log" 2>&1
      rc=$?
      grep '^RESULT ' "$W/$name.log" | tail -1 | cut -c8- > "$W/$name.json"
    else
      tree=$ROOT; [ $side = before ] && tree=$BEFORE
      (cd "$tree" && PYTHONPATH=$tree TORCHINDUCTOR_CACHE_DIR=/tmp/ic_$side timeout -k 15 $limit \
        python3 -m duoka.cli bench --model "$model" --layout $LAYOUT --seq $SEQ --micro-batch $MB --steps $STEPS \
        --warmup $WARMUP --nproc-per-node 1 --timeout $limit --out "$W/$name.json") > "$W/$name.log" 2>&1
      rc=$?
    fi
    python3 - "$W/$name.json" "$W/$name.meta.json" "$name" "$model" "$side" "$rc" "$((SECONDS - t0))" <<'EOF'
import json, sys
src, dst, name, model, side, rc, wall = sys.argv[1:]
meta = {"name": name, "model": model, "side": side, "rc": int(rc), "wall_s": int(wall), "tok_s": None}
try:
    r = json.loads(open(src).read())
    if side == "peer":
        meta.update(tok_s=r["tok_s_gpu"], mfu=r["mfu_pct"] / 100, peak_gib=r["peak_mem_gib"], step_s=r["step_s"])
    else:
        meta.update(tok_s=r["tokens_per_s_per_gpu"], mfu=r["mfu"], peak_gib=r["peak_mem_gib"],
                    step_s=r["step_time_s"], step_times_s=r.get("step_times_s"), breakdown_s=r.get("breakdown_s"))
except Exception as e:
    meta["error"] = f"{type(e).__name__}: {e}"
open(dst, "w").write(json.dumps(meta) + "\n")
print(json.dumps({k: meta.get(k) for k in ("name", "rc", "wall_s", "tok_s", "mfu", "peak_gib", "error") if k in meta}))
EOF
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
