#!/usr/bin/env bash
# The convergence study of docs/fp8.md: the default job (`ndtrain train`, 2 CPU processes or
# every local GPU) in bf16 and in fp8 with each recipe (arms: tensorwise rowwise blockwise
# mxfp8, and nvfp4, nvfp4-nohadamard, nvfp4-nosr, nvfp4-1d, nvfp4-notail), for each seed, one run after the other;
# and in fp32, a control: how far another precision's rounding alone moves a run from bf16's.
# Every run evaluates every 50 steps (evaluation does not change training).
# Usage: [STEPS=400] [ARMS="bf16 fp32 tensorwise rowwise blockwise"] [EXTRA="KEY=VALUE ..."] \
#          bash docs/fp8-study.sh OUT [SEEDS...]
#   (seeds default to 0 1 2; STEPS < 400 is a short version to check the script works; EXTRA
#   reaches every run, e.g. EXTRA="model.preset=125M" for a longer study)
# Results: OUT/results.jsonl (one line per run: arm, seed, final validation loss, training
# seconds); then python docs/fp8_study_plot.py OUT docs/fp8-study.png prints the table of
# relative gaps to bf16, whose last line is the largest mean gap.
# A run already in results.jsonl is skipped; an interrupted one resumes from its checkpoint.
set -euo pipefail
out=${1:?usage: fp8-study.sh OUT [SEEDS...]}; shift
seeds=${*:-0 1 2}
arms=${ARMS:-bf16 fp32 tensorwise rowwise blockwise}
steps=${STEPS:-400}
read -r -a extra <<< "${EXTRA:-}"
mkdir -p "$out"
touch "$out/results.jsonl"
for s in $seeds; do
  for arm in $arms; do
    if grep -q "\"arm\": \"$arm\", \"seed\": $s," "$out/results.jsonl"; then continue; fi
    case "$arm" in
      bf16|fp32) precision=(train.precision="$arm") ;;
      nvfp4) precision=(train.precision=nvfp4) ;;
      nvfp4-nohadamard) precision=(train.precision=nvfp4 train.nvfp4_hadamard=false) ;;
      nvfp4-nosr) precision=(train.precision=nvfp4 train.nvfp4_stochastic_rounding=false) ;;
      nvfp4-1d) precision=(train.precision=nvfp4 train.nvfp4_2d_weights=false) ;;
      nvfp4-notail) precision=(train.precision=nvfp4 train.nvfp4_base_blocks=0) ;;
      *) precision=(train.precision=fp8 train.fp8_recipe="$arm") ;;
    esac
    t0=$(date +%s.%N)
    python -m ndtrain.cli train "${precision[@]}" "${extra[@]}" train.seed="$s" train.steps="$steps" train.eval_every=50 \
      run.progress=false run.dir="$out/$arm-$s" > "$out/$arm-$s.log" 2>&1
    python - "$arm" "$s" "$out/$arm-$s" "$t0" "$(date +%s.%N)" "$(uptime)" >> "$out/results.jsonl" <<'PY'
import json, sys
arm, seed, run, t0, t1, load = sys.argv[1:]
rows = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
val = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
print(json.dumps({"arm": arm, "seed": int(seed), "val_loss": val[-1], "steps": rows[-1]["step"] + 1,
                  "train_s": round(sum(r["step_time_s"] for r in rows), 1), "wall_s": round(float(t1) - float(t0), 1),
                  "load": load.split("load average:")[-1].strip()}))
PY
  done
done
