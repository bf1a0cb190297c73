#!/usr/bin/env bash
# The RL study of docs/rl.md: from one SFT warm-start (the default job's, cached), for each
# seed, one run after the other on 2 CPU processes:
#   grpo      the default job's GRPO                       (ndtrain rl)
#   shuffled  the same with rewards permuted over the batch (rl.shuffle_rewards=true)
#   sft       more SFT from the warm-start for the grpo run's wall-clock (steps = its seconds
#             divided by the warm-up's median step time) at peak lr $SFT_LR (default 3e-3, the
#             warm-up's) decaying to $SFT_MIN_LR_RATIO × it (default 0.1, the warm-up's), then
#             evaluated on the same held-out prompts (ndtrain rl --evaluate)
# Usage: [ARMS="grpo shuffled sft"] [SFT_LR=..] [SFT_MIN_LR_RATIO=..] bash docs/rl-study.sh OUT [SEEDS...]
# Results: OUT/results.jsonl, one line per run (sft arms are named sft@LR).
set -euo pipefail
out=${1:?usage: rl-study.sh OUT [SEEDS...]}; shift
seeds=${*:-0 1 2}
arms=${ARMS:-grpo shuffled sft}
sft_lr=${SFT_LR:-3e-3}
sft_min=${SFT_MIN_LR_RATIO:-0.1}
mkdir -p "$out"
nd="python -m ndtrain.cli"
cache="$out/cache"
[ -f "$out/start.log" ] || $nd rl --evaluate data.cache_dir="$cache" > "$out/start.log"  # the warm-up, once (cached)
warm=$(ls -d "$cache"/rl-warmup/*/run | head -1)
step_s=$(python -c "import json,statistics,sys; print(statistics.median(json.loads(l)['step_time_s'] for l in open(sys.argv[1])))" "$warm/metrics.jsonl")
for s in $seeds; do
  for arm in $arms; do
    if [ $arm != sft ]; then
      extra=(); [ $arm = shuffled ] && extra=(rl.shuffle_rewards=true)
      t0=$(date +%s.%N)
      $nd rl model.init_from=run:"$warm" train.seed=$s data.cache_dir="$cache" run.dir="$out/$arm-$s" "${extra[@]}" \
        > "$out/$arm-$s.log"
      t1=$(date +%s.%N)
      python - "$out/$arm-$s" "$arm" "$s" "$t0" "$t1" >> "$out/results.jsonl" <<'EOF'
import json, sys
run, arm, seed, t0, t1 = sys.argv[1:]
s = json.load(open(f"{run}/summary.json"))
print(json.dumps({"arm": arm, "seed": int(seed), "start": s["start"]["pass@1"], "end": s["final"]["pass@1"],
                  "wall_s": float(t1) - float(t0)}))
EOF
      continue
    fi
    wall=$(python -c "import json,sys; print([r for r in map(json.loads, open(sys.argv[1])) if r['arm']=='grpo' and r['seed']==$s][-1]['wall_s'])" "$out/results.jsonl")
    steps=$(python -c "print(max(1, round($wall / $step_s)))")
    name="sft-$sft_lr-$s"
    t0=$(date +%s.%N)
    $nd sft model.init_from=run:"$warm" train.seed=$s data.path="$(dirname "$warm")/train.jsonl" train.steps=$steps \
      train.seq_len=64 train.global_batch=32 train.lr=$sft_lr train.min_lr_ratio=$sft_min train.warmup=0 \
      train.eval_every=0 data.packing=bfd data.template=builtin sft.generate=0 run.plot=false run.dir="$out/$name" \
      > "$out/$name.log"
    t1=$(date +%s.%N)
    $nd rl --evaluate model.init_from=run:"$out/$name" data.cache_dir="$cache" > "$out/$name.eval.log"
    python - "$out" "$name" "$s" "$steps" "$t0" "$t1" "$sft_lr" >> "$out/results.jsonl" <<'EOF'
import json, re, sys
out, name, seed, steps, t0, t1, lr = sys.argv[1:]
start = float(re.search(r"pass@1 ([0-9.]+)", open(f"{out}/start.log").read()).group(1))
end = float(re.search(r"pass@1 ([0-9.]+)", open(f"{out}/{name}.eval.log").read()).group(1))
print(json.dumps({"arm": f"sft@{lr}", "seed": int(seed), "start": start, "end": end, "steps": int(steps),
                  "wall_s": float(t1) - float(t0)}))
EOF
  done
done
