"""Tests of the data pipeline: tokenizer, shards, corpus, prepare, loader."""

from __future__ import annotations

import json
import math
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models

from ndtrain.data import (
    EOT,
    BatchLoader,
    DataError,
    PreparedData,
    TextTokenizer,
    TokenStream,
    is_validation,
    iter_documents,
    prepare_data,
    read_shard,
    stdlib_files,
    write_shard,
)
from ndtrain.data import prepare as prepare_module
from ndtrain.data.corpus import stdlib_dir

WORDS = "the quick brown fox jumps over lazy dog def class return import self value".split()


def make_text(rng: np.random.Generator, words: int) -> str:
    """Deterministic pseudo-prose with line breaks, tabs and a little unicode."""
    picked = rng.choice(WORDS + ["naïve", "日本語", "\t", "→"], size=words)
    lines = [" ".join(picked[i : i + 9]) for i in range(0, words, 9)]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def tiny_tokenizer() -> TextTokenizer:
    rng = np.random.default_rng(0)
    return TextTokenizer.train([make_text(rng, 80) for _ in range(20)], vocab_size=300)


# --- tokenizer -------------------------------------------------------------------------

ROUND_TRIP_TEXTS = [
    "",
    "plain ascii words",
    "tabs\tand\nnewlines\r\nand  double  spaces   \n\n",
    "unicode: naïve café, 日本語, Ελληνικά, emoji 🎉👩‍💻, combining e\u0301",
    "never seen in training: ʘ‿ʘ ∮ ℵ \x00 \x7f \u2028 \ufeff",
    f"a literal {EOT} inside a document stays text",
    "def f(x):\n    return {'k': [1, 2.5e-3]}  # comment\n",
]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips_any_text(tiny_tokenizer, text):
    ids = tiny_tokenizer.encode(text)
    assert tiny_tokenizer.decode(ids) == text
    assert tiny_tokenizer.eot_id not in ids
    assert all(0 <= i < tiny_tokenizer.vocab_size for i in ids)


def test_tokenizer_batch_matches_single(tiny_tokenizer):
    batch = tiny_tokenizer.encode_batch(ROUND_TRIP_TEXTS)
    assert batch == [tiny_tokenizer.encode(t) for t in ROUND_TRIP_TEXTS]


def test_tokenizer_vocab_and_eot(tiny_tokenizer):
    assert 257 <= tiny_tokenizer.vocab_size <= 300
    assert tiny_tokenizer.decode([tiny_tokenizer.eot_id]) == EOT


def test_tokenizer_from_file(tiny_tokenizer, tmp_path):
    path = tmp_path / "tokenizer.json"
    tiny_tokenizer.save(path)
    loaded = TextTokenizer.from_file(path)
    assert (loaded.vocab_size, loaded.eot_id) == (tiny_tokenizer.vocab_size, tiny_tokenizer.eot_id)
    for text in ROUND_TRIP_TEXTS:
        assert loaded.encode(text) == tiny_tokenizer.encode(text)


def test_tokenizer_file_without_end_of_text(tmp_path):
    path = tmp_path / "noeot.json"
    Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).save(str(path))
    with pytest.raises(DataError, match="end-of-text") as err:
        TextTokenizer.from_file(path)
    assert str(path) in str(err.value) and "<|endoftext|>" in str(err.value)


def test_tokenizer_bad_file_and_small_vocab(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{ not json")
    with pytest.raises(DataError, match="broken.json"):
        TextTokenizer.from_file(path)
    with pytest.raises(DataError, match="vocab_size 100"):
        TextTokenizer.train(["abc"], vocab_size=100)


# --- shards ----------------------------------------------------------------------------


@pytest.mark.parametrize("high, code", [(65535, 1), (70000, 2)])
def test_shard_round_trip(tmp_path, high, code):
    tokens = np.random.default_rng(1).integers(0, high + 1, size=1000)
    tokens[0] = high
    path = tmp_path / "s.bin"
    write_shard(path, tokens)
    assert struct.unpack_from("<I", path.read_bytes(), 12)[0] == code
    back = read_shard(path)
    assert np.array_equal(back, tokens)
    assert not back.flags.writeable
    assert path.stat().st_size == 32 + 1000 * (2 if code == 1 else 4)
    assert [p.name for p in tmp_path.iterdir()] == ["s.bin"]  # no temp file left behind


def test_a_flipped_byte_in_a_shard_fails_its_checksum(tmp_path):
    """The size and the header cannot see a byte changed in place; the checksum does, when
    asked (the command asks once per shard before a run)."""
    path = tmp_path / "train-00000.bin"
    write_shard(path, np.arange(100))
    raw = bytearray(path.read_bytes())
    raw[32 + 2 * 50] ^= 0x01  # token 50 becomes 51: a valid id, a different corpus
    path.write_bytes(bytes(raw))
    assert read_shard(path)[50] == 51  # the header alone cannot tell
    with pytest.raises(DataError, match="do not match the checksum in its header") as err:
        read_shard(path, verify=True)
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    write_shard(path, np.arange(100))
    assert np.array_equal(read_shard(path, verify=True), np.arange(100))


def test_empty_shard_round_trip(tmp_path):
    write_shard(tmp_path / "e.bin", np.array([], dtype=np.int64))
    assert len(read_shard(tmp_path / "e.bin")) == 0


def _corrupt(raw: bytes, case: str) -> bytes:
    if case == "bad magic":
        return b"XXTOKENS" + raw[8:]
    if case == "wrong version":
        return raw[:8] + struct.pack("<I", 2) + raw[12:]
    if case == "unknown dtype":
        return raw[:12] + struct.pack("<I", 7) + raw[16:]
    if case == "truncated":
        return raw[:-3]
    if case == "extra bytes":
        return raw + b"\x00\x00"
    if case == "short header":
        return raw[:20]
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case, rule",
    [
        ("bad magic", "magic"),
        ("wrong version", "version 2"),
        ("unknown dtype", "dtype code 7"),
        ("truncated", "header promises 100 tokens"),
        ("extra bytes", "header promises 100 tokens"),
        ("short header", "shorter than the 32-byte header"),
    ],
)
def test_shard_corruption_is_refused(tmp_path, case, rule):
    path = tmp_path / "train-00000.bin"
    write_shard(path, np.arange(100))
    path.write_bytes(_corrupt(path.read_bytes(), case))
    with pytest.raises(DataError, match=rule) as err:
        read_shard(path)
    assert str(path) in str(err.value)
    assert "\n" not in str(err.value)


# --- corpus ----------------------------------------------------------------------------


def test_stdlib_files():
    files = stdlib_files()
    assert len(files) > 100
    assert files == sorted(files)
    root = stdlib_dir()
    banned = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
    for path in files:
        assert path.suffix == ".py"
        assert not banned & set(path.relative_to(root).parts[:-1])


def test_is_validation_is_stable():
    key = "pkg/module.py"
    assert is_validation(key, 0.5) == (zlib.crc32(key.encode()) / 2**32 < 0.5)
    keys = [f"doc{i}" for i in range(2000)]
    assert not any(is_validation(k, 0.0) for k in keys)
    assert all(is_validation(k, 1.0) for k in keys)
    assert 0.15 < np.mean([is_validation(k, 0.2) for k in keys]) < 0.25


def test_iter_documents_txt_jsonl_and_dir(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"first\r\ndoc \xff")  # CRLF kept, bad byte replaced
    (tmp_path / "b.jsonl").write_text('{"text": "one"}\n\n{"text": "two\\nlines", "id": 3}\n')
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.md").write_text("# title")
    (tmp_path / "sub" / "ignored.csv").write_text("x,y")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "d.txt").write_text("hidden")

    assert list(iter_documents(str(tmp_path / "a.txt"))) == [("a.txt", "first\r\ndoc \ufffd")]
    assert list(iter_documents(str(tmp_path / "b.jsonl"))) == [("b.jsonl:1", "one"), ("b.jsonl:3", "two\nlines")]
    assert [k for k, _ in iter_documents(str(tmp_path))] == ["a.txt", "b.jsonl:1", "b.jsonl:3", "sub/c.md"]


def test_iter_documents_text_key(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"body": "hello"}\n')
    assert list(iter_documents(str(tmp_path / "x.jsonl"), text_key="body")) == [("x.jsonl:1", "hello")]


@pytest.mark.parametrize("line", ["not json", '{"other": "x"}', "[1, 2]", '{"text": 5}'])
def test_bad_jsonl_line_names_file_and_line(tmp_path, line):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(DataError) as err:
        list(iter_documents(str(path)))
    assert f"{path}:2" in str(err.value)


def test_missing_or_unsupported_source(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        list(iter_documents(str(tmp_path / "nope")))
    (tmp_path / "data.csv").write_text("a")
    with pytest.raises(DataError, match="unsupported"):
        list(iter_documents(str(tmp_path / "data.csv")))


def test_stdlib_documents_are_keyed_relative():
    key, text = next(iter_documents("stdlib"))
    assert not key.startswith("/") and key.endswith(".py") and text


# --- prepare ---------------------------------------------------------------------------

VAL_FRACTION = 0.2


@pytest.fixture
def corpus(tmp_path) -> Path:
    rng = np.random.default_rng(2)
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(36):
        (root / f"doc{i:02d}.txt").write_text(make_text(rng, int(rng.integers(20, 120))), encoding="utf-8")
    return root


def _prepare(corpus: Path, cache: Path, **kwargs) -> Path:
    args = dict(vocab_size=300, val_fraction=VAL_FRACTION, cache_dir=cache, progress=False, shard_tokens=700)
    return prepare_data(str(corpus), **(args | kwargs))


def test_prepare_data_meta_matches_shards(corpus, tmp_path):
    out = _prepare(corpus, tmp_path / "cache")
    assert out.parent == tmp_path / "cache" / "data"
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temp dir left
    meta = json.loads((out / "meta.json").read_text())
    assert meta["format"] == "ndtrain-tokens" and meta["version"] == 1
    assert meta["source"] == str(corpus.resolve())
    for split in ("train", "val"):
        sizes = [len(read_shard(out / name)) for name in meta[f"{split}_shards"]]
        assert sum(sizes) == meta[f"{split}_tokens"] > 0
        assert all(s == 700 for s in sizes[:-1]) and 0 < sizes[-1] <= 700
        assert sorted(p.name for p in out.glob(f"{split}-*.bin")) == meta[f"{split}_shards"]
    assert len(meta["train_shards"]) > 1  # the stream test below crosses shard boundaries
    data = PreparedData.open(out)
    assert (data.vocab_size, data.eot_id) == (meta["vocab_size"], meta["eot_id"])
    assert 0 < data.unigram_val_loss < math.log(data.vocab_size)


def test_prepare_data_tokens_decode_to_documents(corpus, tmp_path):
    data = PreparedData.open(_prepare(corpus, tmp_path / "cache"))
    tok = data.tokenizer()
    docs = list(iter_documents(str(corpus)))
    val = [text for key, text in docs if is_validation(key, VAL_FRACTION)]
    train = [text for key, text in docs if not is_validation(key, VAL_FRACTION)]
    assert val and train
    for split, texts in (("train", train), ("val", val)):
        stream = data.stream(split)
        assert tok.decode(stream.slice(0, len(stream))) == "".join(t + EOT for t in texts)


def test_prepare_data_reuses_cache(corpus, tmp_path, monkeypatch):
    out = _prepare(corpus, tmp_path / "cache")
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}

    def must_not_build(*args, **kwargs):
        raise AssertionError("prepared data was rebuilt")

    monkeypatch.setattr(prepare_module, "_build", must_not_build)
    assert _prepare(corpus, tmp_path / "cache") == out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    assert prepare_data(str(out)) == out  # a prepared directory is its own source


def test_prepare_data_key_follows_inputs(corpus, tmp_path):
    first = _prepare(corpus, tmp_path / "cache")
    assert _prepare(corpus, tmp_path / "cache", vocab_size=290) != first
    (corpus / "doc00.txt").write_text("changed content\n")
    assert _prepare(corpus, tmp_path / "cache") != first


def test_prepare_data_with_user_tokenizer(corpus, tmp_path, tiny_tokenizer):
    tok_path = tmp_path / "tok.json"
    tiny_tokenizer.save(tok_path)
    data = PreparedData.open(_prepare(corpus, tmp_path / "cache", tokenizer=str(tok_path)))
    assert data.eot_id == tiny_tokenizer.eot_id
    first_train = next(text for key, text in iter_documents(str(corpus)) if not is_validation(key, VAL_FRACTION))
    expected = tiny_tokenizer.encode(first_train) + [tiny_tokenizer.eot_id]
    assert data.stream("train").slice(0, len(expected)).tolist() == expected


def test_prepare_data_keeps_both_splits(tmp_path):
    (tmp_path / "two").mkdir()
    (tmp_path / "two" / "a.txt").write_text("alpha beta gamma\n")
    (tmp_path / "two" / "b.txt").write_text("delta epsilon\n")
    for fraction in (1e-9, 0.999999):
        meta = PreparedData.open(_prepare(tmp_path / "two", tmp_path / "cache", val_fraction=fraction)).meta
        assert meta["train_tokens"] > 0 and meta["val_tokens"] > 0

    single = tmp_path / "single.txt"
    single.write_text("".join(f"line {i} of one long document\n" for i in range(50)))
    data = PreparedData.open(_prepare(single, tmp_path / "cache"))
    tok = data.tokenizer()
    text = tok.decode(data.stream("train").slice(0, data.meta["train_tokens"]))
    text += tok.decode(data.stream("val").slice(0, data.meta["val_tokens"]))
    assert text.replace(EOT, "") == single.read_text()
    assert text.endswith("\n" + EOT)  # cut at a line boundary


def test_prepare_data_bad_inputs(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no non-empty documents"):
        _prepare(tmp_path / "empty", tmp_path / "cache")
    with pytest.raises(DataError, match="val_fraction"):
        _prepare(tmp_path / "empty", tmp_path / "cache", val_fraction=0)
    with pytest.raises(DataError, match="not a prepared directory"):
        PreparedData.open(tmp_path / "empty")
    assert not (tmp_path / "cache" / "data").exists() or not any((tmp_path / "cache" / "data").iterdir())


# --- loader ----------------------------------------------------------------------------

SEQ = 8


@pytest.fixture
def counting_stream(tmp_path) -> TokenStream:
    """Tokens 0..N-1 in three unequal shards, so a window's tokens say where it came from."""
    tokens = np.arange(203)
    paths = []
    for i, (lo, hi) in enumerate([(0, 50), (50, 51), (51, 203)]):
        paths.append(tmp_path / f"train-{i:05d}.bin")
        write_shard(paths[-1], tokens[lo:hi])
    return TokenStream(paths)


def test_token_stream_slices_across_shards(counting_stream):
    assert len(counting_stream) == 203
    assert counting_stream.slice(45, 60).tolist() == list(range(45, 60))
    assert counting_stream.slice(0, 203).tolist() == list(range(203))
    assert len(counting_stream.slice(7, 7)) == 0
    with pytest.raises(DataError):
        counting_stream.slice(200, 204)


def test_loader_windows_and_targets(counting_stream):
    loader = BatchLoader(counting_stream, SEQ, global_batch=4, seed=0)
    assert loader.windows == (203 - 1) // SEQ == 25
    inputs, targets = loader.rows(3, 0, 4)
    assert inputs.dtype == targets.dtype == torch.int64
    assert inputs.shape == targets.shape == (4, SEQ)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    for row in inputs:
        start = int(row[0])
        assert start % SEQ == 0
        assert row.tolist() == list(range(start, start + SEQ))


def test_loader_is_a_function_of_seed_and_step(counting_stream):
    a = BatchLoader(counting_stream, SEQ, 4, seed=7)
    b = BatchLoader(counting_stream, SEQ, 4, seed=7)
    for step in (5, 0, 40, 5):  # any order, any fresh loader
        assert all(torch.equal(x, y) for x, y in zip(a.rows(step, 0, 4), b.rows(step, 0, 4)))
    c = BatchLoader(counting_stream, SEQ, 4, seed=8)
    assert any(not torch.equal(a.rows(s, 0, 4)[0], c.rows(s, 0, 4)[0]) for s in range(5))


def test_loader_row_ranges_compose(counting_stream):
    loader = BatchLoader(counting_stream, SEQ, global_batch=6, seed=3)
    full = loader.rows(4, 0, 6)  # rows 24..29 straddle the epoch boundary at 25
    for k in range(7):
        left, right = loader.rows(4, 0, k), loader.rows(4, k, 6)
        for whole, a, b in zip(full, left, right):
            assert torch.equal(torch.cat([a, b]), whole)


@pytest.mark.parametrize("shuffle", [True, False])
def test_loader_visits_every_window_once_per_epoch(counting_stream, shuffle):
    loader = BatchLoader(counting_stream, SEQ, global_batch=5, seed=1, shuffle=shuffle)  # 25 = 5 steps
    orders = []
    for epoch in range(2):
        steps = range(epoch * 5, epoch * 5 + 5)
        assert {loader.epoch_of(s) for s in steps} == {epoch}
        starts = torch.cat([loader.rows(s, 0, 5)[0][:, 0] for s in steps]) // SEQ
        assert sorted(starts.tolist()) == list(range(25))
        orders.append(starts.tolist())
    assert (orders[0] != orders[1]) == shuffle
    assert (orders[0] == list(range(25))) != shuffle


def test_loader_rejects_short_stream_and_bad_rows(counting_stream):
    with pytest.raises(DataError, match="203 tokens is too short for seq_len 203"):
        BatchLoader(counting_stream, 203, 2, seed=0)
    assert BatchLoader(counting_stream, 202, 2, seed=0).windows == 1  # exactly one window fits
    loader = BatchLoader(counting_stream, SEQ, 4, seed=0)
    with pytest.raises(DataError, match="global_batch"):
        loader.rows(0, 2, 5)


def test_loader_on_prepared_data(corpus, tmp_path):
    data = PreparedData.open(_prepare(corpus, tmp_path / "cache"))
    loader = BatchLoader(data.stream("train"), seq_len=16, global_batch=3, seed=0)
    inputs, targets = loader.rows(0, 0, 3)
    assert inputs.shape == (3, 16) and int(inputs.max()) < data.vocab_size
