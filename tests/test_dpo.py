"""DPO: preference records and their errors, a pair per row with answer-only ±1 weights, the
loss and its figures against a direct computation on the chosen and rejected sequences
alone (fp64), the reference kept with the run and never recomputed on resume or after
SIGTERM, the shuffled control, dp2, tp2, pp2 and ZeRO-3 (with and without LoRA) equal to one
process in fp64, and the command's bad input."""

from __future__ import annotations

import functools
import json
import math
import random

import pytest
import torch
import torch.nn.functional as F

from helpers import TINY, assert_proof, proof_in_rank, reference_in_rank
from ndtrain.cli import main
from ndtrain.data.chat import BadRecord
from ndtrain.data.preference import CHOSEN, REJECTED, pair_rows, parse_pair, prepare_preferences
from ndtrain.data.template import BuiltinTemplate
from ndtrain.data.tokenizer import TextTokenizer
from ndtrain.model.loss import IGNORE
from ndtrain.testing import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

WORDS = "the value of each item is returned when the list is empty or the key is missing".split()


def make_pairs(n: int = 48, seed: int = 0) -> list[dict]:
    """All three record shapes; answers of 1 to 12 words, so pairs fill rows unequally."""
    rng = random.Random(seed)
    words = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
    out = []
    for i in range(n):
        p, c, r = words(rng.randint(2, 8)), words(rng.randint(1, 12)), words(rng.randint(1, 12))
        if i % 3 == 0:
            out.append({"prompt": p, "chosen": " " + c, "rejected": " " + r})
        elif i % 3 == 1:
            out.append({"prompt": [{"role": "user", "content": p}], "chosen": [{"role": "assistant", "content": c}],
                        "rejected": [{"role": "assistant", "content": r}]})
        else:
            head = [{"role": "system", "content": "be brief"}, {"role": "user", "content": p},
                    {"role": "assistant", "content": words(2)}, {"role": "user", "content": words(2)}]
            out.append({"chosen": head + [{"role": "assistant", "content": c}],
                        "rejected": head + [{"role": "assistant", "content": r}]})
    return out


@pytest.fixture(scope="module")
def dpo_files(tmp_path_factory, tiny_data):
    root = tmp_path_factory.mktemp("dpo")
    path = root / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in make_pairs()))
    return str(path), f"{tiny_data}/tokenizer.json"


@pytest.fixture(scope="module")
def template(dpo_files):
    return BuiltinTemplate(TextTokenizer.from_file(dpo_files[1]))


# --------------------------------------------------------------------------- records and rows


def test_three_record_shapes_train_only_the_choice():
    plain = parse_pair({"prompt": "2+2=", "chosen": "4", "rejected": "5"}, "k")
    assert not plain.chosen.chat and [(t.content, t.trained) for t in plain.rejected.turns] == [("2+2=", False),
                                                                                              ("5", True)]
    chat = parse_pair({"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": "a"}],
                       "rejected": [{"role": "assistant", "content": "b"}]}, "k")
    assert chat.chosen.chat and [t.trained for t in chat.chosen.turns] == [False, True]
    head = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "earlier"},
            {"role": "user", "content": "q2"}]
    whole = parse_pair({"chosen": head + [{"role": "assistant", "content": "a"}],
                        "rejected": head + [{"role": "assistant", "content": "b"}]}, "k")
    assert [t.trained for t in whole.chosen.turns] == [False, False, False, True]  # the earlier answer is context
    assert whole.rejected.answer == "b"


@pytest.mark.parametrize("record, why", [
    ({"prompt": "q", "chosen": "a"}, "needs 'chosen' and 'rejected' (missing rejected)"),
    ({"prompt": "q", "chosen": "a", "rejected": "  "}, "an assistant turn is empty"),
    ({"chosen": "a", "rejected": "b"}, "'prompt' must be a string too"),
    ({"prompt": "q", "chosen": "a", "rejected": [{"role": "assistant", "content": "b"}]}, "both be strings or both"),
    ({"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
      "rejected": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "b"}]},
     "the same conversation but for the last"),
    ({"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "user", "content": "a"}],
      "rejected": [{"role": "assistant", "content": "b"}]}, "may only hold assistant messages"),
    ([1, 2], "a record must be a JSON object"),
])
def test_bad_records_say_why(record, why):
    with pytest.raises(BadRecord, match=why.replace("(", r"\(").replace(")", r"\)")):
        parse_pair(record, "k")


def test_a_row_holds_the_pair_with_plus_and_minus_one_on_the_answers_only(dpo_files, template):
    data = prepare_preferences(dpo_files[0], template, 96, 0.2)
    rows = pair_rows(data.train, 96, template.pad_id)
    assert len(rows) == len(data.train)
    for r, (chosen, rejected) in enumerate(data.train):
        for doc, ex, sign in ((CHOSEN, chosen, 1.0), (REJECTED, rejected, -1.0)):
            at = (rows.doc_ids[r] == doc).nonzero().flatten()
            assert torch.equal(rows.tokens[r, at], torch.from_numpy(ex.tokens[:-1]))
            assert torch.equal(rows.positions[r, at], torch.arange(len(at)))
            trained = torch.from_numpy(ex.trained[1:])
            assert torch.equal(rows.weights[r, at], torch.where(trained, sign, 0.0).double())
        assert (rows.weights[r][rows.targets[r] == IGNORE] == 0).all()


def test_shuffled_control_swaps_exactly_half_of_every_batch(dpo_files):
    """dpo.shuffle: each training batch's rows have their weights negated (chosen and
    rejected swapped) in exactly half the rows (an odd batch: one more or one fewer, by a
    coin), which rows varying with step and seed, the same for every micro-batch split; the
    held-out rows keep their labels."""
    from ndtrain.config import load_config
    from ndtrain.data.preference import control_signs
    g = 8
    make = lambda *extra: _dpo_task(*dpo_files, load_config(None, TINY + [  # noqa: E731
        "train.seq_len=96", f"train.global_batch={g}", *extra]))
    plain, control = make(), make("dpo.shuffle=true")
    swapped = []
    for step in range(6):
        a, b = plain.rows("train", step, 0, g), control.rows("train", step, 0, g)
        sign = (b.weights * a.weights).sum(-1).sign()
        assert torch.equal(b.weights.abs(), a.weights.abs()) and int((sign < 0).sum()) == g // 2
        assert torch.equal(torch.cat([control.rows("train", step, i, i + 2).weights for i in range(0, g, 2)]),
                           b.weights)  # micro-batches see the same swaps
        swapped.append((sign < 0).tolist())
    assert len({tuple(x) for x in swapped}) > 1  # other rows at other steps
    assert torch.equal(control.rows("val", 0, 0, g).weights, plain.rows("val", 0, 0, g).weights)
    assert torch.equal(control_signs(0, 3, g), control_signs(0, 3, g))
    assert not torch.equal(control_signs(0, 3, g), control_signs(1, 3, g))
    odd = torch.stack([control_signs(0, step, 7) for step in range(200)])
    assert set((odd < 0).sum(-1).tolist()) == {3, 4}


# --------------------------------------------------------------------------- the loss against a direct computation


def _fp64_model(vocab: int):
    from ndtrain.config import load_config
    from ndtrain.model.llama import Transformer
    args = load_config(None, ["model.preset=tiny"]).model_args(vocab_size=vocab).with_(max_seq_len=96)
    model = Transformer(args)
    model.init_weights(0)
    return model.double()


def _answer_logprob(model, ex) -> torch.Tensor:
    """log p of an example's trained tokens, the example alone in its own sequence."""
    tokens = torch.from_numpy(ex.tokens)
    logp = torch.log_softmax(model(tokens[None, :-1])[0], dim=-1)
    picked = logp.gather(-1, tokens[1:, None])[:, 0]
    return picked[torch.from_numpy(ex.trained[1:])].sum()


def test_loss_and_metrics_equal_a_direct_computation_in_fp64(dpo_files, template):
    """The objective on packed pair rows (reference sums on their anchors) against DPO
    written out: each answer's log-probability from a forward of its sequence alone, the
    reference another model; the loss, its gradients (1e-10 of each tensor's largest) and
    the step's figures."""
    from ndtrain.config import load_config
    from ndtrain.train.dpo import DPO, STATS, _means
    cfg = load_config(None, TINY + ["train.seq_len=96", "train.global_batch=8", "dpo.beta=0.5"])
    data = prepare_preferences(dpo_files[0], template, 96, 0.2)
    task = DPO(cfg, data)
    policy, reference = _fp64_model(template.vocab_size), _fp64_model(template.vocab_size)
    index = [task.loaders["train"].order[k] for k in range(8)]  # the pairs of step 0's rows
    sums = torch.zeros(len(data.train), 2, dtype=torch.float64)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1), dtype=p.dtype))
        for i in index:
            sums[i] = torch.stack([_answer_logprob(reference, ex) for ex in data.train[i]])
    task.set_reference({"train": sums, "val": torch.zeros(len(data.val), 2)})
    mb = task.rows("train", 0, 0, 8)
    beta = 0.5
    # ours: the trainer's loss (model/loss.TokenLoss with this objective) over the pair rows, divided by pairs
    from ndtrain.model.loss import TokenLoss
    policy.zero_grad()
    logits = policy(mb.tokens, positions=mb.positions, doc_ids=mb.doc_ids)
    ours = TokenLoss(objective=task.objective)(logits, mb) / task.targets(mb)
    ours.backward()
    grads = {k: p.grad.clone() for k, p in policy.named_parameters()}
    stats = task.objective.take("cpu")
    # written out
    policy.zero_grad()
    margins = []
    for i in index:
        (c, r), ref = data.train[i], sums[i]
        margins.append(beta * ((_answer_logprob(policy, c) - ref[0]) - (_answer_logprob(policy, r) - ref[1])))
    direct = torch.stack([-F.logsigmoid(m) for m in margins]).mean()
    direct.backward()
    ours, direct = float(ours.detach()), float(direct.detach())
    assert task.targets(mb) == 8 and abs(ours - direct) <= 1e-12 * direct
    for k, p in policy.named_parameters():
        assert (grads[k] - p.grad).abs().max() <= 1e-10 * p.grad.abs().max(), k
    m = torch.stack(margins).detach()
    figures = _means(stats, "")
    assert len(STATS) == 6 and stats[0] == 8
    assert figures["pref_accuracy"] == float((m > 0).double().mean()) and 0 < figures["pref_accuracy"] < 1
    assert abs(figures["reward_margin"] - float(m.mean())) <= 1e-12


# --------------------------------------------------------------------------- layouts

DPO_TEST = ["train.steps=3", "train.seq_len=64", "train.global_batch=8", "model.max_seq_len=64", "dpo.beta=0.5",
            "train.lr=1e-2"]


def _dpo_task(data_path, tokenizer_path, cfg):
    """The DPO task of the layout proofs. Its template's new tokens train no rows here
    (`new_tokens = ()`, as with a tokenizer that has its chat tokens): the proofs are of the
    adapters under each layout, tensor parallelism included; LoRA's trained token rows
    (refused under tp and pp) have their own proofs in tests/test_lora.py."""
    from ndtrain.train.dpo import DPO
    template = BuiltinTemplate(TextTokenizer.from_file(tokenizer_path))
    task = DPO(cfg, prepare_preferences(data_path, template, cfg.train.seq_len, 0.2))
    task.new_tokens = ()
    return task


def _dpo_rows(files, rows):
    make = functools.partial(_dpo_task, *files)
    out = {}
    for name, overrides in rows:
        run = (reference_in_rank if name.startswith("single") else proof_in_rank)(DPO_TEST + overrides, "", make_task=make)
        run["figures"] = [{k: r[k] for k in ("pref_accuracy", "reward_margin")} for r in run.pop("history")]
        out[name] = run
    return out


LORA = ["lora.rank=4", "lora.alpha=8", "lora.init=random"]  # B drawn too: A has a gradient at step 1
# name, overrides, the one-process reference it must equal
DPO_LAYOUTS = [("dp2", ["parallel.dp=2", "train.micro_batch=1"], "single"),
               ("tp2-sp-lora", ["parallel.tp=2", "train.micro_batch=2", *LORA], "single-lora")]
DPO_LAYOUTS_SLOW = [("tp2-sp", ["parallel.tp=2", "train.micro_batch=2"], "single"),
                    ("zero3-dp2", ["parallel.zero=3", "train.micro_batch=2"], "single"),
                    ("pp2-1f1b", ["parallel.pp=2", "train.micro_batch=2"], "single"),
                    ("zero3-dp2-lora", ["parallel.zero=3", "train.micro_batch=2", *LORA], "single-lora"),
                    ("pp2-1f1b-lora", ["parallel.pp=2", "train.micro_batch=2", *LORA], "single-lora")]


def _check_dpo_layouts(dpo_files, layouts):
    """Each layout against its one-process reference in fp64 under the tolerance rule
    (tests/helpers.assert_proof), each computing its own reference log-probabilities with
    its own forward; the steps' preference figures agree too. One launch per world size."""
    singles = sorted({ref for _, _, ref in layouts})
    refs = run_ranks(_dpo_rows, 1, dpo_files, [(n, [] if n == "single" else LORA) for n in singles])[0]
    for ref in refs.values():  # the first loss is log 2 (policy = reference); later ones move away from it
        assert ref["losses"][0] == pytest.approx(math.log(2), abs=1e-12) and abs(ref["losses"][-1] - math.log(2)) > 1e-3
    runs = run_ranks(_dpo_rows, 2, dpo_files, [(n, o) for n, o, _ in layouts], timeout=600)[0]
    for name, _, ref_name in layouts:
        ref = refs[ref_name]
        try:
            assert_proof(runs[name], ref)
        except AssertionError as e:
            raise AssertionError(f"layout {name}: {e}") from None
        # Step 0's margins are rounding (policy = reference, ~1e-16), so its accuracy is a coin
        # toss per pair; from step 1 the margins are ≥ 1e-4 and every layout counts the same.
        for step, (a, b) in enumerate(zip(runs[name]["figures"], ref["figures"])):
            assert step == 0 or a["pref_accuracy"] == b["pref_accuracy"], (name, step)
            assert abs(a["reward_margin"] - b["reward_margin"]) <= 1e-9 * max(abs(b["reward_margin"]), 1e-3), name
    if "single-lora" in refs:  # the base is frozen: only the adapters have gradients
        grads = refs["single-lora"]["grads"]
        assert grads and all(k.endswith((".lora.a", ".lora.b")) for k in grads), sorted(grads)[:4]
        assert all(g.abs().max() > 0 for g in grads.values())
        assert set(runs[next(n for n, _, r in layouts if r == "single-lora")]["grads"]) == set(grads)


def test_dpo_layouts_equal_one_process_in_fp64(dpo_files):
    """dp2 with accumulation, and tp2 with SP under LoRA (frozen base, adapters split with
    their layer), against one process in fp64."""
    _check_dpo_layouts(dpo_files, DPO_LAYOUTS)


@pytest.mark.slow
def test_dpo_layouts_equal_one_process_zero3_pp_in_fp64(dpo_files):
    """ZeRO-3 dp2 and pp2 (1F1B), with and without LoRA, against one process in fp64."""
    _check_dpo_layouts(dpo_files, DPO_LAYOUTS_SLOW)


# --------------------------------------------------------------------------- the command


def _cli(dpo_files, tmp_path, *extra):
    return ["dpo", "--nproc", "1", f"data.path={dpo_files[0]}", f"data.tokenizer={dpo_files[1]}",
            "model.init_from=scratch", "model.preset=tiny", "run.device=cpu", "run.threads=1", "train.seq_len=64",
            "train.global_batch=8", "train.eval_every=4", "run.progress=false", f"data.cache_dir={tmp_path / 'c'}",
            *extra]


def test_reference_is_stored_and_resume_reads_it(dpo_files, tmp_path, monkeypatch, capsys):
    """A run stopped after 1 step and resumed to 2 equals one run of 2 steps, loss for loss,
    and the resumed run reads the stored reference: computing it again would fail here."""
    import numpy as np

    from ndtrain.train import dpo
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert main(_cli(dpo_files, tmp_path, "train.steps=2", "run.plot=false", f"run.dir={whole}")) == 0
    assert main(_cli(dpo_files, tmp_path, "train.steps=2", "run.stop_after=1", "run.plot=false",
                     f"run.dir={parts}")) == 0
    with np.load(parts / dpo.REFERENCE_FILE) as f:
        assert f["train"].shape[1] == 2 and (f["train"] < 0).all() and (f["val"] < 0).all()

    def refuse(self, trainer):
        raise AssertionError("the reference was computed again on resume")
    monkeypatch.setattr(dpo.DPO, "compute_reference", refuse)
    capsys.readouterr()
    assert main(_cli(dpo_files, tmp_path, "train.steps=2", f"run.dir={parts}")) == 0
    read = lambda run: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    a, b = read(whole), read(parts)
    assert [r["step"] for r in b] == [0, 1] and [r["loss"] for r in a] == [r["loss"] for r in b]
    assert b[1]["val_loss"] == a[1]["val_loss"] and "val_pref_accuracy" not in b[0]
    for key in ("val_pref_accuracy", "val_reward_margin", "val_reward_chosen", "val_reward_rejected",
                "val_likelihood_accuracy", "pref_accuracy", "reward_margin"):
        assert key in b[1], key
    summary = json.loads((parts / "summary.json").read_text())
    assert summary["task"] == "dpo" and (parts / "dpo.png").is_file()
    out = capsys.readouterr().out
    assert "held-out preference accuracy 0.500 (the reference) →" in out and "--temperature 0" in out


def test_sigterm_stops_dpo_with_a_checkpoint_and_the_printed_command_continues_it(dpo_files, tmp_path, capsys,
                                                                                  monkeypatch):
    """SIGTERM (as Kubernetes or scancel send it) stops `ndtrain dpo` at a step boundary with a
    checkpoint, exit 143, as for sft (tests/test_stop.py); the printed command continues the
    run from the step saved, reading the stored reference instead of computing it again."""
    import shlex

    from ndtrain.checkpoint import store
    from ndtrain.train import dpo
    from test_stop import _assert_stopped_by_sigterm, main_until_sigterm
    run = tmp_path / "run"
    argv = _cli(dpo_files, tmp_path, "train.steps=100000", "train.log_every=1", "train.eval_every=0",
                "run.plot=false", f"run.dir={run}")
    metrics = run / "metrics.jsonl"
    code = main_until_sigterm(argv, lambda: metrics.exists() and metrics.read_text())
    err = capsys.readouterr().err
    step = _assert_stopped_by_sigterm(code, err, run)
    command = err.split("continue the run with: ")[1].splitlines()[0]
    assert shlex.split(command) == ["ndtrain", *argv]

    def refuse(self, trainer):
        raise AssertionError("the reference was computed again on resume")
    monkeypatch.setattr(dpo.DPO, "compute_reference", refuse)
    assert main(shlex.split(command)[1:] + ["run.stop_after=1"]) == 0
    assert store.read_meta(store.latest(run))["step"] == step + 1


def test_dpo_toml_lists_the_commands_defaults():
    from pathlib import Path

    from ndtrain.config import DPO_DEFAULTS, load_config
    path = Path(__file__).parent.parent / "configs" / "dpo.toml"
    assert load_config(path).to_dict() == load_config(None, [], defaults=DPO_DEFAULTS).to_dict()


def _bad_jsonl(tmp_path, lines):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


@pytest.mark.parametrize("case", ["no-file", "not-json", "no-chosen", "missing", "empty", "beta-zero", "beta-negative",
                                  "cp", "seq-len", "user-folder"])
def test_bad_input_is_one_line_exit_2_nothing_written(case, dpo_files, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    good = {"prompt": "q", "chosen": "a", "rejected": "b"}
    files, extra = dpo_files, []
    if case == "no-file":
        files, expect = (tmp_path / "nope.jsonl", dpo_files[1]), "nope.jsonl': path does not exist"
    elif case == "not-json":
        files = (_bad_jsonl(tmp_path, [good]), dpo_files[1])
        files[0].write_text(files[0].read_text() + "{not json\n")
        expect = "bad.jsonl:2: not valid JSON"
    elif case == "no-chosen":
        files = (_bad_jsonl(tmp_path, [{"prompt": "q", "rejected": "b"}]), dpo_files[1])
        expect = "bad.jsonl:1: a preference record needs 'chosen' and 'rejected' (missing chosen)"
    elif case == "user-folder":  # run.dir: a folder of the user's, neither empty nor an ndtrain run
        (tmp_path / "mine").mkdir()
        (tmp_path / "mine" / "notes.txt").write_text("mine")
        extra, expect = [f"run.dir={tmp_path / 'mine'}"], "is a folder that is neither empty nor an ndtrain run"
    elif case == "missing":
        files = (_bad_jsonl(tmp_path, [good, {"prompt": "q", "chosen": "a"}]), dpo_files[1])
        expect = "bad.jsonl:2: a preference record needs 'chosen' and 'rejected' (missing rejected)"
    elif case == "empty":
        files = (_bad_jsonl(tmp_path, [good, good, {"prompt": "q", "chosen": "", "rejected": "b"}]), dpo_files[1])
        expect = "bad.jsonl:3: an assistant turn is empty"
    elif case == "beta-zero":
        extra, expect = ["dpo.beta=0"], "dpo.beta = 0.0: must be > 0"
    elif case == "beta-negative":
        extra, expect = ["dpo.beta=-0.1"], "dpo.beta = -0.1: must be > 0"
    elif case == "cp":
        extra, expect = ["--nproc", "2", "parallel.cp=2"], "parallel.cp = 2: ndtrain dpo needs each pair's whole row"
    else:
        extra, expect = ["train.seq_len=8"], "train.seq_len = 8: is smaller than the shortest pair"
    before = set(tmp_path.rglob("*"))
    code = main(_cli(files, tmp_path, *extra)[:]) if case != "cp" else main(
        [a for a in _cli(files, tmp_path) if a not in ("--nproc", "1")] + extra)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and expect in err, err
    assert set(tmp_path.rglob("*")) == before


def test_embedded_pairs_prefer_the_quotes_the_prompt_asks_for(monkeypatch):
    """stdlib-pairs: a body with quotes becomes a pair whose prompt asks for " or ' quotes, in
    turn within a file (from a coin per file), its chosen answer the body with every quote
    written as asked and the rejected one the other way; bodies without quotes, too long or
    with too many lines are left out."""
    from ndtrain.data import instructions, preference
    from ndtrain.data.chat import Conversation, Turn
    bodies = ["    return 'a' + \"b\"\n", "    return x\n", "    s = 'x'\n" * 9, "    return '" + "y" * 400 + "'\n",
              "    return \"c\"\n", "    return 'd'\n"]
    convs = [Conversation("m.py", [Turn("user", f"def f{i}():\n"), Turn("assistant", b, True)])
             for i, b in enumerate(bodies)]
    monkeypatch.setattr(instructions, "stdlib_functions", lambda cache_dir: convs)
    pairs = preference.stdlib_pairs("unused")
    assert [p.chosen.turns[0].content.split("\n")[0] for p in pairs] == ["def f0():", "def f4():", "def f5():"]
    asked = [preference.asked_quote("m.py", i) for i in range(3)]
    assert asked[0] != asked[1] != asked[2]  # in turn
    for pair, quote, body in zip(pairs, asked, (bodies[0], bodies[4], bodies[5])):
        other = "'" if quote == '"' else '"'
        prompt = pair.chosen.turns[0]
        assert prompt == pair.rejected.turns[0] and prompt.content.endswith(preference.QUOTE_ASKS[quote])
        assert pair.chosen.answer == body.replace(other, quote) and pair.rejected.answer == body.replace(quote, other)
    assert {preference.asked_quote(f"f{i}.py", 0) for i in range(8)} == {'"', "'"}  # a coin per file
