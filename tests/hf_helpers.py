"""What the Hugging Face tests share: a chat tokenizer as instruct models ship them (a BOS its
post-processor adds, ChatML special tokens, a chat template), built here without a download."""

from __future__ import annotations

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
