"""Weights checked before they are imported: `convert --from-hf` and `model.init_from`
(`hf:` and `run:`) refuse a source before anything is written, on one line naming what is
wrong, when

- its config is no model (model/args.py `shape_problem`, and model/hf_config.py for a
  config.json: counts that are not positive, heads that do not divide the width, ...);
- a tensor the model needs is missing (a whole layer, one expert) or one is there that it
  has no place for (a config whose layer count disagrees with the weights);
- a tensor's shape is not the model's (a config whose vocabulary is not the embedding's
  rows), or its dtype is not a floating-point one;
- a value is NaN or infinite (one pass over the weights, a chunk at a time).

The expected names and shapes are those of the model the config describes, built on the
meta device (no memory is allocated).
"""

from __future__ import annotations

import torch

from ndtrain.checkpoint.files import NAMES
from ndtrain.config import ConfigError
from ndtrain.model.args import ModelArgs, shape_problem

FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
CHUNK = 1 << 22  # elements read at a time by the finiteness check
SHOWN = 4  # names listed in one line before "and N more"


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """`weight/NAME` → shape of every parameter of the model (a tied head is the embedding)."""
    from ndtrain.model.llama import Transformer
    with torch.device("meta"):
        model = Transformer(args)
    return {f"weight/{name}": tuple(p.shape) for name, p in model.named_parameters()}


def listed(names) -> str:
    names = sorted(names)
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def check_args(args: ModelArgs, where: str, key: str) -> None:
    problem = shape_problem(args)
    if problem:
        field, value, rule = problem
        raise ConfigError(f"{where}: {key} {field}", value, rule)


def missing_error(where: str, missing, args: ModelArgs) -> ConfigError:
    n = len(missing)
    return ConfigError(where, listed(missing), f"missing ({n} tensor{'s' * (n > 1)} the model of its config needs: "
                       f"{args.n_layers} layers, vocabulary {args.vocab_size}); a truncated download, or a config "
                       "that does not describe these weights")


def check_tensors(source, args: ModelArgs, where: str, name_of=lambda key: key[len("weight/"):]) -> None:
    """Every weight of `source` against the model of `args`: names (missing, unexpected),
    shapes, whether all the pieces of each are there, dtypes. `name_of` turns our key into
    the name the source's files use, for the message."""
    expected = expected_shapes(args)
    have = {key: shape for key, (shape, _) in source.index.items() if key.startswith("weight/")}
    missing = [name_of(k) for k in expected if k not in have]
    if missing:
        raise missing_error(where, missing, args)
    unexpected = [name_of(k) for k in have if k not in expected]
    if unexpected:
        raise ConfigError(where, listed(unexpected), f"not part of the model its config describes ({args.n_layers} "
                          "layers); a config that does not describe these weights, or a stray file")
    for key, shape in expected.items():
        if tuple(have[key]) != shape:
            raise ConfigError(f"{where}: {name_of(key)}", f"shape {list(have[key])}", _shape_rule(key, shape, args))
    for key in expected:
        _check_pieces(source, key, where, name_of)


def _shape_rule(key: str, shape: tuple, args: ModelArgs) -> str:
    if key.endswith(("tok_embeddings.weight", "output.weight")):
        return f"expected {list(shape)}: the config's vocabulary has {args.vocab_size} tokens and its width is {args.dim}"
    return f"expected {list(shape)} for the model its config describes"


def _check_pieces(source, key: str, where: str, name_of) -> None:
    shape, parts = source.index[key]
    total = int(torch.Size(shape).numel())
    held = sum(piece.numel for piece, _ in parts)
    if held < total:
        raise ConfigError(f"{where}: {name_of(key)}", f"{held} of {total} elements", "missing pieces (an expert "
                          "of the stack, or a shard of a checkpoint is not there)")
    for dtype in source.dtypes.get(key, ()):
        if dtype not in FLOAT_DTYPES:
            raise ConfigError(f"{where}: {name_of(key)}", dtype, f"a weight must be one of {', '.join(FLOAT_DTYPES)}")


def check_finite(source, where: str, name_of=lambda key: key[len("weight/"):]) -> None:
    """Refuse a NaN or infinite value in any weight of `source` (read a chunk at a time)."""
    for key, (_, parts) in sorted(source.index.items()):
        if not key.startswith("weight/"):
            continue
        for piece, read in parts:
            for lo in range(0, piece.numel, CHUNK):
                data = read(lo, min(lo + CHUNK, piece.numel))
                if not bool(torch.isfinite(data).all()):
                    bad = data[~torch.isfinite(data)][0].item()
                    raise ConfigError(f"{where}: {name_of(key)}", f"holds {bad}", "weights must be finite; this "
                                      "model diverged or its file is damaged")


assert set(FLOAT_DTYPES) <= set(NAMES)
