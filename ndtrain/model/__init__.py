"""The decoder model and its shapes."""

from .args import PRESETS, ModelArgs, flops_per_token, param_count
from .llama import KVCache, Transformer

__all__ = ["ModelArgs", "PRESETS", "Transformer", "KVCache", "param_count", "flops_per_token"]
