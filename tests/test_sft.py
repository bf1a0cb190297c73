"""Supervised fine-tuning: records and their errors, the loss mask on rendered examples
(builtin and Hugging Face templates), best-fit-decreasing packing, packed = padded in fp64,
no prompt or padding token in the loss or the gradients, every SFT layout = one process in
fp64 (with very unequal answer counts per micro-batch), and the command's bad input."""

from __future__ import annotations

import functools
import json
import random

import numpy as np
import pytest
import torch

from helpers import LOSS_TOL, TINY, assert_proof, proof_in_rank, reference_in_rank
from ndtrain.cli import main
from ndtrain.data.chat import Conversation, Turn, parse_record, read_jsonl, BadRecord
from ndtrain.data.packing import PAD_DOC, best_fit_decreasing, fit_examples, pack
from ndtrain.data.shards import DataError
from ndtrain.data.sft import prepare_sft
from ndtrain.data.template import BuiltinTemplate, HFTemplate, render
from ndtrain.data.tokenizer import TextTokenizer
from ndtrain.model.loss import IGNORE, token_loss_sum
from ndtrain.testing import run_ranks

WORDS = ("the value of each item is returned when the list is empty or the key is missing "
         "def return self none true false for while if else import class").split()


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_records(n: int = 48, seed: int = 0) -> list[dict]:
    """Chats (some with a system turn, some with two answers) and plain prompt/completion
    pairs; answers from 1 to ~40 words, so rows and micro-batches hold very unequal answer
    token counts."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        answer = sentence(rng, rng.choice([1, 2, 3, 25, 40]))
        if i % 4 == 3:
            out.append({"prompt": sentence(rng, rng.randint(3, 12)), "completion": " " + answer})
            continue
        messages = [{"role": "system", "content": "be brief"}] if i % 3 == 0 else []
        messages.append({"role": "user", "content": sentence(rng, rng.randint(2, 15))})
        if i % 5 == 0:
            messages += [{"role": "assistant", "content": sentence(rng, 2)},
                         {"role": "user", "content": sentence(rng, 3)}]
        messages.append({"role": "assistant", "content": answer})
        out.append({"messages": messages})
    return out


@pytest.fixture(scope="module")
def sft_files(tmp_path_factory, tiny_data):
    root = tmp_path_factory.mktemp("sft")
    path = root / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in make_records()))
    return str(path), f"{tiny_data}/tokenizer.json"


@pytest.fixture(scope="module")
def template(sft_files):
    return BuiltinTemplate(TextTokenizer.from_file(sft_files[1]))


# --------------------------------------------------------------------------- records


def test_records_both_shapes_and_roles():
    turns, chat = parse_record({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                                             {"role": "assistant", "content": "a"}]})
    assert chat and [t.trained for t in turns] == [False, False, True]
    turns, chat = parse_record({"prompt": "2+2=", "completion": "4"})
    assert not chat and [(t.content, t.trained) for t in turns] == [("2+2=", False), ("4", True)]
    turns, chat = parse_record({"prompt": [{"role": "user", "content": "q"}],
                                "completion": [{"role": "assistant", "content": "a"}]})
    assert chat and [t.trained for t in turns] == [False, True]


@pytest.mark.parametrize("record, why", [
    ({"messages": [{"role": "user", "content": "q"}]}, "no assistant turn"),
    ({"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "a"}]}, "role 'tool'"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]}, "empty"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                   {"role": "user", "content": "q"}]}, "must end with the assistant"),
    ({"messages": [{"role": "assistant", "content": "a"}]}, "no prompt to answer"),
    ({"prompt": "q", "completion": 3}, "both be strings"),
    ({"text": "q"}, "needs 'messages'"),
])
def test_bad_records_say_why(record, why):
    with pytest.raises(BadRecord, match=why):
        parse_record(record)


def test_jsonl_errors_name_file_and_line_or_are_skipped_and_counted(tmp_path):
    path = tmp_path / "d.jsonl"
    good = json.dumps({"prompt": "a", "completion": "b"})
    path.write_text(f"{good}\n\n{{not json\n{good}\n" + json.dumps({"messages": []}) + "\n")
    with pytest.raises(DataError, match=rf"^{path}:3: not valid JSON"):
        read_jsonl(path, "d.jsonl")
    records = read_jsonl(path, "d.jsonl", on_bad_record="skip")
    assert [c.key for c in records.conversations] == ["d.jsonl:1", "d.jsonl:4"]
    assert [s.split(": ")[0] for s in records.skipped] == [f"{path}:3", f"{path}:5"]


# --------------------------------------------------------------------------- templates and the mask


def test_builtin_template_trains_assistant_turns_only(template, sft_files):
    conv = Conversation("k", [Turn("system", "be brief"), Turn("user", "what is the key"),
                              Turn("assistant", "the value", True), Turn("user", "and"),
                              Turn("assistant", "none", True)])
    (ex,) = render(template, [conv])
    end, tok = template.end, template.tok
    runs, start = [], 0
    for i in range(1, len(ex.tokens) + 1):
        if i == len(ex.tokens) or ex.trained[i] != ex.trained[start]:
            runs.append((tok.decode(ex.tokens[start:i].tolist()), bool(ex.trained[start])))
            start = i
    assert runs == [("<|system|>be brief<|end|><|user|>what is the key<|end|><|assistant|>", False),
                    ("the value<|end|>", True), ("<|user|>and<|end|><|assistant|>", False), ("none<|end|>", True)]
    assert ex.tokens[-1] == end
    assert template.vocab_size == tok.vocab_size == TextTokenizer.from_file(sft_files[1]).vocab_size + 4
    # A user typing a special token's text gets characters, not the token.
    (typed,) = render(template, [Conversation("k", [Turn("user", "<|end|>"), Turn("assistant", "a", True)])])
    assert list(typed.tokens).count(end) == 2
    # The prompt a model answers at evaluation: everything before the last answer, then its header.
    assert tok.decode(template.prompt_ids(conv)) == ("<|system|>be brief<|end|><|user|>what is the key<|end|>"
                                                     "<|assistant|>the value<|end|><|user|>and<|end|><|assistant|>")


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _hf_tokenizer(chat_template: str):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator([" ".join(WORDS)] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", chat_template=chat_template)


def test_hf_chat_template_masks_the_answers_it_renders():
    hf = HFTemplate(_hf_tokenizer(CHATML))
    conv = Conversation("k", [Turn("system", "be brief"), Turn("user", "what is the key"),
                              Turn("assistant", "the value", True), Turn("user", "and"),
                              Turn("assistant", "none", True)])
    (ex,) = render(hf, [conv])
    decode = hf.tok.decode
    whole = hf.tok.apply_chat_template([{"role": t.role, "content": t.content} for t in conv.turns], tokenize=False)
    assert decode(ex.tokens.tolist()) == whole
    trained = [decode(ex.tokens[i:j].tolist()) for i, j in _runs(ex.trained)]
    assert trained == ["the value<|im_end|>\n", "none<|im_end|>\n"]
    assert hf.tok.convert_tokens_to_ids("<|im_end|>") in hf.stop_ids
    assert decode(hf.prompt_ids(conv)).endswith("<|im_start|>user\nand<|im_end|>\n<|im_start|>assistant\n")
    # A template that rewrites earlier turns as the conversation grows cannot be masked.
    counting = "{{ messages|length }}" + CHATML
    with pytest.raises(DataError, match="prefix"):
        render(HFTemplate(_hf_tokenizer(counting)), [conv])


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of True."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    return list(zip(edges[::2], edges[1::2]))


# --------------------------------------------------------------------------- packing


def test_best_fit_decreasing():
    assert best_fit_decreasing([5, 4, 3, 3, 2, 2, 1], 8) == [[0, 2], [1, 3, 6], [4, 5]]
    rng = random.Random(1)
    lengths = [rng.randint(1, 64) for _ in range(500)]
    bins = best_fit_decreasing(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(500))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    # Best fit: no bin but the last opened could have taken a later, smaller item of another bin.
    assert len(bins) <= -(-sum(lengths) // 64) * 11 / 9 + 1


def test_packed_rows_restart_positions_and_mask_prompts(sft_files, template):
    data = prepare_sft(sft_files[0], template, 64, "keep_start", 0.2)
    rows = pack(data.train, 64, "bfd", template.pad_id)
    padded = pack(data.train, 64, "none", template.pad_id)
    assert len(rows) < len(padded) and rows.padding_fraction < padded.padding_fraction
    assert int((rows.targets != IGNORE).sum()) == int((padded.targets != IGNORE).sum()) == sum(
        int(ex.trained[1:].sum()) for ex in data.train)
    for r in range(len(rows)):
        docs = rows.doc_ids[r]
        for d in docs.unique().tolist():
            where = (docs == d).nonzero().flatten()
            assert torch.equal(where, torch.arange(where[0], where[-1] + 1))  # contiguous
            assert torch.equal(rows.positions[r, where], torch.arange(len(where)))  # restarts at 0
            if d == PAD_DOC:
                assert (rows.targets[r, where] == IGNORE).all() and where[-1] == 63
    # keep_start cuts a long example; drop leaves it out; both are counted.
    long = [render(template, [Conversation("k", [Turn("user", "q " * 10), Turn("assistant", "a " * 60, True)])])[0]]
    kept, counts, _ = fit_examples(long, 64, "keep_start")
    assert counts.truncated == 1 and kept[0].length == 64
    kept, counts, _ = fit_examples(long, 64, "drop")
    assert counts.dropped_long == 1 and not kept
    kept, counts, _ = fit_examples(long, 8, "keep_start")  # only prompt left: no answer to train
    assert counts.dropped_no_answer == 1 and not kept


def _fp64_model(vocab: int):
    from ndtrain.config import load_config
    from ndtrain.model.llama import Transformer
    args = load_config(None, ["model.preset=tiny"]).model_args(vocab_size=vocab).with_(max_seq_len=64)
    model = Transformer(args)
    model.init_weights(0)
    return model.double()


def _loss_and_grads(model, mb, n_targets):
    model.zero_grad()
    logits = model(mb.tokens, positions=mb.positions, doc_ids=mb.doc_ids)
    logits.retain_grad()
    loss = token_loss_sum(logits, mb.targets) / n_targets
    loss.backward()
    return loss.item(), {k: p.grad.clone() for k, p in model.named_parameters()}, logits.grad


def test_packed_equals_padded_in_fp64(sft_files, template):
    """The same examples, packed by BFD (document masks, restarted positions) or one per
    padded row: the same loss and gradients, element by element at 1e-10 of each tensor's max."""
    data = prepare_sft(sft_files[0], template, 64, "keep_start", 0.2)
    examples = [ex for ex in data.train if ex.length <= 40][:12]
    packed, padded = (pack(examples, 64, p, template.pad_id) for p in ("bfd", "none"))
    assert len(packed) < len(padded) and packed.doc_ids.max() >= 2  # rows really hold several examples
    model = _fp64_model(template.vocab_size)
    n = int((packed.targets != IGNORE).sum())
    loss_a, grads_a, _ = _loss_and_grads(model, packed.batch(torch.arange(len(packed))), n)
    loss_b, grads_b, _ = _loss_and_grads(model, padded.batch(torch.arange(len(padded))), n)
    assert abs(loss_a - loss_b) <= 1e-12 * abs(loss_b)
    for k in grads_b:
        scale = grads_b[k].abs().max()
        assert (grads_a[k] - grads_b[k]).abs().max() <= 1e-10 * scale, k


@pytest.mark.filterwarnings("ignore:.*without torch.compile")  # eager flex on the CPU: unfused, as intended here
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("window", [0, 6])
def test_flex_document_attention_equals_the_mask_on_packed_rows(sft_files, template, dtype, window, monkeypatch):
    """model.doc_attention = flex (what CUDA runs: flex_attention with a block mask built
    from doc_ids, no s × s mask) against mask (the boolean mask with SDPA, what the CPU
    proofs run) on packed SFT rows, with and without a sliding window: the same loss and
    gradients. flex_attention refuses a backward on the CPU (its fused kernels have none);
    its eager path, torch's own math over the same block mask and rule, has one, so the
    check is lifted here to compare what ndtrain hands flex. Tolerance, derived: the two
    differ only in the order of the softmax sums, ≤ n·u relative per attention (n = 64 keys
    a row, u the unit roundoff), through 4 layers and the backward (× 4 × 10):
    64·4·10·u = 2.8e-13 in fp64, 1.5e-4 in fp32."""
    import torch.nn.attention.flex_attention as flex

    from ndtrain.model.llama import Transformer
    monkeypatch.setattr(flex, "_validate_device", lambda *tensors: None)
    data = prepare_sft(sft_files[0], template, 64, "keep_start", 0.2)
    packed = pack([ex for ex in data.train if ex.length <= 40][:12], 64, "bfd", template.pad_id)
    mb = packed.batch(torch.arange(len(packed)))
    assert int(mb.doc_ids.max()) >= 2
    n = int((packed.targets != IGNORE).sum())
    results = {}
    for documents in ("mask", "flex"):
        base = _fp64_model(template.vocab_size).args
        model = Transformer(base.with_(doc_attention=documents, sliding_window=window))
        model.init_weights(0)
        results[documents] = _loss_and_grads(model.to(dtype), mb, n)
    tol = 64 * 4 * 10 * torch.finfo(dtype).eps / 2
    (loss_m, grads_m, _), (loss_f, grads_f, _) = results["mask"], results["flex"]
    assert abs(loss_f - loss_m) <= tol * abs(loss_m)
    for k in grads_m:
        assert (grads_f[k] - grads_m[k]).abs().max() <= tol * grads_m[k].abs().max(), k
    assert any(not torch.equal(grads_f[k], grads_m[k]) for k in grads_m)  # flex really ran


def test_no_prompt_or_padding_token_reaches_the_loss_or_the_gradients(sft_files, template):
    data = prepare_sft(sft_files[0], template, 64, "keep_start", 0.2)
    rows = pack(data.train[:16], 64, "bfd", template.pad_id)
    mb = rows.batch(torch.arange(len(rows)))
    model = _fp64_model(template.vocab_size)
    n = int((mb.targets != IGNORE).sum())
    loss, grads, logit_grad = _loss_and_grads(model, mb, n)
    masked = mb.targets == IGNORE
    prompt = masked & (mb.doc_ids != PAD_DOC)
    assert prompt.sum() > 0 and (mb.doc_ids == PAD_DOC).sum() > 0
    assert (logit_grad[masked] == 0).all()  # no masked position's prediction is in the loss
    assert (logit_grad[~masked].abs().sum(-1) > 0).all()  # every answer position's is
    # Rewriting every padding token changes nothing at all, bit for bit.
    mb2 = rows.batch(torch.arange(len(rows)))
    mb2.tokens = torch.where(mb.doc_ids == PAD_DOC, (mb.tokens + 7) % template.vocab_size, mb.tokens)
    loss2, grads2, _ = _loss_and_grads(model, mb2, n)
    assert loss2 == loss and all(torch.equal(grads[k], grads2[k]) for k in grads)
    # Rewriting one document's tokens leaves every other document's logits exactly as they were.
    with torch.no_grad():
        base = model(mb.tokens, positions=mb.positions, doc_ids=mb.doc_ids)
        other = mb.tokens.clone()
        row = int((mb.doc_ids.max(dim=1).values >= 1).nonzero()[0])
        doc0 = mb.doc_ids[row] == 0
        other[row, doc0] = (other[row, doc0] + 3) % template.vocab_size
        changed = model(other, positions=mb.positions, doc_ids=mb.doc_ids)
    assert not torch.equal(changed[row, doc0], base[row, doc0])
    assert torch.equal(changed[row, ~doc0], base[row, ~doc0])


# --------------------------------------------------------------------------- layouts

SFT_TEST = ["train.steps=3", "train.seq_len=64", "train.global_batch=8", "model.max_seq_len=64"]


def _sft_task(data_path, tokenizer_path, cfg):
    from ndtrain.train.sft import SFT
    template = BuiltinTemplate(TextTokenizer.from_file(tokenizer_path))
    return SFT(cfg, prepare_sft(data_path, template, cfg.train.seq_len, "keep_start", 0.2))


def _sft_rows(files, rows):
    make = functools.partial(_sft_task, *files)
    return {name: (reference_in_rank if name == "single" else proof_in_rank)(SFT_TEST + overrides, "", make_task=make)
            for name, overrides in rows}


SFT_LAYOUTS = {
    1: [("single", [])],
    2: [("dp2-accumulation", ["parallel.dp=2", "train.micro_batch=1"]),
        ("zero3-dp2", ["parallel.zero=3", "train.micro_batch=2"]),
        ("tp2-sp", ["parallel.tp=2", "train.micro_batch=2"]),
        ("pp2-1f1b", ["parallel.pp=2", "parallel.pp_schedule=1f1b", "train.micro_batch=2"]),
        # packed rows under context parallelism: the document masks inside the ring (and after
        # Ulysses' all-to-all), targets per cp rank unequal
        ("cp2-ring", ["parallel.cp=2", "parallel.cp_impl=ring", "train.micro_batch=2"]),
        ("cp2-ulysses", ["parallel.cp=2", "parallel.cp_impl=ulysses", "train.micro_batch=2"])],
    8: [("pp2-tp2-dp2", ["parallel.pp=2", "parallel.tp=2", "parallel.dp=2", "train.micro_batch=2"])],
}


def test_sft_layouts_equal_one_process_in_fp64(sft_files, template):
    """The fp64 layout proof (tests/helpers.assert_proof: the first update at exact precision,
    later steps and the final weights within the twin's gaps) on packed SFT rows, for every
    layout the issue lists and context
    parallelism. Micro-batches hold very unequal answer counts, so a mean of
    per-micro-batch means would be caught."""
    task = _sft_task(*sft_files, _config(SFT_TEST))
    counts = [[int((task.rows("train", s, r, r + 1).targets != IGNORE).sum()) for r in range(8)] for s in range(3)]
    assert max(max(c) / max(min(c), 1) for c in counts) >= 3, counts
    _check_sft_layouts(sft_files, 2)


@pytest.mark.slow
def test_sft_layouts_equal_one_process_on_eight_ranks(sft_files):
    _check_sft_layouts(sft_files, 8)


def _check_sft_layouts(sft_files, world):
    ref = run_ranks(_sft_rows, 1, sft_files, SFT_LAYOUTS[1])[0]["single"]
    results = run_ranks(_sft_rows, world, sft_files, SFT_LAYOUTS[world], timeout=600)[0]
    for name, _ in SFT_LAYOUTS[world]:
        try:
            assert_proof(results[name], ref)
        except AssertionError as e:
            raise AssertionError(f"layout {name}: {e}") from None


def _config(overrides):
    from ndtrain.config import load_config, validate
    return validate(load_config(None, TINY + overrides), world=1)


def test_mean_of_means_would_differ(sft_files):
    """The control for the layout test: normalising each micro-batch by its own count moves
    even the first loss (of a near-uniform initial model) 10^3 times beyond the exact
    precision (LOSS_TOL) that test allows at the first update."""
    task = _sft_task(*sft_files, _config(SFT_TEST))
    model = _fp64_model(task.vocab_size)
    micro = task.rows("train", 0, 0, 8).split(1)
    with torch.no_grad():
        sums = [float(token_loss_sum(model(m.tokens, positions=m.positions, doc_ids=m.doc_ids), m.targets))
                for m in micro]
    counts = [int((m.targets != IGNORE).sum()) for m in micro]
    global_mean = sum(sums) / sum(counts)
    mean_of_means = sum(s / c for s, c in zip(sums, counts)) / len(micro)
    assert abs(global_mean - mean_of_means) > 1e3 * LOSS_TOL * global_mean


# --------------------------------------------------------------------------- the command


def test_sft_toml_lists_the_commands_defaults():
    from pathlib import Path

    from ndtrain.config import SFT_DEFAULTS, load_config
    path = Path(__file__).parent.parent / "configs" / "sft.toml"
    assert load_config(path).to_dict() == load_config(None, [], defaults=SFT_DEFAULTS).to_dict()


def _bad_jsonl(tmp_path, name, lines):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.mark.parametrize("case", ["malformed", "no-assistant", "unknown-role", "seq-len", "init-from", "score"])
def test_bad_input_is_one_line_exit_2_nothing_written(case, sft_files, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    good = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a b"}]})
    data, extra, expect = sft_files[0], [], None
    if case == "malformed":
        data = _bad_jsonl(tmp_path, "m.jsonl", [good, '{"messages": [', good])
        expect = "m.jsonl:2: not valid JSON"
    elif case == "no-assistant":
        data = _bad_jsonl(tmp_path, "n.jsonl", [good, good, json.dumps({"messages": [{"role": "user", "content": "q"}]})])
        expect = "n.jsonl:3: no assistant turn"
    elif case == "unknown-role":
        data = _bad_jsonl(tmp_path, "r.jsonl", [json.dumps({"messages": [{"role": "robot", "content": "q"},
                                                                         {"role": "assistant", "content": "a"}]})])
        expect = "r.jsonl:1: messages[0]: role 'robot'"
    elif case == "seq-len":
        extra, expect = ["train.seq_len=4"], "train.seq_len = 4: is smaller than the shortest example"
    elif case == "init-from":
        extra, expect = [f"model.init_from=run:{tmp_path / 'nothing'}"], "model.init_from = 'run:"
    else:
        extra, expect = ["sft.score=no_such_module:f"], "sft.score = 'no_such_module:f': cannot import it"
    before = set(tmp_path.iterdir())
    code = main(["sft", f"data.path={data}", f"data.tokenizer={sft_files[1]}", "model.init_from=scratch",
                 "model.preset=tiny", "run.device=cpu", *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and expect in err, err
    assert set(tmp_path.iterdir()) == before


def answer_length(prompt: str, completion: str, reference: str) -> float:
    """A user-supplied score (sft.score=test_sft:answer_length)."""
    return float(len(completion))


def test_sft_command_end_to_end(sft_files, tmp_path, capsys):
    good, tokenizer = sft_files
    data = tmp_path / "with-a-bad-line.jsonl"
    data.write_text(open(good).read() + '{"messages": "oops"}\n')
    args = [f"data.path={data}", f"data.tokenizer={tokenizer}", "model.init_from=scratch", "model.preset=tiny",
            "train.seq_len=64", "train.global_batch=4", "run.device=cpu", "data.on_bad_record=skip"]
    assert main(["sft", "--show-example", *args]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("training example") and "<|assistant|>⟦" in shown and "<|end|>⟧" in shown
    run = tmp_path / "run"
    assert main(["sft", "--nproc", "1", *args, "train.steps=4", "train.eval_every=2", "sft.generate=2",
                 "sft.max_new_tokens=8", "sft.score=test_sft:answer_length", f"run.dir={run}"]) == 0
    out = capsys.readouterr().out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["task"] == "sft" and len(summary["samples"]) == 2
    assert summary["score"] == sum(len(x["completion"]) for x in summary["samples"]) / 2
    assert summary["baseline_val_loss"] > 0 and summary["val_loss"] > 0
    assert "answer-token validation loss" in out and "held-out prompt" in out
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3] and all(r["targets"] > 0 for r in records)
    assert (run / "skipped_records.txt").read_text() == f"{data}:49: messages must be a non-empty list of messages\n"
    tok = TextTokenizer.from_file(run / "tokenizer.json")
    assert tok.token_id("<|assistant|>") and (run / "checkpoints" / "latest").is_file()


# --------------------------------------------------------------------------- starting points


def _pretrain_then_grow(tiny_data, run_dir, data_path):
    """Rank 0 of 1: a 1-step pretraining run to start from (its full weights returned)."""
    from ckpt_helpers import train
    return train(["train.steps=1"], tiny_data, run_dir)[1]


def _sft_start_in_rank(run_dir, data_path, tokenizer):
    import torch.distributed as dist

    from ckpt_helpers import full_state
    from ndtrain.checkpoint.sources import resolve_init_from
    from ndtrain.config import load_config, validate
    from ndtrain.mesh import ParallelMesh
    from ndtrain.train.sft import SFT
    from ndtrain.train.trainer import Trainer
    from ndtrain.train.worker import mesh_shape

    cfg = load_config(None, TINY + ["train.seq_len=64", f"model.init_from=run:{run_dir}", "parallel.tp=2",
                                    f"data.tokenizer={tokenizer}"])
    resolve_init_from(cfg)  # the run's model (vocabulary 512)
    template = BuiltinTemplate(TextTokenizer.from_file(cfg.data.tokenizer))
    cfg.model.vocab_size = template.vocab_size  # + 4 special tokens, as cmd_sft does
    validate(cfg, world=dist.get_world_size())
    task = SFT(cfg, prepare_sft(data_path, template, 64, "keep_start", 0.2))
    trainer = Trainer(cfg, ParallelMesh.build(mesh_shape(cfg)), task, None)
    trainer.start()
    return full_state(trainer)


def test_init_from_a_run_grows_the_vocabulary_for_the_template(sft_files, tiny_data, tmp_path):
    """init_from=run: on TP 2 (the vocabulary split over the ranks): the run's rows as they
    were, each of the template's 4 added rows the mean of the run's rows."""
    run = str(tmp_path / "base")
    base = run_ranks(_pretrain_then_grow, 1, tiny_data, run, sft_files[0])[0]
    grown = run_ranks(_sft_start_in_rank, 2, run, *sft_files)[0]
    for key in ("tok_embeddings.weight", "output.weight"):
        old = base[key]
        assert grown[key].shape == (old.shape[0] + 4, old.shape[1])
        assert torch.equal(grown[key][:old.shape[0]], old)
        assert torch.allclose(grown[key][old.shape[0]:], old.mean(0).expand(4, -1), rtol=0, atol=1e-7)
    assert all(torch.equal(grown[k], base[k]) for k in base if k not in ("tok_embeddings.weight", "output.weight"))


def test_sft_from_a_hugging_face_model_with_its_chat_template(sft_files, tmp_path, capsys):
    """init_from=hf:DIR uses DIR's chat template; the base model's validation loss that
    ndtrain reports equals the one transformers computes on the same answer tokens."""
    transformers = pytest.importorskip("transformers")
    hf_tok = _hf_tokenizer(CHATML)
    folder = tmp_path / "hf"
    config = transformers.LlamaConfig(vocab_size=len(hf_tok), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    model.save_pretrained(folder)
    hf_tok.save_pretrained(folder)
    run = tmp_path / "run"
    assert main(["sft", "--nproc", "1", f"model.init_from=hf:{folder}", f"data.path={sft_files[0]}",
                 "train.seq_len=64", "train.global_batch=4", "train.steps=1", "train.eval_batches=100",
                 "data.val_fraction=0.2", "sft.generate=0", "run.device=cpu", f"run.dir={run}"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert transformers.AutoTokenizer.from_pretrained(str(run)).chat_template == CHATML  # the run keeps it
    data = prepare_sft(sft_files[0], HFTemplate(hf_tok), 64, "keep_start", 0.2)
    total, count = 0.0, 0
    with torch.no_grad():
        for ex in data.val:
            logits = model(torch.as_tensor(ex.tokens[None, :-1])).logits[0]
            trained = torch.as_tensor(ex.trained[1:])
            losses = torch.nn.functional.cross_entropy(logits, torch.as_tensor(ex.tokens[1:]), reduction="none")
            total, count = total + float(losses[trained].sum()), count + int(trained.sum())
    assert summary["baseline_val_loss"] == pytest.approx(total / count, rel=1e-5)


def _bench_sft(cfg_dict, data):
    from ndtrain.bench import sft
    return sft._worker(cfg_dict, data, 1, 1)


def test_bench_sft_runs_both_layouts(sft_files, template):
    """The benchmark's plumbing (never its timings): both contenders train a step and the
    last line is the ratio."""
    import re
    from types import SimpleNamespace

    from ndtrain.bench import sft
    from ndtrain.bench.common import bench_config
    args = SimpleNamespace(config=None, nproc=2, overrides=[
        "model.preset=tiny", "train.seq_len=64", "train.global_batch=4", "run.device=cpu", "run.threads=1",
        f"data.path={sft_files[0]}", f"data.tokenizer={sft_files[1]}", "data.val_fraction=0.2"])
    cfg = bench_config(args, sft.BENCH)
    data = prepare_sft(sft_files[0], template, 64, "keep_start", 0.2)
    cfg.model.vocab_size = data.vocab_size
    out = run_ranks(_bench_sft, 2, cfg.to_dict(), data, timeout=300)[0]
    assert re.match(r"packed: \d+ rows of \d+ examples, [\d.]+% padding", out), out
    assert re.search(r"\nndtrain sft packed/padded throughput ratio: \d+\.\d\d$", out), out
