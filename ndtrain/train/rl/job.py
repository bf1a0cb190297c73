"""What each rank of `ndtrain rl` runs, and the default job's SFT warm-up.

The default job (`ndtrain rl` with no arguments) starts from a model that has seen the
task: a short supervised warm-up on problems of the training split, run through `ndtrain
sft` (on a JSONL file written here) once, and cached under `data.cache_dir/rl-warmup/` by
everything that decides its result.

SFT on a task like addition goes through a sharp transition (held-out pass@1 from under 0.1
to over 0.9 within about 150 steps), whose place depends on the machine's floating-point
path. So the warm-up does not stop at a step count: every `rl.warmup_check_every` steps it
answers `rl.eval_prompts` held-out problems greedily (a sample of the held-out split drawn
apart from the evaluation's) and stops at the first check whose pass@1 reaches
`rl.warmup_target` (`Warmup`, the SFT task with that check), at most `rl.warmup_steps`.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import nullcontext
from pathlib import Path

from ndtrain import config as config_mod
from ndtrain import supervisor
from ndtrain.config import Config, ConfigError
from ndtrain.data.prompts import prompt_source
from ndtrain.data.verifiable import char_tokenizer, draw_problems, make_task
from ndtrain.observe.metrics import read_metrics, strict_json
from ndtrain.parallel.generation import GenerationLayout, Generator
from ndtrain.train.rl.task import RL, Environment, greedy_pass_at_1
from ndtrain.train.sft import SFT
from ndtrain.train.tasks import load_function, probe_scorer

# The warm-up's own settings (ndtrain sft keys), after the RL job's model, seed and device.
WARMUP_SETTINGS = ["train.seq_len=64", "train.global_batch=32", "train.lr=3e-3", "train.warmup=20",
                   "train.eval_batches=4", "data.packing=bfd", "data.template=builtin", "sft.generate=0",
                   "run.plot=false"]
MODEL_KEYS = ("preset", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "tie_embeddings", "head_dim",
              "dropout") + tuple(f"moe_{k}" for k in ("experts", "top_k", "shared_experts", "ffn_dim", "every"))
TASK_KEYS = ("task", "size", "reverse_answer", "eval_prompts", "max_new_tokens", "warmup_target")
PASS_KEY = "held_out_pass@1"  # the warm-up's check in its metrics.jsonl


def warmup_overrides(cfg: Config, folder: Path) -> list[str]:
    """The `ndtrain sft` overrides of the warm-up into `folder`."""
    r = cfg.rl
    model = [f"model.{k}={getattr(cfg.model, k)}" for k in MODEL_KEYS if getattr(cfg.model, k) is not None]
    return model + WARMUP_SETTINGS + [f"rl.{k}={getattr(r, k)}" for k in TASK_KEYS] + [
        "model.init_from=scratch", f"data.path={folder / 'train.jsonl'}", f"data.tokenizer={folder / 'chars.json'}",
        f"train.steps={r.warmup_steps}", f"train.eval_every={r.warmup_check_every if r.warmup_target else 0}",
        f"train.seed={cfg.train.seed}", f"run.dir={folder / 'run'}", f"run.device={cfg.run.device}",
        f"data.cache_dir={cfg.data.cache_dir}", f"run.progress={cfg.run.progress}"]


class Warmup(SFT):
    """The SFT task of the default job's warm-up, which also answers held-out problems of
    rl.task greedily at every evaluation (`held_out_pass@1` in metrics.jsonl) and ends
    training at the first evaluation whose pass@1 reaches rl.warmup_target."""

    def __init__(self, cfg: Config, data):
        super().__init__(cfg, data)
        self.cfg, self.env = cfg, Environment(cfg, data.template)
        self.problems = self.env.draw(0, "warmup-check", cfg.rl.eval_prompts, "held_out")
        self.generator = None

    def evaluate(self, trainer) -> dict:
        out = super().evaluate(trainer)
        if self.problems:
            if self.generator is None:
                self.generator = Generator(trainer.par, self.cfg, trainer.args, GenerationLayout(trainer.mesh, self.cfg))
            out[PASS_KEY] = greedy_pass_at_1(self.generator, self.cfg, self.env, self.problems)
        return out

    def done(self, record: dict) -> bool:
        target = self.cfg.rl.warmup_target
        return bool(target) and record.get(PASS_KEY, -1.0) >= target


def describe_warmup(cfg: Config, run: Path) -> str:
    """Where the warm-up in `run` stopped, in one line."""
    checks = [r for r in read_metrics(run / "metrics.jsonl") if PASS_KEY in r]
    if not checks:
        return f"ndtrain rl: SFT warm-up: {cfg.rl.warmup_steps} steps (no held-out check)"
    last, target = checks[-1], cfg.rl.warmup_target
    why = "reached" if last[PASS_KEY] >= target else "did not reach (rl.warmup_steps ran out)"
    return (f"ndtrain rl: SFT warm-up stopped after {last['step'] + 1} steps at held-out pass@1 {last[PASS_KEY]:.3f}: "
            f"{why} rl.warmup_target = {target:g}")


def warmup_folder(cfg: Config) -> Path:
    """Where the warm-up of this configuration lives: named by a hash of everything that
    decides its result (the task, the examples, the model, the steps, the seed)."""
    r = cfg.rl
    what = {"task": r.task, "size": r.size, "reverse": r.reverse_answer, "examples": r.warmup_examples,
            "steps": r.warmup_steps, "seed": cfg.train.seed, "settings": WARMUP_SETTINGS,
            "target": r.warmup_target, "every": r.warmup_check_every, "checked": r.eval_prompts,
            "model": {k: getattr(cfg.model, k) for k in MODEL_KEYS}}
    key = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:12]
    return Path(cfg.data.cache_dir).expanduser() / "rl-warmup" / f"{r.task}{r.size}-{key}"


def write_warmup_data(cfg: Config, folder: Path) -> None:
    """The warm-up's examples (training split only) and the task's character tokenizer."""
    r = cfg.rl
    folder.mkdir(parents=True, exist_ok=True)
    task = make_task(r.task, r.size, r.reverse_answer)
    problems = draw_problems(task, cfg.train.seed, "sft", r.warmup_examples, "train")
    lines = "".join(json.dumps({"prompt": p.prompt, "completion": p.answer}) + "\n" for p in problems)
    (folder / "train.jsonl").write_text(lines)
    char_tokenizer().save(folder / "chars.json")


def char_tokenizer_file(cache_dir: str) -> Path:
    """The tasks' character tokenizer as a tokenizer.json under `cache_dir` (written once)."""
    path = Path(cache_dir).expanduser() / "rl-chars" / "tokenizer.json"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        char_tokenizer().save(path)
    return path


def row_length(cfg: Config, rounded: bool = True, template=None) -> int:
    """train.seq_len for the rows: the longest prompt (rl.task's in characters, which no
    tokenizer of ours exceeds; rl.data's in tokens as `template` renders it) and
    rl.max_new_tokens, rounded up to a multiple of 8 (so context and sequence parallelism
    can cut it)."""
    if cfg.rl.data:
        source = prompt_source(cfg)
        longest = max(len(template.prompt_ids(p.conversation)) for split in source.splits.values() for p in split)
    else:
        longest = make_task(cfg.rl.task, cfg.rl.size, cfg.rl.reverse_answer).max_prompt_chars
    need = longest + cfg.rl.max_new_tokens
    return -(-need // 8) * 8 if rounded else need


def check_reward(cfg: Config) -> list[str]:
    """rl.data reads, and rl.reward imports and returns a number for a sample problem's
    reference answer. Raises ConfigError or DataError before anything starts. Returns the
    records of rl.data skipped (data.on_bad_record=skip), "FILE:LINE: why" each."""
    r = cfg.rl
    source = prompt_source(cfg)  # rl.data's file, read and checked (DataError)
    skipped = getattr(source, "skipped", [])
    if r.reward in ("builtin", "exact", "math"):
        return skipped
    fn = load_function("rl.reward", r.reward)
    p = source.draw(0, "probe", 1, "train")[0]
    sample = f"a sample (prompt {p.prompt!r}, completion {p.answer!r}, answer {p.answer!r})"
    probe_scorer("rl.reward", r.reward, fn, (p.prompt, p.answer, p.answer), sample)
    return skipped


def finished(run: Path) -> bool:
    """The warm-up in `run` trained every step (not stopped by a signal) and saved."""
    from ndtrain.checkpoint import store
    summary = run / "summary.json"
    return summary.is_file() and not json.loads(summary.read_text()).get("stopped") and store.latest(run) is not None


# ----------------------------------------------------------------------------- one rank

def rl_worker(cfg_dict: dict, run_dir: str, template, evaluate_only: bool = False) -> dict:
    """Entry point of one rank of `ndtrain rl`. Returns the summary on rank 0 ({} elsewhere).
    Stops and restarts like `train`'s ranks (supervisor.py)."""
    control = supervisor.control()
    with nullcontext() if control.watched else supervisor.stop_signals():
        return _rl(config_mod.from_dict(cfg_dict), run_dir, template, evaluate_only, control)


def _rl(cfg: Config, run_dir: str, template, evaluate_only: bool, control) -> dict:
    from ndtrain.launch import init_process, shutdown
    from ndtrain.train.worker import from_rank_0, start_trainer, write_posttrain_files

    env = init_process(cfg.run.device, cfg.run.threads, cfg.run.collective_timeout_s)
    try:
        run = Path(from_rank_0(run_dir)) if not evaluate_only else None
        trainer = start_trainer(cfg, env, lambda: RL(cfg, Environment(cfg, template)), run, control)
        task, mesh = trainer.task, trainer.mesh
        if evaluate_only:
            try:
                result = task.evaluate(trainer)
            except supervisor.Interrupted:  # a stop request: nothing to save
                result = {"interrupted": True}
            return result if mesh.rank == 0 else {}
        if env.rank == 0:
            write_posttrain_files(cfg, run, template)
        try:
            return reinforce(trainer, task, cfg, run)
        finally:
            task.close()  # the generator processes of asynchronous RL
    finally:
        shutdown()


def reinforce(trainer, task: RL, cfg: Config, run: Path) -> dict:
    """Evaluate the starting policy (from step 0), train, plot. Collective; the summary on
    rank 0."""
    start_file = run / "start_eval.json"
    if trainer.step == 0:
        try:
            start = task.evaluate(trainer)
        except supervisor.Interrupted:  # a stop request: fit() stops at its first rollout and saves step 0
            start = {}
        if trainer.is_logger and start:
            start_file.write_text(strict_json(start) + "\n")
            if cfg.run.progress:
                print(describe_eval("starting policy", start), flush=True)
    else:
        start = json.loads(start_file.read_text()) if start_file.is_file() else {}
    summary = trainer.fit(stop_after=cfg.run.stop_after)
    if not trainer.is_logger:
        return {}
    from ndtrain.observe.plots import plot_rl
    final = next((r for r in reversed(trainer.history) if "pass@1" in r), {})
    summary = dict(summary)
    # the whole run's updates: a resumed run's history holds only the updates since its resume
    rewards = [r["reward_mean"] for r in read_metrics(run / "metrics.jsonl") if "reward_mean" in r]
    tenth = max(1, len(rewards) // 10)
    if rewards:  # the rise (or not) of the training reward, in one line of the summary
        summary["reward_trend"] = {"updates": tenth, "of": len(rewards), "first": sum(rewards[:tenth]) / tenth,
                                   "last": sum(rewards[-tenth:]) / tenth}
    probe = task.env.draw(0, "probe", 1, "held_out")[0]
    summary.update(task="rl", rl_task=task.env.prompts.name, loss=cfg.rl.loss, start=start,
                   final={k: v for k, v in final.items() if k.startswith(("pass@", "eval_"))},
                   sample={"prompt": probe.prompt, "max_new_tokens": cfg.rl.max_new_tokens})
    if cfg.run.plot:
        summary["rl_plot"] = str(plot_rl(run / "metrics.jsonl", run / "rl.png", start,
                                         title=f"{cfg.rl.loss} on {task.env.prompts.name} · "
                                               f"{trainer.mesh.describe()}"))
    (run / "summary.json").write_text(strict_json(summary, indent=1))
    return summary


def describe_eval(label: str, e: dict) -> str:
    passes = " · ".join(f"{k} {v:.3f}" for k, v in e.items() if k.startswith("pass@"))
    return f"{label}: held-out {passes}" + (f" · mean reward {e['eval_reward']:.3f}" if "eval_reward" in e else "")


def describe_summary(s: dict) -> str:
    lines = []
    if s.get("start") and s.get("final"):
        lines.append(describe_eval("start", s["start"]))
        lines.append(describe_eval(f"after {s['steps']} updates", s["final"]))
    if s.get("reward_trend"):
        t = s["reward_trend"]
        n, last = t["updates"], t["of"]
        lines.append(f"training reward (rollout mean) {t['first']:.3f} in updates 1–{n} → {t['last']:.3f} in "
                     f"updates {last - n + 1}–{last}")
    if s.get("rl_plot"):
        lines.append(f"RL curves      {s['rl_plot']}")
    return "\n".join(lines)
