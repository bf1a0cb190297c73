#!/usr/bin/env bash
# The RL study of docs/rl.md: from one SFT warm-start (the default job's, cached), for each
# seed, one run after the other on 2 CPU processes:
#   grpo      the default job's GRPO                       (ndtrain rl)
#   shuffled  the same with rewards permuted over the batch (rl.shuffle_rewards=true)
#   sft       more SFT from the warm-start at a constant lr $SFT_LR (default 3e-4, where the
#             warm-up's schedule ended), stopped by run.stop_after_s after as many seconds of
#             training as the grpo run's rollouts and updates took (its step_time_s summed),
#             then evaluated on the same held-out prompts (ndtrain rl --evaluate)
# Usage: [ARMS="grpo shuffled sft"] [SFT_LR=..] bash docs/rl-study.sh OUT [SEEDS...]
# Results: OUT/results.jsonl, one line per run (train_s: seconds of training, evaluation
# and start-up excluded; wall_s: the whole command).
set -euo pipefail
out=${1:?usage: rl-study.sh OUT [SEEDS...]}; shift
seeds=${*:-0 1 2}
arms=${ARMS:-grpo shuffled sft}
sft_lr=${SFT_LR:-3e-4}
mkdir -p "$out"
nd="python -m ndtrain.cli"
cache="$out/cache"
# the warm-up, once (cached): the former fixed 350 steps, unchecked, which this study used
[ -f "$out/start.log" ] || $nd rl --evaluate rl.warmup_target=0 rl.warmup_steps=350 data.cache_dir="$cache" \
  > "$out/start.log"
warm=$(ls -d "$cache"/rl-warmup/*/run | head -1)
record() {  # record ARM SEED RUN_DIR T0 T1 [EVAL_LOG]: one line of results.jsonl
  python - "$@" >> "$out/results.jsonl" <<'PY'
import json, re, sys
from pathlib import Path
arm, seed, run, t0, t1, *ev = sys.argv[1:]
rows = [json.loads(l) for l in open(f"{run}/metrics.jsonl")]
start = float(re.search(r"pass@1 ([0-9.]+)", (Path(run).parent / "start.log").read_text()).group(1))
end = float(re.search(r"pass@1 ([0-9.]+)", open(ev[0]).read()).group(1)) if ev else rows[-1]["pass@1"]
print(json.dumps({"arm": arm, "seed": int(seed), "start": start, "end": end, "steps": len(rows),
                  "train_s": round(sum(r["step_time_s"] for r in rows), 1), "wall_s": round(float(t1) - float(t0), 1)}))
PY
}
for s in $seeds; do
  for arm in $arms; do
    t0=$(date +%s.%N)
    if [ $arm != sft ]; then
      extra=(); [ $arm = shuffled ] && extra=(rl.shuffle_rewards=true)
      $nd rl model.init_from=run:"$warm" train.seed=$s data.cache_dir="$cache" run.dir="$out/$arm-$s" "${extra[@]}" \
        > "$out/$arm-$s.log"
      record $arm $s "$out/$arm-$s" $t0 $(date +%s.%N)
      continue
    fi
    budget=$(python -c "import json,sys; print([r for r in map(json.loads, open(sys.argv[1])) if r['arm']=='grpo' and r['seed']==$s][-1]['train_s'])" "$out/results.jsonl")
    $nd sft model.init_from=run:"$warm" train.seed=$s data.path="$(dirname "$warm")/train.jsonl" train.steps=100000 \
      run.stop_after_s=$budget train.seq_len=64 train.global_batch=32 train.lr=$sft_lr train.min_lr_ratio=1.0 \
      train.warmup=0 train.eval_every=0 train.log_every=20 data.packing=bfd data.template=builtin sft.generate=0 \
      run.plot=false run.dir="$out/sft-$s" > "$out/sft-$s.log"
    t1=$(date +%s.%N)
    $nd rl --evaluate model.init_from=run:"$out/sft-$s" data.cache_dir="$cache" > "$out/sft-$s.eval.log"
    record sft $s "$out/sft-$s" $t0 $t1 "$out/sft-$s.eval.log"
  done
done
