"""Benchmarks that measure side by side in one run and print ratios (these machines are shared and noisy), one
module per `gptlab bench` verb: device_peak (peak), train_speed (train and attention), reference (the naive C++
engine beside torch), generate, decode, matmul, race, prepare_speed (prepare), serve, tasks (eval), chat_finetune
(chat) (generate runs four programs, one module each: engines, kernels, sliding, quality; memory.py measures a
training step's memory for train_speed); timing.py holds what they share, presets.py the presets they time
(resolved here, not in the CLI). Only the CLI (cli/bench_verbs.py) imports this package, nothing in the core.
Current figures: docs/benchmarks.md."""
