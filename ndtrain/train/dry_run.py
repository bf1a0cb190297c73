"""`ndtrain train --dry-run`: build the layout, measure a step's memory per rank, print it.

Every rank builds its share of the model exactly as training would, runs two steps (forward,
backward, optimizer) on random tokens of the configured shape, and reports the second, the
first steady one (observe/memory.py): parameters, gradients, optimizer state, the most the
forward and backward passes held on top of them, and the peak. Next to the measured model states stands what the
ZeRO formulas predict (parallel/zero.model_state_bytes). Nothing is written: no data is
prepared (the vocabulary is `model.vocab_size`, else the tokenizer's, else
`data.vocab_size`), no run directory is made.
"""

from __future__ import annotations


import torch

from ndtrain.config import Config, from_dict
from ndtrain.mesh import ParallelMesh
from ndtrain.model.llama import Transformer
from ndtrain.observe.memory import format_bytes, measure_peak, per_rank, storage_bytes
from ndtrain.parallel import fp8
from ndtrain.parallel.placement import is_expert
from ndtrain.parallel.precision import compute_dtype
from ndtrain.parallel.states import muon_matrix
from ndtrain.parallel.zero import model_state_bytes

COLUMNS = ("params", "grads", "optimizer", "activations", "peak")
EXPERT_COLUMNS = ("expert_params", "expert_grads", "expert_optimizer")


def vocab_size(cfg: Config) -> int:
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    if cfg.data.tokenizer:
        from ndtrain.data.tokenizer import TextTokenizer
        return TextTokenizer.load(cfg.data.tokenizer).vocab_size
    return cfg.data.vocab_size


def build_measured(args, mesh: ParallelMesh, cfg: Config):
    """`build` under the memory meter: (the layout, the most its construction allocated at
    once, the bytes of the model states it keeps: parameters, gradient buffers, masters)."""
    from ndtrain.parallel.parallelize import build

    with measure_peak(mesh.device) as built:  # meta construction, then only what this rank keeps
        par = build(args, mesh, cfg)
    states = par.states
    return par, built["bytes"], storage_bytes(states.param_tensors() + states.grad_tensors() + states.master_tensors())


def measure(cfg: Config, mesh: ParallelMesh) -> dict:
    """Two steps on random tokens; every rank's figures (collective)."""
    from ndtrain.data.batch import MicroBatch
    from ndtrain.parallel import context
    from ndtrain.train.step import TrainStep

    t = cfg.train
    args = cfg.model_args(vocab_size=vocab_size(cfg))
    par, construction, kept = build_measured(args, mesh, cfg)
    step = TrainStep(par, cfg)
    rows = t.global_batch // mesh.dp_size
    g = torch.Generator().manual_seed(t.seed + mesh.rank)
    tokens = torch.randint(0, args.vocab_size, (rows, t.seq_len + 1), generator=g).to(mesh.device)
    rows = MicroBatch(tokens[:, :-1], tokens[:, 1:])
    if mesh.shape.cp > 1:  # this CP rank's tokens of each sequence, as the trainer gives them
        rows = context.shard(rows, mesh.shape.cp, mesh.coord("cp"), args.mtp_depth)
    micro = rows.split(t.micro_batch)
    for _ in range(2):  # the second step is the steady one: the optimizer state exists
        step.forward_backward(micro, float(t.global_batch * t.seq_len), measure_memory=True)
        step.clip_grad_norm(t.grad_clip)
        step.optimizer_step(t.lr)
    unique = {id(p): p for p in par.model.parameters()}.values()
    psi = sum(p.numel() for p in unique)
    psi_experts = sum(p.numel() for p in unique if is_expert(p))
    frozen = [p for p in unique if not p.requires_grad]  # LoRA's base: parameters only, no gradient or state
    memory = step.memory
    experts = [memory.expert_params or 0, memory.expert_grads or 0, memory.expert_optimizer or 0]
    mine = [psi, psi_experts, construction, kept] + [getattr(memory, c) for c in COLUMNS] + experts
    mine += [memory.fp8_saved or 0, sum(p.numel() for p in frozen), sum(p.numel() for p in frozen if is_expert(p))]
    mine += muon_figures(par, step.optimizer, t.optimizer == "muon")
    table = per_rank(mine, mesh.device)
    keys = ("psi", "psi_experts", "construction", "kept") + COLUMNS + EXPERT_COLUMNS + ("fp8_saved", "psi_frozen",
                                                                                          "psi_frozen_experts") + MUON_KEYS
    backends = (fp8.backend_counts(par.model, (t.micro_batch, t.seq_len // mesh.shape.cp), compute_dtype(t.precision, t.fp8_base),
                                   mesh.device) if fp8.recipe_of(t) else None)
    return {"ranks": [dict(zip(keys, map(int, row))) for row in table], "layout": mesh.describe(),
            "fp8_backends": backends, "device": str(mesh.device),
            "n_shard": mesh.size("dp_shard_cp"), "n_expert_shard": mesh.size("edp_shard"), "moe": args.is_moe,
            **construction_bounds(args)}


MUON_KEYS = ("psi_muon", "psi_muon_experts", "muon_ns_flops", "muon_bytes")


def muon_figures(par, optimizer, muon: bool) -> list[int]:
    """This rank's Muon figures, measured: the parameters Muon updates (dense, routed experts),
    the Newton–Schulz FLOPs of the matrices it owns, the bytes its owners' all-to-alls send."""
    if not muon:
        return [0, 0, 0, 0]
    named = {id(p): (n, p) for n, p in par.model.named_parameters()}.values()
    matrices = [p for n, p in named if muon_matrix(n, p)]
    owners = optimizer.owners
    size = optimizer.muon_groups[0]["params"][0].element_size() if owners.holders else 4
    return [sum(p.numel() for p in matrices), sum(p.numel() for p in matrices if is_expert(p)),
            int(owners.load[owners.group.rank]), owners.bytes_per_step(size)]


def muon_lines(cfg: Config, result: dict, c: int) -> list[str]:
    """Muon's figures per rank, measured beside parallel/muon.muon_costs."""
    from ndtrain.parallel.muon import muon_costs
    t, p = cfg.train, cfg.parallel
    args = cfg.model_args(vocab_size=vocab_size(cfg))
    element = max(c, 4)  # the optimizer's tensors: fp32 masters, or the fp32/fp64 parameters
    world = len(result["ranks"])
    lines = ["", f"Muon: {t.muon_ns_steps} Newton–Schulz steps per matrix and step, one momentum buffer per "
                 "matrix element (AdamW: two moments); each matrix on one owning rank (parallel/muon.py)",
             f"{'rank':>4}  {'Muon params':>12}  {'NS GFLOP owned':>14}  {'formula (avg)':>14}  "
             f"{'owner bytes/step':>16}  {'formula':>12}"]
    for rank, r in enumerate(result["ranks"]):
        experts = r["psi_muon_experts"]
        held = ((r["psi_muon"] - experts) / (result["n_shard"] if p.zero else 1)
                + experts / (result["n_expert_shard"] if p.zero else 1))  # what its optimizer tensors hold
        f = muon_costs(args, world, p.pp, held, t.muon_ns_steps, element)
        lines.append(f"{rank:>4}  {r['psi_muon']:>12,}  {r['muon_ns_flops'] / 1e9:>14.3f}  {f['ns_flops'] / 1e9:>14.3f}  "
                     f"{format_bytes(r['muon_bytes']):>16}  {format_bytes(f['bytes']):>12}")
    lines.append("  formula: each matrix's owner holding an average share of it; the owners prefer a rank that holds "
                 "more of a matrix, so where whole matrices lie in one rank's slice (ZeRO) fewer bytes move")
    return lines


def construction_bounds(args) -> dict:
    """Bytes of the largest parameter and the largest unit (a block, or the embedding, norm
    and head) in fp32, and of the whole model in fp32: what a rank may hold on top of what it
    keeps while the layout is built (parallel/construct.py), and what it would hold if it
    built the whole model first."""
    with torch.device("meta"):
        model = Transformer(args)
    params = [p.numel() for p in model.parameters()]
    blocks = [sum(p.numel() for p in block.parameters()) for block in model.layers.values()]
    return {"largest_param_bytes": 4 * max(params), "model_fp32_bytes": 4 * sum(params),
            "largest_unit_bytes": 4 * max(blocks + [sum(params) - sum(blocks)])}


def dry_run_worker(cfg_dict: dict) -> dict:
    from ndtrain.launch import init_process, shutdown
    from ndtrain.train.worker import mesh_shape

    cfg = from_dict(cfg_dict)
    env = init_process(cfg.run.device, cfg.run.threads)
    try:
        return measure(cfg, ParallelMesh.build(mesh_shape(cfg), env.device))
    finally:
        shutdown()


def render(cfg: Config, result: dict) -> str:
    p, t = cfg.parallel, cfg.train
    c = torch.finfo(compute_dtype(t.precision, t.fp8_base)).bits // 8
    head = (f"dry run: {cfg.model.preset} model, {result['layout']}, zero={p.zero}, {t.precision}, "
            f"recompute={t.recompute}, micro-batch {t.micro_batch}×{t.seq_len}")
    lines = [head, f"{'rank':>4}  {'parameters':>12}  {'params':>12}  {'grads':>12}  {'optimizer':>12}  "
                   f"{'model states':>12}  {'ZeRO formula':>12}  {'activations':>12}  {'peak':>12}"]
    moe = result.get("moe", False)
    for rank, r in enumerate(result["ranks"]):
        states = r["params"] + r["grads"] + r["optimizer"]
        formula = state_formula(r, p.zero, result, c)
        cells = [r["params"], r["grads"], r["optimizer"], states, formula, r["activations"], r["peak"]]
        lines.append(f"{rank:>4}  {r['psi']:>12,}  " + "  ".join(f"{format_bytes(x):>12}" for x in cells))
    if moe:  # the same model states, dense and routed experts apart
        lines += ["", f"{'rank':>4}  {'dense params':>14}  {'dense states':>14}  {'dense formula':>14}  "
                      f"{'expert params':>14}  {'expert states':>14}  {'expert formula':>14}"]
        for rank, r in enumerate(result["ranks"]):
            dense, experts = split_formula(r, p.zero, result, c)
            e_states = r["expert_params"] + r["expert_grads"] + r["expert_optimizer"]
            d_states = r["params"] + r["grads"] + r["optimizer"] - e_states
            lines.append(f"{rank:>4}  {r['psi'] - r['psi_experts']:>14,}  {format_bytes(d_states):>14}  "
                         f"{format_bytes(dense):>14}  {r['psi_experts']:>14,}  {format_bytes(e_states):>14}  "
                         f"{format_bytes(experts):>14}")
    if fp8.recipe_of(t):
        lines += ["", fp8.summary(t, cfg.model_args()),
                  "low-precision copies kept for backward in a step (inside activations; tensorwise keeps x in fp8, "
                  "MXFP8 and NVFP4 x quantized for the weight gradient, the others keep x as it came and quantize "
                  "again in backward): "
                  + ", ".join(f"rank {i} {format_bytes(r['fp8_saved'])}" for i, r in enumerate(result["ranks"]))]
        if result.get("fp8_backends"):
            lines.append(f"fp8 back ends on rank 0 ({result['device']}): "
                         + "; ".join(f"{b} ({n} layers)" for b, n in result["fp8_backends"].items())
                         + " (scaled_mm: one torch._scaled_mm per matmul; the others in docs/fp8.md)")
    if t.optimizer == "muon":
        lines += muon_lines(cfg, result, c)
    extra = max(result["largest_param_bytes"], result["largest_unit_bytes"])
    lines.append("construction peak: the layout is built on the meta device, then each rank allocates only what it "
                 "keeps (model states), drawing one parameter's fp32 initial value at a time (ZeRO-3: one unit's "
                 f"buffer at a time); the whole model in fp32 is {format_bytes(result['model_fp32_bytes'])}")
    for rank, r in enumerate(result["ranks"]):
        bound = r["kept"] + extra
        lines.append(f"{rank:>4}  construction peak {format_bytes(r['construction'])} (keeps {format_bytes(r['kept'])} "
                     f"+ largest unit {format_bytes(extra)} = {format_bytes(bound)}: "
                     f"{'within' if r['construction'] <= bound else 'ABOVE'})")
    lines += ["model states: counted after the optimizer step; ZeRO formula: c·Ψ + g·Ψ + K·Ψ, c bytes per value",
              "  in the compute dtype, g = 4 (fp32 gradient accumulator) or c, K = 12 (fp32 master + Adam moments)",
              "  or 2c in fp32/fp64; sharded terms / shard group"
              + (" (experts: / the ranks holding the same experts, dp_shard·cp/ep)" if moe else ""),
              "activations: the most that forward + backward held on top of what existed when they began",
              "peak: the most held in all at any moment of the two steps"]
    return "\n".join(lines)


def split_formula(r: dict, zero: int, result: dict, c: int) -> tuple[float, float]:
    """The ZeRO formula for a rank's dense parameters (sharded over dp_shard × cp) and for
    its experts (sharded over the ranks of dp_shard × cp holding the same experts)."""
    frozen_experts = r.get("psi_frozen_experts", 0)
    frozen = r.get("psi_frozen", 0) - frozen_experts
    muon_experts = r.get("psi_muon_experts", 0)
    muon = r.get("psi_muon", 0) - muon_experts  # one moment (Muon's momentum) instead of two
    dense_psi = r["psi"] - r.get("psi_experts", 0) - frozen - muon
    dense = sum(model_state_bytes(dense_psi, zero, result["n_shard"], c).values())
    dense += sum(model_state_bytes(muon, zero, result["n_shard"], c, moments=1).values())
    dense += model_state_bytes(frozen, zero, result["n_shard"], c)["params"]
    n_experts = result.get("n_expert_shard", 1)
    expert_psi = r.get("psi_experts", 0) - frozen_experts - muon_experts
    experts = sum(model_state_bytes(expert_psi, zero, n_experts, c).values())
    experts += sum(model_state_bytes(muon_experts, zero, n_experts, c, moments=1).values())
    experts += model_state_bytes(frozen_experts, zero, n_experts, c)["params"]
    return dense, experts


def state_formula(r: dict, zero: int, result: dict, c: int) -> float:
    return sum(split_formula(r, zero, result, c))
