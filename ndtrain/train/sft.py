"""Supervised fine-tuning: the SFT task, the chat template of `ndtrain sft` and `ndtrain rl`
(`make_template`), and what each rank of `ndtrain sft` runs.

The task serves rows of rendered conversations (data/sft.py), packed by best-fit decreasing
or one per row (data/packing.py), with IGNORE on every target that is not an answer token.
The trainer is the pretraining one: the loss is the sum over answer tokens divided by the
number of answer tokens in the whole global batch (tasks.py, principle 5).

Evaluation: the mean loss per answer token over the validation rows (every row once, up to
`train.eval_batches` batches), before training and after; then, if `sft.generate` > 0,
greedy answers to that many held-out prompts, scored by `sft.score`.
"""

from __future__ import annotations

import json
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

from ndtrain import config as config_mod
from ndtrain import supervisor
from ndtrain.config import Config, ConfigError
from ndtrain.data.batch import MicroBatch
from ndtrain.data.corpus import STDLIB
from ndtrain.data.loader import RowLoader
from ndtrain.data.packing import pack
from ndtrain.data.sft import SFTData
from ndtrain.data.template import BuiltinTemplate, HFTemplate
from ndtrain.data.tokenizer import TextTokenizer
from ndtrain.generate.sampler import sample
from ndtrain.model.llama import Transformer
from ndtrain.observe.metrics import strict_json
from ndtrain.parallel.states import load_unique_state
from ndtrain.train.tasks import Task, call_scorer, load_function, probe_scorer


def make_template(cfg: Config, progress: bool = False):
    """The chat template `data.template` names, on the tokenizer the model was trained with:
    - hf (auto with model.init_from=hf:DIR): DIR's tokenizer and its own chat_template;
    - builtin: our special tokens added to `data.tokenizer` (which model.init_from sets to
      its run's or model's tokenizer.json), or to the embedded corpus's tokenizer (prepared
      once, cached)."""
    d, init = cfg.data, cfg.model.init_from
    kind, _, where = init.partition(":")
    if d.template == "hf" or (d.template == "auto" and kind == "hf"):
        if kind != "hf":
            raise ConfigError("data.template", d.template, "needs model.init_from=hf:DIR (a tokenizer with a chat_template)")
        return HFTemplate.from_dir(where)
    if d.tokenizer:
        return BuiltinTemplate(TextTokenizer.load(d.tokenizer))
    from ndtrain.data.prepare import PreparedData, prepare_data
    prepared = prepare_data(source=STDLIB, vocab_size=d.vocab_size, val_fraction=d.val_fraction,
                            cache_dir=d.cache_dir, progress=progress)
    return BuiltinTemplate(PreparedData.open(prepared).tokenizer())


class SFT(Task):
    baseline_label = "base model"

    def __init__(self, cfg: Config, data: SFTData):
        t, d = cfg.train, cfg.data
        self.vocab_size, self.new_tokens = data.vocab_size, data.template.added_ids
        self.train_rows = pack(data.train, t.seq_len, d.packing, data.template.pad_id)
        self.val_rows = pack(data.val, t.seq_len, d.packing, data.template.pad_id)
        self.loaders = {"train": RowLoader(self.train_rows, t.global_batch, t.seed),
                        "val": RowLoader(self.val_rows, t.global_batch, t.seed, shuffle=False, wrap=False)}

    def rows(self, split: str, step: int, start: int, stop: int) -> MicroBatch:
        return self.loaders[split].batch(step, start, stop)

    def eval_batches(self, requested: int) -> int:
        """Every validation row once, in at most `requested` batches."""
        return min(requested, self.loaders["val"].batches_per_pass)


# ----------------------------------------------------------------------------- scoring

def exact_match(prompt: str, completion: str, reference: str) -> float:
    return float(completion.strip() == reference.strip())


def load_score(spec: str):
    """`exact`, or `MODULE:FUNCTION` importable from here. Raises ConfigError."""
    return exact_match if spec == "exact" else load_function("sft.score", spec)


def check_score(spec: str, data) -> None:
    """sft.score imports and returns a finite number for a held-out example's own answer
    (ConfigError otherwise), before anything starts."""
    score = load_score(spec)
    if spec == "exact" or not data.held_out:
        return
    conv = data.held_out[0]
    prompt = data.template.decode(data.template.prompt_ids(conv))
    probe_scorer("sft.score", spec, score, (prompt, conv.answer, conv.answer),
                 f"held-out example {conv.key} (its own answer as the completion)")


def answer_held_out(model: Transformer, data: SFTData, cfg: Config) -> dict:
    """Greedy answers to `sft.generate` held-out prompts spread evenly over the validation
    set, and their mean score."""
    s = cfg.sft
    template, score = data.template, load_score(s.score)
    samples = []
    n = min(s.generate, len(data.held_out))
    for conv in (data.held_out[i * len(data.held_out) // n] for i in range(n)):  # spread over the set
        ids = template.prompt_ids(conv)
        new = sample(model, ids, s.max_new_tokens, temperature=0.0, stop_ids=template.stop_ids)
        if new and new[-1] in template.stop_ids:
            new = new[:-1]
        prompt, completion = template.decode(ids), template.decode(new)
        question = conv.prompt_turns[-1].content if conv.prompt_turns else ""
        value, why = call_scorer(score, prompt, completion, conv.answer)
        if why is not None:
            print(f"ndtrain: sft.score {s.score} {why} on held-out prompt {conv.key}; scored 0", file=sys.stderr,
                  flush=True)
        samples.append({"key": conv.key, "prompt": prompt, "question": question, "completion": completion,
                        "reference": conv.answer, "score": value if why is None else 0.0})
    mean = sum(x["score"] for x in samples) / len(samples) if samples else None
    return {"samples": samples, "score": mean, "score_fn": s.score}


def full_model(trainer) -> Transformer | None:
    """The trained model, whole, on rank 0 (None elsewhere). Collective."""
    state = trainer.par.full_model_state()
    if state is None:
        return None
    model = Transformer(trainer.args).to(trainer.mesh.device)
    load_unique_state(model, state)
    return model


# ----------------------------------------------------------------------------- one rank

def sft_worker(cfg_dict: dict, run_dir: str, data: SFTData, make_task=None) -> dict:
    """Entry point of one rank of `ndtrain sft`. Returns the summary on rank 0 ({} elsewhere).
    Stops and restarts like `train`'s ranks (supervisor.py). `make_task(cfg, data)`: the
    task (default `SFT`; the default RL job's warm-up passes its own, train/rl/job.py)."""
    control = supervisor.control()
    with nullcontext() if control.watched else supervisor.stop_signals():
        return _sft(config_mod.from_dict(cfg_dict), run_dir, data, control, make_task or SFT)


def _sft(cfg: Config, run_dir: str, data: SFTData, control, make_task) -> dict:
    from ndtrain.launch import init_process, shutdown
    from ndtrain.train.worker import from_rank_0, start_trainer, write_posttrain_files

    env = init_process(cfg.run.device, cfg.run.threads, cfg.run.collective_timeout_s)
    try:
        run = Path(from_rank_0(run_dir))
        trainer = start_trainer(cfg, env, lambda: make_task(cfg, data), run, control)
        if env.rank == 0:
            write_posttrain_files(cfg, run, data.template, data.skipped)
        return fine_tune(trainer, trainer.task, data, cfg, run)
    finally:
        shutdown()


def fine_tune(trainer, task: SFT, data: SFTData, cfg: Config, run: Path | None) -> dict:
    """Evaluate (from step 0: the base model), train, evaluate, answer held-out prompts.
    Collective; the summary on rank 0."""
    base_file = run / "base_val_loss.json" if run is not None else None
    if trainer.step == 0:
        task.baseline = trainer.evaluate()
        if trainer.is_logger and cfg.run.progress:
            print(f"base model: validation loss {task.baseline:.4f} nats per answer token", flush=True)
        if base_file is not None and trainer.is_logger:
            base_file.write_text(strict_json({"val_loss": task.baseline}) + "\n")
    elif base_file is not None and base_file.is_file():
        task.baseline = json.loads(base_file.read_text())["val_loss"]
    summary = trainer.fit(stop_after=cfg.run.stop_after)
    model = full_model(trainer) if cfg.sft.generate and not trainer.stopped else None
    if not trainer.is_logger:
        return {}
    summary = dict(summary)
    summary.update(task="sft", data=data.describe(), padding_fraction=task.train_rows.padding_fraction,
                   train_rows=len(task.train_rows), packing=cfg.data.packing)
    if data.held_out:  # the closing hint samples a held-out prompt of this data, as the template shows it
        prompt = data.template.decode(data.template.prompt_ids(data.held_out[0]))
        summary["sample"] = {"prompt": prompt, "max_new_tokens": cfg.sft.max_new_tokens}
    if model is not None:
        with torch.no_grad():
            summary.update(answer_held_out(model, data, cfg))
    if run is not None:
        (run / "summary.json").write_text(strict_json(summary, indent=1))
    return summary


# ----------------------------------------------------------------------------- the command's parts

SHAPE_KEYS = ("preset", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len", "rope_theta",
              "tie_embeddings")


def _run_config(run: Path) -> Config | None:
    try:
        return config_mod.load_config(run / "config.toml")
    except (ConfigError, OSError):
        return None


def find_default_run(root: Path) -> Path | None:
    """The newest run under `root` that a default `ndtrain train` wrote and finished: the
    default model and data, every step trained, a checkpoint."""
    from ndtrain.checkpoint import store
    default = Config()
    runs = sorted(root.glob("train-*"), key=lambda p: p.stat().st_mtime, reverse=True) if root.is_dir() else []
    for run in runs:
        cfg = _run_config(run)
        if cfg is None or not (run / "summary.json").is_file() or store.latest(run) is None:
            continue
        same_model = all(getattr(cfg.model, k) in (getattr(default.model, k), None) for k in SHAPE_KEYS)
        d = cfg.data
        if same_model and (d.path, d.tokenizer, d.vocab_size) == ("stdlib", "", default.data.vocab_size) \
                and json.loads((run / "summary.json").read_text()).get("steps") == cfg.train.steps:
            return run
    return None


def show_example(data: SFTData, max_length: int = 120) -> str:
    """The first training example of at most `max_length` positions as the model reads it,
    the trained tokens highlighted (in colour on a terminal, between ⟦ ⟧ elsewhere)."""
    from rich.console import Console
    from rich.text import Text

    index = next((i for i, ex in enumerate(data.train) if ex.length <= max_length), 0)
    ex = data.train[index]
    text, plain = Text(), []
    start = 0
    for end in [i for i in range(1, len(ex.tokens)) if ex.trained[i] != ex.trained[i - 1]] + [len(ex.tokens)]:
        piece, trained = data.template.decode(ex.tokens[start:end].tolist()), bool(ex.trained[start])
        text.append(piece, style="bold green" if trained else "dim")
        plain.append(f"⟦{piece}⟧" if trained else piece)
        start = end
    n, m = len(ex.tokens), int(ex.trained.sum())
    head = f"training example {index + 1} of {len(data.train):,}: {n} tokens, {m} trained"
    console = Console()
    if console.is_terminal:
        with console.capture() as cap:
            console.print(text, end="")
        body = cap.get()
    else:
        body = "".join(plain)
    return f"{head} ({'green' if console.is_terminal else 'between ⟦ ⟧'})\n{body}"


def _lines(text: str, most: int, width: int = 100) -> str:
    """The first `most` non-blank lines of `text` (each cut at `width` characters), and how
    many more there are."""
    lines = [line if len(line) <= width else line[:width] + " …" for line in text.rstrip().splitlines() if line.strip()]
    more = f"\n   … {len(lines) - most} more lines" if len(lines) > most else ""
    return "\n".join(lines[:most]) + more


def describe_summary(s: dict) -> str:
    lines = []
    if s.get("baseline_val_loss") is not None and s.get("val_loss") is not None:
        lines.append(f"answer-token validation loss {s['baseline_val_loss']:.4f} (base model) → "
                     f"{s['val_loss']:.4f} (fine-tuned) after {s['steps']} steps")
    lines.append(f"training rows: {s['train_rows']:,} ({s['packing']}), {100 * s['padding_fraction']:.1f}% padding")
    for x in s.get("samples", []):
        lines += [f"── held-out prompt ({x['key']}), score {x['score']:g}", _lines(x["question"], 3),
                  "── generated", _lines(x["completion"], 8), "── reference", _lines(x["reference"], 8)]
    if s.get("samples"):
        lines.append(f"mean {s['score_fn']} score on {len(s['samples'])} held-out prompts: {s['score']:.3f}")
    return "\n".join(lines)
