"""What the Hugging Face tests share: a chat tokenizer as instruct models ship them (a BOS its
post-processor adds, ChatML special tokens, a chat template), built here without a download;
and tiny HF model folders made from our own models (no `transformers`), which the bad-input
tests damage."""

from __future__ import annotations

import json

import torch

from ndtrain.model import hf
from ndtrain.model.args import ModelArgs
from ndtrain.model.llama import Transformer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ("the key value answer question model token window rotary scale family chat turn "
         "hello world what is and of to a in").split()


def chat_tokenizer(vocab: int = 300):
    """A byte-level BPE with <|endoftext|>, <|begin|> (the BOS its post-processor puts in
    front of every text), <|im_start|> and <|im_end|> (the eos), and CHATML, as a
    `transformers.PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator([" ".join(WORDS)] * 4, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>", "<|begin|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    begin = tok.token_to_id("<|begin|>")
    tok.post_processor = processors.TemplateProcessing(single="<|begin|> $A", pair="<|begin|> $A $B",
                                                       special_tokens=[("<|begin|>", begin)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHATML)


DENSE = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=300, max_seq_len=64)
MOE = DENSE.with_(moe_experts=4, moe_top_k=2, moe_ffn_dim=32, moe_norm_topk=True)  # a Mixtral


def make_hf(folder, args=DENSE, tensors=None, config=None):
    """A HF folder of a random model of `args`; `tensors(state)` and `config(dict)` damage it."""
    from safetensors.torch import save_file
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    state = {}
    for name, t in Transformer(args).named_parameters():
        for part in hf.hf_parts(name, args):
            state[part.hf] = (t if part.expert is None else t[part.expert]).detach().clone()
    if tensors:
        tensors(state)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    cfg = hf.hf_config_json(args, "float32")
    if config:
        config(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def ours_from(folder):
    """Our model read from the Hugging Face folder `folder`, in eval mode."""
    from ndtrain.checkpoint.layout import load_model
    from ndtrain.checkpoint.sources import HFSource
    source = HFSource(folder)
    model = Transformer(source.args).eval()
    load_model(source, model)
    return model


def parity_and_round_trip(folder, theirs, ours, tmp_path, capsys, prompt, x, new: int) -> str:
    """Greedy generation of `new` tokens after `prompt` and the logits at `x` equal
    transformers' (`theirs`, saved in `folder`); `convert --from-hf` then `--to-hf` gives
    every tensor back bit for bit and a config transformers reads to the same logits, with no
    quantization_config. Returns what the export said on stderr."""
    import transformers
    from safetensors.torch import load_file

    from ndtrain.cli import main
    from ndtrain.generate.sampler import generate

    with torch.no_grad():
        theirs_new = theirs.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                                     do_sample=False)[0, prompt.shape[1]:].tolist()
    assert generate(ours, prompt.tolist(), new, temperature=0.0, stop_ids={2}).tokens[0] == theirs_new

    with torch.no_grad():
        expected = theirs(input_ids=x).logits
        torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=1e-5)

    run, out = tmp_path / "run", tmp_path / "out"
    assert main(["convert", "--from-hf", str(folder), "--to", str(run)]) == 0
    capsys.readouterr()
    assert main(["convert", "--to-hf", str(run), "--out", str(out)]) == 0
    said = capsys.readouterr().err
    original, exported = load_file(folder / "model.safetensors"), load_file(out / "model.safetensors")
    assert original.keys() == exported.keys()
    for key, t in original.items():
        assert t.dtype == exported[key].dtype and torch.equal(t, exported[key]), key
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == theirs.config.model_type and "quantization_config" not in config
    again = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").float().eval()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=x).logits, expected, atol=1e-5, rtol=1e-5)
    return said
