"""`ndtrain prepare` at corpus scale: worker processes that do not change the shards, a build
that continues where it was killed, memory that does not grow with the corpus, malformed
records (data.on_bad_record), and a Hugging Face model folder's tokenizer (data.tokenizer =
hf:DIR) with its family's BOS/EOS, equal to what transformers' tokenizer gives."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from helpers import make_tiny_corpus
from ndtrain.data import encode
from ndtrain.data.prepare import PreparedData, prepare_data
from ndtrain.data.shards import DataError, read_shard
from ndtrain.data.tokenizer import TextTokenizer

ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """About 150 KB of Python in files, and the same text again as JSONL lines (one per
    paragraph: many small documents, many chunks)."""
    root = tmp_path_factory.mktemp("prepare")
    folder = make_tiny_corpus(root)
    with open(folder / "paragraphs.jsonl", "w") as f:
        for path in sorted(folder.glob("*.py")):
            for para in path.read_text().split("\n\n"):
                f.write(json.dumps({"text": para}) + "\n")
    return folder


@pytest.fixture(scope="module")
def tokenizer_file(corpus, tmp_path_factory) -> Path:
    tok = TextTokenizer.train((p.read_text() for p in sorted(corpus.glob("*.py"))), 400)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(path)
    return path


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_workers_and_chunks_do_not_change_the_shards(corpus, tokenizer_file, tmp_path, monkeypatch):
    """Two worker processes, chunks of 4 KB (dozens in flight and out of order on the
    workers), shards of 5,000 tokens: byte for byte the directory one process writes."""
    kw = dict(source=str(corpus), tokenizer=str(tokenizer_file), shard_tokens=5000, progress=False)
    one = prepare_data(cache_dir=tmp_path / "one", workers=1, **kw)
    monkeypatch.setattr(encode, "CHUNK_BYTES", 4096)
    two = prepare_data(cache_dir=tmp_path / "two", workers=2, **kw)
    assert one.name == two.name  # the worker count is not part of the data's identity
    files = _files(one)
    assert len([n for n in files if n.startswith("train-")]) > 10
    assert _files(two) == files


KILL_AT_SHARD = """
import os, sys
import ndtrain.data.build as build
from ndtrain.data import encode
from ndtrain.data.prepare import prepare_data
encode.CHUNK_BYTES = 4096
written = [0]
real = build.write_shard
def write_then_die(path, tokens):
    real(path, tokens)
    written[0] += 1
    if written[0] == {kill}:
        os._exit(3)  # no cleanup: as a killed process
build.write_shard = write_then_die
prepare_data(source={source!r}, tokenizer={tokenizer!r}, shard_tokens=5000, cache_dir={cache!r}, workers={workers},
             progress=False)
"""


def test_an_interrupted_prepare_continues_where_it_stopped(corpus, tokenizer_file, tmp_path, capsys):
    """A build killed after its 7th shard (with its BPE trained and progress recorded) leaves
    its partial directory; the next prepare continues from the recorded document (it says
    so) and writes the directory an uninterrupted build writes, byte for byte."""
    straight = prepare_data(source=str(corpus), shard_tokens=5000, vocab_size=400, cache_dir=tmp_path / "straight",
                            workers=1, progress=False)
    cache = tmp_path / "killed"
    script = KILL_AT_SHARD.format(kill=7, source=str(corpus), tokenizer="", cache=str(cache), workers=2)
    script = script.replace("shard_tokens=5000,", "shard_tokens=5000, vocab_size=400,")
    killed = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert killed.returncode == 3, killed.stderr
    (partial,) = (cache / "data").glob(".*.partial")
    assert (partial / "progress.json").is_file() and (partial / "tokenizer.json").is_file()
    resumed = prepare_data(source=str(corpus), shard_tokens=5000, vocab_size=400, cache_dir=cache, workers=1,
                           progress=True)
    out = capsys.readouterr().out
    assert "continuing an interrupted prepare at document " in out and "at document 0 " not in out, out
    assert resumed.name == straight.name and not partial.exists()
    assert _files(resumed) == _files(straight)
    assert sorted(p.name for p in (cache / "data").iterdir()) == [straight.name]  # no lock, no partial left


MEASURE_PEAK = """
import json, resource, sys
from ndtrain.data import encode
from ndtrain.data.prepare import prepare_data
encode.CHUNK_BYTES = 1 << 16
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = prepare_data(source=sys.argv[1], tokenizer=sys.argv[2], shard_tokens=1 << 16, cache_dir=sys.argv[3],
                   workers=1, progress=False)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"before_kb": before, "peak_kb": peak, "tokens": json.load(open(out / "meta.json"))["train_tokens"]}))
"""


def _peak(corpus_file: Path, tokenizer: Path, cache: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", MEASURE_PEAK, str(corpus_file), str(tokenizer), str(cache)],
                          capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                          timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def _jsonl_of(corpus: Path, path: Path, megabytes: float) -> Path:
    texts = [p.read_text() for p in sorted(corpus.glob("*.py"))]
    written, i = 0, 0
    with open(path, "w") as f:
        while written < megabytes * 1e6:
            line = json.dumps({"text": f"# copy {i}\n" + texts[i % len(texts)]}) + "\n"
            f.write(line)
            written, i = written + len(line), i + 1
    return path


UNDER_A_LIMIT = """
import resource, sys
from ndtrain.data import encode
from ndtrain.data.prepare import prepare_data
encode.CHUNK_BYTES = 1 << 16
mapped = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) * 1024
limit = mapped + (int(sys.argv[4]) << 20)
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
out = prepare_data(source=sys.argv[1], tokenizer=sys.argv[2], shard_tokens=1 << 16, cache_dir=sys.argv[3],
                   workers=1, progress=False)
print(out)
"""


@pytest.mark.slow  # 8 s; the default tier keeps the resumable and parallel prepare tests
def test_a_corpus_larger_than_the_memory_left_is_prepared(corpus, tokenizer_file, tmp_path):
    """A process whose address space may grow by only 16 MB past what it has mapped after its
    imports (RLIMIT_AS) prepares a 24 MB corpus into more than 16 MB of shards.
    One process (workers = 1) with tokenizers' threads off and one malloc arena: RLIMIT_AS
    counts address space reserved, not used, and every thread reserves a 64 MB arena and its
    stack; with the threads the same build needs no more memory, only more reservations.
    Every document is in the shards (one end of text each), which pass their checksums."""
    source = _jsonl_of(corpus, tmp_path / "corpus.jsonl", 24)
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "MALLOC_ARENA_MAX": "1", "TOKENIZERS_PARALLELISM": "false"}
    run = lambda cache, headroom: subprocess.run(  # noqa: E731
        [sys.executable, "-c", UNDER_A_LIMIT, str(source), str(tokenizer_file), str(cache), str(headroom)],
        capture_output=True, text=True, env=env, timeout=600)
    limited = run(tmp_path / "limited", 16)
    assert limited.returncode == 0, limited.stderr[-2000:]
    data = PreparedData.open(limited.stdout.strip())
    data.verify()
    documents = sum(1 for _ in open(source))
    tokens = np.concatenate([read_shard(data.path / n) for n in data.meta["train_shards"] + data.meta["val_shards"]])
    assert (tokens == data.eot_id).sum() == documents and len(tokens) * 2 > 16 << 20  # > 16 MB as uint16


@pytest.mark.slow
def test_memory_does_not_grow_with_the_corpus(corpus, tokenizer_file, tmp_path):
    """The peak RSS of a prepare (one process, chunks of 64 KB, shards of 65,536 tokens) of a
    16 MB corpus is within 4 MB of that of a 2 MB one: holding the 14 MB more text, or its
    ~7 million more tokens (28 MB as uint32), would add at least 14 MB. The bound is the
    buffers' (a chunk, a shard, the BPE cache), not the corpus's."""
    small = _peak(_jsonl_of(corpus, tmp_path / "small.jsonl", 2), tokenizer_file, tmp_path / "c1")
    large = _peak(_jsonl_of(corpus, tmp_path / "large.jsonl", 16), tokenizer_file, tmp_path / "c2")
    assert large["tokens"] > 7 * small["tokens"]
    growth_mb = (large["peak_kb"] - small["peak_kb"]) / 1024
    assert growth_mb < 4, (small, large)


def test_a_malformed_record_names_file_and_line_or_is_skipped(tmp_path, tokenizer_file, capsys):
    """data.on_bad_record = error: a DataError naming file:line, nothing left in the cache;
    skip: the record left out and counted (meta.json, and a line saying so)."""
    path = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": f"document number {i} " * 20}) for i in range(40)]
    lines[2] = '{"text": "torn'
    lines[7] = json.dumps({"body": "wrong field"})
    path.write_text("\n".join(lines) + "\n")
    kw = dict(source=str(path), tokenizer=str(tokenizer_file), cache_dir=tmp_path / "cache")
    with pytest.raises(DataError, match=rf"{path}:3: not valid JSON"):
        prepare_data(progress=False, **kw)
    assert not any((tmp_path / "cache" / "data").iterdir())
    out = prepare_data(on_bad_record="skip", progress=True, **kw)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["skipped_records"] == 2
    assert f"skipped 2 malformed records (data.on_bad_record = skip); first: {path}:3" in capsys.readouterr().out
    tok = PreparedData.open(out).tokenizer()
    tokens = np.concatenate([read_shard(out / n) for n in meta["train_shards"] + meta["val_shards"]])
    assert (tokens == tok.eot_id).sum() == 38


def test_the_cli_refuses_a_malformed_record_in_one_line(tmp_path, capsys):
    from ndtrain.cli import main
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "fine"}\n[1, 2]\n')
    assert main(["prepare", f"data.path={path}", f"data.cache_dir={tmp_path / 'cache'}", "run.progress=false"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{path}:2: each line must be a JSON object" in err, err


def _hf_folder(folder: Path, config: dict, bos_template: bool) -> Path:
    """A Hugging Face model folder's tokenizer files, built here: a byte-level BPE whose
    post-processor puts <|begin|> in front of a text (Llama 3's way) or adds nothing (Qwen's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 8, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|begin|>", "<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    if bos_template:
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin|> $A", pair="<|begin|> $A $B", special_tokens=[("<|begin|>", tok.token_to_id("<|begin|>"))])
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}))
    return folder


@pytest.mark.parametrize("family, config, bos_template, bos", [
    ("llama3", {"bos_token": "<|begin|>", "eos_token": "<|end|>"}, True, True),
    ("qwen", {"eos_token": "<|endoftext|>", "bos_token": None}, False, False),
    ("explicit", {"bos_token": "<|begin|>", "eos_token": "<|end|>", "add_bos_token": True}, False, True),
    ("explicit-off", {"bos_token": "<|begin|>", "eos_token": "<|end|>", "add_bos_token": False}, True, False),
])
def test_a_hugging_face_tokenizer_writes_documents_as_its_family_does(family, config, bos_template, bos, tmp_path):
    """data.tokenizer = hf:DIR: every document is [BOS] + its ids + [EOS], BOS when
    tokenizer_config.json's add_bos_token says so or, where it says nothing, when the
    tokenizer's post-processor adds one; EOS its eos_token. Where transformers reads the folder
    the same way (no add_bos_token: its fast tokenizer follows the post-processor), each
    document equals transformers' encoding plus its eos_token_id."""
    folder = _hf_folder(tmp_path / "model", config, bos_template)
    docs = ["def f(x):\n    return x + 1\n", "print('<|end|> is text here')\n", "x = 1\n"]
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = prepare_data(source=str(source), tokenizer=f"hf:{folder}", cache_dir=tmp_path / "cache", progress=False)
    data = PreparedData.open(out)
    tok = data.tokenizer()
    end, begin = tok.token_id("<|end|>" if family != "qwen" else "<|endoftext|>"), tok.token_id("<|begin|>")
    assert data.eot_id == end and tok.bos_ids == ((begin,) if bos else ())
    tokens = np.concatenate([read_shard(out / n) for n in data.meta["train_shards"] + data.meta["val_shards"]])
    ends = np.flatnonzero(tokens == end)
    assert len(ends) == len(docs)  # the <|end|> written in a document is text, not the token
    pieces = np.split(tokens, ends[:-1] + 1)
    plain = {tuple(tok.encode(d)) for d in docs}
    for piece in pieces:
        assert (piece[0] == begin) == bos
        assert tuple(piece[len(tok.bos_ids):-1]) in plain
    if "add_bos_token" not in config:
        from transformers import AutoTokenizer
        hf = AutoTokenizer.from_pretrained(str(folder))
        theirs = {tuple(hf(d, split_special_tokens=True)["input_ids"] + [hf.eos_token_id]) for d in docs}
        assert {tuple(p.tolist()) for p in pieces} == theirs


def test_hf_tokenizer_without_tokenizer_json_is_a_config_error(tmp_path):
    from ndtrain.config import ConfigError, load_config, validate
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="data.tokenizer = 'hf:.*': hf:DIR needs a Hugging Face model folder"):
        validate(load_config(None, [f"data.tokenizer=hf:{tmp_path / 'empty'}", "run.device=cpu"]))


def test_bench_prepare_runs_both_sides_on_the_same_tokens(corpus, tokenizer_file, tmp_path, capsys):
    """One round: the ratio line last; the bare loop writes as many tokens as ours (the same
    documents, each ending with its end of text); a key neither side reads is refused."""
    import re

    from ndtrain.bench.prepare import bare_encode
    from ndtrain.cli import main
    argv = ["bench", "prepare", "--rounds", "1", f"data.path={corpus}", f"data.tokenizer={tokenizer_file}",
            f"data.cache_dir={tmp_path / 'cache'}"]
    assert main(argv) == 0
    out = capsys.readouterr().out.strip()
    assert re.search(r"\nndtrain prepare/encode_batch throughput ratio: \d+\.\d\d$", out), out
    ours = PreparedData.open(prepare_data(source=str(corpus), tokenizer=str(tokenizer_file),
                                          cache_dir=tmp_path / "cache", progress=False))
    bare = bare_encode(str(corpus), tokenizer_file, "text", tmp_path / "bare.bin")
    assert bare == ours.meta["train_tokens"] + ours.meta["val_tokens"]
    assert main(["bench", "prepare", "train.steps=5"]) == 2
    assert "train.steps = 5: bench prepare cannot apply it" in capsys.readouterr().err
