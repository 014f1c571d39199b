#!/usr/bin/env bash
# The GPU measurements of docs/benchmarks.md in one go (a few minutes on one A100 / H100 / H200): the measured
# peak, `bench train` for char-small and GPT-2 small with their MFU, and char-small trained to its best
# validation loss with the time it took. Run from the repository root with gptlab installed; paste the output.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
"$PYTHON" -m gptlab bench peak --device cuda
"$PYTHON" -m gptlab bench train --device cuda --preset char-small --batch-size 64 --steps 20 --warmup 3
"$PYTHON" -m gptlab bench train --device cuda --preset gpt2 --batch-size 8 --steps 10 --warmup 2
# nanoGPT's reference point: val loss 1.4697 in about 3 minutes on an A100 (5000 steps, batch 64, compiled)
"$PYTHON" -m gptlab train --device cuda --preset char-small --compile true --run runs/gpu-char-small --quiet
grep '"kind": "eval"' runs/gpu-char-small/metrics.jsonl | tail -3
