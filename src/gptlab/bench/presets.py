"""The presets the bench verbs time, resolved in the bench wing rather than in the CLI: which presets name a GPT's
shape (`bench matmul` times their products), and the model, training settings and data `bench train` and
`bench attention` time for a preset. Imports no torch, so the CLI builds its flags from it as fast as from
config.py."""

from __future__ import annotations

from pathlib import Path

from gptlab.config import FINETUNE_PRESET, PRESETS, ModelConfig, TrainConfig, build, get_preset

# presets that name a GPT's shape (bigram has none; finetune only changes dropout)
SHAPED_PRESETS = tuple(n for n, p in PRESETS.items() if "n_embd" in p.model and p.model.get("arch") != "bigram")
# finetune's shape comes from --init-from, which a bench has not: it times what is fine-tuned most, GPT-2 124M at
# context 256, with the preset's dropout
FINETUNE_SHAPE = {**get_preset("gpt2").model, "block_size": 256}


def train_bench_settings(preset: str, batch_size: int, device: str, attention: str | None = None,
                         data: str | None = None) -> tuple[Path, ModelConfig, TrainConfig]:
    """(data folder, model settings, training settings) that `bench train` / `bench attention` time for `preset`
    at `batch_size` on `device`: the preset's (finetune's: FINETUNE_SHAPE), with `attention` where given; `data`,
    else the bundled corpus prepared for the preset's tokenizer (runs.data_dir_for). GptlabError on an unknown
    preset or a setting out of range."""
    from gptlab.runs import data_dir_for

    settings = get_preset(preset)
    shape = FINETUNE_SHAPE if preset == FINETUNE_PRESET else {}
    model_cfg = build(ModelConfig, {**shape, **settings.model}, {"attention": attention} if attention else {})
    train_cfg = build(TrainConfig, settings.train, {"batch_size": batch_size, "device": device})
    return data_dir_for(data, preset, quiet=True), model_cfg, train_cfg
