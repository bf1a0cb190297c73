#!/usr/bin/env bash
# RL on your own prompts (docs/rl.md, "Your own prompts"): a task ndtrain does not build in,
# written as a JSONL file of {"prompt", "answer"} records, taken the way the docs tell a user to:
#   1. the file: every 2-digit subtraction a-b (0 <= b <= a <= 99) once, answer reversed
#      ("53-17=" -> "63"), shuffled: 5,050 records; ndtrain holds out data.val_fraction of them
#      by a hash of each record's name, for SFT and RL alike
#   2. ndtrain sft on it (its training split), from random weights, the default RL job's model
#      and warm-up settings, a checkpoint every 10 steps
#   3. the start: the first checkpoint whose held-out greedy pass@1 (ndtrain rl --evaluate, on the
#      held-out split) reaches 0.3, found by bisection over the checkpoints
#   4. ndtrain rl model.init_from=run:THAT rl.data=FILE rl.reward=$REWARD (the default GRPO job)
# Usage: [REWARD=exact] bash docs/rl-data-study.sh OUT     Results: OUT/result.json
set -euo pipefail
out=${1:?usage: rl-data-study.sh OUT}
reward=${REWARD:-exact}
mkdir -p "$out"
nd="python -m ndtrain.cli"
file="$out/subtraction.jsonl"
python - "$file" <<'PY'
import json, random, sys
pairs = [(a, b) for a in range(100) for b in range(a + 1)]
random.Random(0).shuffle(pairs)
with open(sys.argv[1], "w") as f:
    for a, b in pairs:
        f.write(json.dumps({"prompt": f"{a}-{b}=", "answer": str(a - b)[::-1]}) + "\n")
PY
chars=$(python -c "from ndtrain.train.rl.job import char_tokenizer_file; print(char_tokenizer_file('$out/cache'))")
if [ ! -f "$out/sft/summary.json" ]; then
  $nd sft model.init_from=scratch model.preset=small data.path="$file" data.tokenizer="$chars" data.template=builtin \
    train.seq_len=64 train.global_batch=32 train.lr=3e-3 train.warmup=20 train.steps=600 train.save_every=10 \
    train.eval_every=0 train.eval_batches=4 sft.generate=0 run.plot=false run.progress=false run.dir="$out/sft" \
    data.cache_dir="$out/cache" > "$out/sft.log" 2>&1
fi
evaluate() {  # held-out greedy pass@1 of checkpoint $1
  $nd rl --evaluate model.init_from=run:"$1" rl.data="$file" rl.reward="$reward" data.cache_dir="$out/cache" \
    2> /dev/null | sed -n 's/.*held-out pass@1 \([0-9.]*\).*/\1/p'
}
ckpts=($(ls -d "$out"/sft/checkpoints/step_* | sort))
lo=0; hi=$((${#ckpts[@]} - 1))
echo "{}" > "$out/checks.json"
while [ $lo -lt $hi ]; do  # the first checkpoint reaching 0.3, assuming pass@1 rises with the steps
  mid=$(((lo + hi) / 2))
  p=$(evaluate "${ckpts[$mid]}")
  echo "$(basename "${ckpts[$mid]}") $p" >> "$out/checks.txt"
  if python -c "import sys; sys.exit(0 if float('$p') >= 0.3 else 1)"; then hi=$mid; else lo=$((mid + 1)); fi
done
start=${ckpts[$lo]}
echo "start: $start" >> "$out/checks.txt"
$nd rl model.init_from=run:"$start" rl.data="$file" rl.reward="$reward" data.cache_dir="$out/cache" \
  run.dir="$out/rl" run.progress=false > "$out/rl.log" 2>&1
python - "$out" "$start" <<'PY'
import json, sys
from pathlib import Path
out, start = sys.argv[1:]
s = json.loads((Path(out) / "rl" / "summary.json").read_text())
result = {"start_checkpoint": Path(start).name, "start": s["start"], "final": s["final"],
          "reward_trend": s.get("reward_trend"), "load": open("/proc/loadavg").read().split()[:3]}
(Path(out) / "result.json").write_text(json.dumps(result, indent=1) + "\n")
print(f"held-out pass@1 {s['start']['pass@1']:.3f} -> {s['final']['pass@1']:.3f} "
      f"({100 * (s['final']['pass@1'] - s['start']['pass@1']):+.1f} points)")
PY
