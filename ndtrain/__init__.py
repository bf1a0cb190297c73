"""ndtrain: N-D parallel training of transformer language models on torch.distributed."""

__version__ = "0.1.0"
