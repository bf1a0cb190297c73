"""Data pipeline: corpus -> tokenizer -> token shards -> deterministic global batches.

``prepare_data`` turns a corpus into a cached prepared directory once; ``PreparedData``
opens it; ``BatchLoader`` serves the global batch of any step as a pure function of
``(seed, step)``.
"""

from ndtrain.data.corpus import is_validation, iter_documents, stdlib_files
from ndtrain.data.loader import BatchLoader, TokenStream
from ndtrain.data.prepare import PreparedData, prepare_data
from ndtrain.data.shards import DataError, read_shard, write_shard
from ndtrain.data.tokenizer import EOT, TextTokenizer

__all__ = [
    "EOT", "BatchLoader", "DataError", "PreparedData", "TextTokenizer", "TokenStream",
    "is_validation", "iter_documents", "prepare_data", "read_shard", "stdlib_files", "write_shard",
]
