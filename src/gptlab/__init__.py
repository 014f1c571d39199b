"""gptlab: build, train, run and look inside GPT-2-style language models."""

__version__ = "0.1.0"
