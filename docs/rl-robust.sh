#!/usr/bin/env bash
# The default RL job across seeds and thread settings (docs/rl.md, "The default job on any CPU"):
# for each thread setting and seed, one after the other on 2 CPU processes:
#   grpo      the whole default job, `ndtrain rl train.seed=SEED`: its SFT warm-up (stopped by its
#             held-out check, run under this setting: each setting has its own cache) and GRPO
#   shuffled  (THREADS_CONTROL only) the same GRPO from the same warm-up with rewards permuted over
#             the batch (rl.shuffle_rewards=true), the negative control
# Thread settings: "omp1" runs with OMP_NUM_THREADS=1; "default" with the environment as it is
# (ndtrain then gives each rank cores / processes threads: run.threads = 0).
# Usage: [SETTINGS="omp1 default"] [THREADS_CONTROL=default] bash docs/rl-robust.sh OUT [SEEDS...]
# Unattended: a row already in OUT/results.jsonl is skipped, so the same command continues an
# interrupted study. Then: python docs/rl_robust_table.py OUT (the table of docs/rl.md; its last
# line says whether every row started in the band and gained at least 15 points).
set -euo pipefail
out=${1:?usage: rl-robust.sh OUT [SEEDS...]}; shift
seeds=${*:-0 1 2}
settings=${SETTINGS:-omp1 default}
control=${THREADS_CONTROL:-default}
mkdir -p "$out"
touch "$out/results.jsonl"
nd="python -m ndtrain.cli"
done_already() {  # done_already ARM SETTING SEED
  python - "$out/results.jsonl" "$@" <<'PY'
import json, sys
path, arm, setting, seed = sys.argv[1:]
rows = [json.loads(l) for l in open(path) if l.strip()]
sys.exit(0 if any(r["arm"] == arm and r["threads"] == setting and r["seed"] == int(seed) for r in rows) else 1)
PY
}
record() {  # record ARM SETTING SEED RUN_DIR WALL_S: one line of results.jsonl
  python - "$@" >> "$out/results.jsonl" <<'PY'
import json, sys, tomllib
from pathlib import Path
arm, setting, seed, run, wall = sys.argv[1:]
summary = json.loads((Path(run) / "summary.json").read_text())
warm = Path(tomllib.loads((Path(run) / "config.toml").read_text())["model"]["init_from"].removeprefix("run:"))
checks = [r for r in map(json.loads, open(warm / "metrics.jsonl")) if "held_out_pass@1" in r]
rows = [json.loads(l) for l in open(Path(run) / "metrics.jsonl")]
print(json.dumps({"arm": arm, "threads": setting, "seed": int(seed), "warmup_steps": checks[-1]["step"] + 1,
                  "warmup_check": checks[-1]["held_out_pass@1"], "start": summary["start"]["pass@1"],
                  "end": summary["final"]["pass@1"], "start_pass_k": summary["start"].get("pass@4"),
                  "end_pass_k": summary["final"].get("pass@4"),
                  "train_s": round(sum(r["step_time_s"] for r in rows), 1), "wall_s": round(float(wall), 1),
                  "load": open("/proc/loadavg").read().split()[:3]}))
PY
}
for setting in $settings; do
  cache="$out/cache-$setting"
  env_prefix=(); [ "$setting" = omp1 ] && env_prefix=(env OMP_NUM_THREADS=1)
  for s in $seeds; do
    if ! done_already grpo "$setting" "$s"; then
      rm -rf "$out/grpo-$setting-$s"
      t0=$(date +%s.%N)
      "${env_prefix[@]}" $nd rl train.seed="$s" data.cache_dir="$cache" run.dir="$out/grpo-$setting-$s" \
        run.progress=false > "$out/grpo-$setting-$s.log" 2>&1
      record grpo "$setting" "$s" "$out/grpo-$setting-$s" "$(python -c "import time; print(time.time() - $t0)")"
    fi
    if [ "$setting" = "$control" ] && ! done_already shuffled "$setting" "$s"; then
      warm=$(python -c "import sys, tomllib; print(tomllib.load(open(sys.argv[1], 'rb'))['model']['init_from'][4:])" \
        "$out/grpo-$setting-$s/config.toml")
      rm -rf "$out/shuffled-$setting-$s"
      t0=$(date +%s.%N)
      "${env_prefix[@]}" $nd rl model.init_from=run:"$warm" train.seed="$s" rl.shuffle_rewards=true \
        data.cache_dir="$cache" run.dir="$out/shuffled-$setting-$s" run.progress=false > "$out/shuffled-$setting-$s.log" 2>&1
      record shuffled "$setting" "$s" "$out/shuffled-$setting-$s" "$(python -c "import time; print(time.time() - $t0)")"
    fi
  done
done
