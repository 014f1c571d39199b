"""A GPT-2-architecture GGUF file as a gptlab run: `gptlab import gguf FILE --run R`, so that a GGUF someone hands
over can be evaluated, inspected and fine-tuned.

Read with the `gguf` package's reader; F32, F16, BF16 and Q8_0 tensors are dequantized by its own functions to the
run's fp32. The names are llama.cpp's GPT-2 names (ggml/gguf_out.py writes them); an `output.weight` must equal
`token_embd` (gptlab's GPT-2 ties them). llama.cpp's GPT-2 computes GELU's tanh form, so that is what an imported
model computes, unless the file is one gptlab wrote: its `gptlab.model` key holds the run's own settings (the exact
GELU of a run exported with --approximate-gelu, no biases where the run had none), which are restored. Nothing is
written until the whole file has been read and checked.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptlab import rundir
from gptlab.config import ModelConfig, TrainConfig, from_dict, to_dict
from gptlab.errors import GptlabError
from gptlab.ggml.gguf_out import ARCH, BLOCK, MODEL_KEY, TOP
from gptlab.ggml.vocab import GPTLAB_KEY, Vocab, from_vocab
from gptlab.model import GPT
from gptlab.tokenizer import Tokenizer

READ_TYPES = ("F32", "F16", "BF16", "Q8_0")
HPARAMS = {"block_size": "context_length", "n_embd": "embedding_length", "n_layer": "block_count",
           "n_head": "attention.head_count"}


def open_reader(path: Path) -> Any:
    """The gguf package's reader of `path`; GptlabError when it is missing, not GGUF, truncated or damaged."""
    import gguf

    if not path.is_file():
        raise GptlabError(f"{path} does not exist or is not a file; give a .gguf file")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise GptlabError(f"{path} is not a GGUF file (it does not start with GGUF)")
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # the reader fails in many ways on a cut or damaged file
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if "GGMLQuantizationType" in reason:  # a type id this gguf package does not know
            raise GptlabError(f"{path} holds a tensor of a type the gguf package does not know ({reason}); gptlab "
                              f"imports {', '.join(READ_TYPES)}") from None
        raise GptlabError(f"{path} cannot be read ({reason}); it is truncated or damaged") from None


def field(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value (a list for arrays); `default` when absent."""
    f = reader.get_field(key)
    return default if f is None else f.contents()


def read_config(reader: Any, path: Path) -> ModelConfig:
    """The ModelConfig of the file's GPT-2 (biases on, GELU's tanh form, dropout 0), or the exporting run's own
    settings where gptlab wrote the file; GptlabError for another architecture or an inconsistent file."""
    arch = field(reader, "general.architecture")
    if arch != ARCH:
        raise GptlabError(f"{path} holds a {arch!r} model, not GPT-2 (general.architecture 'gpt2'); gptlab imports "
                          "only GPT-2-architecture GGUF files")
    try:
        size = {ours: int(field(reader, f"{ARCH}.{key}")) for ours, key in HPARAMS.items()}
        eps = float(field(reader, f"{ARCH}.attention.layer_norm_epsilon"))
        ffn = int(field(reader, f"{ARCH}.feed_forward_length", 4 * size["n_embd"]))
    except (TypeError, ValueError):
        raise GptlabError(f"{path} lacks GPT-2's hyperparameters ({', '.join(HPARAMS.values())}); it is damaged") \
            from None
    if ffn != 4 * size["n_embd"]:
        raise GptlabError(f"{path} has a feed-forward width of {ffn}; gptlab's MLP is always 4 x n_embd "
                          f"({4 * size['n_embd']}) wide")
    vocab = len(field(reader, "tokenizer.ggml.tokens", []))
    if not vocab:
        raise GptlabError(f"{path} has no vocabulary (tokenizer.ggml.tokens); gptlab imports models with their "
                          "tokenizer")
    cfg = ModelConfig(vocab_size=vocab, dropout=0.0, bias=True, activation="gelu_tanh", layer_norm_eps=eps, **size)
    own = field(reader, MODEL_KEY)
    if own is not None:
        saved = from_dict(ModelConfig, json.loads(own))
        # GGUF keeps the epsilon as a float32
        if any(getattr(saved, k) != getattr(cfg, k) for k in HPARAMS) or \
                np.float32(saved.layer_norm_eps) != np.float32(cfg.layer_norm_eps):
            raise GptlabError(f"{path}'s {MODEL_KEY} does not describe its own hyperparameters; the file was edited "
                              "after gptlab wrote it")
        cfg = ModelConfig(**{**to_dict(saved), "vocab_size": vocab, "dropout": 0.0})
    return cfg


def gptlab_name(name: str) -> str:
    """llama.cpp's name of a GPT-2 weight -> gptlab's; GptlabError for a tensor gptlab's GPT-2 does not have."""
    top = {v: k for k, v in TOP.items()}
    if name in top:
        return top[name]
    block = {v: k for k, v in BLOCK.items()}
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in block:
        return f"transformer.h.{parts[1]}.{block[parts[2]]}.{parts[3]}"
    raise GptlabError(f"the GGUF file holds a tensor {name!r} that GPT-2 does not have; it is not a plain GPT-2")


def read_tensor(tensor: Any, path: Path) -> np.ndarray:
    """One tensor as fp32 in numpy's order (ggml's dimensions reversed), dequantized by the gguf package."""
    import gguf

    kind = tensor.tensor_type.name
    if kind not in READ_TYPES:
        raise GptlabError(f"{path}: tensor {tensor.name} is {kind}; gptlab imports {', '.join(READ_TYPES)} "
                          "(requantize it with llama.cpp's llama-quantize to Q8_0, or convert to F16)")
    # the reader's arrays are in numpy's order already (ggml's dimensions reversed), quantized ones as bytes per row
    return gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)  # float32 for every READ_TYPES


def file_tensors(reader: Any, path: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The file's weights under gptlab's names; the zero biases of a run without biases dropped; the tied head
    checked and dropped."""
    out = {}
    for tensor in reader.tensors:
        out[tensor.name] = read_tensor(tensor, path)
    head = out.pop("output.weight", None)
    if head is not None and not np.array_equal(head, out.get("token_embd.weight")):
        raise GptlabError(f"{path} has an output.weight that is not tied to token_embd; gptlab's GPT-2 always ties "
                          "them")
    tensors = {gptlab_name(name): torch.from_numpy(array.copy()) for name, array in out.items()}
    if not cfg.bias:
        for name in [n for n in tensors if n.endswith(".bias")]:
            if torch.count_nonzero(tensors[name]):
                raise GptlabError(f"{path}: {name} is not zero, but {MODEL_KEY} says the model has no biases; the "
                                  "file was edited after gptlab wrote it")
            del tensors[name]
    return tensors


def read_vocab(reader: Any) -> Vocab:
    own = field(reader, GPTLAB_KEY)
    # (end of text is a control token of the vocabulary, so the file's eos id is not needed to rebuild it)
    return Vocab(str(field(reader, "tokenizer.ggml.model", "")), list(field(reader, "tokenizer.ggml.tokens")),
                 [int(t) for t in field(reader, "tokenizer.ggml.token_type", [])],
                 list(field(reader, "tokenizer.ggml.merges", [])), gptlab=json.loads(own) if own is not None else None)


def read_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """The model settings, gptlab-named fp32 weights and tokenizer of the GPT-2 in a GGUF file."""
    path = Path(path)
    reader = open_reader(path)
    cfg = read_config(reader, path)
    tensors = file_tensors(reader, path, cfg)
    tokenizer = from_vocab(read_vocab(reader))
    return cfg, tensors, tokenizer


def load_gguf_model(path: str | Path) -> tuple[GPT, Tokenizer]:
    """The GPT-2 in a GGUF file as a gptlab GPT in eval mode (fp32, CPU), with its tokenizer."""
    from gptlab import checkpoint as ck

    cfg, tensors, tokenizer = read_gguf(path)
    model = GPT(cfg)
    ck.load_model_tensors(model, tensors, str(path))
    return model.eval(), tokenizer


def import_gguf(path: str | Path, run_dir: str | Path) -> GPT:
    """Turn the GGUF file into a gptlab run at `run_dir` (config, tokenizer, one "best" checkpoint at step 0) and
    return the model. Raises GptlabError on bad input, or when `run_dir` already holds a run, with nothing written."""
    from gptlab.hf.gpt2_folders import check_import_folder, write_imported_run

    run = Path(run_dir)
    check_import_folder(run)
    model, tokenizer = load_gguf_model(path)
    source = str(Path(path).resolve())
    write_imported_run(run, model, TrainConfig(), tokenizer, {"imported_from": source},
                       rundir.TrainingState(to_dict(model.config), imported_from=source))
    return model
