"""RL with verifiable rewards: the losses against hand-worked numbers, the batched sampler,
the tasks' checks, the update step under every layout against one process in fp64, the
rollout/training log-probability agreement in fp32, bad input, and the command end to end."""

from __future__ import annotations

import json
import math
import random
import re
import shlex

import pytest
import torch

from helpers import TINY
from ndtrain.data.batch import MicroBatch
from ndtrain.data.verifiable import (Addition, Countdown, Reverse, Score, Sort, arithmetic, char_tokenizer,
                                     draw_problems, held_out)
from ndtrain.generate.sampler import filter_logits, generate
from ndtrain.model.args import PRESETS
from ndtrain.model.llama import Transformer
from ndtrain.model.loss import IGNORE
from ndtrain.testing import run_ranks
from ndtrain.train.rl import losses

# One torch thread in this process (conftest.py's one_thread): on a shared 2-core machine two
# threads per tiny matmul cost more in contention than they gain (measured: 20× slower under load).
pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- the losses


def test_advantages_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    std = math.sqrt(4 * 0.5 ** 2 / 3)  # sample standard deviation of (1, 0, 0, 1)
    a = 0.5 / (std + losses.STD_EPS)
    expected = {"grpo": [[a, -a, -a, a], [0, 0, 0, 0]], "dapo": [[a, -a, -a, a], [0, 0, 0, 0]],
                "dr_grpo": [[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0]],
                "reinforce": [[0.75, -0.25, -0.25, 0.75], [-0.25] * 4]}  # batch mean 0.25
    for loss, want in expected.items():
        assert torch.allclose(losses.advantages(rewards, loss), torch.tensor(want, dtype=torch.float64), atol=1e-12), loss


def test_normalisation_weights_by_hand():
    lengths = torch.tensor([2, 3, 0, 5])  # T = 10 trained tokens in N = 3 completions (one row trains nothing)
    expected = {"grpo": [10 / (3 * 2), 10 / (3 * 3), 0.0, 10 / (3 * 5)],  # mean per completion, then over completions
                "dr_grpo": [10 / (3 * 6)] * 4,  # Σ / (N · max_new_tokens = 6)
                "dapo": [1.0] * 4,  # Σ / T: the trainer's division alone
                "reinforce": [10 / 3] * 4}  # Σ per completion, mean over completions
    for loss, want in expected.items():
        got = losses.token_weight(loss, lengths, max_new_tokens=6)
        assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), atol=1e-12), loss


def test_dynamic_sampling_and_overlong_shaping_by_hand():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.2]])
    assert losses.informative(rewards).tolist() == [False, True, False, True]
    # max_new_tokens 8, buffer 4: free up to 4 tokens, then −1/4 per token, −1 at 8 (and beyond)
    got = losses.overlong_penalty(torch.tensor([3, 4, 5, 7, 8, 9]), 8, 4)
    assert got.tolist() == [0.0, 0.0, -0.25, -0.75, -1.0, -1.0]
    assert losses.overlong_penalty(torch.tensor([8]), 8, 0).tolist() == [0.0]


def _objective_case():
    """One row of five positions: the first is a prompt position (IGNORE)."""
    nll = torch.tensor([0.0, 1.0, 2.0, 0.5, 1.5], dtype=torch.float64, requires_grad=True)
    mb = MicroBatch(tokens=torch.zeros(1, 5, dtype=torch.long),
                    targets=torch.tensor([[IGNORE, 5, 6, 7, 8]]),
                    weights=torch.tensor([[0.0, 1.0, 1.0, 0.5, 2.0]], dtype=torch.float64),
                    advantages=torch.tensor([[0.0, 1.0, -1.0, 2.0, -0.5]], dtype=torch.float64),
                    # ratios exp(logp − old) = exp(0.5), exp(−0.7), exp(−0.1), 1
                    old_logprobs=torch.tensor([[9.0, -1.5, -1.3, -0.4, -1.5]], dtype=torch.float64),
                    ref_logprobs=torch.tensor([[9.0, -1.0, -2.5, -0.4, -1.0]], dtype=torch.float64))
    return nll, mb


def test_clipped_objective_and_kl_by_hand():
    nll, mb = _objective_case()
    objective = losses.PolicyObjective("dapo", clip_low=0.2, clip_high=0.28, kl_coef=0.1)
    total = objective(nll, mb)
    total.backward()
    # token 1: A = 1, ratio e^0.5 = 1.6487 > 1.28: the clipped term 1.28 is the smaller: −1.28, no gradient
    # token 2: A = −1, ratio e^−0.7 = 0.4966 < 0.8: min(−0.4966, −0.8) = −0.8 (clipped): +0.8, no gradient
    # token 3: A = 2, ratio e^−0.1 = 0.9048: inside: −2·0.9048, d/dnll = +ratio·A
    # token 4: A = −0.5, ratio 1: −(−0.5) = 0.5, d/dnll = ratio·A = −0.5
    r3 = math.exp(-0.1)
    pg = [-1.28, 0.8, -2 * r3, 0.5]
    d_pg = [0.0, 0.0, 2 * r3, -0.5]
    # k3 with d = log π_ref − log π = ref + nll: e^d − d − 1; d/dnll = e^d − 1
    d = [-1.0 + 1.0, -2.5 + 2.0, -0.4 + 0.5, -1.0 + 1.5]
    k3 = [math.exp(x) - x - 1 for x in d]
    d_k3 = [math.exp(x) - 1 for x in d]
    w = [1.0, 1.0, 0.5, 2.0]
    want = sum(wi * (p + 0.1 * k) for wi, p, k in zip(w, pg, k3))
    want_grad = [0.0] + [wi * (g + 0.1 * dk) for wi, g, dk in zip(w, d_pg, d_k3)]
    assert abs(float(total.detach()) - want) < 1e-12
    assert torch.allclose(nll.grad, torch.tensor(want_grad, dtype=torch.float64), atol=1e-12)
    assert objective.take_counts() == (2.0, 4.0)  # two of the four trained tokens were clipped
    # symmetric clipping (grpo's default): token 1's ratio 1.6487 is clipped at 1.2 instead
    nll.grad = None
    grpo = losses.PolicyObjective("grpo", 0.2, 0.2, 0.0)(nll, mb)
    assert abs(float(grpo.detach()) - sum(wi * p for wi, p in zip(w, [-1.2, 0.8, -2 * r3, 0.5]))) < 1e-12


def test_reinforce_is_advantage_times_log_likelihood():
    nll, mb = _objective_case()
    total = losses.PolicyObjective("reinforce", 0.2, 0.2, 0.0)(nll, mb)
    total.backward()
    w, a, n = [1.0, 1.0, 0.5, 2.0], [1.0, -1.0, 2.0, -0.5], [1.0, 2.0, 0.5, 1.5]
    assert abs(float(total.detach()) - sum(wi * ai * ni for wi, ai, ni in zip(w, a, n))) < 1e-12  # −A·log π = A·nll
    assert torch.allclose(nll.grad[1:], torch.tensor([wi * ai for wi, ai in zip(w, a)], dtype=torch.float64))


# ----------------------------------------------------------------------------- the sampler


def _model(vocab: int = 40, dtype=torch.float64) -> Transformer:
    model = Transformer(PRESETS["tiny"].with_(vocab_size=vocab, max_seq_len=64))
    model.init_weights(3)
    return model.to(dtype)


def test_batched_generation_equals_one_row_at_a_time_and_a_full_forward():
    """Left-padded rows with a KV cache: each row's tokens equal generating it alone (same
    seed), without the cache too, and its recorded log-probabilities equal a plain forward
    of prompt + completion (fp64, 1e-12)."""
    model = _model()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15]]
    seeds = [7, 8, 9, 10]
    for temperature, top_k, top_p in ((1.0, 0, 1.0), (0.8, 5, 0.9), (0.0, 0, 1.0)):
        both = generate(model, prompts, 8, temperature, top_k, top_p, seeds, stop_ids=[3, 17])
        no_cache = generate(model, prompts, 8, temperature, top_k, top_p, seeds, stop_ids=[3, 17], use_cache=False)
        assert no_cache.tokens == both.tokens
        for i, p in enumerate(prompts):
            alone = generate(model, [p], 8, temperature, top_k, top_p, [seeds[i]], stop_ids=[3, 17])
            assert alone.tokens[0] == both.tokens[i]
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([p + both.tokens[i]]))[0], -1)
            ref = [float(logp[len(p) - 1 + j, t]) for j, t in enumerate(both.tokens[i])]
            assert max(abs(x - y) for x, y in zip(ref, both.logprobs[i])) < 1e-12
    stopped = generate(model, prompts, 30, 1.0, seeds=seeds, stop_ids=list(range(20)))
    assert all(t[-1] < 20 for t in stopped.tokens) and all(stopped.stopped)


def test_top_k_and_top_p_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    keep = lambda out: (out > float("-inf")).int().tolist()[0]  # noqa: E731
    assert keep(filter_logits(logits, top_k=2)) == [1, 1, 0, 0, 0]
    assert keep(filter_logits(logits, top_p=0.6)) == [1, 1, 0, 0, 0]  # 0.5 < 0.6 ≤ 0.7
    assert keep(filter_logits(logits, top_p=0.5)) == [1, 0, 0, 0, 0]
    assert keep(filter_logits(logits, top_p=0.86)) == [1, 1, 1, 1, 0]  # 0.85 < 0.86
    assert keep(filter_logits(logits, top_k=3, top_p=0.99)) == [1, 1, 1, 0, 0]


# ----------------------------------------------------------------------------- the tasks


def test_tasks_score_format_and_correctness():
    a = Addition(3, reverse_answer=True)
    assert (a.score("57+312=", "963", "963").correct, a.score("57+312=", "369", "963").format) == (1.0, 1.0)
    assert a.score("57+312=", "369", "963").correct == 0.0 and a.score("57+312=", "9x", "963").format == 0.0
    assert Reverse(5).score("R:abc=", "cba", "cba").correct == 1.0 and Reverse(5).score("R:abc=", "c1", "cba").format == 0
    assert Sort(3).score("S:5,1,4=", "1,4,5", "1,4,5").correct == 1.0 and Sort(3).score("S:5,1,4=", "1 4", "1,4,5").format == 0
    c = Countdown(3)
    assert c.score("C:3,5,7>22=", "7+3*5", "3*5+7").correct == 1.0  # another expression with the same value
    assert c.score("C:3,5,7>22=", "(7-5)*3", "3*5+7") == Score(1.0, 0.0)  # well formed, 6 ≠ 22
    assert c.score("C:3,5,7>22=", "7*3+1", "3*5+7").format == 0.0  # 1 is not given
    assert c.score("C:3,5,7>22=", "5*5-3", "3*5+7").format == 0.0  # 5 used twice
    assert arithmetic("__import__('os')") == (None, None) and arithmetic("3/0") == (None, None)
    rng = random.Random(0)
    for task in (a, Reverse(6), Sort(4), c):
        for _ in range(50):
            p = task.draw(rng)
            assert task.score(p.prompt, p.answer, p.answer).correct == 1.0, p
            assert len(p.prompt) <= task.max_prompt_chars
            assert char_tokenizer().decode(char_tokenizer().encode(p.prompt + p.answer)) == p.prompt + p.answer


def test_held_out_prompts_never_reach_training():
    task = Addition(2, True)
    train = draw_problems(task, 0, "rollout/0/0", 500, "train")
    evaluation = draw_problems(task, 0, "evaluation", 200, "held_out")
    assert not any(held_out(p.prompt) for p in train) and all(held_out(p.prompt) for p in evaluation)
    assert not {p.prompt for p in train} & {p.prompt for p in evaluation}
    assert draw_problems(task, 0, "rollout/0/0", 500, "train") == train  # a pure function of its arguments


# ----------------------------------------------------------------------------- layouts


def length_reward(prompt: str, completion: str, answer: str) -> float:
    """The proofs' reward: a tiny random model never adds correctly, but its completions
    differ in length, so every group has something to learn. It raises on a 7, to prove a
    failing reward is scored 0, counted, and the run goes on."""
    if "7" in completion:
        raise ValueError("no sevens")
    return len(completion) / 6 + float(completion == answer)


# Eight rows (2 prompts × 4 completions) of up to 6 new tokens; a KL to the reference; two
# updates per rollout (the second with ratios ≠ 1); every rollout under another loss. FP64's
# eps (1e-6): with 1e-8 the residues of advantages that cancel within a group made the
# layouts' rounding grow 3-10× per update (docs/architecture.md, the tolerance rule).
RL_PROOF = ["train.steps=8", "train.global_batch=8", "train.seq_len=16",
            "model.max_seq_len=64", "train.eval_every=0", "rl.group_size=4", "rl.max_new_tokens=6", "rl.size=2",
            "rl.reward=test_rl:length_reward", "rl.kl_coef=0.05", "rl.ppo_epochs=2", "rl.eval_prompts=0",
            "train.lr=3e-3", "rl.clip_low=0.02"]
CYCLE = ("grpo", "dapo", "dr_grpo", "reinforce")
METRICS = ("reward_mean", "logprob_gap", "kl", "clip_fraction", "reward_errors", "refills", "entropy", "moe")


def _rl_task(cfg):
    from ndtrain.config import rl_clip_high
    from ndtrain.data.template import BuiltinTemplate
    from ndtrain.train.rl.task import RL, Environment

    class CyclingRL(RL):
        """Rollout k (updates 2k, 2k+1) uses loss CYCLE[k]: its advantages, weights,
        dynamic sampling (dapo) and objective, so one run proves all four."""

        def before_update(self, step, trainer):
            if step % 2 == 0:
                self.cfg.rl.loss = CYCLE[step // 2 % len(CYCLE)]
                self.objective.loss, self.objective.clip_high = self.cfg.rl.loss, rl_clip_high(self.cfg.rl)
            super().before_update(step, trainer)
    return CyclingRL(cfg, Environment(cfg, BuiltinTemplate(char_tokenizer())))


def _rl_rows(rows):
    """Each row: (name, overrides, kind): "reference" (the single-process proof and its
    twin, with the tolerances they give), "proof" (fp64), "fp32", or "strict" (a log-prob
    tolerance below the fp32 gap: the first rollout stops the run, and the message is kept)."""
    from helpers import proof_in_rank, reference_in_rank, train_in_rank
    from ndtrain.train.trainer import TrainingError
    out = {}
    for name, overrides, kind in rows:
        if kind == "strict":
            try:
                train_in_rank(RL_PROOF + overrides, "", make_task=_rl_task)
            except TrainingError as e:
                out[name] = str(e)
            continue
        if kind == "fp32":
            trainer = train_in_rank(RL_PROOF + overrides, "", make_task=_rl_task)[2]
            out[name] = {"metrics": [{k: r.get(k) for k in METRICS} for r in trainer.history]}
            continue
        run = (reference_in_rank if kind == "reference" else proof_in_rank)(RL_PROOF + overrides, "",
                                                                            make_task=_rl_task)
        run["metrics"] = [{k: r.get(k) for k in METRICS} for r in run.pop("history")]
        out[name] = run
    return out


# Every layout runs the head and loss in chunks of 5 positions (train.loss_chunk, not a
# divisor of any micro-batch's positions), against one process with the whole logits: the
# chunked-logits proof under every layout family (tests/test_loss_chunks.py: one process).
CHUNKED = ["train.loss_chunk=5"]
RL_LAYOUTS = [("dp2", ["parallel.dp=2", "train.micro_batch=2", *CHUNKED]),
              ("zero3-dp2", ["parallel.zero=3", "train.micro_batch=2", *CHUNKED]),
              ("tp2", ["parallel.tp=2", *CHUNKED]),
              ("pp2", ["parallel.pp=2", "train.micro_batch=2", *CHUNKED]),
              ("cp2", ["parallel.cp=2", "train.micro_batch=4", *CHUNKED])]
FP32_CONSISTENCY = [("dp2-fp32", ["parallel.dp=2", "train.precision=fp32", "train.steps=2"], "fp32"),
                    ("tp2-fp32", ["parallel.tp=2", "train.precision=fp32", "train.steps=2"], "fp32"),
                    ("dp2-fp32-strict", ["parallel.dp=2", "train.precision=fp32", "train.steps=2",
                                         "rl.logprob_tol=1e-12"], "strict")]


def test_rl_update_under_every_layout_equals_one_process_in_fp64():
    """Seeded rollouts, generated under each layout's generation layout, and the updates on
    them (grpo, dapo, dr_grpo, reinforce, with KL and a second update per rollout) equal one
    process's: the same rollouts (rewards), and every loss, gradient norm, first-step
    gradient and final weight under the tolerance rule (tests/helpers.py: the first update
    at exact precision, later ones within the twin's gaps). Rollout and training
    log-probabilities agree to 1e-10 in fp64 and to 1e-5 in fp32 under dp2 and tp2."""
    from helpers import assert_proof
    ref = run_ranks(_rl_rows, 1, [("single", [], "reference")], timeout=300)[0]["single"]
    metrics = ref["metrics"]
    rollouts = metrics[::2]  # the updates that began with a rollout
    assert sum(m["reward_errors"] for m in rollouts) > 0  # the failing reward was counted and the run went on
    assert max(m["clip_fraction"] for m in metrics[1::2]) > 0  # a rollout's second update clips some ratios
    assert min(m["kl"] for m in rollouts[1:]) > 0
    runs = run_ranks(_rl_rows, 2, [(n, o, "proof") for n, o in RL_LAYOUTS] + FP32_CONSISTENCY, timeout=600)[0]
    for name, _ in RL_LAYOUTS:
        run = runs[name]
        assert [m["reward_mean"] for m in run["metrics"]] == [m["reward_mean"] for m in metrics], name
        assert max(m["logprob_gap"] for m in run["metrics"][::2]) < 1e-10, name
        try:
            assert_proof(run, ref)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
    assert re.match(r"log-probabilities of the sampled tokens differ by up to \S+ between the sampler and the "
                    r"training forward on the same weights \(rl.logprob_tol = 1e-12\)", runs["dp2-fp32-strict"])
    for name, _, _ in FP32_CONSISTENCY[:2]:
        gaps = [m["logprob_gap"] for m in runs[name]["metrics"][::2]]
        assert max(gaps) <= 1e-5 and max(gaps) > 0, (name, gaps)


# ----------------------------------------------------------------------------- the command


def text_reward(prompt: str, completion: str, answer: str):
    return "good"


def broken_reward(prompt: str, completion: str, answer: str):
    raise KeyError(answer)


@pytest.mark.parametrize("extra, expect", [
    (["rl.group_size=1"], "rl.group_size = 1: rl.loss = grpo normalises rewards within a group"),
    (["train.global_batch=12"], "train.global_batch = 12: must be divisible by rl.group_size × dp = 8 × 2 = 16"),
    (["rl.reward=no_such_module:f"], "rl.reward = 'no_such_module:f': cannot import it (ModuleNotFoundError"),
    (["rl.reward=test_rl:no_such_function"], "rl.reward = 'test_rl:no_such_function': cannot import it"),
    (["rl.reward=test_rl:text_reward"], "rl.reward = 'test_rl:text_reward': returned 'good' (str), not a number on a sample"),
    (["rl.reward=test_rl:broken_reward"], "rl.reward = 'test_rl:broken_reward': raised KeyError"),
    (["rl.loss=bandit"], "rl.loss = 'bandit': choose one of reinforce, grpo, dr_grpo, dapo"),
    (["rl.temperature=0"], "rl.temperature = 0.0: greedy sampling gives a group the same completion"),
    (["rl.loss=reinforce", "rl.ppo_epochs=2"], "rl.ppo_epochs = 2: reinforce has no importance ratio"),
    (["rl.size=12"], "rl.size = 12: must be in [1, 9] for rl.task = addition"),
    (["train.seq_len=8"], "train.seq_len = 8: must hold the task's longest prompt"),
    (["model.dropout=0.1"], "model.dropout = 0.1: RL compares the sampler's log-probabilities (no dropout)"),
    (["model.preset=tiny-moe", "model.moe_capacity=1.25"], "model.moe_capacity = 1.25: dropping tokens over an"),
    (["rl.generate_tp=3"], "rl.generate_tp = 3: must divide the 2 processes"),
    (["rl.reward=fuzzy"], "rl.reward = 'fuzzy': choose builtin, exact, math, or MODULE:FUNCTION"),
    (["rl.warmup_target=1.5"], "rl.warmup_target = 1.5: must be in [0, 1]"),
    (["rl.data=missing.jsonl"], "rl.data missing.jsonl: no such file or folder"),
    (["train.loss_chunk=-1"], "train.loss_chunk = -1: must be >= 0"),
])
def test_bad_input_is_one_line_exit_2_nothing_written(extra, expect, tmp_path, capsys, monkeypatch):
    from ndtrain.cli import main
    monkeypatch.chdir(tmp_path)
    code = main(["rl", "--nproc", "2", "model.init_from=scratch", "model.preset=tiny", "run.device=cpu",
                 f"data.cache_dir={tmp_path / 'cache'}", *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and expect in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_failing_reward_scores_zero_and_says_why():
    from ndtrain.data.template import BuiltinTemplate
    from ndtrain.train.rl.task import Environment
    from ndtrain.config import load_config
    cfg = load_config(None, ["rl.reward=test_rl:length_reward"])
    env = Environment(cfg, BuiltinTemplate(char_tokenizer()))
    problem = env.draw(0, "x", 1, "train")[0]
    ids = char_tokenizer().encode("17")
    reward, fmt, correct, error, why = env.score(problem, ids)
    assert (reward, correct, error) == (0.0, 0.0, 1.0) and math.isnan(fmt) and why == "raised ValueError: no sevens"
    assert env.score(problem, char_tokenizer().encode("12"))[:4:2] == (2 / 6, 0.0)


def test_rl_command_end_to_end(tmp_path, capsys):
    """The default job's path with tiny settings: an SFT warm-up through `ndtrain sft`
    (cached: the second command starts from it), then GRPO; metrics.jsonl carries the RL
    metrics and held-out pass@1, rl.png is drawn; --evaluate scores a run's policy."""
    from ndtrain.cli import main
    cache, run = tmp_path / "cache", tmp_path / "run"
    tiny = ["--nproc", "1", "model.preset=tiny", "run.device=cpu", f"data.cache_dir={cache}", "rl.warmup_steps=3",
            "rl.warmup_examples=200", "rl.eval_prompts=8", "rl.pass_k=2", "train.global_batch=16", "rl.group_size=4"]
    assert main(["rl", *tiny, "train.steps=2", "train.eval_every=1", f"run.dir={run}"]) == 0
    out = capsys.readouterr().out
    assert "SFT warm-up on addition" in out and "starting policy: held-out pass@1" in out
    assert re.search(r"training reward \(rollout mean\) \d\.\d{3} in updates 1–1 → \d\.\d{3} in updates 2–2", out)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1] and all("pass@1" in r and "pass@2" in r for r in records)
    for key in ("reward_mean", "reward_std", "response_length", "entropy", "clip_fraction", "kl",
                "groups_with_variance", "rollout_time_s", "step_time_s", "logprob_gap", "correct", "format"):
        assert all(key in r for r in records), key
    assert (run / "rl.png").is_file() and json.loads((run / "summary.json").read_text())["task"] == "rl"
    # the closing hint samples a held-out problem of the task, and runs as printed
    hint = [line for line in out.splitlines() if line.startswith("sample with")]  # the warm-up's (sft), then rl's
    assert len(hint) == 2 and all("def " not in line for line in hint), hint
    hint = shlex.split(hint[-1].split(maxsplit=2)[2])
    assert hint[:2] == ["ndtrain", "generate"] and re.fullmatch(r"\d+\+\d+=", hint[hint.index("--prompt") + 1])
    assert main(hint[1:]) == 0 and capsys.readouterr().out.strip()
    assert main(["rl", *tiny, "--evaluate"]) == 0
    out = capsys.readouterr().out
    assert "starting from the cached SFT warm-up" in out and "held-out pass@1" in out
    # continued to 4 updates, the summary's reward trend spans the whole run, not the part since the resume
    assert main(["rl", *tiny, "train.steps=4", "train.eval_every=1", f"run.dir={run}"]) == 0
    out = capsys.readouterr().out
    trend = json.loads((run / "summary.json").read_text())["reward_trend"]
    assert trend["of"] == 4 and trend["first"] == records[0]["reward_mean"], trend
    assert re.search(r"in updates 1–1 → \d\.\d{3} in updates 4–4", out), out


def test_warmup_stops_at_the_first_check_reaching_its_target(tmp_path):
    """The default job's warm-up (train/rl/job.py): SFT ends at the first check whose held-out
    pass@1 reaches rl.warmup_target (equal counts), never without a check or with target 0;
    its one line names the step and the check, or that rl.warmup_steps ran out."""
    from types import SimpleNamespace

    from ndtrain.config import load_config
    from ndtrain.train.rl.job import PASS_KEY, Warmup, describe_warmup
    cfg = load_config(None, [])
    target = cfg.rl.warmup_target
    stub = SimpleNamespace(cfg=cfg)
    assert Warmup.done(stub, {PASS_KEY: target}) and Warmup.done(stub, {PASS_KEY: 0.9})
    assert not Warmup.done(stub, {PASS_KEY: target - 0.005}) and not Warmup.done(stub, {"val_loss": 0.5})
    assert not Warmup.done(SimpleNamespace(cfg=load_config(None, ["rl.warmup_target=0"])), {PASS_KEY: 1.0})
    checks = [{"step": 4, PASS_KEY: 0.1}, {"step": 9, "loss": 1.0}, {"step": 9, PASS_KEY: target + 0.1}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in checks))
    line = describe_warmup(cfg, tmp_path)
    assert f"stopped after 10 steps at held-out pass@1 {target + 0.1:.3f}: reached rl.warmup_target = {target:g}" in line
    (tmp_path / "metrics.jsonl").write_text(json.dumps(checks[0]) + "\n")
    assert "did not reach (rl.warmup_steps ran out)" in describe_warmup(cfg, tmp_path)


def test_rl_toml_lists_the_commands_defaults():
    from pathlib import Path

    from ndtrain.config import RL_DEFAULTS, load_config
    path = Path(__file__).parent.parent / "configs" / "rl.toml"
    assert load_config(path).to_dict() == load_config(None, [], defaults=RL_DEFAULTS).to_dict()


@pytest.mark.slow
def test_bench_generate_compares_the_same_tokens_and_ends_with_the_ratio(capsys):
    from ndtrain.cli import main
    assert main(["bench", "generate", "--nproc", "3"]) == 2
    assert "--nproc = 3: bench generate runs on one process" in capsys.readouterr().err
    assert main(["bench", "generate", "--rounds", "1", "--steps", "1", "model.preset=tiny", "train.global_batch=2",
                 "train.seq_len=8", "run.device=cpu", "run.threads=1"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"ndtrain kv-cache/no-cache generation throughput ratio: \d+\.\d\d", last), last
