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
HF_PREFIX = "hf:"


def hf_tokenizer_config(folder: Path) -> dict:
    """A Hugging Face model folder's tokenizer_config.json ({} when it has none)."""
    import json
    if not (folder / "tokenizer.json").is_file():
        raise DataError(f"tokenizer hf:{folder}: no tokenizer.json in the folder")
    path = folder / "tokenizer_config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as e:
        raise DataError(f"tokenizer {path}: unreadable ({e})") from None
    if not isinstance(config, dict):
        raise DataError(f"tokenizer {path}: not a JSON object")
    return config


def _token_name(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class TextTokenizer:
    """Encode and decode text; knows its vocabulary size and end-of-text id."""

    def __init__(self, tokenizer: Tokenizer, eot_id: int, bos_ids: tuple[int, ...] = ()):
        self._tok = tokenizer
        self._tok.encode_special_tokens = True
        self.eot_id = eot_id
        # What starts every pretraining document: a Hugging Face family's BOS (Llama, Gemma,
        # Mistral) or nothing (Qwen, GPT-2, our own BPE). Every document ends with eot_id.
        self.bos_ids = tuple(bos_ids)
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

    def to_json(self) -> str:
        return self._tok.to_str()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many texts at once on tokenizers' own thread pool."""
        # encode_batch_fast skips computing character offsets, which we never use.
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in encode(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, path: str | Path) -> None:
        self._tok.save(str(path))

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

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
    def load(cls, spec: str | Path) -> TextTokenizer:
        """`data.tokenizer`: a ``tokenizer.json``, or ``hf:DIR``, a Hugging Face model folder."""
        spec = str(spec)
        return cls.from_hf(spec[3:]) if spec.startswith(HF_PREFIX) else cls.from_file(spec)

    @classmethod
    def from_hf(cls, folder: str | Path) -> TextTokenizer:
        """The tokenizer of a Hugging Face model folder, with its family's document rules:
        documents end with tokenizer_config.json's ``eos_token`` (else a name we recognise)
        and start with its ``bos_token`` when ``add_bos_token`` says so, or, where the config
        does not say, when the tokenizer's post-processor puts one in front of a text (Llama 3's
        template adds <|begin_of_text|>; Qwen's adds nothing)."""
        folder = Path(folder).expanduser()
        config = hf_tokenizer_config(folder)
        eos = _token_name(config.get("eos_token"))
        tok = cls.from_file(folder / "tokenizer.json", eot_token=eos)
        bos = _token_name(config.get("bos_token"))
        if "add_bos_token" in config:
            add = bool(config["add_bos_token"]) and bos is not None
            tok.bos_ids = (tok.token_id(bos),) if add else ()
        else:
            plain = tok._tok.encode("a", add_special_tokens=False).ids
            marked = tok._tok.encode("a", add_special_tokens=True).ids
            tok.bos_ids = tuple(marked[: len(marked) - len(plain)]) if marked[-len(plain):] == plain else ()
        return tok

    @classmethod
    def from_file(cls, path: str | Path, eot_token: str | None = None) -> TextTokenizer:
        """Load a ``tokenizer.json``; its end-of-text token is `eot_token`, else one we recognise."""
        path = Path(path).expanduser()
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for bad files
            first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(f"tokenizer {path}: cannot load ({first_line})") from None
        if eot_token is not None:
            eot_id = tok.token_to_id(eot_token)
            if eot_id is None:
                raise DataError(f"tokenizer {path}: has no token {eot_token!r}, the end of text its config names")
            return cls(tok, eot_id)
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
