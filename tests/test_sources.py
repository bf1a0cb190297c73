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
