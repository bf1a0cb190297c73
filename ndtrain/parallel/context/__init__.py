"""Context parallelism: each sequence split over the `cp` ranks, attention computed across them.

Reading order:
- `layout.py`: the zigzag layout (data side): chunks r and 2·cp−1−r of 2·cp on rank r; one
  permutation of tokens, targets, positions, document ids and weights (`shard`).
- `visibility.py`: which query sees which key, by global token index and document, and
  which block of the layout a ring step computes.
- `kernels.py`: the merge of blocks by their log-sum-exp, and a block in plain torch.
- `fused.py`: a block on torch's fused attention ops (the plain one where none applies).
- `ring.py`, `allgather.py`, `ulysses.py`: the three back ends (`parallel.cp_impl`).
- `sinks.py`: gpt-oss's attention sinks on the fused ops, folded into their log-sum-exp
  (one device's core, when cp = 1, and Ulysses').
- `attention.py`: the module that replaces `AttentionCore`, `apply`, the dropout that stays
  equal to one device's, and the bytes each back end sends (`wire_bytes`).

Everything else composes unchanged: parameters are replicated over cp, so gradients are
reduced over dp × cp (DP buckets over `dp_cp`, ZeRO over `dp_shard_cp`), and every token's
loss is summed and divided by the step's global target count.
"""

from ndtrain.parallel.context.attention import IMPLS, ContextParallelAttention, apply, set_recorder, wire_bytes
from ndtrain.parallel.context.layout import shard, unshard, zigzag_index

__all__ = ["IMPLS", "ContextParallelAttention", "apply", "set_recorder", "shard", "unshard", "wire_bytes", "zigzag_index"]
