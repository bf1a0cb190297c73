"""Tasks: what a training job feeds the one trainer.

Pretraining, supervised fine-tuning and RL differ only in the micro-batches they build
(DESIGN.md, "Tasks"). A task hands the trainer, for step s and this rank, its
`MicroBatch`es and its count of loss targets; the trainer sums the counts over dp × cp,
divides every micro-batch's loss sum by that global count (the step owns the loss), and
runs the layout's schedule. Nothing below the task (the trainer, the schedules, the
parallel modules) branches on which task it is.

The trainer decides which rows are this rank's (its data-parallel share; under context
parallelism, its part of each sequence) and cuts them into micro-batches; the task decides
what the rows hold. A task provides:
- `vocab_size`: the ids its batches may hold (the model's embedding covers them);
- `rows(split, step, start, stop)`: rows start..stop−1 of the global batch of `step`
  ("train"), or of evaluation batch `step` ("val"), as one MicroBatch: a pure function of
  its arguments and the seed, so every layout sees the same data and resume needs no state;
- `eval_batches(requested)`: how many validation batches one evaluation reads;
- `targets(mb)`: the loss targets it counts (default: targets that are not IGNORE);
- `before_update(step, trainer)`: work before each update (RL's rollout phase, which
  samples from the current policy and fills the batches `rows` serves, with per-token
  `weights`); nothing for pretraining and SFT;
- `objective(nll, mb)`: its half of the loss (model/loss.TokenLoss), given each token's
  negative log-likelihood: the weighted sum (default), or RL's policy-gradient objective;
- `evaluate(trainer)`: the metrics of an evaluation step (default: the validation loss,
  `val_loss`, unless train.eval_batches = 0); RL: held-out pass@1 and pass@k;
- `step_metrics(trainer)`: what it adds to each step's record (RL: rewards, lengths,
  entropy, KL, clipping, the rollout's time);
- `done(record)`: after an evaluation, whether training has reached its goal and stops
  there (the default RL job's warm-up stops on a held-out pass@1);
- `baseline`, `baseline_label`: a reference loss for the summary and the plot.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass

from ndtrain.config import Config, ConfigError
from ndtrain.data.batch import MicroBatch
from ndtrain.data.loader import BatchLoader
from ndtrain.data.mixture import MixtureLoader, PreparedMixture
from ndtrain.data.prepare import PreparedData
from ndtrain.data.shards import DataError
from ndtrain.model.loss import count_targets, weighted_sum


class UserCode:
    """Around a call into a user's code (a reward, a score, its module's import): whether a
    KeyboardInterrupt that comes out of it is a real signal (Ctrl-C: it goes on) or the code's
    own `raise KeyboardInterrupt`, which, like its SystemExit, is a failure of that code. A
    real one is seen by supervisor's handlers (the first signal sets the stop), or, where
    SIGINT still has Python's default handler (the command's own process before the ranks
    start), by a handler put in its place for the call."""

    def __enter__(self):
        import signal
        import threading
        self.signalled, self._previous = False, None
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def _on_sigint(self, signum, frame):
        self.signalled = True
        raise KeyboardInterrupt

    def __exit__(self, *exc):
        if self._previous is not None:
            import signal
            signal.signal(signal.SIGINT, self._previous)
        return False

    def own(self, e: BaseException) -> bool:
        """Whether `e` (SystemExit or KeyboardInterrupt) came from the code, not a signal."""
        from ndtrain import supervisor
        return isinstance(e, SystemExit) or not (self.signalled or supervisor.control().stop)


def _raised(e: BaseException) -> str:
    return f"{type(e).__name__}" + (f": {e}" if str(e) else "")


def load_function(key: str, spec: str):
    """The function `MODULE:FUNCTION` names (sft.score, rl.reward), imported from here.
    Raises ConfigError naming `key`."""
    module, _, name = spec.partition(":")
    with UserCode() as code:
        try:
            fn = getattr(importlib.import_module(module), name)
        except Exception as e:  # noqa: BLE001 - importing a user's module runs its code, which may raise anything
            raise ConfigError(key, spec, f"cannot import it ({_raised(e)})") from None
        except (SystemExit, KeyboardInterrupt) as e:
            if not code.own(e):
                raise
            raise ConfigError(key, spec, f"cannot import it (it raised {_raised(e)})") from None
    if not callable(fn):
        raise ConfigError(key, spec, "is not callable")
    return fn


def call_scorer(fn, *args) -> tuple[float | None, str | None]:
    """(the finite number a user's scoring function returns, None), or (None, why not): it
    raised (SystemExit and its own KeyboardInterrupt too: `UserCode`), or returned something
    that is not a finite number."""
    with UserCode() as code:
        try:
            value = fn(*args)
        except Exception as e:  # noqa: BLE001 - a user's function may raise anything
            return None, f"raised {_raised(e)}"
        except (SystemExit, KeyboardInterrupt) as e:
            if not code.own(e):
                raise
            return None, f"raised {_raised(e)}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None, f"returned {value!r} ({type(value).__name__}), not a number"
    if not math.isfinite(value):
        return None, f"returned {value}, not a finite number"
    return float(value), None


def probe_scorer(key: str, spec: str, fn, args: tuple, sample: str) -> None:
    """Call a user's scoring function once on `sample` before anything starts: ConfigError
    naming `key` unless it returns a finite number."""
    _, why = call_scorer(fn, *args)
    if why is not None:
        raise ConfigError(key, spec, f"{why} on {sample}: it must return a finite number")


@dataclass
class StepData:
    micro_batches: list[MicroBatch]
    n_targets: int  # this rank's loss targets; the trainer sums them over dp × cp


class Task:
    vocab_size: int
    # Token ids a chat template added to the tokenizer: under LoRA their embedding (and
    # head) rows train (model/lora.TokenRows); every other row stays frozen.
    new_tokens: tuple[int, ...] = ()
    baseline: float | None = None
    baseline_label: str = "baseline"
    objective = staticmethod(weighted_sum)

    def rows(self, split: str, step: int, start: int, stop: int) -> MicroBatch:
        raise NotImplementedError

    def eval_batches(self, requested: int) -> int:
        return requested

    def targets(self, mb: MicroBatch) -> int:
        return count_targets(mb.targets)

    def before_update(self, step: int, trainer) -> None:
        """Called before the batch of `step` is read (RL: the rollout phase)."""

    def step_metrics(self, trainer) -> dict:
        """Called on every rank after each update; returns what the step's record adds."""
        return {}

    def evaluate(self, trainer) -> dict:
        """Called on every rank on evaluation steps; returns the record's evaluation keys."""
        return {"val_loss": trainer.evaluate()} if trainer.cfg.train.eval_batches else {}

    def done(self, record: dict) -> bool:
        """Called on every rank after an evaluation step's `evaluate`, with the step's record:
        True ends training there (with a checkpoint), as if it were the last step."""
        return False


class Pretrain(Task):
    """Next-token prediction on windows of a token stream (data/loader.BatchLoader), or of
    a weighted mixture of streams (data/mixture.MixtureLoader): then each step's record
    carries `source_tokens` and each evaluation `val_loss.<name>` per source, `val_loss`
    being their mean weighted as the sources are."""

    baseline_label = "unigram baseline"

    def __init__(self, cfg: Config, data: PreparedData | PreparedMixture):
        t = cfg.train
        self.vocab_size = data.vocab_size
        self.baseline = data.unigram_val_loss
        self.notes: list[str] = []  # what the command says before the start (a source that repeats)
        self.mixture = data.sources if isinstance(data, PreparedMixture) else None
        if self.mixture is None:
            self.loaders = {"train": BatchLoader(data.stream("train"), t.seq_len, t.global_batch, t.seed),
                            "val": BatchLoader(data.stream("val"), t.seq_len, t.global_batch, t.seed, shuffle=False)}
            return
        names = [s.name for s in self.mixture]
        train = MixtureLoader([s.data.stream("train") for s in self.mixture], [s.weight for s in self.mixture],
                              t.seq_len, t.global_batch, t.seed, names)
        self.notes = train.passes(t.steps, [s.repeat for s in self.mixture])
        self.loaders = {"train": train}
        for s in self.mixture:
            try:
                self.loaders[f"val.{s.name}"] = BatchLoader(s.data.stream("val"), t.seq_len, t.global_batch, t.seed,
                                                            shuffle=False)
            except DataError as e:
                raise DataError(f"data source {s.name!r}, validation split: {e}") from None

    def rows(self, split: str, step: int, start: int, stop: int) -> MicroBatch:
        return MicroBatch(*self.loaders[split].rows(step, start, stop))

    def step_metrics(self, trainer) -> dict:
        if self.mixture is None:
            return {}
        return {"source_tokens": self.loaders["train"].source_tokens(trainer.step + 1)}  # trainer.step: this step

    def evaluate(self, trainer) -> dict:
        if self.mixture is None or not trainer.cfg.train.eval_batches:
            return super().evaluate(trainer)
        out = {f"val_loss.{s.name}": trainer.evaluate(f"val.{s.name}") for s in self.mixture}
        total = sum(s.weight for s in self.mixture)
        out["val_loss"] = sum(s.weight / total * out[f"val_loss.{s.name}"] for s in self.mixture)
        return out
