"""Memory per rank: model states by the ZeRO formulas (plan/params.py), activations by
replaying one step.

Activations are not one formula: what is held at the worst moment depends on the schedule.
So the planner replays one training step of each pipeline rank, action by action in the
order its schedule runs them (`compute_orders`, the engine's own lists), adding and removing
bytes where the engine allocates and frees them:
- forward of a micro-batch on a chunk: each block's saved tensors (plan/activations.py, by
  recompute mode), the head's, the loss's (logits, log-softmax; vocab-parallel under TP);
- backward: the loss gradient (the largest moment for a large vocabulary), then block by
  block from the last, each with its working tensors (the incoming gradient, the MLP's
  gradients, one weight's gradient) and, when recomputed, its forward run again; the
  block's saved tensors go when its backward ends (zero bubble: when its W ends, plus the
  gradients kept at the split nodes until then; a backward the executor defers,
  `lists.deferred`, keeps nothing there: its B does nothing, its W the whole backward);
- communication buffers: ZeRO-3's gathered units (the current one, the prefetched one, the
  chunk's root), ZeRO-2/3's full-size reduce buffers, each from a unit's first gradient
  until the next unit's reduction starts (the engine waits for the one in flight then),
  and the gradient shards they leave;
  DP's and ZeRO-1's reduce-dtype staging copies under bf16/fp16; the pipeline's messages,
  which the executor keeps until the end of the step (a V's turn hands them over: `turns`).
`activations` is the highest sum over the step of everything but the model states that
exist when it begins, the quantity `train --dry-run` measures (observe/memory.py); `total`
is that plus those states, the rank's peak.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ndtrain.config import Config
from ndtrain.model.args import ModelArgs
from ndtrain.parallel.pipeline.partition import Chunk, owner
from ndtrain.parallel.pipeline.schedules import B, F, W, Action, compute_orders, vshape
from ndtrain.plan.activations import (block_bytes_per_token, head_bytes_per_token, kv_width,
                                      llama_mlp_bytes_per_token, mtp_inputs, recomputed, wide)
from ndtrain.plan.params import (BYTES, block_experts, block_local, block_weight_groups, padded_vocab, root_local,
                                 stage_chunks, stage_params, stage_states)
from ndtrain.plan.pipeline import deferred_backwards

SAVED = "saved activations"


@dataclass
class RankMemory:
    """One pipeline rank's bytes (every dp, cp and tp rank of a stage holds the same)."""

    stage: int
    params_count: int
    params: float
    grads: float
    optimizer: float
    activations: float = 0.0  # the step's peak on top of the states held when it began
    at_peak: dict = field(default_factory=dict)  # what made up `activations` at that moment
    grads_held: bool = True  # whether gradients exist when the step begins (ZeRO-0/1)
    in_flight: int = 0  # micro-batches whose activations were held at that moment
    saved_by_mode: dict = field(default_factory=dict)  # one micro-batch's saved blocks per recompute mode

    @property
    def total(self) -> float:
        return self.params + self.optimizer + (self.grads if self.grads_held else 0.0) + self.activations

    def as_dict(self) -> dict:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "total": self.total}


# --------------------------------------------------------------------------- the replay

class Ledger:
    """Live bytes by category; remembers the highest total and what it was made of."""

    def __init__(self):
        self.live: Counter = Counter()
        self.peak = 0.0
        self.at_peak: dict = {}
        self.in_flight = 0  # micro-batches whose activations are held (set by the replay)
        self.in_flight_at_peak = 0

    def add(self, what: str, n: float) -> None:
        self.live[what] += n

    def moment(self, **transient: float) -> None:
        """A point where the engine holds what is live plus `transient`."""
        total = sum(self.live.values()) + sum(transient.values())
        if total > self.peak:
            parts = Counter(self.live)
            for k, v in transient.items():
                parts[k.replace("_", " ")] += v
            self.peak = total
            self.at_peak = {k: v for k, v in parts.items() if v > 0}
            self.in_flight_at_peak = self.in_flight


@dataclass
class StepShape:
    """The sizes the replay needs, for one pipeline rank."""

    cfg: Config
    args: ModelArgs
    c: int  # compute bytes per value
    r: int  # reduce bytes per value
    g: int  # gradient accumulation bytes per value (fp32 under bf16/fp16, else the compute dtype)
    n: int  # tokens of a micro-batch on one rank (after context parallelism)
    n_res: float  # tokens of the residual stream on one rank (after sequence parallelism)
    shard: int  # ZeRO's shard group, dp_shard × cp

    @classmethod
    def of(cls, cfg: Config, args: ModelArgs) -> "StepShape":
        p, t = cfg.parallel, cfg.train
        c = BYTES[t.precision]
        r = 4 if (t.reduce_fp32 and c == 2) else c
        n = t.micro_batch * t.seq_len // p.cp
        return cls(cfg, args, c, r, wide(c), n, n / p.tp if p.sp else n, p.dp_shard * p.cp)

    @property
    def tp(self) -> int:
        return self.cfg.parallel.tp

    def saved_by_mode(self, mode: str, layer: int = 0) -> float:
        """Block `layer`'s saved bytes for one micro-batch under a recompute mode (none,
        selective, full); a bf16/fp16 MoE router also keeps its weight widened to fp32."""
        moe = self.args.is_moe_layer(layer)
        cache = self.__dict__.setdefault("_saved", {})
        if (mode, moe) not in cache:
            p, a = self.cfg.parallel, self.args
            cache[(mode, moe)] = block_bytes_per_token(a, self.c, self.tp, p.sp, mode, p.cp, p.cp_impl, moe,
                                                       p.ep) * self.n
            if moe and mode != "full" and self.c < wide(self.c):
                cache[(mode, moe)] += wide(self.c) * a.moe_experts * a.dim
        return cache[(mode, moe)]

    def block_saved(self, layer: int) -> float:
        return self.saved_by_mode(recomputed(self.cfg.train.recompute, layer), layer)

    def block_full(self, layer: int) -> float:
        return self.saved_by_mode("none", layer)

    def slots(self) -> float:
        """Expert rows this rank runs per micro-batch in an MoE block (k per routed token)."""
        return self.n / self.tp * self.args.moe_top_k

    def rerun_kept(self, layer: int) -> float:
        """What a recomputed region's second run keeps until the region's backward is over:
        a whole block's saved tensors but its input (full), or the attention core's (selective:
        rotated q and k, the softmax statistics, the kernel's output; v is its input)."""
        mode = recomputed(self.cfg.train.recompute, layer)
        if mode == "full":
            return self.block_full(layer) - self.block_saved(layer)
        if mode == "selective":
            a, p = self.args, self.cfg.parallel
            q, kv = a.n_heads * a.head_dim / p.tp, kv_width(a, p.tp)
            return (self.c * (2 * q + kv) + wide(self.c) * a.n_heads / p.tp) * self.n
        return 0.0

    def weight_gradient(self, layer: int = 0) -> float:
        """The largest weight gradient of a block, before it is accumulated (an MoE block: one
        stacked gradient of the rank's E/ep experts)."""
        a = self.args
        if a.is_moe_layer(layer):
            return self.c * a.moe_experts // self.cfg.parallel.ep * a.dim * a.expert_dim
        return self.c * a.dim * a.ffn_dim / self.tp

    def block_working(self, layer: int = 0) -> float:
        """A block's backward at its widest, beside the incoming gradient: the down
        projection's backward (the gradient of SwiGLU's product and of its weight), or the
        product's (that gradient and the two it makes, of silu(gate) and of up); an MoE block
        the same over its slots and the expert width, plus the gradient of the slots' rows."""
        a, c, n = self.args, self.c, self.n
        if a.is_moe_layer(layer):
            rows = self.slots()
            f = rows * a.expert_dim
            return c * a.dim * (n + rows) + max(c * f + self.weight_gradient(layer), 3 * c * f)
        f = a.ffn_dim / self.tp
        return c * a.dim * n + max(c * f * n + self.weight_gradient(layer), 3 * c * f * n)

    def block_forward_working(self) -> float:
        """The end of a block's forward: the attention branch's output (a local variable
        until the block returns), the MLP's row-parallel output before it joins the residual
        stream, under TP its copy for the all-reduce or reduce-scatter, under SP that one's
        output."""
        h = self.c * self.args.dim
        sp = self.cfg.parallel.sp
        return h * self.n_res + h * self.n * (2 if self.tp > 1 else 1) + (h * self.n_res if sp else 0.0)

    def incoming_gradient(self) -> float:
        """The gradient a block's backward starts from; under SP also its gather over the
        sequence (the backward of the block's last reduce-scatter)."""
        h = self.c * self.args.dim
        return h * self.n_res + (h * self.n if self.cfg.parallel.sp else 0.0)

    def attention_working(self, backward: bool) -> float:
        """Context parallelism's attention at its widest, beyond what it saves. Its blocks run
        on fused attention ops (parallel/context/fused.py), which hold no scores; what counts
        is the copies around them. The ring: the queries (and in backward the output and
        its gradient) in head layout, the K/V it holds and the ones arriving, the running
        output (fp32) with a merge's temporaries, and in backward the dq accumulator and
        three K/V gradient accumulators (its own, the one arriving, the one it sent).
        All-gather: every rank's K/V twice while they are put in sequence order, then the
        blocks; in backward the K/V gradients of the whole sequence, twice while they go
        back to rank order. Ulysses (a fused kernel over the whole sequence for cp's heads)
        holds the all-to-all buffers of q, k, v. 0 without context parallelism."""
        p = self.cfg.parallel
        if p.cp == 1:
            return 0.0
        a, c, w, n, cp = self.args, self.c, wide(self.c), self.n, p.cp
        q, kv, heads = a.n_heads * a.head_dim / p.tp, kv_width(a, p.tp), a.n_heads / p.tp
        if p.cp_impl == "ulysses":
            kv_heads = kv // a.head_dim
            kv = (kv_heads if kv_heads % cp == 0 else cp) * a.head_dim
            return 3 * c * (q + 2 * kv) * n
        widen = w * q * n if c != w else 0.0  # a block's output widened to fp32
        if p.cp_impl == "allgather":
            if backward:
                grads = 2 * w * kv * n * cp
                blocks, back = c * q * n / 2 + 2 * c * kv * n * cp, grads + 2 * w * kv * n  # to rank order
                return 3 * c * q * n + w * q * n + grads + max(blocks, back)
            blocks = 2 * c * q * n + widen + w * heads * n + 4 * w * q * n
            return max(4 * c * kv * n * cp, blocks)
        held = (4 if cp > 2 else 2) * c * kv * n  # the K/V of a later step, and the next ones arriving
        if backward:
            first = c * q * n + 6 * c * kv * n + 2 * w * kv * n
            later = held + 6 * w * kv * n + max(c * q * n + c * kv * n, c * q * n / 2 + 2 * c * kv * n)
            return 3 * c * q * n + w * q * n + max(first, later)
        return 2 * c * q * n + held + widen + w * heads * n + 4 * w * q * n

    def mlp_saved(self, layer: int) -> float:
        """The MLP's part of a block's saved bytes, freed when the MLP's backward ends (none
        for a recomputed block: its rerun's tensors stay until the block's backward ends)."""
        if recomputed(self.cfg.train.recompute, layer) == "full":
            return 0.0
        p = self.cfg.parallel
        return llama_mlp_bytes_per_token(self.args, self.c, self.tp, p.sp, self.args.is_moe_layer(layer), p.ep) * self.n

    def split_kept(self, layer: int = 0) -> float:
        """Zero bubble: the gradients B leaves at the split nodes for W, per block: the
        outputs' gradients of wq, wk, wv, wo, w1, w3, w2 (an MoE block: the router's and the
        experts', over its slots) and the two norm weights."""
        a, tp = self.args, self.tp
        if a.is_moe_layer(layer):  # the router's output, the experts' (w1, w3, w2) over the slots
            mlp = a.moe_experts / tp + self.slots() / self.n * (2 * a.expert_dim + a.dim)
        else:
            mlp = 2 * a.ffn_dim / tp + a.dim
        return self.c * self.n * (a.dim / tp + 2 * kv_width(a, tp) + a.dim + mlp) + self.c * self.n_res * 2 * a.dim

    def vocab_local(self) -> int:
        return padded_vocab(self.args, self.tp) // self.tp


def _loss_forward(s: StepShape) -> tuple[float, float]:
    """(the most the loss holds while it runs forward, what it keeps for backward). The loss
    works in fp32 (fp64 in fp64): w bytes per value."""
    v, n, c, w = s.vocab_local(), s.n, s.c, wide(s.c)
    copy = w * v * n if c != w else 0  # the widened copy of low-precision logits
    if s.tp > 1:  # vocab-parallel: logits, (masked), widened shifted logits → softmax kept
        masked = c * v * n if v * s.tp != s.args.vocab_size else 0
        return c * v * n + masked + copy + w * v * n, w * v * n
    return c * v * n + copy + w * v * n, w * v * n  # logits, log-softmax kept


def _loss_backward(s: StepShape) -> float:
    """On top of what the loss kept: cross-entropy's gradient and log-softmax's."""
    v, n, c, w = s.vocab_local(), s.n, s.c, wide(s.c)
    if s.tp > 1:  # in place on the kept softmax; cast back to the compute dtype
        return c * v * n if c != w else 0.0
    return 2 * w * v * n


@dataclass(frozen=True)
class Unit:
    """One ZeRO unit on this rank (a block, or a chunk's root): the elements of its flat
    buffers (padded to their shard groups), of this rank's shards of them, and of the linear
    layers' weights among them (fp8 all-gathers carry those in one byte)."""

    full: int
    shard: float
    linear: int = 0


class Units:
    """ZeRO's units on this rank: dense flats sharded over dp_shard × cp, routed experts over
    dp_shard·cp/ep (parallel/zero.py)."""

    def __init__(self, s: StepShape, chunks: list[Chunk]):
        p = s.cfg.parallel
        n, ne = s.shard, max(s.shard // p.ep, 1)
        pad = lambda x, k: -(-x // k) * k  # noqa: E731 - flat buffers are padded to the shard group
        self.block = {}
        for i in (i for ch in chunks for i in ch.layer_ids):
            dense, experts = pad(block_local(s.args, s.tp, i), n), pad(block_experts(s.args, i, p.ep), ne)
            split, whole = block_weight_groups(s.args, s.tp, i)
            linear = sum(k for k, matrix in split if matrix) + block_experts(s.args, i, p.ep)
            self.block[i] = Unit(dense + experts, dense / n + experts / ne, linear)
        self.root = {ch.index: Unit(pad(root_local(s.args, ch, s.tp), n), pad(root_local(s.args, ch, s.tp), n) / n)
                     for ch in chunks}

    def blocks(self, ch: Chunk) -> Unit:
        """All of a chunk's blocks together."""
        units = [self.block[i] for i in ch.layer_ids]
        return Unit(sum(u.full for u in units), sum(u.shard for u in units), sum(u.linear for u in units))


class Replay:
    """One step of one pipeline rank, action by action (see the module docstring)."""

    def __init__(self, cfg: Config, args: ModelArgs, rank: int, chunks: list[Chunk], fp8=None):
        self.cfg, self.args = cfg, args
        self.s = s = StepShape.of(cfg, args)
        p, t = cfg.parallel, cfg.train
        self.units = Units(s, chunks)
        self.z3 = p.zero == 3
        # ZeRO-2/3 under a pipeline defer: a chunk's gradients accumulate until its last
        # backward pass of the step, and ZeRO-3 keeps its units gathered until the step ends
        self.defer = p.zero >= 2 and p.pp > 1
        self.keep_gathered = self.z3 and not p.reshard_after_forward and not self.defer
        m = t.accumulation(p.dp)
        self.chunks = {ch.index: ch for ch in chunks}
        if p.pp > 1:
            orders = compute_orders(p.pp_schedule, p.pp, p.pp_virtual, m)[rank]
        else:  # micro-batches run one after another: the first, the second (ZeRO-2/3 shards
            # exist by then) and the last (which reduces) are the ones that differ
            orders = [[Action(kind, 0, i)] for i in sorted({0, min(1, m - 1), m - 1}) for kind in (F, B)]
        self.actions = [a for tick in orders for a in tick]
        # zero bubble: the backwards split into B and W (DualPipeV splits only some); `split`
        # says whether the backward being replayed is one of them
        self.split_keys = {(a.chunk, a.micro) for a in self.actions if a.kind == W}
        # of them, those the executor defers (lists.deferred: the first chunk's, a V's turn's):
        # B does nothing and W the whole backward, so nothing waits at split nodes in between
        self.deferred = deferred_backwards(p.pp_schedule, p.pp, p.pp_virtual, m, rank) if self.split_keys else frozenset()
        self.split = False
        self.last_backward = {a.chunk: k for k, a in enumerate(self.actions) if a.kind in (B, W)}
        self.book = Ledger()
        self.held: dict[tuple[int, int], float] = {}  # (chunk, micro) → saved bytes not yet freed
        self.handed: dict[tuple[int, int], float] = {}  # (chunk, micro) → its input gradient from this rank
        self.passes: Counter = Counter()  # backward passes per chunk (ZeRO-2/3 keep shards after the first)
        self.kept = 0.0  # ZeRO-3 units kept gathered from forward to backward
        self.fp8 = fp8
        self.this_step: set = set()  # units whose step-long buffers exist (deferred ZeRO-2/3)
        self.unresolved = 0.0  # ZeRO-2/3: what the last reduction holds until the next one starts
        self.hidden = s.c * args.dim * s.n_res  # one hidden state of the residual stream

    def run(self) -> Ledger:
        for k, a in enumerate(self.actions):
            self.book.in_flight = len(self.held) + (a.kind == F)
            if a.kind != F and (a.chunk, a.micro) in self.deferred:  # B nothing, W the whole backward
                if a.kind == W:
                    self.backward(a, k, whole=True)
                continue
            {F: self.forward, B: self.backward, W: self.weights}[a.kind](a, k)
        return self.book

    def turns(self, chunk: int) -> bool:
        """Whether the chunk after `chunk` is on the same rank (a V's turn): its output is the
        next chunk's input, which that chunk's first block saves (counted there, not as a
        message); the input gradient coming back is held until the chunk's last backward."""
        p = self.cfg.parallel
        return owner(chunk, p.pp, vshape(p.pp_schedule)) == owner(chunk + 1, p.pp, vshape(p.pp_schedule))

    # -- sizes ----------------------------------------------------------------------------
    def gathered(self, unit: Unit) -> float:
        """Bytes of one gathered unit: the compute dtype; under fp8 its linear weights' fp8
        copies too (they live while the unit is gathered), or only those when the weights
        travel in fp8 (`train.fp8_all_gather`)."""
        c, fp8 = self.s.c, self.fp8
        linear = c if fp8 is None else (1.0 if fp8.all_gather else c + 1.0)
        return c * (unit.full - unit.linear) + linear * unit.linear

    def gathered_units(self, ch: Chunk) -> tuple[float, float]:
        """ZeRO-3: bytes of the chunk's largest gathered block and of its gathered root (0 when
        they stay gathered for the whole step: the ledger holds them then)."""
        if not self.z3 or self.defer:
            return 0.0, 0.0
        return max(self.gathered(self.units.block[i]) for i in ch.layer_ids), self.gathered(self.units.root[ch.index])

    def gathered_in_backward(self, ch: Chunk, remaining: int) -> float:
        """The root, the current block and the one before it (prefetched), or, kept gathered
        since forward, the root and the blocks not yet done."""
        block_g, root_g = self.gathered_units(ch)
        return root_g + (remaining if self.keep_gathered else min(remaining, 2)) * block_g

    def once_this_step(self, unit, what: str, nbytes: float) -> None:
        """Allocate a buffer that then lives until the step ends, the first time only."""
        if unit not in self.this_step:
            self.this_step.add(unit)
            self.book.add(what, nbytes)

    def reduce_buffers(self, last: bool) -> tuple[float, tuple[float, float]]:
        """Bytes of the gradient buffers of a backward pass, per element of a unit's full buffers
        (and of its shards): (from a unit's first gradient: ZeRO-2/3's full accumulator, in the
        accumulation dtype; from its completion, on the pass that reduces: the reduce-scatter's
        output (per shard element) and, when the accumulation and reduction dtypes differ, the
        converted copy; DP: that copy of the bucket)."""
        zero, r, g = self.cfg.parallel.zero, self.s.r, self.s.g
        convert = r if r != g else 0.0
        if zero >= 2:
            return g, (convert - (g if convert else 0.0), r) if (last or not self.defer) else (0.0, 0.0)
        if not last:
            return 0.0, (0.0, 0.0)
        return 0.0, (convert, r if zero == 1 else 0.0)

    def _release(self, key) -> None:
        """The last backward of (chunk, micro): its saved tensors go, and a handed-over gradient."""
        self.book.add(SAVED, -self.held.pop(key))
        self.book.add("input gradients", -self.handed.pop(key, 0.0))

    def _keep(self, key, n: float) -> None:
        self.book.add(SAVED, n)
        self.held[key] += n

    # -- actions --------------------------------------------------------------------------
    def forward(self, a: Action, k: int) -> None:
        s, ch, key, book = self.s, self.chunks[a.chunk], (a.chunk, a.micro), self.book
        block_g, root_g = self.gathered_units(ch)
        if self.z3 and self.defer:  # gathered at the chunk's first forward, kept until the step ends
            self.once_this_step(("gathered", ch.index), "gathered parameters",
                                self.gathered(self.units.blocks(ch)) + self.gathered(self.units.root[ch.index]))
        if self.fp8 is not None and not self.z3:  # the step's fp8 copies of the block weights
            p = self.cfg.parallel
            self.once_this_step(("fp8", ch.index), "fp8 weight copies",
                                self.fp8.copy_bytes(self.args, ch.layer_ids, p.tp, p.ep))
        self.held[key] = 0.0
        if not ch.embed and s.c != wide(s.c):  # the received input; widened, it is the first block's input
            self._keep(key, self.hidden)
        for i in ch.layer_ids:
            book.moment(gathered_parameters=self.kept + root_g + 2 * block_g,
                        working=s.attention_working(backward=False))
            self._keep(key, s.block_saved(i))
            if self.keep_gathered:
                self.kept += block_g
        if ch.head:
            head = head_bytes_per_token(self.args, s.c, s.tp, self.cfg.parallel.sp) * s.n
            running, kept = _loss_forward(s)
            mtp = mtp_inputs(self.args, s.c) * s.n + s.block_saved(self.args.n_layers - 1) + head  # model/mtp.py
            for saved in [head] + [mtp] * self.args.mtp_depth:  # the head and loss, then each MTP module's
                self._keep(key, saved)
                book.moment(gathered_parameters=self.kept + root_g, loss=running)
                book.add("loss", kept)
        elif not self.turns(ch.index):  # the output sent on: the executor keeps the send until the step ends
            book.add("pipeline messages", self.hidden)
        if self.keep_gathered:
            self.kept += root_g

    def weights(self, a: Action, k: int) -> None:
        """Zero bubble's W: autograd resumed at each split node, deepest first (the embedding,
        then the blocks in forward order, then the head): the gradient buffers fill unit by
        unit, each node's kept gradient goes when its weights are done, the graph (retained
        until then) at the end."""
        s, ch, key, book = self.s, self.chunks[a.chunk], (a.chunk, a.micro), self.book
        first, launched = self.reduce_buffers(self.last_backward[a.chunk] == k)
        root, staged = self.units.root[ch.index], 0.0
        self.unresolved = 0.0
        if ch.embed:
            staged += self._first_gradient((ch.index, "root"), root, first)
            book.moment(working=self.embedding_gradient(), gradient_buffers=staged)
        for i in ch.layer_ids:
            staged += self._first_gradient((ch.index, i), self.units.block[i], first)
            book.moment(working=s.weight_gradient(i), gradient_buffers=staged)
            self._keep(key, -s.split_kept(i))
            staged += self._launch(ch, self.units.block[i], first, launched)
        if ch.head and not ch.embed:
            staged += self._first_gradient((ch.index, "root"), root, first)
            book.moment(working=s.c * s.vocab_local() * self.args.dim, gradient_buffers=staged)
        staged += self._launch(ch, root, first, launched)
        self._release(key)
        self._after_reduction(ch)

    def _first_gradient(self, key, unit: Unit, first: float) -> float:
        """A unit's first gradient of a pass: its accumulator (ZeRO-2/3). Returns the bytes
        the pass frees when it ends; a deferred accumulator lives until the step ends."""
        if not first:
            return 0.0
        if self.defer:
            self.once_this_step(("accumulator", key), "gradient buffers", first * unit.full)
            return 0.0
        return first * unit.full

    def _launch(self, ch: Chunk, unit: Unit, first: float, launched: tuple[float, float]) -> float:
        """A unit's reduction starts; returns the change in this pass's gradient buffers
        (ZeRO-2/3): its reduction's output arrives, and the unit reduced before it is waited
        for: its full-size input goes, its slice stays (the first pass; the shard it becomes,
        counted when the pass ends) or is added into the shard and goes (a later pass). DP's,
        ZeRO-1's and a deferred stage's buffers wait for finish(), when the step ends."""
        out = launched[0] * unit.full + launched[1] * unit.shard
        if self.cfg.parallel.zero <= 1 or self.defer:
            self.book.add("gradient buffers", out)
            return 0.0
        kept = self.s.g * unit.shard if not self.passes[ch.index] else 0.0
        freed, self.unresolved = self.unresolved, first * unit.full + out - kept
        return out - freed

    def _after_reduction(self, ch: Chunk) -> None:
        """ZeRO-2/3: the first pass leaves each unit's reduced slice (in the accumulation dtype)."""
        s = self.s
        if self.cfg.parallel.zero >= 2 and not self.defer and not self.passes[ch.index]:
            self.book.add("gradient shards", s.g * (self.units.blocks(ch).shard + self.units.root[ch.index].shard))
        self.passes[ch.index] += 1

    def embedding_gradient(self) -> float:
        """The embedding's weight gradient and the gradient arriving at it."""
        s = self.s
        return s.c * s.vocab_local() * self.args.dim + s.c * self.args.dim * s.n

    def backward(self, a: Action, k: int, whole: bool = False) -> None:
        """One backward pass of one micro-batch through one chunk (B; under zero bubble the
        input gradients only: the weights' come in W; `whole`: the whole one, whatever the
        list says)."""
        s, ch, key, book = self.s, self.chunks[a.chunk], (a.chunk, a.micro), self.book
        self.split = key in self.split_keys and not whole
        first, launched = self.reduce_buffers(self.last_backward[a.chunk] == k)
        if self.split:
            first, launched = 0.0, (0.0, 0.0)
        units, root = self.units, self.units.root[ch.index]
        staged = 0.0  # gradient buffers this pass frees when it ends
        self.unresolved = 0.0
        if ch.head:
            staged += self._first_gradient((ch.index, "root"), root, first)
            self._head_backward(ch, key, staged)
        for done, i in enumerate(reversed(ch.layer_ids)):
            staged += self._first_gradient((ch.index, i), units.block[i], first)
            now = self.gathered_in_backward(ch, len(ch.layer_ids) - done)
            mode = recomputed(self.cfg.train.recompute, i)
            rerun = s.rerun_kept(i)
            if mode == "full":  # the block's forward again, then its backward: the rerun stays throughout
                book.moment(gathered_parameters=now, gradient_buffers=staged, recompute=rerun,
                            working=max(s.block_forward_working(), s.attention_working(False)) + s.incoming_gradient())
            book.moment(gathered_parameters=now, gradient_buffers=staged, recompute=rerun if mode == "full" else 0.0,
                        working=s.block_working(i))
            # attention's backward comes after the MLP's, whose saved tensors are gone by then (a
            # recomputed block's rerun keeps them until it ends); selective reruns the core here
            attention = s.incoming_gradient() - s.mlp_saved(i)
            if mode == "selective":
                book.moment(gathered_parameters=now, gradient_buffers=staged, recompute=rerun,
                            working=s.attention_working(False) + attention)
            if s.attention_working(True):
                book.moment(gathered_parameters=now, gradient_buffers=staged, recompute=rerun,
                            working=s.attention_working(True) + attention)
            if not self.split:
                self._keep(key, -s.block_saved(i))
            staged += self._launch(ch, units.block[i], first, launched)
        if ch.embed:
            if not ch.head:
                staged += self._first_gradient((ch.index, "root"), root, first)
            if not self.split:
                book.moment(gathered_parameters=self.gathered_in_backward(ch, 0), gradient_buffers=staged,
                            working=self.embedding_gradient())
        staged += self._launch(ch, root, first, launched)
        book.moment(gathered_parameters=self.gathered_in_backward(ch, 0), gradient_buffers=staged)
        if self.split:  # zero bubble: the graph stays for W, with the gradients kept at the split nodes
            # and what recomputed regions ran again
            self._keep(key, sum(s.split_kept(i) + s.rerun_kept(i) for i in ch.layer_ids))
        else:
            self._release(key)
            self._after_reduction(ch)
        if ch.index > 0 and not self.turns(ch.index - 1):
            book.add("pipeline messages", self.hidden)  # the input's gradient, sent and kept
        elif ch.index > 0:  # a V's turn: handed to the chunk before (`turns`)
            self.handed[(ch.index - 1, a.micro)] = self.hidden
            book.add("input gradients", self.hidden)
        if self.keep_gathered:
            self.kept = 0.0  # the end of a backward pass reshards every unit

    def _head_backward(self, ch: Chunk, key, root_buffer: float) -> None:
        """The loss's gradient (before any hook gathers anything), then the head's, whose
        weight gradient lands in `root_buffer` (this pass's gradient buffers so far)."""
        s, book = self.s, self.book
        c, v = s.c, s.vocab_local()
        kept = _loss_forward(s)[1]
        book.moment(gathered_parameters=self.kept, loss=_loss_backward(s))
        book.add("loss", -kept * (1 + self.args.mtp_depth))  # the head's and each MTP module's (forward)
        if self.split:  # W still needs the loss's kept tensors and the logits' gradient (under TP: the same)
            self._keep(key, kept)
        now = self.gathered_in_backward(ch, len(ch.layer_ids))
        book.moment(gathered_parameters=now, working=c * v * s.n + c * v * self.args.dim)
        book.moment(gathered_parameters=now, gradient_buffers=root_buffer, working=c * v * self.args.dim)
        if self.split:
            self._keep(key, c * v * s.n if (s.tp == 1 or c != wide(c)) else 0.0)
        else:
            self._keep(key, -head_bytes_per_token(self.args, c, s.tp, self.cfg.parallel.sp) * s.n)


def replay(cfg: Config, args: ModelArgs, rank: int, chunks: list[Chunk], fp8=None) -> Ledger:
    """The activation peak of pipeline rank `rank` over one step."""
    return Replay(cfg, args, rank, chunks, fp8).run()


def per_rank(cfg: Config, args: ModelArgs, fp8=None) -> list[RankMemory]:
    """Memory of every pipeline stage (all ranks of a stage hold the same)."""
    p = cfg.parallel
    out = []
    for rank, chunks in enumerate(stage_chunks(cfg, args)):
        psi = stage_params(cfg, args, chunks)
        states = stage_states(cfg, args, chunks)
        book = replay(cfg, args, rank, chunks, fp8)
        s = StepShape.of(cfg, args)
        layers = [i for ch in chunks for i in ch.layer_ids]
        by_mode = {mode: sum(s.saved_by_mode(mode, i) for i in layers) for mode in ("none", "selective", "full")}
        out.append(RankMemory(rank, psi, states["params"], states["grads"], states["optimizer"],
                              book.peak, book.at_peak, p.zero <= 1, book.in_flight_at_peak, by_mode))
    return out
