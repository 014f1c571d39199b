"""Hugging Face GPT-2 folders <-> gptlab runs: import, export, and the weights fine-tuning starts from.

A Hugging Face GPT-2 folder is config.json plus model.safetensors or pytorch_model.bin (or shards listed in a
*.index.json), and optionally tokenizer files. Its four projection matrices are Conv1D modules stored (in, out),
where gptlab uses nn.Linear, (out, in): they are transposed both ways. The LM head is tied to wte, so only wte is
stored. Old checkpoints also carry the causal-mask buffers attn.bias and attn.masked_bias, which are not weights
and are dropped. Reading needs only safetensors, torch (`torch.load(weights_only=True)`, which never unpickles
arbitrary objects) and tokenizers: transformers is not needed here at all, only by the tests that check parity.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from gptlab import __version__
from gptlab import checkpoint as ck
from gptlab import lora, rundir
from gptlab.chat import grow_vocab, rows_added
from gptlab.config import ModelConfig, TrainConfig, from_dict, to_dict
from gptlab.errors import GptlabError
from gptlab.hf.hf_tokenizer import read_hf_tokenizer, write_tokenizer_files
from gptlab.model import GPT, is_gpt
from gptlab.tokenizer import Tokenizer

HF_CONFIG = "config.json"
EXPORT_MARK = "gptlab-export.json"  # in every folder `gptlab export` wrote: what a later export may replace
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # in order of preference
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
HF_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}  # HF name -> ours
# transformers' GPT2Config defaults, which apply to any key a config.json leaves out
GPT2_DEFAULTS: dict[str, Any] = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
                                     n_inner=None, activation_function="gelu_new", layer_norm_epsilon=1e-5)
# GPT-2 variants that transformers can express and gptlab's model does not compute: the value gptlab implements
VARIANTS = {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False,
            "tie_word_embeddings": True}


# ---- reading a Hugging Face folder -----------------------------------------------------------------------------

def read_hf_config(folder: str | Path) -> ModelConfig:
    """The ModelConfig of the GPT-2 described by `folder`/config.json (dropout 0, biases on).
    Raises GptlabError when the folder is missing, not a model folder, not GPT-2, or a variant gptlab lacks."""
    folder = Path(folder)
    if not folder.is_dir():
        raise GptlabError(f"{folder} does not exist or is not a folder; give a Hugging Face GPT-2 model folder "
                          "(config.json + model.safetensors)")
    path = folder / HF_CONFIG
    if not path.is_file():
        raise GptlabError(f"{folder} is not a Hugging Face model folder (no {HF_CONFIG}); get one with e.g. "
                          "`hf download openai-community/gpt2 --local-dir gpt2`")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise GptlabError(f"{path} is not valid JSON; the folder is damaged, download it again") from None
    if not isinstance(raw, dict) or raw.get("model_type") != "gpt2":
        kind = raw.get("model_type") if isinstance(raw, dict) else None
        raise GptlabError(f"{folder} holds a {kind!r} model, not GPT-2 (model_type 'gpt2' in {HF_CONFIG}); "
                          "gptlab imports only GPT-2 checkpoints")
    hf = {**GPT2_DEFAULTS, **raw}
    for key, implemented in VARIANTS.items():
        if hf.get(key, implemented) != implemented:
            raise GptlabError(f"{path} sets {key}={hf[key]}, a GPT-2 variant gptlab does not implement")
    if hf["activation_function"] not in HF_ACTIVATIONS:
        raise GptlabError(f"{path} uses activation {hf['activation_function']!r}; gptlab implements GPT-2's "
                          f"{', '.join(HF_ACTIVATIONS)} only")
    try:
        if hf["n_inner"] not in (None, 4 * int(hf["n_embd"])):
            raise GptlabError(f"{path} sets n_inner={hf['n_inner']}; gptlab's MLP is always 4 x n_embd wide")
        return ModelConfig(vocab_size=int(hf["vocab_size"]), block_size=int(hf["n_positions"]),
                           n_layer=int(hf["n_layer"]), n_head=int(hf["n_head"]), n_embd=int(hf["n_embd"]),
                           dropout=0.0, bias=True, activation=HF_ACTIVATIONS[hf["activation_function"]],
                           layer_norm_eps=float(hf["layer_norm_epsilon"]))
    except (TypeError, ValueError):
        raise GptlabError(f"{path} has a non-numeric model size; the file is damaged") from None


def weight_files(folder: Path) -> list[Path]:
    """The weight files of a HF folder: one file, or the shards its *.index.json lists; safetensors preferred."""
    for name in WEIGHT_FILES:
        if (folder / name).is_file():
            return [folder / name]
        index = folder / f"{name}.index.json"
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
                raise GptlabError(f"{index} is damaged (no weight_map); download the folder again") from None
            missing = [s for s in shards if not (folder / s).is_file()]
            if missing:
                raise GptlabError(f"shard {missing[0]} listed in {index} is missing; download the folder again")
            return [folder / s for s in shards]
    raise GptlabError(f"{folder} has a {HF_CONFIG} but no weights ({' or '.join(WEIGHT_FILES)}, or shards with "
                      "an .index.json)")


def read_weight_file(path: Path) -> dict[str, torch.Tensor]:
    """The tensors in one safetensors or PyTorch weight file; raises GptlabError when it cannot be read."""
    if path.suffix != ".safetensors":
        with open(path, "rb") as f:
            head = f.read(64)
        if head.startswith(b"version https://git-lfs"):
            raise GptlabError(f"{path} is a Git LFS pointer, not the weights; fetch the file itself (git lfs pull)")
        if not (head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"):  # a zip archive or a legacy pickle
            raise GptlabError(f"{path} is not a PyTorch weights file (it does not start like one); it is damaged or "
                              "something else, download it again")
    try:
        if path.suffix == ".safetensors":
            tensors = load_file(path)
        else:
            tensors = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise GptlabError(f"{path} holds Python objects besides tensors, which gptlab never unpickles; convert "
                          "the checkpoint to safetensors") from None
    except Exception as exc:  # safetensors and torch.load fail in many ways on a truncated or damaged file
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise GptlabError(f"{path} cannot be read ({reason}); it is truncated or damaged, download it again") \
            from None
    if not isinstance(tensors, dict) or not all(torch.is_tensor(t) for t in tensors.values()):
        raise GptlabError(f"{path} is not a state dict of tensors; it is not a GPT-2 checkpoint")
    return tensors


def from_hf_names(tensors: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """HF GPT-2 tensors (with or without the `transformer.` prefix) -> gptlab names, Linear layout, fp32.
    Drops the causal-mask buffers and a tied lm_head; refuses an lm_head that is not tied to wte."""
    out, lm_head = {}, None
    for name, tensor in tensors.items():
        parts = name.split(".")
        if parts[-2:] in (["attn", "bias"], ["attn", "masked_bias"]):  # mask buffers, not c_attn.bias
            continue
        if name == "lm_head.weight":
            lm_head = tensor
            continue
        name = "transformer." + name.removeprefix("transformer.")
        if name.endswith(CONV1D):
            tensor = tensor.t()  # Conv1D (in, out) -> Linear (out, in)
        out[name] = tensor.float().contiguous()
    wte = out.get("transformer.wte.weight")
    if lm_head is not None and wte is not None and not torch.equal(lm_head.float(), wte):
        raise GptlabError(f"the checkpoint in {source} has an lm_head that is not tied to wte; gptlab's GPT-2 "
                          "always ties them")
    return out


def read_hf_model(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The model settings and gptlab-named weights of the GPT-2 in `folder`; raises GptlabError on bad input."""
    folder = Path(folder)
    model_cfg = read_hf_config(folder)
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        tensors.update(read_weight_file(path))
    return model_cfg, from_hf_names(tensors, str(folder))


def load_hf_model(folder: str | Path) -> GPT:
    """The GPT-2 in `folder` as a gptlab GPT in eval mode (fp32, CPU); raises GptlabError on bad input, including
    weights whose names or shapes do not fit the config."""
    model_cfg, tensors = read_hf_model(folder)
    model = GPT(model_cfg)
    ck.load_model_tensors(model, tensors, str(folder))
    return model.eval()


# ---- import -----------------------------------------------------------------------------------------------------

def import_hf(folder: str | Path, run_dir: str | Path) -> GPT:
    """Turn the HF GPT-2 folder into a gptlab run at `run_dir` (config, tokenizer, one "best" checkpoint at step
    0) and return the model. Raises GptlabError on bad input or when `run_dir` already holds a run."""
    folder, run = Path(folder), Path(run_dir)
    check_import_folder(run)
    model_cfg, tensors = read_hf_model(folder)
    tokenizer = read_hf_tokenizer(folder, model_cfg.vocab_size)
    model = GPT(model_cfg)
    ck.load_model_tensors(model, tensors, str(folder))
    source = str(folder.resolve())
    write_imported_run(run, model, TrainConfig(), tokenizer, {"imported_from": source},
                       rundir.TrainingState(to_dict(model_cfg), imported_from=source))
    return model.eval()


def check_import_folder(run: Path) -> None:
    """GptlabError when `run` already holds a run, prepared data or another model."""
    if rundir.folder_kind(run) is not None:
        what = {"run": "a run", "data": "prepared data", "hf": "a model (config.json)"}[rundir.folder_kind(run)]
        raise GptlabError(f"{run} already holds {what}; choose another --run or delete it first")


def write_imported_run(run: Path, model: torch.nn.Module, train_cfg: TrainConfig, tokenizer: Tokenizer,
                       extra: dict[str, Any], state: rundir.TrainingState) -> None:
    """A new run at `run` holding `model` as its one "best" checkpoint at step 0; nothing left when it fails."""
    with rundir.RunLock(run) as lock:
        try:
            rundir.init_run(run, from_dict(ModelConfig, state.model), train_cfg, tokenizer, extra)
            ck.save_checkpoint(run, "best", 0, model, state, keep=1)
        except GptlabError:
            lock.undo()
            raise


# ---- export -----------------------------------------------------------------------------------------------------

def to_hf_tensors(model: GPT, vocab_size: int) -> dict[str, torch.Tensor]:
    """The model's weights under HF GPT2LMHeadModel's names and Conv1D layout, wte cut to `vocab_size` rows,
    zero biases where the model has none (HF GPT-2 always has them), no lm_head (HF ties it to wte)."""
    out = {}
    for name, tensor in ck.model_tensors(model).items():
        if name.endswith(CONV1D):
            tensor = tensor.t()  # Linear (out, in) -> Conv1D (in, out)
        out[name] = tensor.float().contiguous()
    out["transformer.wte.weight"] = out["transformer.wte.weight"][:vocab_size].clone()
    for name in list(out):
        bias = name.removesuffix(".weight") + ".bias"
        if name.endswith(".weight") and ".wte." not in name and ".wpe." not in name and bias not in out:
            out[bias] = torch.zeros(out[name].shape[-1])  # Conv1D (in, out) and LayerNorm (C,): last dim
    return out


def hf_config(model_cfg: ModelConfig, tokenizer: Tokenizer) -> dict[str, Any]:
    """config.json for transformers' GPT2LMHeadModel describing `model_cfg` with the tokenizer's vocabulary."""
    c = model_cfg
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": tokenizer.vocab_size, "n_positions": c.block_size,
        "n_ctx": c.block_size,  # the legacy name, still read by some converters (llama.cpp's GGUF)
        "n_embd": c.n_embd, "n_layer": c.n_layer, "n_head": c.n_head, "n_inner": None,
        "activation_function": "gelu_new" if c.activation == "gelu_tanh" else "gelu",
        "layer_norm_epsilon": c.layer_norm_eps,
        "resid_pdrop": c.dropout, "embd_pdrop": c.dropout, "attn_pdrop": c.dropout,
        "initializer_range": 0.02, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "tie_word_embeddings": True, "use_cache": True,
        "bos_token_id": tokenizer.eot_id, "eos_token_id": tokenizer.eot_id, "dtype": "float32",
    }


@contextlib.contextmanager
def staged_folder(out: Path):
    """A new hidden folder beside `out` to write into. When the block ends, its files move into `out` (made if
    missing; files of other names already there stay) with EXPORT_MARK, which lets a later export replace them;
    when the block raises, it is removed, with the parent
    folders made for it, so a failed write changes nothing on disk."""
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()][-1:]  # the topmost one made here
    staging = out.parent / f".{out.name}.export-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)  # left by a killed export of a process with this id
        staging.mkdir()
    except OSError as exc:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)
        raise GptlabError(f"cannot create output folder {out}: {exc.strerror}") from None
    try:
        yield staging
        rundir.write_json(staging / EXPORT_MARK, {"written_by": f"gptlab {__version__}",
                                                  "files": sorted(os.listdir(staging))})
        if out.is_dir():
            for path in staging.iterdir():
                os.replace(path, out / path.name)
            staging.rmdir()
        else:
            os.replace(staging, out)
    except BaseException:
        for folder in [staging, *made]:
            shutil.rmtree(folder, ignore_errors=True)
        raise


def check_export_folder(out: Path, run_dir: str | Path, overwrite: bool = False) -> None:
    """GptlabError when `out` cannot take an export of `run_dir`: the run itself, a run or data folder, a file, or
    (unless `overwrite`) a folder holding files gptlab did not export there (no EXPORT_MARK)."""
    if out.resolve() == Path(run_dir).resolve() or rundir.folder_kind(out) in ("run", "data"):
        kind = "the run itself" if out.resolve() == Path(run_dir).resolve() else \
            {"run": "a gptlab run", "data": "a prepared data folder"}[rundir.folder_kind(out)]
        raise GptlabError(f"--out {out} is {kind}; exporting there would overwrite its config.json and "
                          "tokenizer.json, so give --out a folder of its own")
    if out.exists() and not out.is_dir():
        raise GptlabError(f"{out} exists and is not a folder; give --out a new or existing folder")
    theirs = [] if overwrite or not out.is_dir() or (out / EXPORT_MARK).is_file() else sorted(os.listdir(out))
    if theirs:
        shown = ", ".join(theirs[:4]) + (f" and {len(theirs) - 4} more" if len(theirs) > 4 else "")
        raise GptlabError(f"{out} holds files gptlab did not write ({shown}); give --out a new or empty folder, or "
                          "pass --overwrite to write the export's files there (replacing those of the same names)")


def write_weights(tensors: dict[str, torch.Tensor], staging: Path, out: Path, name: str) -> None:
    """`tensors` as staging/name in safetensors with the "pt" format mark transformers and PEFT check, readable as
    the umask allows (safetensors writes 0600); one line naming out/name when the disk refuses."""
    try:
        save_file(tensors, staging / name, metadata={"format": "pt"})
        os.chmod(staging / name, rundir.umask_mode())
    except (OSError, SafetensorError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).strip()
        raise GptlabError(f"cannot write {out / name}: {reason}; check free space") from None


def export_hf(run_dir: str | Path, out_dir: str | Path, which: str = "best", merge: bool = False,
              overwrite: bool = False) -> list[str]:
    """Write the run's model (its best checkpoint, else its latest) as a HF GPT-2 folder: config.json,
    model.safetensors and tokenizer files, all or nothing (see staged_folder); a LoRA run's with `merge`, its
    adapters merged into its base; into a new or empty folder, an earlier export, or with `overwrite` any folder.
    Returns the names written; raises GptlabError on bad input."""
    out = Path(out_dir)
    check_export_folder(out, run_dir, overwrite)
    adapters = lora.settings(rundir.read_run_config(run_dir)["train"])
    if adapters is not None and not merge:
        raise GptlabError(f"{run_dir} holds LoRA adapters ({adapters}): export --merge writes the whole model with "
                          "them merged in, --format peft the adapters alone")
    if merge and adapters is None:
        raise GptlabError(f"{run_dir} has no LoRA adapters to merge (it was trained in full); export it without "
                          "--merge")
    loaded = ck.load_run(run_dir, which)
    if not is_gpt(loaded.model):
        raise GptlabError(f"{run_dir} holds a {loaded.model_cfg.arch} model; only GPT models have a Hugging Face "
                          "GPT-2 form")
    tensors = to_hf_tensors(loaded.model, loaded.tokenizer.vocab_size)
    with staged_folder(out) as staging:
        write_weights(tensors, staging, out, "model.safetensors")
        rundir.write_json(staging / HF_CONFIG, hf_config(loaded.model_cfg, loaded.tokenizer))
        names = write_tokenizer_files(staging, loaded.tokenizer, loaded.model_cfg.block_size)
    return [HF_CONFIG, "model.safetensors"] + names


# ---- the weights fine-tuning starts from (`gptlab train --init-from`) --------------------------------------------

def source_model_config(source: str | Path) -> ModelConfig:
    """The model settings of a gptlab run or a HF GPT-2 folder; raises GptlabError when it is neither."""
    path = Path(source)
    if rundir.is_run(path):
        return from_dict(ModelConfig, rundir.read_run_config(path)["model"])
    if (path / HF_CONFIG).is_file():
        return read_hf_config(path)
    raise GptlabError(f"--init-from {source}: not a gptlab run nor a Hugging Face GPT-2 folder; give a folder made "
                      "by `gptlab train` / `gptlab import`, or one with config.json + model.safetensors")


def _read_source(source: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    path = Path(source)
    if rundir.is_run(path):
        loaded = ck.load_run(path)
        return loaded.model_cfg, ck.model_tensors(loaded.model), loaded.tokenizer
    source_model_config(path)  # refuses what is neither
    model_cfg, tensors = read_hf_model(path)
    return model_cfg, tensors, read_hf_tokenizer(path, model_cfg.vocab_size)


def init_tensors(source: str | Path, model_cfg: ModelConfig, tokenizer: Tokenizer) -> dict[str, torch.Tensor]:
    """The weights of `source` (a gptlab run's best checkpoint, else its latest, or a HF GPT-2 folder) for a model
    of `model_cfg` that trains on data tokenized by `tokenizer`: only dropout, the attention path and a shorter
    block_size (position embeddings cropped) may differ from the source, and the vocabulary when `tokenizer` is the
    source's with the chat markers added (their rows grown, see chat.grow_vocab). Raises GptlabError when the
    shape or the tokenizer does not match."""
    src_cfg, tensors, src_tokenizer = _read_source(source)
    chat = rows_added(src_tokenizer, tokenizer)
    vocab = max(src_cfg.vocab_size, tokenizer.vocab_size) if chat else src_cfg.vocab_size
    same = ("arch", "n_layer", "n_head", "n_embd", "bias", "activation", "layer_norm_eps")
    diff = [f"{k}={getattr(model_cfg, k)} (source {getattr(src_cfg, k)})" for k in same
            if getattr(model_cfg, k) != getattr(src_cfg, k)]
    if model_cfg.vocab_size != vocab:
        diff.insert(0, f"vocab_size={model_cfg.vocab_size} (source {vocab})")
    if diff:
        raise GptlabError(f"--init-from {source}: the model shape comes from the source, but {', '.join(diff)}; "
                          "drop those settings")
    if model_cfg.block_size > src_cfg.block_size:
        raise GptlabError(f"--init-from {source}: block_size {model_cfg.block_size} is longer than the source's "
                          f"{src_cfg.block_size}; it can only be cut shorter")
    if not chat and tokenizer.to_dict() != src_tokenizer.to_dict():
        fix = "--tokenizer gpt2" if src_tokenizer.kind == "gpt2" else "the source's own tokenizer"
        raise GptlabError(f"--init-from {source}: the data was prepared with a {tokenizer.kind} tokenizer of "
                          f"{tokenizer.vocab_size} ids, but the source uses a different {src_tokenizer.kind} "
                          f"tokenizer of {src_tokenizer.vocab_size}; prepare the data with {fix}")
    if chat:
        tensors = grow_vocab(tensors, src_tokenizer.vocab_size, vocab)
    return ck.crop_positions(tensors, model_cfg.block_size)
