"""The precision the numerically delicate parts of the model compute in."""

from __future__ import annotations

import torch
from torch import Tensor


def widened(x: Tensor) -> Tensor:
    """`x` in fp32, or in fp64 if it is already (fp64 runs are the layout proofs: nothing
    may round them to fp32 on the way)."""
    return x if x.dtype == torch.float64 else x.float()


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype `widened` gives a tensor of `dtype`."""
    return dtype if dtype == torch.float64 else torch.float32
