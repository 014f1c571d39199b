"""What exporting an exact-GELU run to llama.cpp costs: llama.cpp's GPT-2 graph computes GELU's tanh form whatever a
model was trained with, so `gptlab export --format gguf --approximate-gelu` measures, in gptlab, how far the
run's next-token distributions move when its exact GELU becomes the tanh form: the mean KL divergence
KL(exact || tanh) in nats per position and the share of positions whose most likely token stays the same.

Measured on the run's validation text (its data folder, when it still holds the data the run was tokenized for),
else on text the model itself writes (seeded), as `KL_WINDOWS` windows of up to `KL_TOKENS` tokens."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch

from gptlab import rundir
from gptlab.checkpoint import LoadedRun
from gptlab.config import SampleConfig
from gptlab.errors import GptlabError

KL_WINDOWS = 8  # windows of text the divergence is averaged over
KL_TOKENS = 256  # tokens a window holds at most (the context, when shorter)
KL_SEED = 0  # of the text the model writes when its data is gone


def validation_windows(run_dir: str | Path, loaded: LoadedRun, length: int) -> list[list[int]] | None:
    """KL_WINDOWS windows of `length` ids spread evenly over the run's validation split, or None when the run's
    data folder is gone, was tokenized otherwise, or is too short."""
    from gptlab.data.batches import load_dataset

    folder = rundir.read_run_config(run_dir).get("data")
    try:
        data = load_dataset(folder) if folder else None
    except GptlabError:
        return None
    if data is None or data.tokenizer.to_dict() != loaded.tokenizer.to_dict() or len(data.val) < length:
        return None
    starts = np.linspace(0, len(data.val) - length, KL_WINDOWS).astype(int)
    return [np.asarray(data.val[int(s):int(s) + length]).astype(np.int64).tolist() for s in starts]


def sampled_windows(loaded: LoadedRun, length: int) -> list[list[int]]:
    """KL_WINDOWS windows of `length` ids the model writes itself: samples of one prompt (temperature 1, seeded),
    the end-of-text id (id 0 without one)."""
    from gptlab.engine import generate_batch

    first = loaded.tokenizer.eot_id if loaded.tokenizer.eot_id is not None else 0
    cfg = SampleConfig(max_new_tokens=length - 1, temperature=1.0, seed=KL_SEED)
    rows = [[first] for _ in range(KL_WINDOWS)]
    for ids in generate_batch(loaded.model, [[first]], cfg, num_samples=KL_WINDOWS):
        for row, i in zip(rows, ids):
            row.append(int(i))
    return rows


def tanh_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` whose MLPs compute GELU's tanh form, as llama.cpp's GPT-2 does."""
    twin = copy.deepcopy(model)
    for module in twin.modules():
        if isinstance(module, torch.nn.GELU):
            module.approximate = "tanh"
    return twin.eval()


def divergence(model: torch.nn.Module, windows: list[list[int]]) -> tuple[float, float]:
    """(mean KL(model || its tanh twin) in nats per position, share of positions with the same top token), both
    computed in float64: the divergence of a well-trained model is far below float32's rounding of its logits."""
    model = copy.deepcopy(model).double().eval()
    twin = tanh_twin(model)
    kls, same = [], []
    with torch.inference_mode():
        for window in windows:
            x = torch.tensor([window])
            exact = torch.log_softmax(model(x)[0][0], dim=-1)
            tanh = torch.log_softmax(twin(x)[0][0], dim=-1)
            kls.append((exact.exp() * (exact - tanh)).sum(-1))
            same.append((exact.argmax(-1) == tanh.argmax(-1)).float())
    return torch.cat(kls).mean().item(), torch.cat(same).mean().item()


def gelu_kl(run_dir: str | Path, loaded: LoadedRun) -> tuple[float, float, str]:
    """(mean KL, top-token agreement, what it was measured on) of the run's model against its tanh-GELU twin."""
    length = min(loaded.model_cfg.block_size, KL_TOKENS)
    windows = validation_windows(run_dir, loaded, length)
    text = f"{KL_WINDOWS} windows of {length} tokens of the run's validation text"
    if windows is None:
        windows = sampled_windows(loaded, length)
        text = f"{KL_WINDOWS} windows of {length} tokens the model wrote (seed {KL_SEED}; its data is gone)"
    kl, agree = divergence(loaded.model.eval(), windows)
    return kl, agree, text
