"""Benchmarks that measure side by side in one run and print ratios (these machines are shared and noisy), one
module per `gptlab bench` verb: peak, train (train and attention), generate, decode, matmul; timing.py holds
what they share. Nothing in the core imports this package. Current figures: docs/benchmarks.md."""
