"""RL on your own prompts: the answer checks (`rl.reward = exact | math`) against cases
worked by hand, question/answer records and their split (the one `ndtrain sft` makes of the
same file), and the documented path end to end: `ndtrain sft` on the file, then `ndtrain rl
model.init_from=run:DIR rl.data=FILE` with each reward."""

from __future__ import annotations

import json

import pytest

from ndtrain.data.answers import exact, final_answer, math_answer, normalise
from ndtrain.data.verifiable import Score


def test_exact_matches_after_normalisation():
    assert normalise("  The  Answer\tIS Paris. ") == "the answer is paris"
    assert exact("PARIS.", "paris") == Score(1.0, 1.0)
    assert exact("Paris, France", "paris") == Score(1.0, 0.0)
    assert exact("   ", "paris") == Score(0.0, 0.0)  # nothing answered: no format either
    assert exact("ｐａｒｉｓ", "paris").correct == 1.0  # NFKC folds full-width letters


@pytest.mark.parametrize("completion, reference, score", [
    ("so the total is \\boxed{42}.", "42", (1.0, 1.0)),
    ("first 7, then \\boxed{\\frac{3}{4}}", "0.75", (1.0, 1.0)),  # the last box, a fraction
    ("\\boxed{1} ... finally \\boxed{2}", "#### 2", (1.0, 1.0)),  # GSM8K's reference form
    ("She has 1,234 apples", "1234", (1.0, 1.0)),  # thousands commas, the last number
    ("it costs $18.", "18", (1.0, 1.0)),
    ("3/4 of them", "\\frac{3}{4}", (1.0, 1.0)),
    ("0.3333", "1/3", (1.0, 0.0)),  # 1e-4 relative: outside the 1e-6 tolerance
    ("0.3333333", "1/3", (1.0, 1.0)),  # 1e-7 relative: inside it
    ("the answer is -5", "5", (1.0, 0.0)),
    ("I do not know", "5", (0.0, 0.0)),  # no box, no number: no answer found
    ("\\boxed{x+1}", "\\boxed{x + 1}", (1.0, 1.0)),  # not numbers: normalised text, spaces dropped
])
def test_math_answers_by_hand(completion, reference, score):
    assert math_answer(completion, reference) == Score(*score)


def test_the_final_answer_is_the_last_box_with_balanced_braces():
    assert final_answer("\\boxed{\\frac{1}{2}} and \\boxed{{a}{b}}") == "{a}{b}"
    assert final_answer("no numbers") is None and final_answer("7 then 8") == "8"


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_question_records_split_as_sft_splits_them(tmp_path):
    """Records with an answer (a string prompt, chat messages, a number answer) read as
    conversations ending in the assistant's answer; the held-out prompts are the records
    `ndtrain sft` holds out of the same file; training draws are seeded samples of the rest."""
    from ndtrain.data.prompts import FilePrompts
    from ndtrain.data.sft import prepare_sft
    from ndtrain.data.template import BuiltinTemplate
    from ndtrain.data.verifiable import char_tokenizer
    records = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(60)]
    records[3] = {"messages": [{"role": "system", "content": "add"}, {"role": "user", "content": "3+3="}],
                  "answer": 6}
    path = _write(tmp_path / "q.jsonl", records)
    source = FilePrompts(str(path), val_fraction=0.1)
    held = source.splits["held_out"]
    assert len(held) + len(source.splits["train"]) == 60 and held
    sft = prepare_sft(str(path), BuiltinTemplate(char_tokenizer()), 64, "keep_start", 0.1)
    assert [c.key for c in sft.held_out] == [p.conversation.key for p in held]
    assert source.splits["train"][0].conversation.turns[-1].trained
    three = next(p for split in source.splits.values() for p in split if p.conversation.key == "q.jsonl:4")
    assert (three.prompt, three.answer, [t.role for t in three.conversation.turns]) == \
        ("3+3=", "6", ["system", "user", "assistant"])
    assert source.draw(0, "rollout/0/0", 5, "train") == source.draw(0, "rollout/0/0", 5, "train")
    assert source.draw(0, "rollout/0/0", 5, "train") != source.draw(0, "rollout/1/0", 5, "train")
    assert source.draw(9, "evaluation", 1000, "held_out") == held  # every held-out prompt, whatever the key


def test_rl_data_reads_parquet_and_names_a_corrupt_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ndtrain.data.prompts import FilePrompts
    from ndtrain.data.shards import DataError
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not a table")
    with pytest.raises(DataError, match=r"bad.parquet: not a readable parquet file"):
        FilePrompts(str(tmp_path / "bad.parquet"), 0.1)
    pq.write_table(pa.table({"prompt": [f"{a}+1=" for a in range(40)], "answer": [str(a + 1) for a in range(40)]}),
                   tmp_path / "q.parquet")
    source = FilePrompts(str(tmp_path / "q.parquet"), 0.1)
    assert sum(len(s) for s in source.splits.values()) == 40 and source.splits["held_out"][0].conversation.key


@pytest.mark.parametrize("records, expect", [
    ([{"prompt": "1+1=", "completion": "2"}] * 3, "a record needs 'answer'"),
    ([{"prompt": "1+1=", "answer": ["2"]}] * 3, "'answer' must be a string (or a number)"),
    ([{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "answer": "c"}] * 3,
     "the prompt ends with the assistant's turn"),
])
def test_bad_question_files_are_one_line(tmp_path, capsys, records, expect):
    from ndtrain.cli import main
    path = _write(tmp_path / "q.jsonl", records)
    code = main(["rl", "--nproc", "1", f"rl.data={path}", "model.init_from=scratch", "model.preset=tiny",
                 f"data.cache_dir={tmp_path / 'cache'}", f"run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and expect in err, err
    assert not (tmp_path / "run").exists()


def test_your_own_prompts_sft_then_rl_with_exact_and_math_rewards(tmp_path, capsys):
    """The documented path on a task ndtrain does not build in (doubling a number), with a
    mixture-of-experts model: `ndtrain sft` on the file's training split, then `ndtrain rl model.init_from=run:DIR
    rl.data=FILE` with the math reward: the rollouts are scored (a policy
    that has seen the task doubles some numbers right), the starting policy and every
    update are evaluated on the held-out prompts; both commands record the routing
    statistics of every block. rl.data without model.init_from says what to do first."""
    from ndtrain.cli import main
    path = _write(tmp_path / "double.jsonl", [{"prompt": f"d:{a}=", "answer": str(2 * a)} for a in range(10)])
    cache, sft_run = tmp_path / "cache", tmp_path / "sft"
    common = ["--nproc", "1", "run.device=cpu", f"data.cache_dir={cache}", "run.progress=false", "run.plot=false"]
    assert main(["rl", *common, f"rl.data={path}"]) == 2
    assert "rl.data has no default warm-up: fine-tune on its training split first" in capsys.readouterr().err
    chars = cache / "chars.json"
    from ndtrain.data.verifiable import char_tokenizer
    cache.mkdir()
    char_tokenizer().save(chars)
    assert main(["sft", *common, "model.preset=tiny-moe", "model.init_from=scratch", f"data.path={path}",
                 f"data.tokenizer={chars}", "data.template=builtin", "data.val_fraction=0.2", "train.steps=40",
                 "train.seq_len=16", "train.global_batch=8", "train.lr=3e-3", "train.eval_every=0",
                 "sft.generate=0", f"run.dir={sft_run}"]) == 0
    sft_records = [json.loads(line) for line in (sft_run / "metrics.jsonl").read_text().splitlines()]
    assert all(len(r["moe"]["tokens_per_expert"]) == 4 for r in sft_records)  # routing statistics, every block
    for reward in ("math",):  # exact: the same path (test_the_environment_scores_with_each_reward)
        run = tmp_path / f"rl-{reward}"
        assert main(["rl", *common, f"model.init_from=run:{sft_run}", f"rl.data={path}", f"rl.reward={reward}",
                     "data.val_fraction=0.2", "train.steps=2", "train.global_batch=8", "rl.group_size=4",
                     "rl.max_new_tokens=4", "train.eval_every=1", "rl.pass_k=2", f"run.dir={run}"]) == 0
        out = capsys.readouterr().out
        assert f"ndtrain rl: grpo on {path} (rl.reward {reward})" in out
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert all("pass@1" in r and 0 <= r["pass@1"] <= 1 and len(r["moe"]["tokens_per_expert"]) == 4
                   for r in records)
        assert max(r["correct"] for r in records) > 0, records  # the warmed-up policy doubles some numbers
        assert 0 <= json.loads((run / "start_eval.json").read_text())["pass@1"] <= 1


def test_the_environment_scores_rl_data_with_each_reward(tmp_path):
    """With rl.data, rl.reward builtin means exact; exact and math score the same
    completions as their checks say ("09" is not "9" to exact, the same number to math;
    the character tokenizer has no "."); a user's function gets the question text."""
    from ndtrain.config import load_config
    from ndtrain.data.template import BuiltinTemplate
    from ndtrain.data.verifiable import char_tokenizer
    from ndtrain.train.rl.task import Environment
    path = _write(tmp_path / "q.jsonl", [{"prompt": f"h:{a}=", "answer": str(3 * a)} for a in range(20)])
    tok = char_tokenizer()
    scores = {}
    for reward in ("builtin", "exact", "math", "test_rl_data:question_length"):
        env = Environment(load_config(None, [f"rl.data={path}", f"rl.reward={reward}"]), BuiltinTemplate(tok))
        problem = next(p for split in env.prompts.splits.values() for p in split if p.prompt == "h:3=")
        scores[reward] = [env.score(problem, tok.encode(text))[:3] for text in ("9", "09", "x")]
    assert scores["builtin"] == scores["exact"] == [(1.0, 1.0, 1.0), (0.0, 1.0, 0.0), (0.0, 1.0, 0.0)]
    assert scores["math"] == [(1.0, 1.0, 1.0), (1.0, 1.0, 1.0), (0.0, 0.0, 0.0)]
    assert [s[0] for s in scores["test_rl_data:question_length"]] == [4.0] * 3


def question_length(prompt: str, completion: str, answer: str) -> float:
    return float(len(prompt))
