"""A thin wrapper over a HuggingFace ``tokenizers.Tokenizer``.

Two ways in: ``TextTokenizer.train`` builds a byte-level BPE on the training documents
(the default for the embedded corpus), ``TextTokenizer.from_file`` loads a user's
``tokenizer.json``. Either way the rest of ndtrain sees the same four things: encode,
decode, the vocabulary size the model's embedding must cover, and the id that ends a
document.

Special tokens written literally inside a document are encoded as plain text: only the
data pipeline decides where a document ends, never the document's content.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ndtrain.data.shards import DataError

EOT = "<|endoftext|>"
# Names that common tokenizers give their end-of-text / end-of-sequence token.
EOT_CANDIDATES = (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
BYTE_ALPHABET = 256


class TextTokenizer:
    """Encode and decode text; knows its vocabulary size and end-of-text id."""

    def __init__(self, tokenizer: Tokenizer, eot_id: int):
        self._tok = tokenizer
        self._tok.encode_special_tokens = True
        self.eot_id = eot_id
        # The embedding must cover every id the tokenizer can emit, and a user's ids
        # need not be contiguous (added tokens may sit above the base vocabulary).
        self.vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt as a Hugging Face tokenizer reads it: special tokens written in it are
        those tokens (a chat template's <|im_start|>, ...), and the tokens the tokenizer's
        post-processor adds (a BOS) are added."""
        self._tok.encode_special_tokens = False
        try:
            return self._tok.encode(text, add_special_tokens=True).ids
        finally:
            self._tok.encode_special_tokens = True

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many texts at once on tokenizers' own thread pool."""
        # encode_batch_fast skips computing character offsets, which we never use.
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in encode(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, path: str | Path) -> None:
        self._tok.save(str(path))

    def token_id(self, text: str) -> int:
        found = self._tok.token_to_id(text)
        if found is None:
            raise DataError(f"tokenizer has no token {text!r}")
        return found

    def with_special_tokens(self, names: list[str]) -> TextTokenizer:
        """A copy that also knows `names` as special tokens (new ids after the vocabulary,
        unless it already has them). Text that spells one out still encodes as plain text."""
        tok = Tokenizer.from_str(self._tok.to_str())
        tok.add_special_tokens([n for n in names if tok.token_to_id(n) is None])
        return TextTokenizer(tok, self.eot_id)

    @classmethod
    def from_file(cls, path: str | Path) -> TextTokenizer:
        """Load a ``tokenizer.json``; its end-of-text token must be one we recognise."""
        path = Path(path).expanduser()
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for bad files
            first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(f"tokenizer {path}: cannot load ({first_line})") from None
        for name in EOT_CANDIDATES:
            eot_id = tok.token_to_id(name)
            if eot_id is not None:
                return cls(tok, eot_id)
        raise DataError(
            f"tokenizer {path}: no end-of-text token; looked for {', '.join(EOT_CANDIDATES)}"
        )

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> TextTokenizer:
        """Train a byte-level BPE of ``vocab_size`` tokens (including ``EOT``).

        Starting from all 256 byte symbols means every string, whatever its script,
        encodes without an unknown token and decodes back to itself exactly.
        """
        if vocab_size < BYTE_ALPHABET + 1:
            raise DataError(
                f"vocab_size {vocab_size}: a byte-level BPE needs at least "
                f"{BYTE_ALPHABET + 1} (256 bytes + end-of-text)"
            )
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer)
        return cls(tok, tok.token_to_id(EOT))
