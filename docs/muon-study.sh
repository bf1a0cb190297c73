#!/usr/bin/env bash
# The token-efficiency study of docs/muon.md: the default job (`ndtrain train`, 2 CPU processes
# or every local GPU) with AdamW and with Muon (train.optimizer=muon), each at the learning
# rates of a small grid on the first seed, then each optimizer's best rate (lowest final
# validation loss) on the other seeds. Every run evaluates every 20 steps (evaluation does not
# change training).
# Usage: [STEPS=400] [ADAMW_LRS="0.0015 0.003 0.006"] [MUON_LRS="0.003 0.006 0.012"] \
#          [EXTRA="KEY=VALUE ..."] bash docs/muon-study.sh OUT [SEEDS...]
#   (seeds default to 0 1 2; the grid runs on the first)
# Results: OUT/results.jsonl (one line per run: optimizer, lr, seed, the validation curve,
# training seconds); then python docs/muon_study_plot.py OUT docs/muon-study.png prints the
# grid, the per-seed table and, last, the mean ratio of Muon's steps to AdamW's.
# A run already in results.jsonl is skipped.
set -euo pipefail
out=${1:?usage: muon-study.sh OUT [SEEDS...]}; shift
read -r -a seeds <<< "${*:-0 1 2}"
steps=${STEPS:-400}
read -r -a extra <<< "${EXTRA:-}"
mkdir -p "$out"
touch "$out/results.jsonl"

run() {  # optimizer lr seed
  local opt=$1 lr=$2 s=$3 name="$1-$2-$3"
  if grep -q "\"name\": \"$name\"" "$out/results.jsonl"; then return; fi
  local t0; t0=$(date +%s.%N)
  python -m ndtrain.cli train train.optimizer="$opt" train.lr="$lr" "${extra[@]}" train.seed="$s" \
    train.steps="$steps" train.eval_every=20 run.progress=false run.dir="$out/$name" > "$out/$name.log" 2>&1
  python - "$name" "$opt" "$lr" "$s" "$out/$name" "$t0" "$(date +%s.%N)" "$(uptime)" >> "$out/results.jsonl" <<'PY'
import json, sys
name, opt, lr, seed, run, t0, t1, load = sys.argv[1:]
rows = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
curve = [[r["step"] + 1, r["val_loss"]] for r in rows if r.get("val_loss") is not None]
print(json.dumps({"name": name, "optimizer": opt, "lr": float(lr), "seed": int(seed), "val": curve,
                  "train_s": round(sum(r["step_time_s"] for r in rows), 1), "wall_s": round(float(t1) - float(t0), 1),
                  "load": load.split("load average:")[-1].strip()}))
PY
}

best() {  # optimizer: the grid's lr with the lowest final validation loss on the first seed
  python - "$out/results.jsonl" "$1" "${seeds[0]}" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
rows = [r for r in rows if r["optimizer"] == sys.argv[2] and r["seed"] == int(sys.argv[3])]
print(min(rows, key=lambda r: r["val"][-1][1])["lr"])
PY
}

for lr in ${ADAMW_LRS:-0.0015 0.003 0.006}; do run adamw "$lr" "${seeds[0]}"; done
for lr in ${MUON_LRS:-0.003 0.006 0.012}; do run muon "$lr" "${seeds[0]}"; done
for s in "${seeds[@]:1}"; do
  run adamw "$(best adamw)" "$s"
  run muon "$(best muon)" "$s"
done
