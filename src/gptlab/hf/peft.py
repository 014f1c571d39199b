"""LoRA adapters in PEFT's format, both ways: adapter_config.json + adapter_model.safetensors, the folder that
`peft.PeftModel.from_pretrained` loads onto transformers' GPT2LMHeadModel of the exported base. transformers' GPT-2
keeps its Linears as Conv1D (weights transposed), so PEFT marks them fan_in_fan_out; its lora_A (r, in) and lora_B
(out, r) are laid out as ours, under "base_model.model." + our names. The rows of tokens a fine-tune added (the
chat markers) are PEFT's trainable tokens (`trainable_token_indices`, tied to the LM head as GPT-2 ties it); PEFT
puts them on the base's embedding, so the base must first be grown to the adapter's tokenizer
(`model.resize_token_embeddings(len(tokenizer))`): the folder holds that tokenizer and its chat template."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from gptlab import checkpoint as ck
from gptlab import lora, rundir
from gptlab.chat import grow_vocab
from gptlab.config import LORA_TARGETS, TrainConfig, to_dict
from gptlab.errors import GptlabError
from gptlab.hf.gpt2_folders import (check_export_folder, check_import_folder, staged_folder, write_imported_run,
                         write_weights)
from gptlab.hf.hf_tokenizer import write_tokenizer_files
from gptlab.lora import TOKEN_IDS
from gptlab.model import build_model
from gptlab.tokenizer import ChatTokenizer

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
TOKEN_VALUES = "transformer.wte.token_values"  # ours, beside lora.TOKEN_IDS; PEFT's name for the rows:
PEFT_TOKENS = "transformer.wte.token_adapter.trainable_tokens_delta"  # (despite the name, the rows themselves)
# PEFT settings gptlab's adapters do not have: an adapter that uses one is refused rather than loaded differently
_UNSUPPORTED = {"use_dora": False, "use_rslora": False, "modules_to_save": None, "layers_to_transform": None,
               "rank_pattern": {}, "alpha_pattern": {}, "lora_bias": False, "bias": "none",
               "target_parameters": None, "layer_replication": None,
               "use_qalora": False, "exclude_modules": None, "megatron_config": None, "loftq_config": {},
               "alora_invocation_tokens": None, "arrow_config": None, "use_bdlora": None, "velora_config": None,
               "monteclora_config": None, "kasa_config": None, "astra_config": None}
# LoraConfig's other settings: those read below, and those that leave the adapters' model plain LoRA (metadata; PEFT
# sets fan_in_fan_out itself for GPT-2's Conv1D; layers_pattern is read only with layers_to_transform; an
# initialisation's settings, its name being checked: _INITS)
_READ = ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "target_modules", "init_lora_weights",
         "trainable_token_indices")
_HARMLESS = ("auto_mapping", "peft_version", "base_model_name_or_path", "revision", "inference_mode", "fan_in_fan_out",
             "layers_pattern", "megatron_core", "eva_config", "corda_config", "lora_ga_config", "qalora_group_size",
             "runtime_config", "ensure_weight_tying")
_INITS = (True, False, "gaussian", "eva", "orthogonal")  # PEFT's starts that leave the base as it was and train A, B
_TASKS = (None, "CAUSAL_LM")  # adapters for GPT-2's language-model head (another task's model has other modules)


def hub_name(folder: str | Path) -> str:
    """The Hugging Face name of a model folder: "org/name" for a snapshot in Hugging Face's cache
    (.../models--org--name/snapshots/HASH), else the folder's own name (what `--local-dir` downloads are named)."""
    path = Path(folder)
    cached = [part for part in path.parts if part.startswith("models--")]
    return cached[-1].removeprefix("models--").replace("--", "/") if cached else path.name


def base_name(base_run: str | Path) -> str | None:
    """adapter_config.json's base_model_name_or_path: the Hugging Face name of the model the base run was imported
    from; None for a base trained here, which has none (its local path would tell others nothing peft can use)."""
    try:
        config = rundir.read_run_config(base_run)
    except GptlabError:
        return None
    source = config.get("imported_from")
    return hub_name(source) if isinstance(source, str) and lora.settings(config["train"]) is None else None


def adapter_config(adapters: lora.LoraSettings, base: str | None,
                   tokens: list[int] | None = None) -> dict[str, Any]:
    """adapter_config.json for `adapters` (and the rows of added `tokens`) on transformers' GPT-2 (PEFT's
    LoraConfig fields that matter; PEFT fills in the rest with its defaults)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": adapters.rank,
            "lora_alpha": adapters.alpha, "lora_dropout": adapters.dropout, "target_modules": list(adapters.targets),
            "fan_in_fan_out": True, "bias": "none", "inference_mode": True, "init_lora_weights": True,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "trainable_token_indices": tokens or None}


def export_peft(run_dir: str | Path, out_dir: str | Path, overwrite: bool = False) -> list[str]:
    """Write a LoRA run's adapters (its best checkpoint, else its latest) in PEFT's format, all or nothing, where
    hf.check_export_folder allows (`overwrite`: over another project's files too); returns the names written.
    GptlabError when the run has no adapters or --out is taken."""
    out = Path(out_dir)
    check_export_folder(out, run_dir, overwrite)
    adapters = lora.settings(rundir.read_run_config(run_dir)["train"])
    if adapters is None:
        raise GptlabError(f"{run_dir} has no LoRA adapters (it was trained in full); export it with --format hf")
    loaded = ck.load_run(run_dir, merge=False)
    own = ck.model_tensors(loaded.model)
    ids = own.pop(TOKEN_IDS, None)
    tokens = None if ids is None else ids.tolist()
    if TOKEN_VALUES in own:
        own[PEFT_TOKENS] = own.pop(TOKEN_VALUES)
    tensors = {PREFIX + name: t.float().contiguous() for name, t in own.items()}
    base = base_name((loaded.state.base or {}).get("run", ""))
    with staged_folder(out) as staging:
        write_weights(tensors, staging, out, ADAPTER_WEIGHTS)
        rundir.write_json(staging / ADAPTER_CONFIG, adapter_config(adapters, base, tokens))
        names = write_tokenizer_files(staging, loaded.tokenizer, loaded.model_cfg.block_size) if tokens else []
    return [ADAPTER_CONFIG, ADAPTER_WEIGHTS] + names


def read_adapter(folder: str | Path) -> tuple[lora.LoraSettings, dict[str, torch.Tensor]]:
    """The LoRA settings and tensors (under gptlab's names) of a PEFT adapter folder; GptlabError when it is not
    one, or uses a PEFT feature gptlab's adapters do not have."""
    folder = Path(folder)
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
    except FileNotFoundError:
        raise GptlabError(f"{folder} is not a PEFT adapter folder (no {ADAPTER_CONFIG})") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise GptlabError(f"{folder / ADAPTER_CONFIG} is damaged (not valid JSON)") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else None
        raise GptlabError(f"{folder} holds a PEFT adapter of type {kind!r}; gptlab imports LoRA adapters only")
    for key, plain in _UNSUPPORTED.items():
        if config.get(key, plain) not in (plain, None, {}, False):
            raise GptlabError(f"{folder}: the adapter sets {key} = {config[key]!r}, which gptlab's LoRA does not "
                              "implement; only plain LoRA adapters import")
    targets = _plain_targets(config, folder)
    try:
        train = TrainConfig(init_from="-", lora_rank=int(config["r"]), lora_alpha=float(config["lora_alpha"]),
                            lora_dropout=float(config.get("lora_dropout") or 0.0), lora_targets=",".join(targets))
    except (KeyError, TypeError, ValueError) as exc:
        raise GptlabError(f"{folder / ADAPTER_CONFIG} lacks a usable r, lora_alpha or target_modules ({exc})") from None
    except GptlabError as exc:
        raise GptlabError(f"{folder}: {exc}") from None
    if not (folder / ADAPTER_WEIGHTS).is_file():
        raise GptlabError(f"{folder} has no {ADAPTER_WEIGHTS} (gptlab reads adapters in safetensors only)")
    try:
        tensors = load_file(folder / ADAPTER_WEIGHTS)
    except (SafetensorError, OSError) as exc:
        raise GptlabError(f"{folder / ADAPTER_WEIGHTS} cannot be read ({exc})") from None
    named = {name.removeprefix(PREFIX): t.float() for name, t in tensors.items()}
    tokens = _token_indices(config.get("trainable_token_indices"), folder)
    if tokens:
        named[TOKEN_VALUES], named[TOKEN_IDS] = named.pop(PEFT_TOKENS, torch.zeros(0)), torch.tensor(tokens)
    settings = lora.settings(train)
    assert settings is not None
    return settings, named


def _plain_targets(config: dict[str, Any], folder: Path) -> list[str]:
    """adapter_config.json's target_modules, a list of layers gptlab adapts, after its task and start are checked;
    GptlabError naming the setting for another task, a start that changed the base's weights (PiSSA, OLoRA, CorDA,
    LoftQ, LoRA-GA) or froze B (MiCA), a regular expression (what PEFT makes of a string) or a layer gptlab does not
    adapt."""
    def refuse(key: str, why: str = "") -> GptlabError:
        return GptlabError(f"{folder}: the adapter sets {key} = {config[key]!r}{why}, which gptlab's LoRA does not "
                           "implement; only plain LoRA adapters import")
    if config.get("task_type") not in _TASKS:
        raise refuse("task_type", " (a model other than GPT-2's language model)")
    if config.get("init_lora_weights", True) not in _INITS:
        raise refuse("init_lora_weights")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        raise refuse("target_modules", " (a regular expression over whole module names)")
    if isinstance(targets, list) and any(t not in LORA_TARGETS for t in targets):
        raise refuse("target_modules", f" (gptlab adapts {', '.join(LORA_TARGETS)})")
    return targets


def _token_indices(given: Any, folder: Path) -> list[int]:
    """PEFT's trainable_token_indices (a list, or one embedding's list by module name) as a list of ids."""
    if isinstance(given, dict) and len(given) == 1 and str(next(iter(given))).endswith("wte"):
        given = next(iter(given.values()))
    if given is None or (isinstance(given, list) and all(isinstance(i, int) for i in given)):
        return list(given or [])
    raise GptlabError(f"{folder}: trainable_token_indices {given!r} is not a list of token ids of the embedding; "
                      "gptlab trains added tokens on transformer.wte only")


def import_peft(folder: str | Path, base_run: str | Path, run_dir: str | Path) -> int:
    """Turn a PEFT LoRA adapter for the model of `base_run` (a gptlab run) into a LoRA run at `run_dir` (config,
    tokenizer, one "best" checkpoint at step 0 holding the adapters and naming its base); returns the adapters'
    parameter count. GptlabError on bad input; nothing is written then."""
    run = Path(run_dir)
    check_import_folder(run)
    if not rundir.is_run(Path(base_run)):
        raise GptlabError(f"--base {base_run} is not a gptlab run; import the base model first (gptlab import hf "
                          "FOLDER --run RUN) and give --base RUN")
    adapters, tensors = read_adapter(folder)
    loaded = ck.load_run(base_run)
    model, base, tokenizer = loaded.model, ck.model_tensors(loaded.model), loaded.tokenizer
    tokens = tensors[TOKEN_IDS].tolist() if TOKEN_IDS in tensors else None
    if tokens:  # the chat markers' rows: the base grown for them, as fine-tuning grew it
        model, base, tokenizer = _grown(loaded, tokens, folder)
    try:
        lora.apply_lora(model, adapters, tokens)
        ck.load_model_tensors(model, tensors, str(folder))
    except GptlabError as exc:
        raise GptlabError(f"the adapter in {folder} does not fit the model of {base_run}: {exc}") from None
    source = str(Path(folder).resolve())
    train = TrainConfig(init_from=str(Path(base_run).resolve()), lora_rank=adapters.rank, lora_alpha=adapters.alpha,
                        lora_dropout=adapters.dropout, lora_targets=",".join(adapters.targets))
    ref = {"run": train.init_from, "sha256": lora.tensors_sha256(base)}
    state = rundir.TrainingState(to_dict(model.config), train=to_dict(train), imported_from=source, base=ref)
    preset = rundir.read_run_config(base_run).get("preset")  # the base's, as a run fine-tuned from it shows its own
    write_imported_run(run, model, train, tokenizer, {"imported_from": source, "base": ref,
                                                      **({"preset": preset} if preset else {})}, state)
    return lora.adapter_count(model)


def _grown(loaded: ck.LoadedRun, tokens: list[int],
           folder: Path) -> tuple[torch.nn.Module, dict[str, torch.Tensor], ChatTokenizer]:
    """The base model, its weights and tokenizer grown by the chat markers, which `tokens` must be."""
    tokenizer = ChatTokenizer(loaded.tokenizer)
    if isinstance(loaded.tokenizer, ChatTokenizer) or sorted(tokens) != sorted(tokenizer.special_ids.values()):
        raise GptlabError(f"{folder}: the adapter trains the rows of tokens {tokens}, which are not the chat "
                          f"markers added to the base's tokenizer ({sorted(tokenizer.special_ids.values())})")
    cfg = dataclasses.replace(loaded.model_cfg, vocab_size=max(loaded.model_cfg.vocab_size, tokenizer.vocab_size))
    base = grow_vocab(ck.model_tensors(loaded.model), loaded.tokenizer.vocab_size, cfg.vocab_size)
    model = build_model(cfg)
    ck.load_model_tensors(model, base, str(folder))
    return model, base, tokenizer
