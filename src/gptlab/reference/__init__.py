"""The naive GPT-2 from the equations: a plain C++ engine (csrc/reference.cpp: loops a reader can follow, every
forward beside its hand-derived backward, float and double, no autograd) that trains and decodes a gptlab GPT, the
reference the optimised paths are measured against (docs/from-the-equations.md).

Rooms: `library` (building and loading the library, its structs and their ABI check), `naive_gpt` (a GPT's
weights in, logits, loss and gradients out; `NaiveGPT`, a GPT whose forward and backward are the engine's),
`naive_adamw` (the engine's global-norm clipping and AdamW as a torch Optimizer), `naive_training` (what
`gptlab train --engine reference` uses: the model and the optimizer), `check` (the engine beside the torch model on
a run's data, per tensor).
"""
