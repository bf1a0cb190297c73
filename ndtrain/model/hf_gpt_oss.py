"""gpt-oss's Hugging Face checkpoint layout ⇄ ours (model/hf.py calls these for gpt_oss).

Three things differ from the other families' tables, where each tensor of ours is a whole
HF tensor, an expert of it or a row range of it:
- the experts are stacked in HF too, but stored as x·W (`gate_up_proj` [E, D, 2F],
  `down_proj` [E, F, D]) where ours are nn.Linear's W·x (w1, w3 [E, F, D], w2 [E, D, F]);
- gate and up are interleaved in `gate_up_proj`'s last dimension (gate at the even
  columns, up at the odd ones), and so are their biases in `gate_up_proj_bias` [E, 2F];
- OpenAI's published checkpoints store the expert matrices in MXFP4 (`*_blocks`
  [E, rows, cols/32, 16] bytes, two 4-bit values each, low nibble first, and `*_scales`
  [E, rows, cols/32], a power-of-two exponent + 127 per 32 values), rows and cols in
  nn.Linear's orientation. They are dequantized on import (`dequantize_mxfp4`): every value
  is e2m1 × 2^k, exact in bf16 and fp32. The export writes the dequantized matrices in the
  chosen dtype (bf16 by default for a gpt-oss source), never MXFP4, and says so.

`Part.layout` names the view of the HF tensor that is ours: "even"/"odd" (the gate/up
columns of the last dimension, transposed for the matrices), "t" (transposed), "" (as is).
"""

from __future__ import annotations

import torch
from torch import Tensor

# Within a layer: ours -> (HF's, layout)
NAMES = {
    "attention.sinks": ("self_attn.sinks", ""),
    "attention.wo.bias": ("self_attn.o_proj.bias", ""),
    "feed_forward.router.weight": ("mlp.router.weight", ""),
    "feed_forward.router.bias": ("mlp.router.bias", ""),
    "feed_forward.experts.w1": ("mlp.experts.gate_up_proj", "even"),
    "feed_forward.experts.w3": ("mlp.experts.gate_up_proj", "odd"),
    "feed_forward.experts.w2": ("mlp.experts.down_proj", "t"),
    "feed_forward.experts.w1_bias": ("mlp.experts.gate_up_proj_bias", "even"),
    "feed_forward.experts.w3_bias": ("mlp.experts.gate_up_proj_bias", "odd"),
    "feed_forward.experts.w2_bias": ("mlp.experts.down_proj_bias", ""),
}
BACK: dict[str, list[tuple[str, str]]] = {}
for _ours, (_hf, _layout) in NAMES.items():
    BACK.setdefault(_hf, []).append((_ours, _layout))
QUANTIZED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # stored as *_blocks + *_scales by OpenAI

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: Tensor, scales: Tensor) -> Tensor:
    """MXFP4 blocks [E, rows, G, 16] (uint8) and scales [E, rows, G] (uint8) → the matrix
    [E, cols, rows] (cols = 32·G) in fp32, in HF's x·W orientation (as the unquantized
    checkpoint stores it)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match "
                         "([..., G, 16] and [..., G])")
    table = torch.tensor(E2M1, dtype=torch.float32)
    b = blocks.to(torch.int64)
    values = torch.stack([table[b & 0x0F], table[b >> 4]], dim=-1).flatten(-2)  # [E, rows, G, 32]
    values = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1).float())
    e, rows = blocks.shape[:2]
    return values.reshape(e, rows, -1).transpose(1, 2).contiguous()


def ours_from_hf(layout: str, t: Tensor) -> Tensor:
    """Our tensor from the whole HF tensor it is a view of."""
    if layout in ("even", "odd"):
        t = t[..., 0::2] if layout == "even" else t[..., 1::2]
        return t.transpose(1, 2).contiguous() if t.dim() == 3 else t.contiguous()
    if layout == "t":
        return t.transpose(1, 2).contiguous()
    return t


def hf_from_ours(pieces: dict[str, Tensor]) -> Tensor:
    """The HF tensor from ours, by layout: {"even": w1, "odd": w3} interleaved (matrices
    transposed first), {"t": w2} transposed, {"": t} as is."""
    if "" in pieces:
        return pieces[""]
    if "t" in pieces:
        return pieces["t"].transpose(1, 2).contiguous()
    gate, up = pieces["even"], pieces["odd"]
    if gate.dim() == 3:
        gate, up = gate.transpose(1, 2), up.transpose(1, 2)
    return torch.stack([gate, up], dim=-1).flatten(-2).contiguous()


def hf_shape(layout: str, ours: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the HF tensor that holds ours (of shape `ours`) in `layout`."""
    if layout in ("even", "odd"):
        return (ours[0], ours[2], 2 * ours[1]) if len(ours) == 3 else (ours[0], 2 * ours[1])
    if layout == "t":
        return (ours[0], ours[2], ours[1])
    return tuple(ours)


def ours_shape(layout: str, hf: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of our tensor held in `layout` by the HF tensor of shape `hf`."""
    if layout in ("even", "odd"):
        return (hf[0], hf[2] // 2, hf[1]) if len(hf) == 3 else (hf[0], hf[1] // 2)
    if layout == "t":
        return (hf[0], hf[2], hf[1])
    return tuple(hf)


def mxfp4_shape(blocks: tuple[int, ...]) -> tuple[int, ...]:
    """The dequantized matrix's shape (x·W orientation) of MXFP4 blocks [E, rows, G, 16]."""
    return (blocks[0], blocks[2] * 32, blocks[1])
