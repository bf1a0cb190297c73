"""Direct preference optimisation (`ndtrain dpo`): the preference task of the one trainer.

For a prompt x with a chosen answer y_w and a rejected one y_l, the policy π (the model
trained) and the frozen reference π_ref (the starting model), DPO (Rafailov et al. 2023)
minimises the sigmoid loss

    L = −log σ(β · [(log π(y_w|x) − log π_ref(y_w|x)) − (log π(y_l|x) − log π_ref(y_l|x))])

averaged over pairs, where log π(y|x) sums the log-probabilities of the answer's tokens
only (the prompt is context). β · (log π − log π_ref) is the answer's implicit reward; the
bracket times β is the pair's reward margin.

How it fits the trainer (train/tasks.py): a row holds one pair (data/preference.py: the
chosen example, then the rejected one, each its own document), `weights` is +1 on the
chosen answer's targets and −1 on the rejected one's, so a row's Σ weight · log p is the
policy's log-ratio. The reference's log-probability of each answer is computed once,
before the first update, by the training layout's own forward (Trainer.logprobs_everywhere)
and stored with the run (`reference_logprobs.npz`: a resumed run reads it, never
recomputes it); in the rows it sits on the first target of its answer (`ref_logprobs`), so
Σ weight · (log p − ref) is the bracket. `PreferenceObjective` turns a micro-batch's token
log-likelihoods into its rows' summed losses, and the task counts one target per pair, so
the step's division by the global count is the mean over the batch's pairs on every
layout. A pair's loss needs its whole row, so context parallelism is refused
(config/tasks.check_dpo_job); every other layout runs it, whatever parameters are trained.

Evaluation (every train.eval_every steps and at the end): on every held-out pair once,
`val_loss`, `val_pref_accuracy` (the share of pairs whose margin is positive, a tie
counting half: 0.5 before the first update), `val_reward_margin`, `val_reward_chosen`,
`val_reward_rejected`, and `val_likelihood_accuracy` (the share where the policy gives the
chosen answer the higher log-probability outright). Each step adds the same figures for its
training batch (`pref_accuracy`, `reward_margin`, ...).
"""

from __future__ import annotations

import json
import math
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ndtrain import config as config_mod
from ndtrain import supervisor
from ndtrain.comm import ops
from ndtrain.config import Config
from ndtrain.data.batch import MicroBatch
from ndtrain.data.loader import RowLoader
from ndtrain.data.preference import PreferenceData, control_signs, pair_rows
from ndtrain.deferred import Lazy
from ndtrain.train.tasks import Task
from ndtrain.train.trainer import TrainingError

REFERENCE_FILE = "reference_logprobs.npz"
STATS = ("pairs", "accuracy", "margin", "chosen", "rejected", "loss")  # sums over pairs (pair_stats)


def pair_stats(chosen: Tensor, rejected: Tensor, pair: Tensor, beta: float) -> Tensor:
    """Sums over the pairs (`pair` 1, else 0) of STATS, from each pair's log-ratios
    log π − log π_ref of the chosen and the rejected answer: [6] (detached)."""
    margin = beta * (chosen - rejected)
    won = (margin > 0).to(margin.dtype) + 0.5 * (margin == 0).to(margin.dtype)
    values = [pair, won, margin, beta * chosen, beta * rejected, -F.logsigmoid(margin)]
    return torch.stack([(v * pair).sum() for v in values]).detach().double()


def answer_sums(values: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """Per row [b], the sum of `values` [b, s] over the chosen answer's targets and over the
    rejected one's."""
    return (values * (weights > 0)).sum(-1), (values * (weights < 0)).sum(-1)


class PreferenceObjective:
    """The task's half of the loss (model/loss.TokenLoss): Σ over the micro-batch's pairs of
    −log σ(β · margin), from each token's negative log-likelihood. Keeps, as it goes, the
    sums of STATS for the step's metrics."""

    def __init__(self, beta: float):
        self.beta = beta
        self.stats: Tensor | None = None

    def __call__(self, nll: Tensor, mb: MicroBatch) -> Tensor:
        w = mb.weights.to(nll.dtype)
        delta = -nll.view(mb.targets.shape) - mb.ref_logprobs.to(nll.dtype)  # log π − log π_ref (sums at anchors)
        chosen, rejected = answer_sums(delta, w)
        pair = (w != 0).any(-1).to(nll.dtype)
        stats = pair_stats(chosen, rejected, pair, self.beta)
        self.stats = stats if self.stats is None else self.stats + stats
        return (-F.logsigmoid(self.beta * (chosen - rejected)) * pair).sum()

    def take(self, device) -> Tensor:
        """The sums since the last call (zeros on a rank that computed no loss)."""
        out = self.stats if self.stats is not None else torch.zeros(len(STATS), dtype=torch.float64)
        self.stats = None
        return out.to(device)


def _means(stats: Tensor, prefix: str) -> dict:
    """{prefix}pref_accuracy, reward_margin, reward_chosen, reward_rejected (and val_loss)
    from summed STATS, as host values."""
    n = max(float(stats[0]), 1.0)
    out = {f"{prefix}pref_accuracy": float(stats[1]) / n, f"{prefix}reward_margin": float(stats[2]) / n,
           f"{prefix}reward_chosen": float(stats[3]) / n, f"{prefix}reward_rejected": float(stats[4]) / n}
    if prefix:
        out[f"{prefix}loss"] = float(stats[5]) / n
    return out


class DPO(Task):
    baseline_label = "the reference (log 2)"

    def __init__(self, cfg: Config, data: PreferenceData):
        t = cfg.train
        self.cfg, self.vocab_size, self.new_tokens = cfg, data.vocab_size, data.template.added_ids
        self.baseline = math.log(2.0)  # every pair's loss before the first update (margin 0)
        pad = data.template.pad_id
        self.pair_rows = {"train": pair_rows(data.train, t.seq_len, pad), "val": pair_rows(data.val, t.seq_len, pad)}
        self.loaders = {"train": RowLoader(self.pair_rows["train"], t.global_batch, t.seed),
                        "val": RowLoader(self.pair_rows["val"], t.global_batch, t.seed, shuffle=False, wrap=False)}
        self.objective = PreferenceObjective(cfg.dpo.beta)
        self.reference: dict[str, Tensor] | None = None

    # -- the task interface ---------------------------------------------------------
    def rows(self, split: str, step: int, start: int, stop: int) -> MicroBatch:
        """`dpo.shuffle` (the control): exactly half of each training batch's pairs swapped,
        chosen for rejected (their weights negated: data/preference.control_signs)."""
        mb = self.loaders[split].batch(step, start, stop)
        if split == "train" and self.cfg.dpo.shuffle:
            signs = control_signs(self.cfg.train.seed, step, self.cfg.train.global_batch)[start:stop]
            mb = replace(mb, weights=mb.weights * signs[:, None])
        return mb

    def targets(self, mb: MicroBatch) -> int:
        return int((mb.weights != 0).any(-1).sum())  # one per pair: the loss is a mean over pairs

    def eval_batches(self, requested: int) -> int:
        return min(requested, self.loaders["val"].batches_per_pass)

    def before_update(self, step: int, trainer) -> None:
        if self.reference is None:
            self.set_reference(self.compute_reference(trainer))

    def step_metrics(self, trainer) -> dict:
        mesh = trainer.mesh
        stats = ops.all_reduce_bookkeeping(self.objective.take(mesh.device), mesh.group("dp_cp"))
        stats = ops.all_reduce_bookkeeping(stats, mesh.group("pp"))  # only the last stage computes the loss
        return {key: Lazy(lambda s, key=key: _means(s, "")[key], (stats,)) for key in _means(torch.zeros(6), "")}

    def evaluate(self, trainer) -> dict:
        """Every held-out pair once (up to train.eval_batches batches), through the training
        layout's forward."""
        if not self.cfg.train.eval_batches:
            return {}
        self.before_update(trainer.step, trainer)
        stats, likelihood = torch.zeros(len(STATS), dtype=torch.float64), 0.0
        beta = self.cfg.dpo.beta
        for k in range(self.eval_batches(self.cfg.train.eval_batches)):
            mb = self.loaders["val"].batch(k, 0, self.cfg.train.global_batch)
            logp = trainer.logprobs_everywhere(mb)
            pair = (mb.weights != 0).any(-1).double()
            stats += pair_stats(*answer_sums(logp - mb.ref_logprobs, mb.weights), pair, beta)
            chosen, rejected = answer_sums(logp, mb.weights)
            likelihood += float(((chosen > rejected).double() * pair).sum())
        out = _means(stats, "val_")
        out["val_likelihood_accuracy"] = likelihood / max(float(stats[0]), 1.0)
        return out

    # -- the reference ----------------------------------------------------------------
    def compute_reference(self, trainer) -> dict[str, Tensor]:
        """log π_ref of every pair's chosen and rejected answer [pairs, 2] (fp64), per split,
        under the current weights (the starting model's, before the first update). Collective."""
        if trainer.step != 0:
            raise TrainingError(f"step {trainer.step}: the reference log-probabilities are missing; they are "
                                "computed once, before the first update, and kept in the run's " + REFERENCE_FILE)
        g = self.cfg.train.global_batch
        out = {}
        for split, rows in self.pair_rows.items():
            once = RowLoader(rows, g, 0, shuffle=False, wrap=False)
            sums = []
            for k in range(once.batches_per_pass):
                supervisor.heartbeat()
                mb = once.batch(k, 0, g)
                sums.append(torch.stack(answer_sums(trainer.logprobs_everywhere(mb), mb.weights), dim=1))
            out[split] = torch.cat(sums)[:len(rows)]
        return out

    def set_reference(self, reference: dict[str, Tensor]) -> None:
        """The rows' `ref_logprobs`: each answer's reference log-probability on its first target."""
        for split, rows in self.pair_rows.items():
            ref = reference[split].double()
            if ref.shape != (len(rows), 2):
                raise TrainingError(f"the stored reference log-probabilities hold {ref.shape[0]} {split} pairs, the "
                                    f"data {len(rows)}: the run's data changed")
            anchors = torch.zeros_like(rows.weights)
            index = torch.arange(len(rows))
            anchors[index, (rows.weights > 0).double().argmax(-1)] = ref[:, 0]
            anchors[index, (rows.weights < 0).double().argmax(-1)] = ref[:, 1]
            rows.ref_logprobs = anchors
        self.reference = reference

    def save_reference(self, run: Path) -> None:
        np.savez(run / REFERENCE_FILE, **{k: v.numpy() for k, v in self.reference.items()})

    def load_reference(self, run: Path) -> None:
        path = run / REFERENCE_FILE
        if not path.is_file():
            raise TrainingError(f"resuming {run}: its {REFERENCE_FILE} is missing; the reference log-probabilities "
                                "are computed once, before the first update, and are not recomputed on resume")
        with np.load(path) as f:
            self.set_reference({k: torch.from_numpy(f[k]) for k in ("train", "val")})


# ----------------------------------------------------------------------------- one rank

def dpo_worker(cfg_dict: dict, run_dir: str, data: PreferenceData) -> dict:
    """Entry point of one rank of `ndtrain dpo`. Returns the summary on rank 0 ({} elsewhere).
    Stops and restarts like `train`'s ranks (supervisor.py)."""
    control = supervisor.control()
    with nullcontext() if control.watched else supervisor.stop_signals():
        return _dpo(config_mod.from_dict(cfg_dict), run_dir, data, control)


def _dpo(cfg: Config, run_dir: str, data: PreferenceData, control) -> dict:
    from ndtrain.launch import init_process, shutdown
    from ndtrain.train.worker import from_rank_0, start_trainer, write_posttrain_files

    env = init_process(cfg.run.device, cfg.run.threads, cfg.run.collective_timeout_s)
    try:
        run = Path(from_rank_0(run_dir))
        trainer = start_trainer(cfg, env, lambda: DPO(cfg, data), run, control)
        task = trainer.task
        if trainer.step == 0:
            task.set_reference(task.compute_reference(trainer))  # the starting model's, once
        else:
            task.load_reference(run)
        if env.rank == 0:
            write_posttrain_files(cfg, run, data.template, data.skipped)
            if trainer.step == 0:
                task.save_reference(run)
        return optimise(trainer, task, data, cfg, run)
    finally:
        shutdown()


def optimise(trainer, task: DPO, data: PreferenceData, cfg: Config, run: Path) -> dict:
    """Train (evaluating every train.eval_every steps), plot. Collective; the summary on rank 0."""
    summary = trainer.fit(stop_after=cfg.run.stop_after)
    if not trainer.is_logger:
        return {}
    from ndtrain.observe.plots import plot_dpo
    summary = dict(summary)
    final = next((r for r in reversed(trainer.history) if "val_pref_accuracy" in r), {})
    ref = task.reference["val"]
    summary.update(task="dpo", data=data.describe(), loss_unit="nats/pair", beta=cfg.dpo.beta,
                   shuffled=cfg.dpo.shuffle,
                   final={k: v for k, v in final.items() if k.startswith("val_")},
                   reference_likelihood_accuracy=float((ref[:, 0] > ref[:, 1]).double().mean()),
                   val_pairs=len(data.val), train_pairs=len(data.train))
    if data.val:  # the closing hint: a held-out prompt, as the template shows it
        chosen = data.val[0][0]
        first = int(chosen.trained.argmax())
        summary["sample"] = {"prompt": data.template.decode(chosen.tokens[:first].tolist()), "max_new_tokens": 128}
    if cfg.run.plot:
        summary["dpo_plot"] = str(plot_dpo(run / "metrics.jsonl", run / "dpo.png",
                                           title=f"DPO (β = {cfg.dpo.beta:g}) · {trainer.mesh.describe()}"
                                           + (" · shuffled control" if cfg.dpo.shuffle else "")))
    (run / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def describe_summary(s: dict) -> str:
    lines = []
    f = s.get("final") or {}
    if f:
        lines.append(f"held-out preference accuracy 0.500 (the reference) → {f['val_pref_accuracy']:.3f} after "
                     f"{s['steps']} steps on {s['val_pairs']:,} held-out pairs; reward margin "
                     f"{f['val_reward_margin']:.3f} "
                     f"(chosen {f['val_reward_chosen']:.3f}, rejected {f['val_reward_rejected']:.3f})")
        lines.append(f"chosen answer more likely outright: {s['reference_likelihood_accuracy']:.3f} of held-out pairs "
                     f"under the reference → {f['val_likelihood_accuracy']:.3f} under the policy")
    if s.get("shuffled"):
        lines.append("dpo.shuffle: chosen and rejected were swapped in exactly half of every training batch's pairs "
                     "(the control); the held-out pairs keep their labels")
    if s.get("dpo_plot"):
        lines.append(f"DPO curves     {s['dpo_plot']}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the default job's warm-up

# The warm-up's own settings (ndtrain sft keys), after the DPO job's model, seed and device.
WARMUP_SETTINGS = ["train.seq_len=128", "train.global_batch=16", "train.lr=3e-3", "train.warmup=10",
                   "train.eval_every=0", "train.eval_batches=4", "data.packing=bfd", "data.template=builtin",
                   "data.val_fraction=0.05", "sft.generate=0", "run.plot=false"]


def warmup_folder(cfg: Config) -> Path:
    """Where the default job's SFT warm-up of this configuration lives: named by a hash of
    everything that decides its result."""
    import hashlib
    from ndtrain.train.rl.job import MODEL_KEYS
    what = {"data": cfg.data.path, "pairs": "quotes as asked", "answers": "chosen and rejected", "val_fraction": cfg.data.val_fraction,
            "vocab": cfg.data.vocab_size,
            "steps": cfg.dpo.warmup_steps, "seed": cfg.train.seed, "settings": WARMUP_SETTINGS,
            "model": {k: getattr(cfg.model, k) for k in MODEL_KEYS}}
    key = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:12]
    return Path(cfg.data.cache_dir).expanduser() / "dpo-warmup" / f"{cfg.data.path}-{key}"


def write_warmup_data(cfg: Config, folder: Path) -> None:
    """The warm-up's examples: the training split's prompts, each with its chosen and with its
    rejected answer, so the reference learns both forms and prefers neither: the preference
    is left for DPO to learn from the labels (and a shuffled control has none to find)."""
    from ndtrain.data.preference import stdlib_pairs
    from ndtrain.data.sft import split
    folder.mkdir(parents=True, exist_ok=True)
    train, _ = split(stdlib_pairs(cfg.data.cache_dir), cfg.data.val_fraction)
    lines = "".join(json.dumps({"messages": [{"role": t.role, "content": t.content} for t in conv.turns]}) + "\n"
                    for p in train for conv in (p.chosen, p.rejected))
    (folder / "train.jsonl").write_text(lines)


def warmup_overrides(cfg: Config, folder: Path) -> list[str]:
    """The `ndtrain sft` overrides of the warm-up into `folder`: random weights, the embedded
    corpus's tokenizer."""
    from ndtrain.train.rl.job import MODEL_KEYS
    model = [f"model.{k}={getattr(cfg.model, k)}" for k in MODEL_KEYS if getattr(cfg.model, k) is not None]
    return model + WARMUP_SETTINGS + [
        "model.init_from=scratch", f"data.path={folder / 'train.jsonl'}", f"data.vocab_size={cfg.data.vocab_size}",
        f"train.steps={cfg.dpo.warmup_steps}", f"train.seed={cfg.train.seed}", f"run.dir={folder / 'run'}",
        f"run.device={cfg.run.device}", f"data.cache_dir={cfg.data.cache_dir}", f"run.progress={cfg.run.progress}"]
