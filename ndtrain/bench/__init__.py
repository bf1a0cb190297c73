"""Benchmarks that run ndtrain and a PyTorch-native anchor side by side in one invocation."""
