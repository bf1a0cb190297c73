"""Which query may see which key, in global token indices, for one micro-batch on one CP
rank: the causal rule (a key at or before the query), documents (both in one document), a
sliding window (a key fewer than `window` tokens before the query: Mistral, Qwen2, Gemma 2
layers), and which blocks of the zigzag layout a ring step must compute at all.

A window crosses ring blocks like any other rule: a block whose every pair lies `window` or
more tokens apart is skipped, one whose every pair lies closer is computed whole, and the
rest carry a mask. Token indices are those of the whole row, so a window over a packed row
of documents measures the same distances as one device's."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ndtrain.parallel.context.layout import chunks_of, gathered_index, zigzag_index


@dataclass
class Block:
    """The part of (local queries × some keys) that has visible pairs: query rows `rows`,
    key columns `cols`, and which pairs of them are visible: all (`mask` None), the causal
    square (`causal`: query i sees key j ≤ i, the rows and columns being the same tokens in
    the same order), or `mask` [b or 1, 1, rows, cols], True = visible."""

    rows: slice
    cols: slice
    mask: Tensor | None
    causal: bool = False
    _cache: dict = field(default_factory=dict, repr=False)

    def additive(self, dtype: torch.dtype) -> Tensor:
        """The mask as the fused ops take it: 0 where visible, −inf elsewhere."""
        if dtype not in self._cache:
            self._cache[dtype] = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device).masked_fill_(
                ~self.mask, float("-inf"))
        return self._cache[dtype]

    def seen(self) -> Tensor:
        """[b or 1, 1, rows]: the rows that see at least one key of the block."""
        if "seen" not in self._cache:
            self._cache["seen"] = self.mask.any(dim=-1)
        return self._cache["seen"]

    def keep(self, kind: str, rng: tuple[Tensor, Tensor]) -> None:
        """What a CUDA op's forward returned for its backward (its random state)."""
        self._cache[kind] = rng

    def kept(self, kind: str, device) -> tuple[Tensor, Tensor]:
        if kind not in self._cache:  # no forward ran this op here: without dropout it is unread
            return tuple(torch.zeros((), dtype=torch.int64, device=device) for _ in range(2))
        return self._cache[kind]

    def explicit(self, device) -> Tensor | None:
        """The mask for the plain kernel: `mask`, the causal square spelled out, or None."""
        if not self.causal:
            return self.mask
        n = self.rows.stop - self.rows.start
        return torch.ones(1, 1, n, n, dtype=torch.bool, device=device).tril()


@dataclass
class Visibility:
    seq_len: int  # S, the whole sequence
    cp: int
    rank: int
    causal: bool = True
    docs: Tensor | None = None  # [cp, b, S/cp] every rank's document ids, None = one per row
    device: torch.device | str = "cpu"
    window: int = 0  # a query sees keys fewer than `window` tokens before it; 0: every earlier key

    def __post_init__(self):
        self.local = self.seq_len // self.cp
        self.chunk = self.seq_len // (2 * self.cp)
        self.index = [zigzag_index(self.seq_len, self.cp, r, self.device) for r in range(self.cp)]
        self._blocks: dict[int, Block | None] = {}  # every layer asks the same, forward and backward
        self._gathered: list[Block] | None = None
        if self.window >= self.seq_len:  # a window that cuts nothing
            self.window = 0

    def mask(self, rows: slice, key_index: Tensor, key_docs: Tensor | None) -> Tensor | None:
        """Visibility of this rank's query rows against keys at `key_index` (global) with
        documents `key_docs` [b, keys]; None when everything is visible."""
        q = self.index[self.rank][rows]
        mask = q[:, None] >= key_index[None, :] if self.causal else None
        if self.window:
            near = q[:, None] - key_index[None, :] < self.window
            mask = near if mask is None else mask & near
        if self.docs is not None:
            same = self.docs[self.rank][:, rows, None] == key_docs[:, None, :]
            mask = same if mask is None else same & mask
        if mask is None:
            return None
        return mask.view(-1 if mask.dim() == 3 else 1, 1, *mask.shape[-2:])

    def ring_block(self, src: int) -> Block | None:
        if src not in self._blocks:
            self._blocks[src] = self._ring_block(src)
        return self._blocks[src]

    def gathered_blocks(self) -> list[Block]:
        """Local queries × the whole sequence's keys in natural order (all-gather back end):
        each query chunk j sees keys [0, j·c) fully and its own chunk causally, so two
        blocks per chunk (one for chunk 0), 2·cp·c² visible pairs on every rank. With
        documents each block carries its mask; without causality one block of everything;
        with a window one masked block per chunk, over the keys the window reaches."""
        if self._gathered is None and self.window and self.causal:
            self._gathered = self._windowed_gathered_blocks()
        if self._gathered is None:
            docs = self.natural_docs()
            if not self.causal:
                rows, cols = slice(0, self.local), slice(0, self.seq_len)
                self._gathered = [Block(rows, cols, self.mask(rows, self._keys(cols), docs))]
                return self._gathered
            blocks, c = [], self.chunk
            for half, chunk in enumerate(chunks_of(self.rank, self.cp)):
                rows = slice(half * c, (half + 1) * c)
                for cols, causal in ((slice(0, chunk * c), False), (slice(chunk * c, (chunk + 1) * c), True)):
                    if cols.stop == cols.start:
                        continue
                    if docs is None:
                        blocks.append(Block(rows, cols, None, causal))
                    else:
                        blocks.append(Block(rows, cols, self.mask(rows, self._keys(cols), docs[:, cols])))
            self._gathered = blocks
        return self._gathered

    def _windowed_gathered_blocks(self) -> list[Block]:
        docs, c, blocks = self.natural_docs(), self.chunk, []
        for half, chunk in enumerate(chunks_of(self.rank, self.cp)):
            rows = slice(half * c, (half + 1) * c)
            cols = slice(max(0, chunk * c - self.window + 1), (chunk + 1) * c)
            blocks.append(Block(rows, cols, self.mask(rows, self._keys(cols), docs[:, cols] if docs is not None else None)))
        return blocks

    def sequence_mask(self, natural: Tensor) -> Tensor | None:
        """[b or 1, 1, S, S] visibility of the whole sequence in natural order, for a back end
        that gathers it (Ulysses): `natural` orders every rank's tokens (rank order) by
        position. None: plain causal (or, not causal, everything)."""
        if self.docs is None and not self.window:
            return None
        pos = torch.arange(self.seq_len, device=natural.device)
        mask = pos[:, None] >= pos[None, :] if self.causal else torch.ones(self.seq_len, self.seq_len, dtype=torch.bool,
                                                                           device=natural.device)
        if self.window:
            mask = mask & (pos[:, None] - pos[None, :] < self.window)
        if self.docs is None:
            return mask[None, None]
        docs = self.docs.permute(1, 0, 2).reshape(self.docs.shape[1], -1)[:, natural]
        return ((docs[:, :, None] == docs[:, None, :]) & mask)[:, None]

    def natural_docs(self) -> Tensor | None:
        """Every rank's document ids in sequence order, [b, S] (None without documents)."""
        if self.docs is None:
            return None
        natural = self.docs.new_empty((self.docs.shape[1], self.seq_len))
        natural[:, gathered_index(self.seq_len, self.cp, self.docs.device)] = \
            self.docs.permute(1, 0, 2).reshape(self.docs.shape[1], -1)
        return natural

    def _keys(self, cols: slice) -> Tensor:
        return torch.arange(cols.start, cols.stop, device=self.device)

    def _ring_block(self, src: int) -> Block | None:
        """What this rank computes against the keys of CP rank `src` (None: nothing).

        In chunks: query chunk i sees key chunk j fully when j < i, causally when j = i, not
        at all when j > i. For the zigzag layout that gives (own keys) the local causal
        square (the local order is increasing in global position); (src < rank) all
        queries × the first half of the keys; (src > rank) the second half of the queries ×
        all keys: 2c² pairs every off-diagonal step, so the ring is balanced. A window takes
        away the chunks too far back (`_chunk_pair`).
        """
        if src == self.rank and self.causal and self.docs is None and not self.window:  # own keys, in order
            return Block(slice(0, self.local), slice(0, self.local), None, causal=True)
        q_chunks, k_chunks = chunks_of(self.rank, self.cp), chunks_of(src, self.cp)
        pairs = {(qh, kh): self._chunk_pair(qc, kc) for qh, qc in enumerate(q_chunks) for kh, kc in enumerate(k_chunks)}
        live = [pair for pair, kind in pairs.items() if kind != "none"]
        if not live:
            return None
        q_halves = range(min(p[0] for p in live), max(p[0] for p in live) + 1)
        k_halves = range(min(p[1] for p in live), max(p[1] for p in live) + 1)
        c = self.chunk
        rows, cols = slice(q_halves[0] * c, (q_halves[-1] + 1) * c), slice(k_halves[0] * c, (k_halves[-1] + 1) * c)
        all_full = all(pairs[(qh, kh)] == "full" for qh in q_halves for kh in k_halves)
        if all_full and self.docs is None:
            return Block(rows, cols, None)
        key_docs = self.docs[src][:, cols] if self.docs is not None else None
        return Block(rows, cols, self.mask(rows, self.index[src][cols], key_docs))

    def _chunk_pair(self, qc: int, kc: int) -> str:
        """How query chunk qc sees key chunk kc: "full", "diag" (some pairs) or "none". The
        nearest pair of chunks kc < qc lies (qc − kc − 1)·c + 1 tokens apart, the farthest
        (qc − kc + 1)·c − 1."""
        if not self.causal:
            return "full"
        if kc > qc:
            return "none"
        if kc == qc:
            return "diag"
        if not self.window:
            return "full"
        c = self.chunk
        if (qc - kc - 1) * c + 1 >= self.window:
            return "none"
        return "full" if (qc - kc + 1) * c - 1 < self.window else "diag"
