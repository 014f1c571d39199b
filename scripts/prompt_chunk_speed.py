"""The prompt pass's speed by chunk size: GPT-2 124M's shape (random weights, tanh GELU) in fp32, a 512-token prompt
through `generate_batch` (the path `gptlab sample` runs) with `prefix_cache.PROMPT_CHUNK` set to 64 (the exact
prefix cache's block), 128, 256 and 512, then 64 and 512 again; the best of 3 each. What the fp32 prompt pass of
`gptlab bench generate --peer llama.cpp` loses to its 64-token chunks (docs/benchmarks.md).

    python scripts/prompt_chunk_speed.py
"""

import torch

import gptlab.inference.prefix_cache as prefix_cache
from gptlab.bench.engines import GEN_MODELS
from gptlab.bench.llamacpp import gptlab_prefill
from gptlab.config import ModelConfig, build
from gptlab.inference.loading import prepare_for_inference
from gptlab.machine import cpu_model
from gptlab.model import GPT
from gptlab.runtime import set_threads


def main() -> None:
    set_threads()
    torch.manual_seed(0)
    config = build(ModelConfig, {**GEN_MODELS["gpt2-124M"], "activation": "gelu_tanh"}, {})
    model = prepare_for_inference(GPT(config).eval(), "fp32")
    prompt = torch.randint(0, config.vocab_size, (512,)).tolist()
    print(f"prompt pass of 512 tokens, fp32, GPT-2 124M's shape; {cpu_model()}, {torch.get_num_threads()} threads")
    for chunk in (64, 128, 256, 512, 64, 512):
        prefix_cache.PROMPT_CHUNK = chunk
        gptlab_prefill(model, prompt)  # warm-up
        best = min(gptlab_prefill(model, prompt) for _ in range(3))
        print(f"chunks of {chunk:>3}: {512 / best:,.0f} tokens/s")


if __name__ == "__main__":
    main()
