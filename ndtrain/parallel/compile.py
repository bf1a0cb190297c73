"""Regional compilation (`train.compile`): each decoder block and the token loss go through
`torch.compile` on their own, as torchtitan compiles per block.

What is compiled is each block's `forward` (and its attention core's, which selective
recomputation wraps on its own), so the module's hooks stay outside the compiled code: ZeRO-3
gathers a block in its forward pre-hook and frees it in its forward hook, eagerly, around the
compiled forward; the data-parallel and ZeRO gradient hooks sit on the parameters, after the
compiled backward. The blocks of a model share one compiled graph (the same code, guarded on
shapes), and the cache limit is raised to the number of blocks so that no block ever falls
back to eager for lack of room.

Order. `build` compiles before it wraps recomputation, so a recomputed region holds the
compiled code and its second run calls the same compiled function, which saves exactly what
the first run saved (recomputation matches the tensors by position). The regions are opaque
to the compiler (`parallel/recompute.run_recomputed` is excluded from tracing): a block
whose attention core is recomputed compiles in two pieces around it. Torchtitan wraps torch's
checkpointing first and compiles around it; the compiler cannot see inside ours, so the
other way round is the one that keeps recomputation exact.

Collectives inside a block (tensor, sequence, context and expert parallelism) may break the
graph into pieces; meaning never changes (tests/test_compile.py proves compiled equals eager
on every layout family). One schedule refuses: zero bubble splits each backward into its input
and weight parts, which a compiled block computes in one node (config validation says so).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn



def _compiled(fn: Callable, backend: str) -> Callable:
    return torch.compile(fn, backend=backend)


def compile_blocks(model: nn.Module, backend: str) -> list[str]:
    """Compile the forward of every block of every decoder in `model` (and of each block's
    attention core); returns the blocks' names."""
    import torch._dynamo  # noqa: PLC0415  (the compiler's configuration)

    names = []
    for name, module in model.named_modules():
        layers = getattr(module, "layers", None)
        if not isinstance(layers, nn.ModuleDict):
            continue
        for key, block in layers.items():
            core = getattr(getattr(block, "attention", None), "core", None)
            if core is not None:
                core.forward = _compiled(core.forward, backend)
            block.forward = _compiled(block.forward, backend)
            names.append(f"{name}.layers.{key}" if name else f"layers.{key}")
    # One cache entry per distinct block (MoE and dense blocks, layer keys) must fit.
    limit = 2 * len(names) + 8
    for key in ("cache_size_limit", "accumulated_cache_size_limit"):
        if getattr(torch._dynamo.config, key, limit) < limit:
            setattr(torch._dynamo.config, key, limit)
    return names


def compile_loss(nll: Callable, backend: str) -> Callable:
    """The per-token loss, compiled: the fp32 upcast of the logits fuses into it."""
    return _compiled(nll, backend)
