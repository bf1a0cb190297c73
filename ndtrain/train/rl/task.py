"""The RL task: a rollout phase before each update, then the update through the one trainer.

Before the update of step s (every `rl.ppo_epochs` steps; the updates in between reuse the
batch and its old log-probabilities), every rank takes part in the rollout phase:

1. the generation model: the training weights under the generation layout
   (parallel/generation.py);
2. prompts: train.global_batch / rl.group_size problems drawn for this rollout (a pure
   function of the seed and the rollout's index, so every layout draws the same), each
   sampled rl.group_size times, every row with its own seed (rollout.py);
3. scores: the reward function on each completion; dapo drops groups whose rewards are all
   equal and samples new ones (up to rl.max_refills rounds), and shapes overlong answers;
4. advantages and weights (losses.py), the frozen reference's log-probabilities;
5. the old policy's log-probabilities, computed by the *training* forward on this rank's
   rows (Trainer.logprobs), compared with the sampler's: the largest gap is logged, and in
   fp32 or fp64 a gap above rl.logprob_tol stops the run (inference and training disagree).

`rows` then serves the rollout as the batch (prompt tokens and padding IGNORE; per trained
token its advantage, weight, old and reference log-probabilities) and `PolicyObjective`
turns each micro-batch's token log-likelihoods into the loss; the trainer divides by the
global count of completion tokens, as for every task.
"""

from __future__ import annotations

import sys
import time
import zlib
from dataclasses import dataclass

import torch
from torch import Tensor

from ndtrain.checkpoint import layout, sources
from ndtrain.comm import ops
from ndtrain.config import Config, rl_clip_high, rl_overlong_buffer
from ndtrain.data.batch import MicroBatch
from ndtrain.data.chat import Conversation, Turn
from ndtrain.data import answers
from ndtrain.data.prompts import prompt_source
from ndtrain.data.verifiable import Problem
from ndtrain.model.loss import IGNORE
from ndtrain.parallel.generation import (GenerationLayout, Generator, empty_generation_model, frozen_copy,
                                         sampling_view)
from ndtrain.train.rl import losses
from ndtrain.train.rl.asynchronous import AsyncRollouts
from ndtrain.train.rl.rollout import Generations, Sampling, generate_everywhere
from ndtrain.train.tasks import Task, call_scorer, load_function
from ndtrain.train.trainer import TrainingError

PRECISE = ("fp32", "fp64")  # where the rollout/training log-prob gap is enforced


def checked_reward(check, format_reward: float):
    """A reward from a check giving a Score (format, correct): correct + format_reward · format."""
    def reward(prompt: str, completion: str, answer: str) -> tuple[float, float, float]:
        s = check(prompt, completion, answer)
        return s.correct + format_reward * s.format, s.format, s.correct
    return reward


@dataclass
class Environment:
    """What the policy is asked (rl.task's problems or rl.data's records) and how it is
    scored (rl.reward), shared by every rank."""

    template: object  # data/template.BuiltinTemplate | HFTemplate
    prompts: object  # data/prompts.TaskPrompts | FilePrompts

    def __init__(self, cfg: Config, template, prompts=None):
        r = cfg.rl
        self.template = template
        self.prompts = prompts if prompts is not None else prompt_source(cfg)
        task = getattr(self.prompts, "task", None)
        kind = "exact" if r.reward == "builtin" and task is None else r.reward
        self.custom = None
        if kind == "builtin":
            self.check = checked_reward(task.score, r.format_reward)
        elif kind in answers.CHECKS:
            check = answers.CHECKS[kind]
            self.check = checked_reward(lambda prompt, completion, answer: check(completion, answer), r.format_reward)
        else:
            self.custom = load_function("rl.reward", r.reward)
        self.last_failure: str | None = None  # why the user's reward last failed

    def draw(self, seed: int, key: str, n: int, split: str) -> list[Problem]:
        return self.prompts.draw(seed, key, n, split)

    def prompt_ids(self, problem: Problem) -> list[int]:
        """rl.data's record as the chat template renders it for the answer (as `ndtrain sft`
        trained on it); a built-in task's prompt as it is."""
        if problem.conversation is not None:
            return self.template.prompt_ids(problem.conversation)
        conv = Conversation("rl", [Turn("user", problem.prompt), Turn("assistant", problem.answer, True)], chat=False)
        return self.template.prompt_ids(conv)

    def completion_text(self, ids: list[int]) -> str:
        if ids and ids[-1] in self.template.stop_ids:
            ids = ids[:-1]
        return self.template.decode(ids)

    def score(self, problem: Problem, ids: list[int]) -> tuple[float, float, float, float, str | None]:
        """(reward, format, correct, error, why) of a completion. A reward function that
        raises or returns a non-number scores 0 and says why. With a user's reward, format is
        unknown (nan) and a completion is correct when its reward reaches 1."""
        text = self.completion_text(ids)
        if self.custom is None:
            return (*self.check(problem.prompt, text, problem.answer), 0.0, None)
        value, why = call_scorer(self.custom, problem.prompt, text, problem.answer)
        if why is not None:
            self.last_failure = why
            return 0.0, float("nan"), 0.0, 1.0, why
        return value, float("nan"), float(value >= 1.0), 0.0, None


def greedy_pass_at_1(generator: Generator, cfg: Config, env: Environment, problems: list[Problem]) -> float:
    """The share of `problems` the training model answers correctly, greedily (the default
    job's warm-up checks it). Collective."""
    t = env.template
    gen = generate_everywhere(generator.model(), generator.layout, [env.prompt_ids(p) for p in problems],
                              [0] * len(problems), Sampling(cfg.rl.max_new_tokens, 0.0), t.stop_ids, t.pad_id,
                              lambda i, ids: env.score(problems[i], ids)[:4])
    return float(gen.score("correct").mean())


def row_seed(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


class RL(Task):
    baseline_label = "the starting policy"

    def __init__(self, cfg: Config, env: Environment):
        r = cfg.rl
        self.cfg, self.env = cfg, env
        self.vocab_size = env.template.vocab_size
        self.objective = losses.PolicyObjective(r.loss, r.clip_low, rl_clip_high(r), r.kl_coef)
        self.sampling = Sampling(r.max_new_tokens, r.temperature, r.top_k, r.top_p, r.long_tail)
        self.reference = None
        self.generator: Generator | None = None
        self.rollouts = None  # asynchronous.AsyncRollouts under rl.generate_ranks
        self.last_sampled = None  # when this rank's share of the last synchronous rollout was sampled
        self.batch: MicroBatch | None = None
        self.metrics: dict = {}
        # Each rollout phase's wall-clock times on this rank (docs/rl_timeline_plot.py draws them):
        # begin, end, and in the synchronous job `sampled` (this rank's share done, before the
        # gather), in the asynchronous one `pushed` (the weights sent) and the generator's times.
        self.timeline: list[dict] = []
        self.eval_problems = env.draw(0, "evaluation", r.eval_prompts, "held_out")

    # -- the task interface ---------------------------------------------------------
    def rows(self, split: str, step: int, start: int, stop: int) -> MicroBatch:
        return self.batch.rows(start, stop)

    def eval_batches(self, requested: int) -> int:
        return 0

    def before_update(self, step: int, trainer) -> None:
        if self.batch is not None and step % self.cfg.rl.ppo_epochs:
            self.metrics = {"rollout_time_s": 0.0}  # the same rollout, another update
            return
        t0, began = time.perf_counter(), time.time()
        index = step // self.cfg.rl.ppo_epochs
        if self.cfg.rl.generate_ranks:  # generator processes sample; the training ranks take their rollouts
            if self.rollouts is None:
                self.rollouts = AsyncRollouts(self.cfg, trainer, index)
            self.batch, self.metrics = self.rollouts.take(index, self, trainer)
            times = self.rollouts.times
        else:
            self.batch, self.metrics = self.rollout(index, trainer)
            times = {"sampled": self.last_sampled}
        self.metrics["rollout_time_s"] = time.perf_counter() - t0
        self.timeline.append({"step": step, "begin": began, "end": time.time(), **times})

    def close(self) -> None:
        """Stops the generator processes, if any (every rank may call it)."""
        if self.rollouts is not None:
            self.rollouts.close()
            self.rollouts = None

    def step_metrics(self, trainer) -> dict:
        clipped, tokens = self.objective.take_counts()
        mesh = trainer.mesh
        counts = ops.all_reduce_scalars([clipped, tokens], mesh.group("dp_cp"))
        clipped, tokens = ops.all_reduce_scalars(counts, mesh.group("pp"))  # only the last stage counts
        out = dict(self.metrics)
        out["clip_fraction"] = clipped / tokens if tokens else 0.0
        return out

    def evaluate(self, trainer) -> dict:
        """Held-out pass@1 (greedy) and pass@k (rl.pass_k samples at rl.temperature), and
        the mean greedy reward."""
        r = self.cfg.rl
        if not self.eval_problems:
            return {}
        t0 = time.perf_counter()
        model = self._generator(trainer).model()
        prompts = [self.env.prompt_ids(p) for p in self.eval_problems]
        greedy = self._generate(trainer, model, self.eval_problems, prompts, [0] * len(prompts),
                                Sampling(r.max_new_tokens, 0.0))
        out = {"pass@1": float(greedy.score("correct").mean()), "eval_reward": float(greedy.score("reward").mean())}
        if r.pass_k:
            k = r.pass_k
            problems = [p for p in self.eval_problems for _ in range(k)]
            seeds = [row_seed("eval", i, j) for i in range(len(prompts)) for j in range(k)]
            sampled = self._generate(trainer, model, problems, [p for p in prompts for _ in range(k)], seeds,
                                     self.sampling)
            correct = sampled.score("correct").view(len(prompts), k)
            out[f"pass@{k}"] = float((correct.max(dim=1).values > 0).double().mean())
        out["eval_time_s"] = time.perf_counter() - t0
        return out

    # -- the rollout phase ----------------------------------------------------------
    def _generate(self, trainer, model, problems: list[Problem], prompts: list[list[int]], seeds: list[int],
                  sampling: Sampling, reference=None) -> Generations:
        report = trainer.mesh.coord("tp") == 0
        shown = []

        def score(i: int, ids: list[int]) -> tuple[float, float, float, float]:
            *values, why = self.env.score(problems[i], ids)
            if why is not None and report and len(shown) < 3:
                shown.append(i)
                print(f"ndtrain: rl.reward {self.cfg.rl.reward} {why} for prompt {problems[i].prompt!r} "
                      f"(completion {self.env.completion_text(ids)!r}); scored 0", file=sys.stderr, flush=True)
            return tuple(values)
        t = self.env.template
        return generate_everywhere(model, self.generator.layout, prompts, seeds, sampling, t.stop_ids, t.pad_id,
                                   score, reference, self.cfg.train.micro_batch, self.cfg.train.loss_chunk)

    def _generator(self, trainer) -> Generator:
        if self.generator is None:
            self.generator = Generator(trainer.par, self.cfg, trainer.args, GenerationLayout(trainer.mesh, self.cfg))
        return self.generator

    def _reference(self, trainer):
        """The frozen reference: the starting policy (model.init_from's weights, else the
        weights before the first update), under the generation layout."""
        if self.reference is None:
            init = self.cfg.model.init_from
            gen = self._generator(trainer).layout
            if init:
                model = empty_generation_model(trainer.par, self.cfg, trainer.args, gen.tp)
                source = sources.open_init_source(init, trainer.report)
                sources.grow_vocab(source, trainer.args.vocab_size)
                layout.load_model(source, model)
                self.reference = sampling_view(model.requires_grad_(False), gen.tp)
            else:
                self.reference = frozen_copy(trainer.par, self.cfg, trainer.args, gen)
        return self.reference

    def rollout(self, index: int, trainer) -> tuple[MicroBatch, dict]:
        """Rollout `index` sampled now, on the training ranks (the synchronous job). Collective."""
        generator = self._generator(trainer)
        model = generator.model()
        reference = self._reference(trainer)
        rounds, kept = self.sample_rounds(index, lambda rows, prompts, seeds: self._generate(
            trainer, model, rows, prompts, seeds, self.sampling, reference))
        self.last_sampled = rounds[-1][2].times[1] if rounds[-1][2].times else None
        batch, metrics = self.assemble(rounds, kept, index, index, trainer)
        sent = ops.all_reduce_scalars([generator.transfer.bytes], generator.layout.world)[0]
        metrics.update(weight_sync_s=generator.transfer.seconds, weight_sync_bytes=sent)
        return batch, metrics

    def sample_rounds(self, index: int, generate) -> tuple[list, list[tuple[int, int]]]:
        """The rounds of rollout `index` (dapo: refilled until its groups are informative):
        [(problems, prompt ids, Generations, shaped rewards [groups, G])], and the kept
        (round, group) pairs. `generate(problems, prompts, seeds)` samples; the rest is a
        pure function of its results, so a generator process computes the same."""
        r, t = self.cfg.rl, self.cfg.train
        n_groups, g = t.global_batch // r.group_size, r.group_size
        dynamic = r.loss == "dapo"
        buffer = rl_overlong_buffer(r)
        rounds = []  # (problems, prompts, generations, shaped rewards [n_groups, g])
        kept: list[tuple[int, int]] = []  # (round, group)
        for k in range(1 + (r.max_refills if dynamic else 0)):
            problems = self.env.draw(t.seed, f"rollout/{index}/{k}", n_groups, "train")
            rows = [p for p in problems for _ in range(g)]
            prompts = [self.env.prompt_ids(p) for p in rows]
            seeds = [row_seed(t.seed, index, k, i) for i in range(len(rows))]
            gen = generate(rows, prompts, seeds)
            if self.env.custom is not None and bool((gen.score("error") > 0).all()):
                raise TrainingError(f"rl.reward = {r.reward!r} failed on all {len(rows)} completions of rollout "
                                    f"{index} (it {self.env.last_failure}): stopping rather than training on "
                                    "rewards of 0")
            rewards = gen.score("reward") + losses.overlong_penalty(gen.lengths, r.max_new_tokens, buffer)
            rewards = rewards.view(n_groups, g)
            rounds.append((rows, prompts, gen, rewards))
            useful = losses.informative(rewards) if dynamic else torch.ones(n_groups, dtype=torch.bool)
            kept += [(k, j) for j in range(n_groups) if useful[j]][:n_groups - len(kept)]
            if len(kept) == n_groups:
                break
        if len(kept) < n_groups:  # refills ran out: complete with groups that teach nothing (advantage 0)
            spare = [(k, j) for k in range(len(rounds)) for j in range(n_groups) if (k, j) not in kept]
            kept += spare[:n_groups - len(kept)]
        return rounds, kept

    def assemble(self, rounds, kept, index: int, version: int, trainer) -> tuple[MicroBatch, dict]:
        """The batch of rollout `index` sampled with the weights of rollout `version` (each
        token with its own version where a partial rollout took newer weights part-way:
        `Generations.versions`), and its metrics. A stale token (its version < index) trains
        with the importance weight from the sampler's (behaviour) log-probability, its own
        version's, to the training forward's (π_old); a fresh one with none, and only fresh
        tokens' log-probability gaps are a consistency check (other weights sampled the rest)."""
        r = self.cfg.rl
        batch, rollout_logp, versions = self._batch(rounds, kept, index, version, trainer)
        trained = batch.targets != IGNORE
        stale = trained & (versions < index)
        if stale.any():
            batch.is_weights = losses.behaviour_weights(batch.old_logprobs, rollout_logp, stale, r.off_policy,
                                                        r.tis_cap)
        metrics = self._metrics(rounds, batch, rollout_logp, trainer, check=trained & ~stale)
        metrics.update(refills=len(rounds) - 1, staleness=index - version)
        if stale.any():
            w = torch.exp(batch.old_logprobs - rollout_logp)[stale]
            metrics.update(behaviour_weight=float(w.mean()), tis_truncated=float((w > r.tis_cap).double().mean()))
        if trained.any():
            metrics["token_staleness"] = float((index - versions)[trained].double().mean())
        return batch, metrics

    def _batch(self, rounds, kept, index: int, version: int, trainer) -> tuple[MicroBatch, Tensor, Tensor]:
        """The rollout as global rows, with old log-probabilities from the training forward;
        and the sampler's log-probability and the weights' version of every position."""
        r, t = self.cfg.rl, self.cfg.train
        g = r.group_size
        rewards = torch.stack([rounds[k][3][j] for k, j in kept])  # [groups, g]
        if r.shuffle_rewards:  # the negative control: rewards that say nothing about the completions
            generator = torch.Generator().manual_seed(row_seed(t.seed, "shuffle", index))
            rewards = rewards.flatten()[torch.randperm(rewards.numel(), generator=generator)].view_as(rewards)
        adv = losses.advantages(rewards, r.loss).flatten()
        rows = [(rounds[k][1][j * g + i], rounds[k][2], j * g + i) for k, j in kept for i in range(g)]
        lengths = torch.stack([gen.lengths[i] for _, gen, i in rows])
        weight = losses.token_weight(r.loss, lengths, r.max_new_tokens)
        n, s = len(rows), t.seq_len
        pad = self.env.template.pad_id
        tokens = torch.full((n, s), pad, dtype=torch.long)
        targets = torch.full((n, s), IGNORE, dtype=torch.long)
        advantages, weights, ref, rollout = (torch.zeros((n, s), dtype=torch.float64) for _ in range(4))
        versions = torch.full((n, s), version, dtype=torch.long)
        for row, (prompt, gen, i) in enumerate(rows):
            c, p = int(gen.lengths[i]), len(prompt)
            if p + c > s:
                raise TrainingError(f"a prompt of {p} tokens and its completion of {c} exceed train.seq_len = {s}; "
                                    "raise train.seq_len")
            completion = gen.tokens[i, :c]
            tokens[row, :p] = torch.tensor(prompt)
            tokens[row, p:p + c] = completion
            at = slice(p - 1, p - 1 + c)
            targets[row, at] = completion
            advantages[row, at], weights[row, at] = float(adv[row]), float(weight[row])
            rollout[row, at] = gen.logprobs[i, :c]
            if gen.versions is not None:
                versions[row, at] = gen.versions[i, :c]
            if gen.ref_logprobs is not None:
                ref[row, at] = gen.ref_logprobs[i, :c]
        batch = MicroBatch(tokens, targets, weights=weights, advantages=advantages,
                           ref_logprobs=ref if rounds[0][2].ref_logprobs is not None else None)
        batch.old_logprobs = trainer.logprobs_everywhere(batch)  # the training forward's, every row on every rank
        return batch, rollout, versions

    def _metrics(self, rounds, batch: MicroBatch, rollout_logp: Tensor, trainer, check: Tensor) -> dict:
        """The rollout's metrics; `check`: the tokens whose sampler and training log-probabilities
        must agree (those sampled with the current weights)."""
        r = self.cfg.rl
        gens = [gen for _, _, gen, _ in rounds]
        scores = torch.cat([gen.scores for gen in gens])
        lengths = torch.cat([gen.lengths for gen in gens]).double()
        entropy = torch.cat([gen.entropies[i, :int(gen.lengths[i])] for gen in gens for i in range(len(gen.lengths))])
        rewards = torch.cat([rw.flatten() for *_, rw in rounds])
        groups = torch.cat([rw for *_, rw in rounds])
        trained = batch.targets != IGNORE
        gap = float((batch.old_logprobs - rollout_logp).abs()[trained].max()) if trained.any() else 0.0
        out = {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
               "correct": float(scores[:, 2].mean()), "response_length": float(lengths.mean()),
               "truncated": float(torch.cat([~gen.stopped for gen in gens]).double().mean()),
               "entropy": float(entropy.mean()) if len(entropy) else 0.0,
               "groups_with_variance": float(losses.informative(groups).double().mean()),
               "reward_errors": int(scores[:, 3].sum()), "logprob_gap": gap}
        if not torch.isnan(scores[:, 1]).all():
            out["format"] = float(scores[:, 1].nanmean())
        if batch.ref_logprobs is not None:
            out["kl"] = float(losses.k3(batch.old_logprobs, batch.ref_logprobs)[trained].mean())
        fresh = float((batch.old_logprobs - rollout_logp).abs()[check].max()) if check.any() else 0.0
        if fresh > r.logprob_tol and self.cfg.train.precision in PRECISE:
            raise TrainingError(
                f"log-probabilities of the sampled tokens differ by up to {fresh:.2e} between the sampler and the "
                f"training forward on the same weights (rl.logprob_tol = {r.logprob_tol:g}): inference and "
                "training disagree")
        return out

