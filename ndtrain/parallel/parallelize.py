"""From a plain model to this rank's share of an N-D layout.

`build(args, mesh, cfg)` builds the single-device model (or, under pipeline parallelism,
only this rank's chunks), gives it the same initial weights every layout gives it, applies
each dimension's transformation in a fixed order and returns a `Parallelized`: the local
module plus the objects that run a step's forward and backward on it. The trainer's step
(train/step.py) only talks to `Parallelized`, so adding a dimension changes this file and
that dimension's module, never the trainer.

Order of the transformations (each one is a no-op when its dimension has size 1):
1. tensor/sequence parallel module swaps   (parallel/tensor.py)
2. context-parallel attention cores        (parallel/context/); without cp, gpt-oss's
   attention sinks on the fused ops        (parallel/context/sinks.py)
3. MoE blocks: token split, this rank's experts, all-to-all dispatch (parallel/expert.py)
   then, under train.precision = fp8, the block linears' fp8 matmuls (parallel/fp8.py);
   with LoRA (model/lora.py) every parameter but the adapters' is frozen here, so the
   gradient synchronisation below gives the base weights no buffer and no optimizer state
4. regional compilation of each block      (parallel/compile.py, train.compile), then the
   activation recomputation wrappers around it (parallel/recompute.py)
5. gradient synchronisation over dp × cp (expert weights: over edp): DP buckets
   (parallel/data.py) or ZeRO (parallel/zero.py), each with the compute dtype and fp32
   masters of parallel/precision.py
6. the schedule: one stage, or a pipeline  (parallel/pipeline/)

Who holds the model states is `Parallelized.states`: `states.ReplicatedStates` (zero = 0:
the model's own parameters, plus fp32 masters under mixed precision) or `zero.ZeRO` (flat
shards). The optimizer updates `states.optim_params()`, clipping measures their gradients,
and checkpoints and the memory report read the states through the same few methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ndtrain.comm import ops
from ndtrain.config import Config
from ndtrain.data.batch import MicroBatch
from ndtrain.deferred import Lazy
from ndtrain.mesh import ParallelMesh
from ndtrain.model.args import ModelArgs
from ndtrain.model.llama import Transformer
from ndtrain.model.lora import freeze_base
from ndtrain.model.loss import TokenLoss, token_nll, weighted_sum
from ndtrain.model.moe import RoutingLog
from ndtrain.model.mtp import MTPStep
from ndtrain.parallel import context, expert, fp8, tensor
from ndtrain.parallel.context import sinks as context_sinks
from ndtrain.parallel.compile import compile_blocks, compile_loss
from ndtrain.parallel.construct import initializer, materialize
from ndtrain.parallel.data import DataParallel, GradSyncs
from ndtrain.parallel.pipeline.executor import PipelineSchedule
from ndtrain.parallel.pipeline.schedules import vshape
from ndtrain.parallel.pipeline.stage import StageModel, TiedEmbedding, build_chunks, gather_stages
from ndtrain.parallel.precision import MasterWeights, cast_parameters, compute_dtype, has_masters, reduce_dtype
from ndtrain.parallel.recompute import apply_recompute
from ndtrain.parallel.schedule import GradSync, SingleStage
from ndtrain.parallel.states import ReplicatedStates
from ndtrain.parallel.zero import ZeRO

@dataclass
class Parallelized:
    """This rank's model and the machinery of one forward and backward on it."""

    model: nn.Module
    mesh: ParallelMesh
    grad_sync: GradSync
    schedule: SingleStage | PipelineSchedule
    states: ReplicatedStates | ZeRO
    loss_fn: TokenLoss
    # MoE models: the step's routing statistics and the routers' bias update
    balance: expert.LoadBalance | None = None
    # elements of initial values this rank computed (its shard: parallel/construct.py)
    initialised: int = 0
    # run.fault_tolerance = "replicas": sums the synchronised gradients (and the step's
    # loss) with the other replica groups' (replicas/run.py), where HSDP or DP would sum
    # them over dp_replicate: before the TP partial sums and the copy to the masters.
    across_replicas: Callable[[torch.Tensor], None] | None = None
    # multi-token prediction (model/mtp.py): train.mtp_weight, and the last step's mtp_loss
    mtp_weight: float | None = None
    mtp_loss: torch.Tensor | None = None

    def forward_backward(self, micro_batches: list[MicroBatch], n_targets: float | torch.Tensor,
                         unscale: float = 1.0) -> torch.Tensor:
        """Forward and backward of every micro-batch (each loss divided by `n_targets`, the
        step's global target count), gradients synchronised over every dimension and handed
        to the optimizer's tensors in fp32, times `unscale`. Returns this rank's share of the
        token loss. MoE models add their balance loss to the objective and leave the step's
        routing statistics in `routing_stats` (collective)."""
        routing = self.balance.log() if self.balance is not None else None
        if self.mtp_weight is not None:  # its losses join the objective through the step's log
            if self.mesh.shape.cp > 1 and micro_batches[0].mtp_tokens is None:  # a position's tokens ahead
                raise ValueError("multi-token prediction under context parallelism reads the batch's lookahead: "
                                 "shard it with context.shard(..., mtp_depth)")
            routing = routing if routing is not None else RoutingLog()
            routing.mtp = MTPStep(self.loss_fn, self.mtp_weight)
        local = self.schedule.run(micro_batches, n_targets, self.grad_sync, routing)
        if self.across_replicas is not None:
            self.across_replicas(local)
        if self.mtp_weight is not None:  # Σ over modules / depth, per target, summed over the ranks
            sums = routing.mtp.sums  # none on a pipeline stage without the head: 0 there
            local = sum(sums.values(), torch.zeros((), dtype=torch.float64, device=self.mesh.device))
            self.mtp_loss = self.reduce_loss(local * unscale / (max(len(sums), 1) * n_targets))  # fp16: unscaled
        tp = self.mesh.group("tp")
        if tp.active:  # once per step: the sum of gradients each tp rank holds a part of
            tensor.sum_partial_grads(self.states.partial_grads("tp"), tp)
        self.states.grads_to_optimizer(unscale)
        if self.balance is not None:
            self.balance.reduce(routing, n_targets / unscale)
        return local

    @property
    def routing_stats(self) -> Lazy | None:
        """Per MoE block, the last step's loads, max violation, dead experts, balance loss: a
        dict once read (`ndtrain.deferred`: with the step's record, or `.value()`)."""
        return self.balance.stats if self.balance is not None else None

    def after_step(self) -> None:
        """After an applied optimizer step: the routers' bias update (MoE)."""
        if self.balance is not None:
            self.balance.update_bias()

    def evaluate(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        return self.schedule.evaluate(micro_batches)

    def logprobs(self, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        """log p(target) [b, s] at every position of every micro-batch (0 where the target is
        IGNORE), forward only, on every rank (under pipeline parallelism the last stage's,
        broadcast). What RL compares with its rollout's log-probabilities."""
        return self.schedule.logprobs(micro_batches)

    def reduce_loss(self, local: torch.Tensor) -> torch.Tensor:
        """The step's loss from each rank's share: summed over dp × cp, and over pp, where
        only the last stage holds a loss. On the device (fp64): reading it is a host sync."""
        total = ops.all_reduce_bookkeeping(local.detach().double(), self.mesh.group("dp_cp"))
        return ops.all_reduce_bookkeeping(total, self.mesh.group("pp"))

    def full_model_state(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights on rank 0 (None elsewhere). Collective: over the
        ZeRO-3 shards, then over tp on the first data-parallel replica, then over pp
        (every stage sends its weights to rank 0)."""
        return self._whole(self.states.gathered_state())

    def full_grad_state(self) -> dict[str, torch.Tensor] | None:
        """The whole model's gradients as the optimizer receives them (summed over every
        dimension, before clipping), by name, on rank 0; None elsewhere. Collective, like
        `full_model_state`. What the layout proofs compare after the first step."""
        return self._whole(self.states.gathered_grads())

    def _whole(self, state: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
        """From the states gathered over dp_shard × cp (on its rank 0) to the whole model:
        experts gathered over ep, tensor-parallel shards over tp, stages over pp."""
        state = expert.gather_experts(self.model, state, self.mesh)
        if self.mesh.coord("dp_cp") != 0:
            return None
        state = tensor.full_state(self.model, state, self.mesh.group("tp"))
        if self.mesh.shape.pp > 1:
            return gather_stages(self.model, state, self.mesh)
        return state if self.mesh.rank == 0 else None


def build_model(args: ModelArgs, seed: int, device: torch.device, layer_ids=None, embed: bool = True,
                head: bool = True) -> Transformer:
    model = Transformer(args, layer_ids, embed, head)
    model.init_weights(seed)
    return model.to(device)


def decoder(args: ModelArgs, mesh: ParallelMesh, cfg: Config):
    """`make(layer_ids, embed, head)`: this rank's share of (part of) the decoder, laid out
    on the meta device: tensor-parallel modules when tp > 1, context-parallel attention when
    cp > 1, MoE blocks placed and split (parallel/expert.py); parallel/construct.py gives
    the parameters memory and the values every layout starts from."""
    tp, cp = mesh.group("tp"), mesh.group("cp")
    if args.lora_tokens and (tp.active or mesh.shape.pp > 1):  # the command refuses it (config/lora.py)
        raise ValueError("LoRA's trained token rows (model/lora.TokenRows) are not split over tp or pp")
    nv, tail = fp8.options(cfg.train, args.n_layers, mesh.dp_size)  # one rounding state for every chunk of this rank

    def make(layer_ids=None, embed: bool = True, head: bool = True) -> Transformer:
        if tp.active:
            model = tensor.build(args, tp, cfg.parallel.sp, layer_ids, embed, head)
        else:
            with torch.device("meta"):
                model = Transformer(args, layer_ids, embed, head)
        if cp.active:
            context.apply(model, cp, cfg.parallel.cp_impl, tp if tp.active and cfg.parallel.sp else None)
        elif args.attn_sinks:  # gpt-oss's sinks on the fused ops (context parallelism folds them itself)
            context_sinks.apply(model)
        expert.parallelize(model, mesh, cfg.parallel.sp)
        if fp8.recipe_of(cfg.train):
            fp8.apply(model, mesh, fp8.recipe_of(cfg.train), None, nv, tail)
        if args.lora_rank:  # only the adapters train: no gradient, buffer or optimizer state for the rest
            freeze_base(model)
        return model
    return make


def materialized(model: Transformer, args: ModelArgs, mesh: ParallelMesh, cfg: Config) -> Transformer:
    """A model `decoder` laid out (a chunk, outside any layout: anchors for tests and
    benchmarks), given memory and its initial values on the mesh's device."""
    materialize(model, initializer(model, args, cfg.train.seed, mesh.group("tp"), mesh.device), mesh.device)
    model.reset_rope(mesh.device)
    expert.materialize_buffers(model, mesh.device)
    return model


def build(args: ModelArgs, mesh: ParallelMesh, cfg: Config, objective: Callable = weighted_sum) -> Parallelized:
    """`objective(nll, micro_batch)`: the task's half of the loss (model/loss.TokenLoss)."""
    t, p = cfg.train, cfg.parallel
    tp = mesh.group("tp")
    nll = tensor.VocabParallelNLL(tp) if tp.active else token_nll
    if t.compile and not tp.active:  # the vocabulary-parallel loss's collectives stay eager
        nll = compile_loss(nll, t.compile_backend)
    loss_fn = TokenLoss(nll, objective, t.loss_chunk)
    pipelined = mesh.shape.pp > 1
    # The whole model, or under pipeline parallelism only this rank's chunks; module swaps
    # (tensor parallelism, in `decoder`) and recomputation wrappers apply to each chunk,
    # before StageModel gathers them under the full model's names for ZeRO or DP.
    make = decoder(args, mesh, cfg)
    chunks = build_chunks(args, mesh, cfg, make) if pipelined else {0: make()}
    for chunk in chunks.values():
        if t.compile:  # inside the recomputed regions: their second run is the same compiled code
            compile_blocks(chunk, t.compile_backend)
        apply_recompute(chunk, t.recompute)
    model = StageModel(chunks) if pipelined else chunks[0]
    # Everything so far lives on the meta device; now each rank materialises what it keeps.
    init = initializer(model, args, t.seed, tp, mesh.device)
    dtype, rdtype = compute_dtype(t.precision, t.fp8_base), reduce_dtype(t.precision, t.reduce_fp32, t.fp8_base)
    if p.zero:
        decoders = {f"chunk{c}": chunk for c, chunk in chunks.items()} if pipelined else None
        gathered_fp8 = fp8.weights(model) if t.fp8_all_gather else frozenset()
        states = grad_sync = ZeRO(model, mesh, p.zero, dtype, rdtype, init, p.reshard_after_forward,
                                  defer=pipelined, decoders=decoders, fp8_weights=gathered_fp8,
                                  muon=t.optimizer == "muon")
    else:
        materialize(model, init, mesh.device)
        masters = MasterWeights(list(model.parameters())) if has_masters(dtype) else None
        cast_parameters(list(model.parameters()), dtype)
        bucket_bytes = int(p.bucket_mb * 2**20)
        accum = torch.float32 if has_masters(dtype) else None  # gradients add up in fp32 under bf16/fp16
        dense, experts = expert.expert_params(p for p in model.parameters() if p.requires_grad)
        grad_sync = DataParallel(dense, mesh.group("dp_cp"), bucket_bytes, rdtype, accum)
        if experts:  # summed over the ranks holding the same experts
            grad_sync = GradSyncs([grad_sync, DataParallel(experts, mesh.group("edp"), bucket_bytes, rdtype, accum)])
        states = ReplicatedStates(model, grad_sync, masters)
    for chunk in chunks.values():
        chunk.reset_rope(mesh.device)
        expert.materialize_buffers(chunk, mesh.device)
    if pipelined:
        # the last stage's copy of the embedding: the tied head, or multi-token prediction's input
        # embedding (model/mtp.py); LoRA: a frozen embedding needs no sum
        tied_trains = (args.tie_embeddings or args.mtp_depth) and not args.lora_rank
        tied = TiedEmbedding(mesh, model, states.summed_grad, vshape(p.pp_schedule),
                             args.tie_embeddings) if tied_trains else None
        schedule = PipelineSchedule(chunks, mesh, p.pp_schedule, p.pp_virtual, loss_fn, tied)
    else:
        schedule = SingleStage(model, loss_fn)
    balance = expert.LoadBalance(model, args, mesh, t.moe_aux_loss, t.moe_bias_rate) if args.is_moe else None
    # multi-token prediction joins the token loss of pretraining and SFT (DPO and RL refuse it:
    # config/tasks.py)
    mtp_weight = t.mtp_weight if args.mtp_depth and objective is weighted_sum else None
    return Parallelized(model, mesh, grad_sync, schedule, states, loss_fn, balance, init.generated,
                        mtp_weight=mtp_weight)
