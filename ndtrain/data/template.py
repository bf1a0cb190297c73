"""Chat templates: a conversation to token ids, each id marked trained or not.

A template renders a `Conversation` (data/chat.py) as *segments*, runs of ids that are all
trained (the loss counts them) or all context. The loss covers the assistant turns of a
chat, each with the marker that ends it (so the model learns to stop), or the completion of
a plain prompt/completion pair followed by end-of-text. Everything else (system and user
turns, role headers, padding) is context.

Two templates:
- `BuiltinTemplate`: our tokenizer plus four special tokens added to it, `<|system|>`,
  `<|user|>`, `<|assistant|>` (headers) and `<|end|>` (ends a turn). A turn is
  `header content <|end|>`. The special ids are inserted by id, never parsed from text, so a
  user who types `<|end|>` gets those characters, not the token.
- `HFTemplate`: a Hugging Face tokenizer's own `chat_template`, through `transformers`'
  `apply_chat_template`. Which characters belong to an answer is found by rendering the
  conversation up to each assistant turn twice, with the generation prompt and with the
  answer: the answer is what the second adds to the first. A template whose renders are not
  prefixes of each other (one that rewrites earlier turns) is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ndtrain.data.chat import Conversation, Turn
from ndtrain.data.shards import DataError
from ndtrain.data.tokenizer import TextTokenizer

HEADERS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
END = "<|end|>"
# The builtin template in Jinja: `header content <|end|>` per turn.
CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@dataclass
class Example:
    """A rendered conversation: token ids and, per id, whether it is a trained target."""

    tokens: np.ndarray  # [n] int64
    trained: np.ndarray  # [n] bool

    @property
    def length(self) -> int:
        """Positions it fills in a row: every token but the last is an input."""
        return len(self.tokens) - 1


def join(segments: list[tuple[list[int], bool]]) -> Example:
    tokens = np.fromiter((i for ids, _ in segments for i in ids), dtype=np.int64)
    trained = np.fromiter((t for ids, t in segments for _ in ids), dtype=bool, count=len(tokens))
    return Example(tokens, trained)


class BuiltinTemplate:
    name = "builtin"

    def __init__(self, tokenizer: TextTokenizer):
        names = list(HEADERS.values()) + [END]
        self.tok = tokenizer.with_special_tokens(names)
        # The ids this template added to the tokenizer: rows the model has never trained
        # (under LoRA they train: model/lora.TokenRows).
        self.added_ids = tuple(self.tok.token_id(n) for n in names if tokenizer._tok.token_to_id(n) is None)
        self.header = {role: self.tok.token_id(text) for role, text in HEADERS.items()}
        self.end = self.tok.token_id(END)
        self.vocab_size = self.tok.vocab_size
        self.stop_ids = {self.end, self.tok.eot_id}
        self.pad_id = self.tok.eot_id  # any id will do: padding is never attended to nor trained

    def render_many(self, conversations: list[Conversation]) -> list[list[tuple[list[int], bool]]]:
        ids = iter(self.tok.encode_batch([t.content for c in conversations for t in c.turns]))
        return [self._segments(c, ids) for c in conversations]

    def _segments(self, conv: Conversation, ids) -> list[tuple[list[int], bool]]:
        """`ids` yields the encoded content of each turn in order."""
        if not conv.chat:  # plain prompt and completion, the completion closed by end-of-text
            prompt, completion = next(ids), next(ids)
            return [(prompt, False), (completion + [self.tok.eot_id], True)]
        out = []
        for turn in conv.turns:
            out += [([self.header[turn.role]], False), (next(ids) + [self.end], turn.trained)]
        return out

    def prompt_ids(self, conv: Conversation) -> list[int]:
        """What a model is given to answer `conv`'s last turn: the turns before it, then the
        assistant header (for a plain pair, the prompt)."""
        if not conv.chat:
            return self.tok.encode(conv.turns[0].content)
        turns = conv.prompt_turns
        segments = self._segments(Conversation(conv.key, turns), iter(self.tok.encode_batch([t.content for t in turns])))
        return [i for ids, _ in segments for i in ids] + [self.header["assistant"]]

    def decode(self, ids) -> str:
        return self.tok.decode(ids)

    def save(self, run_dir: Path) -> None:
        """The tokenizer, special tokens included, as the run's tokenizer.json, and a
        tokenizer_config.json whose chat template (Jinja, as Hugging Face's
        `apply_chat_template` reads it) renders a conversation to the ids `render` gives it,
        so an exported model is prompted as it was trained."""
        self.tok.save(Path(run_dir) / "tokenizer.json")
        eot = self.tok._tok.id_to_token(self.tok.eot_id)
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eot, "pad_token": eot,
                  "chat_template": CHAT_TEMPLATE}
        (Path(run_dir) / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")


class HFTemplate:
    """A Hugging Face tokenizer with a chat template (`transformers`, loaded from a local
    folder: no download)."""

    name = "hf"

    def __init__(self, hf_tokenizer):
        if not getattr(hf_tokenizer, "chat_template", None):
            raise DataError(f"tokenizer {getattr(hf_tokenizer, 'name_or_path', '')}: has no chat_template; "
                            "use data.template=builtin")
        self.tok = hf_tokenizer
        self.vocab_size = len(hf_tokenizer)
        self.added_ids: tuple[int, ...] = ()  # its chat tokens are the tokenizer's own
        eos = hf_tokenizer.eos_token_id
        self.stop_ids = {eos} if eos is not None else set()
        pad = hf_tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (eos if eos is not None else 0)
        # The answer's closing marker (e.g. <|im_end|>): a special token that a rendered
        # answer adds after its content stops generation too.
        probe = self.text_segments(Conversation("probe", [Turn("user", "x"), Turn("assistant", "y", True)]))[-1][0]
        special = set(hf_tokenizer.all_special_ids) | set(getattr(hf_tokenizer, "added_tokens_decoder", {}))
        self.stop_ids |= {i for i in self._encode(probe.split("y", 1)[-1]) if i in special}

    @classmethod
    def from_dir(cls, path: str | Path) -> "HFTemplate":
        from transformers import AutoTokenizer
        try:
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as e:  # noqa: BLE001 - transformers raises many kinds
            raise DataError(f"tokenizer {path}: cannot load with transformers ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''})") from None
        return cls(tok)

    def _apply(self, turns: list[Turn], generation_prompt: bool) -> str:
        messages = [{"role": t.role, "content": t.content} for t in turns]
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"] if text else []

    def text_segments(self, conv: Conversation) -> list[tuple[str, bool]]:
        """The rendered text in runs, each trained or not. For every assistant turn i, the
        answer is what rendering turns 0..i adds to rendering turns 0..i−1 with the
        generation prompt."""
        if not conv.chat:
            eos = self.tok.eos_token or ""
            return [(conv.turns[0].content, False), (conv.turns[1].content + eos, True)]
        out, done = [], ""
        for i, turn in enumerate(conv.turns):
            if not turn.trained:
                continue
            prefix = self._apply(conv.turns[:i], True)  # i >= 1: a conversation opens with a prompt
            full = self._apply(conv.turns[:i + 1], False)
            if not (prefix.startswith(done) and full.startswith(prefix)):
                raise DataError("the chat template does not render a conversation as a prefix of its continuation "
                                "(it rewrites earlier turns), so the answer tokens cannot be located; "
                                "use data.template=builtin")
            out += [(prefix[len(done):], False), (full[len(prefix):], True)]
            done = full
        return [(text, trained) for text, trained in out if text]

    def render_many(self, conversations: list[Conversation]) -> list[list[tuple[list[int], bool]]]:
        return [[(self._encode(text), trained) for text, trained in self.text_segments(c)] for c in conversations]

    def prompt_ids(self, conv: Conversation) -> list[int]:
        if not conv.chat:
            return self._encode(conv.turns[0].content)
        return self._encode(self._apply(conv.prompt_turns, True))

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def save(self, run_dir: Path) -> None:
        """tokenizer.json, its config and the chat template, as `save_pretrained` writes them."""
        self.tok.save_pretrained(str(run_dir))


def render(template, conversations: list[Conversation]) -> list[Example]:
    return [join(s) for s in template.render_many(conversations)]
