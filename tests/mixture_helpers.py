"""Small corpora in every format a source may be (data/sources.py), made from stdlib text,
and a prepared three-source mixture (a parquet folder, a .jsonl.zst file, a .txt folder)."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

STDLIB = Path(sysconfig.get_paths()["stdlib"])
MODULES = ("textwrap.py", "bisect.py", "colorsys.py", "heapq.py", "fnmatch.py", "shlex.py", "glob.py",
           "keyword.py", "stat.py", "queue.py", "sched.py", "this.py", "abc.py", "numbers.py", "copy.py")


def texts(n: int, offset: int = 0) -> list[str]:
    """Documents offset..offset+n−1 of the stdlib modules cut into pieces of 1.5 KB (distinct
    ranges never share a piece)."""
    pieces = []
    for name in MODULES:
        body = (STDLIB / name).read_text(errors="replace")
        pieces += [body[i:i + 1500] for i in range(0, len(body), 1500)]
    assert offset + n <= len(pieces), len(pieces)
    return pieces[offset:offset + n]


def write_parquet_folder(root: Path, docs: list[str], column: str = "text", shards: int = 2) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq
    root.mkdir(parents=True, exist_ok=True)
    per = -(-len(docs) // shards)
    for k in range(shards):
        part = docs[k * per:(k + 1) * per]
        table = pa.table({column: part, "id": list(range(len(part)))})
        pq.write_table(table, root / f"train-{k:05d}-of-{shards:05d}.parquet", row_group_size=7)
    return root


def write_jsonl(path: Path, docs: list[str], key: str = "text") -> Path:
    """A .jsonl, .jsonl.gz or .jsonl.zst file (compressed by pyarrow's codecs)."""
    import pyarrow as pa
    data = "".join(json.dumps({key: d, "n": i}) + "\n" for i, d in enumerate(docs)).encode()
    codec = {".gz": "gzip", ".zst": "zstd"}.get(path.suffix)
    if codec is None:
        path.write_bytes(data)
    else:
        with pa.CompressedOutputStream(str(path), codec) as f:
            f.write(data)
    return path


def write_txt_folder(root: Path, docs: list[str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i, d in enumerate(docs):
        (root / f"doc{i:03d}.txt").write_text(d)
    return root


def write_saved_dataset(root: Path, docs: list[str], column: str = "text", shards: int = 2) -> Path:
    """What `datasets.Dataset.save_to_disk` writes: Arrow IPC stream files, state.json listing
    them, dataset_info.json."""
    import pyarrow as pa
    root.mkdir(parents=True, exist_ok=True)
    per = -(-len(docs) // shards)
    names = []
    for k in range(shards):
        table = pa.table({column: docs[k * per:(k + 1) * per]})
        name = f"data-{k:05d}-of-{shards:05d}.arrow"
        with pa.OSFile(str(root / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table, max_chunksize=5)
        names.append(name)
    (root / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names],
                                                 "_split": "train"}))
    (root / "dataset_info.json").write_text(json.dumps({"features": {column: {"dtype": "string"}}}))
    return root


def mixture_sources(root: Path) -> list[dict]:
    """The acceptance mixture: a parquet folder 0.5, a .jsonl.zst file 0.3, a .txt folder 0.2,
    each a different slice of the text."""
    web = write_parquet_folder(root / "web", texts(40, 0), column="content")
    code = write_jsonl(root / "code.jsonl.zst", texts(30, 40))
    notes = write_txt_folder(root / "notes", texts(20, 70))
    return [{"name": "web", "path": str(web), "weight": 0.5, "text_key": "content"},
            {"name": "code", "path": str(code), "weight": 0.3},
            {"name": "notes", "path": str(notes), "weight": 0.2}]


def sources_override(sources: list[dict]) -> str:
    return "data.sources=" + json.dumps(sources)


def prepared_mixture(root: Path, sources: list[dict] | None = None):
    """The mixture prepared under root/cache (a 400-token BPE trained on all three sources)."""
    from ndtrain.data.mix_prepare import SourceSpec, prepare_mixture
    sources = sources or mixture_sources(root)
    specs = [SourceSpec(s["name"], s["path"], s["weight"], s.get("text_key") or "text", s.get("repeat", True))
             for s in sources]
    return prepare_mixture(specs, vocab_size=400, val_fraction=0.2, cache_dir=root / "cache", progress=False)
