"""Every source format reads back the documents written into it, in order, with the text
field configured; a folder is read as the Hugging Face dataset it is; bad sources fail with
one line naming the file."""

import json

import pytest

from mixture_helpers import texts, write_jsonl, write_parquet_folder, write_saved_dataset, write_txt_folder
from ndtrain.data.corpus import iter_documents
from ndtrain.data.shards import DataError
from ndtrain.data.sources import check_source


def _texts(path, key="text"):
    return [t for _, t in iter_documents(str(path), key)]


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_jsonl_plain_and_compressed(tmp_path, suffix):
    docs = texts(12) + ["line\u2028separator inside a string"]
    path = write_jsonl(tmp_path / f"d{suffix}", docs, key="body")
    keyed = list(iter_documents(str(path), "body"))
    assert [t for _, t in keyed] == docs
    assert keyed[0][0] == f"d{suffix}:1"  # the line number: a key independent of where the file lies
    with pytest.raises(DataError, match=r":1: each line must be a JSON object with a string field 'text'"):
        _texts(path)


def test_parquet_folder_streams_row_groups_in_order(tmp_path):
    docs = texts(30)
    folder = write_parquet_folder(tmp_path / "pq", docs, column="content", shards=3)
    (folder / "README.md").write_text("a hub snapshot's card is not a document")
    assert _texts(folder, "content") == docs
    with pytest.raises(DataError, match=r"no column 'text' \(the source's text_key\); its columns are content, id"):
        _texts(folder)
    with pytest.raises(DataError, match=r"column 'id' holds int64, not text"):
        _texts(folder, "id")
    check_source(folder, "content")
    write_parquet_folder(tmp_path / "pq" / "more", texts(4), column="body", shards=1)  # a later shard lacks it
    with pytest.raises(DataError, match=r"more/train-00000-of-00001.parquet: no column 'content'"):
        check_source(folder, "content")


def test_hub_snapshot_reads_parquet_below_it_only(tmp_path):
    root = tmp_path / "snapshot"
    write_parquet_folder(root / "data", texts(10), shards=2)
    (root / "README.md").write_text("card")
    (root / ".cache").mkdir()
    (root / ".cache" / "x.parquet").write_text("hidden: not read")
    assert _texts(root) == texts(10)


def test_save_to_disk_folders(tmp_path):
    docs = texts(17)
    saved = write_saved_dataset(tmp_path / "saved", docs)
    assert _texts(saved) == docs
    # a DatasetDict: its train split
    dd = tmp_path / "dd"
    write_saved_dataset(dd / "train", docs[:9])
    write_saved_dataset(dd / "test", docs[9:])
    (dd / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    assert _texts(dd) == docs[:9]
    import pyarrow as pa  # an Arrow file in the random-access format rather than the stream
    table = pa.table({"text": docs[:3]})
    with pa.OSFile(str(tmp_path / "f.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=2)
    assert _texts(tmp_path / "f.arrow") == docs[:3]
    (dd / "dataset_dict.json").write_text(json.dumps({"splits": ["validation"]}))
    with pytest.raises(DataError, match="without a 'train' split"):
        _texts(dd)


def test_text_folder_and_bad_sources(tmp_path):
    folder = write_txt_folder(tmp_path / "notes", texts(5))
    assert _texts(folder) == texts(5)
    with pytest.raises(DataError, match="no such file or directory"):
        check_source(tmp_path / "missing.parquet", "text")
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(DataError, match="unsupported file type"):
        check_source(tmp_path / "x.csv", "text")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no"):
        check_source(tmp_path / "empty", "text")
    (tmp_path / "bad.jsonl.zst").write_bytes(b"not zstd at all")
    with pytest.raises(DataError, match=r"bad.jsonl.zst: cannot read"):
        check_source(tmp_path / "bad.jsonl.zst", "text")


def test_token_files_are_split_at_an_end_of_text_and_copied(tmp_path):
    """A folder of .bin token files (data/shards.py's format) prepares into a directory whose
    train + val streams are each file's ids, cut after an end-of-text id near 1 − val_fraction."""
    import numpy as np

    from ndtrain.data.prepare import PreparedData
    from ndtrain.data.shards import write_shard
    from ndtrain.data.token_files import prepare_source as prepare_data
    from ndtrain.data.tokenizer import TextTokenizer
    tok = TextTokenizer.train(texts(10), 300)
    tok.save(tmp_path / "tok.json")
    folder = tmp_path / "ids"
    folder.mkdir()
    files = []
    for k in range(2):
        ids = np.concatenate([np.asarray(tok.encode(t) + [tok.eot_id]) for t in texts(5, 5 * k)])
        write_shard(folder / f"part{k}.bin", ids)
        files.append(ids)
    with pytest.raises(DataError, match="holds token ids; name the tokenizer"):
        prepare_data(str(folder), cache_dir=tmp_path / "cache", progress=False)
    data = PreparedData.open(prepare_data(str(folder), tokenizer=str(tmp_path / "tok.json"), val_fraction=0.3,
                                          cache_dir=tmp_path / "cache", progress=False, shard_tokens=500))
    train = np.asarray(data.stream("train").slice(0, data.meta["train_tokens"]))
    val = np.asarray(data.stream("val").slice(0, data.meta["val_tokens"]))
    cuts = [int(np.flatnonzero(ids[: int(len(ids) * 0.7) + 1] == tok.eot_id)[-1]) + 1 for ids in files]
    assert np.array_equal(train, np.concatenate([ids[:c] for ids, c in zip(files, cuts)]))
    assert np.array_equal(val, np.concatenate([ids[c:] for ids, c in zip(files, cuts)]))
    assert len(data.meta["train_shards"]) > 1  # copied in shards of 500 ids
    write_shard(folder / "part2.bin", np.array([1, 2, 400]))
    with pytest.raises(DataError, match=r"part2.bin: holds token id 400, outside the 300 ids"):
        prepare_data(str(folder), tokenizer=str(tmp_path / "tok.json"), cache_dir=tmp_path / "cache", progress=False)


def test_a_bad_data_path_is_one_line_and_writes_nothing(tmp_path, capsys):
    from ndtrain.cli import main
    folder = write_parquet_folder(tmp_path / "pq", texts(6), column="content")
    assert main(["prepare", f"data.path={folder}", f"data.cache_dir={tmp_path / 'cache'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no column 'text' (the source's text_key); its columns are content, id" in err[0]
    assert not (tmp_path / "cache").exists()
