"""Nothing silent, nothing lost (issue 22, section 2): what a Hugging Face model is besides
its weights survives `convert --from-hf` / `--to-hf`, generation stops where HF's does, and
every refusal is one line with exit status 2.

- Missing config.json keys take each family's transformers default (compared key by key
  with transformers' own config classes).
- A round trip keeps generation_config.json (its list of eos ids), the bos/eos/pad ids,
  the chat template and the tokenizer files byte for byte, and the source's dtype; HF
  `generate` on the exported model stops where it stops on the original, and
  `apply_chat_template` renders the same text.
- `ndtrain generate` stops at the generation config's second eos id, adds the tokenizer's
  BOS and reads <|im_start|> in the prompt as the special token: its text equals HF's.
- `--to-hf` into a non-empty folder refuses; `--overwrite` removes the old shards that
  ndtrain's reader (and transformers) would otherwise read.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hf_helpers import chat_tokenizer

transformers = pytest.importorskip("transformers")

PROMPT = "<|im_start|>user\nwhat is the key<|im_end|>\n<|im_start|>assistant\n"


# --------------------------------------------------------------------------- defaults

FEATURES = {  # keys that switch on what a family's defaults govern
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2": dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
    "qwen3": dict(use_sliding_window=True, max_window_layers=2),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, head_dim=24),
    "gemma2": dict(head_dim=16),
}


@pytest.mark.parametrize("model_type", ["llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "phi3",
                                        "gemma2"])
def test_a_missing_key_takes_the_familys_transformers_default(model_type):
    """For every key we read, a config.json without it gives the model transformers builds
    from that same config.json (its config class fills the default)."""
    from ndtrain.model.hf_config import FAMILIES, args_from_hf_config

    base = dict(model_type=model_type, vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                rope_theta=5e4, tie_word_embeddings=False, **FEATURES.get(model_type, {}))
    keys = sorted(FAMILIES[model_type].defaults)
    assert {"rope_theta", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings"} <= set(keys)
    for key in keys:
        config = {k: v for k, v in base.items() if k != key}
        theirs = transformers.AutoConfig.for_model(**config).to_dict()
        assert _args_or_refusal(config) == _args_or_refusal(theirs), f"{model_type} without {key}"


def _args_or_refusal(config):
    """The model of a config.json, or the line refusing it (Mistral's default of 8 key/value
    heads does not divide the 4 heads of a config without num_key_value_heads: both refused)."""
    from ndtrain.model.hf_config import HFConfigError, args_from_hf_config
    try:
        return args_from_hf_config(config)
    except HFConfigError as e:
        return str(e)


def test_mixtral_without_rope_theta_rotates_with_its_own_default():
    from ndtrain.model.hf_config import args_from_hf_config
    config = dict(model_type="mixtral", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                  intermediate_size=32, num_local_experts=2)
    assert args_from_hf_config(config).rope_theta == 1e6 == transformers.MixtralConfig(**config).rope_parameters[
        "rope_theta"]


# --------------------------------------------------------------------------- a chat model, there and back

@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny Llama with a chat tokenizer, whose generation config lists two eos ids: the
    tokenizer's <|im_end|> and the token greedy decoding reaches at its fourth step from
    PROMPT (so generation stops there, on the second id of the list)."""
    folder = tmp_path_factory.mktemp("chat") / "hf"
    tok = chat_tokenizer()
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, bos_token_id=tok.bos_token_id,
                                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids
    model.generation_config.eos_token_id = None
    free = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
    stop = int(free[3])
    model.generation_config.eos_token_id = [tok.eos_token_id, stop]
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    expected = free[:free.tolist().index(stop) + 1].tolist()
    return folder, tok, expected


def hf_generate(folder, tok) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).float().eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)[
        0, ids.shape[1]:].tolist()


def test_round_trip_keeps_what_makes_a_model_usable(chat_model, tmp_path, capsys):
    from ndtrain.cli import main
    from ndtrain.data.tokenizer import TextTokenizer

    folder, tok, expected = chat_model
    assert hf_generate(folder, tok) == expected  # stops on the generation config's second eos id
    run, out = tmp_path / "run", tmp_path / "out"
    assert main(["convert", "--from-hf", str(folder), "--to", str(run)]) == 0
    # ndtrain generate: the prompt read as HF reads it (BOS added, <|im_start|> special), stops there too
    ours = TextTokenizer.from_file(run / "tokenizer.json")
    assert ours.encode_prompt(PROMPT) == tok(PROMPT).input_ids and ours.encode_prompt(PROMPT)[0] == tok.bos_token_id
    capsys.readouterr()
    assert main(["generate", "--run", str(run), "--prompt", PROMPT, "--temperature", "0",
                 "--max-new-tokens", "20"]) == 0
    assert capsys.readouterr().out == PROMPT + tok.decode(expected[:-1]) + "\n"

    assert main(["convert", "--to-hf", str(run), "--out", str(out)]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (folder / name).read_bytes(), name
    config, source = (json.loads((d / "config.json").read_text()) for d in (out, folder))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "model_type"):
        assert config[key] == source[key], key
    assert hf_generate(out, tok) == expected
    exported = transformers.AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "what is the key"}]
    assert exported.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == PROMPT


def test_the_source_dtype_is_kept_unless_dtype_says_otherwise(tmp_path, capsys):
    from safetensors.torch import load_file

    from ndtrain.cli import main
    config = transformers.Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--to", str(tmp_path / "run")]) == 0
    assert main(["convert", "--to-hf", str(tmp_path / "run"), "--out", str(tmp_path / "bf16")]) == 0
    assert main(["convert", "--to-hf", str(tmp_path / "run"), "--out", str(tmp_path / "fp32"), "--dtype", "fp32"]) == 0
    capsys.readouterr()
    original = load_file(tmp_path / "hf" / "model.safetensors")
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        exported = load_file(tmp_path / name / "model.safetensors")
        assert all(t.dtype == dtype and torch.equal(t.float(), original[k].float()) for k, t in exported.items())
        assert json.loads((tmp_path / name / "config.json").read_text())["torch_dtype"] == str(dtype)[6:]


def test_export_into_a_non_empty_folder_refuses_or_overwrites(chat_model, tmp_path, capsys):
    """Old shards and their index left beside a new model.safetensors would be read in its
    place (by ndtrain's reader and by transformers): refused, or removed with --overwrite."""
    from ndtrain.checkpoint.layout import load_model
    from ndtrain.checkpoint.sources import HFSource
    from ndtrain.cli import main
    from ndtrain.model.llama import Transformer

    folder = chat_model[0]
    run, out = tmp_path / "run", tmp_path / "out"
    assert main(["convert", "--from-hf", str(folder), "--to", str(run)]) == 0
    out.mkdir()
    shard = out / "model-00001-of-00001.safetensors"
    shutil.copyfile(folder / "model.safetensors", shard)  # "an old model": same names, other bytes below
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": shard.name}}))
    (out / "README.md").write_text("notes")
    before = sorted(p.name for p in out.iterdir())
    capsys.readouterr()
    assert main(["convert", "--to-hf", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out" in err and "is not empty" in err and "--overwrite" in err
    assert sorted(p.name for p in out.iterdir()) == before  # nothing written
    assert main(["convert", "--to-hf", str(run), "--out", str(out), "--overwrite"]) == 0
    assert not shard.exists() and not (out / "model.safetensors.index.json").exists()
    assert (out / "README.md").read_text() == "notes"  # not a model file: kept
    mine, theirs = Transformer(HFSource(out).args), Transformer(HFSource(folder).args)
    load_model(HFSource(out), mine)
    load_model(HFSource(folder), theirs)
    assert all(torch.equal(a, b) for a, b in zip(mine.state_dict().values(), theirs.state_dict().values()))


# --------------------------------------------------------------------------- refusals

def _tiny_llama(folder, **config_changes):
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    raw = json.loads((folder / "config.json").read_text())
    for key, value in config_changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (folder / "config.json").write_text(json.dumps(raw))


def _stray_file(folder):
    shutil.copyfile(folder / "model.safetensors", folder / "model-old.safetensors")


def _foreign_tensor(folder):
    from safetensors.torch import save_file
    save_file({"vision_tower.patch.weight": torch.zeros(2, 2)}, folder / "vision.safetensors")


def _lora(folder):
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))


REFUSED = {
    "rope type": (dict(rope_parameters={"rope_type": "mrope", "rope_theta": 1e4}), None,
                  "config.json rope_scaling.rope_type = 'mrope': not supported"),
    "partial rotary": (dict(partial_rotary_factor=0.5), None, "config.json partial_rotary_factor = 0.5"),
    "attention bias": (dict(attention_bias=True), None, "config.json attention_bias = True"),
    "gemma3": (dict(model_type="gemma3"), None, "config.json model_type = 'gemma3': Gemma 3 (gemma3) is a "
                                                "vision-language model; its text part is supported as gemma3_text"),
    "per-layer rope": (dict(rope_parameters={"full_attention": {"rope_type": "default"}}), None,
                       "one set of rotary parameters per layer type"),
    "stray file": ({}, _stray_file, "is in two files"),
    "foreign tensor": ({}, _foreign_tensor, "vision.safetensors = 'vision_tower.patch.weight': no tensor"),
    "lora adapter": ({}, _lora, "'adapter_config.json': is a LoRA adapter"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_refusal_is_one_line_exit_2_from_convert_and_init_from(case, tmp_path, capsys):
    from ndtrain.cli import main
    changes, damage, fragment = REFUSED[case]
    folder = tmp_path / "hf"
    _tiny_llama(folder, **changes)
    if damage:
        damage(folder)
    capsys.readouterr()
    assert main(["convert", "--from-hf", str(folder), "--to", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()
    assert main(["train", f"model.init_from=hf:{folder}", "run.device=cpu", f"run.dir={tmp_path / 'train'}"]) == 2
    again = capsys.readouterr().err
    assert again.count("\n") == 1 and fragment in again, again
    assert not (tmp_path / "train").exists()


def test_a_config_without_rms_norm_eps_loads_with_the_familys_default(tmp_path, capsys):
    from ndtrain.checkpoint.sources import hf_args
    from ndtrain.cli import main
    _tiny_llama(tmp_path / "hf", rms_norm_eps=None)
    assert hf_args(tmp_path / "hf").norm_eps == transformers.AutoConfig.from_pretrained(tmp_path / "hf").rms_norm_eps
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--to", str(tmp_path / "run")]) == 0


# --------------------------------------------------------------------------- a fine-tuned model's template

def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def test_the_builtin_template_exports_as_a_chat_template(tiny_data, tmp_path):
    """An SFT run with the builtin template writes a Jinja chat template that renders a
    conversation to the ids it trained on, and a generation config stopping at <|end|>."""
    from ndtrain.checkpoint.hf_files import carry, eos_ids
    from ndtrain.data.chat import Conversation, Turn
    from ndtrain.data.template import BuiltinTemplate
    from ndtrain.data.tokenizer import TextTokenizer

    template = BuiltinTemplate(TextTokenizer.from_file(f"{tiny_data}/tokenizer.json"))
    template.save(tmp_path)
    carry("", tmp_path, template.stop_ids)
    conv = Conversation("k", [Turn("system", "be brief"), Turn("user", "def f(x): return x"),
                              Turn("assistant", "the value", True)])
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": t.role, "content": t.content} for t in conv.turns[:2]]
    assert _ids(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)) == template.prompt_ids(conv)
    assert set(eos_ids(tmp_path)) == template.stop_ids == {template.end, template.tok.eot_id}


def test_an_sft_run_exports_its_chat_template_and_stop_ids(chat_model, tmp_path, capsys):
    from test_sft import make_records

    from ndtrain.checkpoint.hf_files import eos_ids
    from ndtrain.cli import main

    folder, tok, _ = chat_model
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in make_records(16)))
    run, out = tmp_path / "run", tmp_path / "out"
    assert main(["sft", "--nproc", "1", f"model.init_from=hf:{folder}", f"data.path={data}", "train.seq_len=64",
                 "train.global_batch=4", "train.steps=1", "train.eval_batches=1", "sft.generate=0",
                 "run.device=cpu", "run.progress=false", f"run.dir={run}"]) == 0
    assert main(["convert", "--to-hf", str(run), "--out", str(out)]) == 0
    capsys.readouterr()
    exported = transformers.AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "what is the key"}]
    assert exported.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == PROMPT
    assert tok.convert_tokens_to_ids("<|im_end|>") in eos_ids(out)
    assert set(eos_ids(folder)) <= set(eos_ids(out))
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
