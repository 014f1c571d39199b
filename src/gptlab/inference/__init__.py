"""The inference wing: a model made fast to generate with, as one object the engine takes.

Rooms: `loading` (`load_for_inference(run, device, precision)`: a run's model loaded and made ready for sample,
eval and serve; `prepare_for_inference(model, precision)`: a model made ready), `prepared` (the `InferenceModel`
the engine takes: the model, its decoder, the precision of its KV cache; the `Decoder` protocol and `TorchStep`, the
model's own forward, which stays the reference), `weights` (packed Linears, huge pages), `int8` (weight-only int8
with per-row scales: the torch reference), `native` (building and loading csrc/decode.cpp, and checking its ABI),
`fused` (the ctypes call of one decode step, fp32, bf16 or int8 weights). Import the modules themselves: this file
imports nothing.
"""
