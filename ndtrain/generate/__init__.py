"""Text generation from a trained model."""

from .sampler import sample

__all__ = ["sample"]
