"""A run as a GGUF file that llama.cpp (and ollama, LM Studio, llamafile) runs: `gptlab export RUN --format gguf
--outtype f32|bf16|q8_0 --out FILE`.

Written with the `gguf` package (ggml's own writer and quantizer) in llama.cpp's GPT-2 architecture: its tensor
names, the fused QKV projection in nn.Linear's layout (ggml's first dimension is the input), biases everywhere
(zeros where gptlab's model has none), the LM head tied to `token_embd` (llama.cpp duplicates it), the
hyperparameters, and the vocabulary (ggml/vocab.py). The tensor types follow llama.cpp's own converter: vectors
(LayerNorms, biases) and the position table stay F32; a matrix takes the outtype, and a matrix whose rows do not
divide into q8_0's 32-weight blocks falls back to F16, as the converter falls back.

llama.cpp's GPT-2 graph computes GELU's tanh form whatever the model was trained with, so a run trained with the
exact GELU (gptlab's default) is refused unless the export is asked to approximate, and then the KL divergence the
approximation costs is measured and reported (`gelu_kl`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gptlab import checkpoint as ck
from gptlab import rundir
from gptlab.config import ModelConfig, to_dict
from gptlab.errors import GptlabError
from gptlab.ggml.vocab import GPTLAB_KEY, Vocab, to_vocab
from gptlab.model import GPT, is_gpt
from gptlab.tokenizer import Tokenizer

ARCH = "gpt2"
OUTTYPES = ("f32", "bf16", "q8_0")
FILE_TYPES = {"f32": 0, "bf16": 32, "q8_0": 7}  # llama.cpp's general.file_type (gguf.LlamaFileType)
MODEL_KEY = "gptlab.model"  # the run's ModelConfig as JSON: a file gptlab wrote imports back as its run
Q8_BLOCK = 32  # weights per q8_0 block, each block with one fp16 scale
TOP = {"transformer.wte.weight": "token_embd.weight", "transformer.wpe.weight": "position_embd.weight",
       "transformer.ln_f.weight": "output_norm.weight", "transformer.ln_f.bias": "output_norm.bias"}
BLOCK = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
         "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}


def gguf_name(name: str) -> str:
    """gptlab's name of a weight -> llama.cpp's (`transformer.h.3.mlp.c_fc.bias` -> `blk.3.ffn_up.bias`)."""
    if name in TOP:
        return TOP[name]
    parts = name.split(".")
    if parts[:2] != ["transformer", "h"] or len(parts) < 5 or ".".join(parts[3:-1]) not in BLOCK:
        raise AssertionError(f"no GGUF name for {name}")
    return f"blk.{parts[2]}.{BLOCK['.'.join(parts[3:-1])]}.{parts[-1]}"


def gguf_tensors(model: GPT, vocab_size: int) -> dict[str, np.ndarray]:
    """The model's weights under llama.cpp's names, fp32, `token_embd` cut to the tokenizer's `vocab_size` rows and
    a zero bias beside every matrix and LayerNorm that has none (llama.cpp's GPT-2 requires them)."""
    # model_tensors stores the tied head once, as wte: llama.cpp's GPT-2 reads token_embd when output.weight is absent
    out = {gguf_name(name): t.detach().float().cpu().numpy() for name, t in ck.model_tensors(model).items()}
    out["token_embd.weight"] = np.ascontiguousarray(out["token_embd.weight"][:vocab_size])
    for name in list(out):
        bias = name.removesuffix(".weight") + ".bias"
        if name.startswith(("blk.", "output_norm")) and name.endswith(".weight") and bias not in out:
            out[bias] = np.zeros(out[name].shape[0], dtype=np.float32)
    return out


def tensor_type(name: str, array: np.ndarray, outtype: str) -> str:
    """The type llama.cpp's converter gives this tensor at `outtype`: "f32", "f16", "bf16" or "q8_0"."""
    if array.ndim == 1 or name == "position_embd.weight":  # LayerNorms and biases are GPT-2's only vectors
        return "f32"
    if outtype == "q8_0" and array.shape[1] % Q8_BLOCK:
        return "f16"  # the converter's fallback when a row is no whole number of blocks
    return outtype


def encoded(array: np.ndarray, kind: str) -> tuple[np.ndarray, object]:
    """(the bytes or values to write, their ggml type) for `array` as `kind`, by the gguf package's quantizer
    (bit-exact with ggml's reference: round-to-nearest-even bf16, q8_0 blocks of 32 with an fp16 scale)."""
    import gguf

    qtype = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
             "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[kind]
    return gguf.quants.quantize(np.ascontiguousarray(array), qtype), qtype


def _write_vocab(writer, vocab: Vocab) -> None:
    writer.add_tokenizer_model(vocab.model)
    if vocab.model == "gpt2":
        writer.add_tokenizer_pre("gpt-2")
        writer.add_token_merges(vocab.merges)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    if vocab.eot_id is not None:
        writer.add_bos_token_id(vocab.eot_id)
        writer.add_eos_token_id(vocab.eot_id)
    writer.add_add_bos_token(False)
    if vocab.chat_template is not None:
        writer.add_chat_template(vocab.chat_template)
    writer.add_string(GPTLAB_KEY, json.dumps(vocab.gptlab, ensure_ascii=False))


def write_gguf(path: Path, model_cfg: ModelConfig, tokenizer: Tokenizer, tensors: dict[str, np.ndarray],
               outtype: str, name: str) -> dict[str, int]:
    """Write the GGUF file at `path` in one step (a hidden temp file beside it, renamed into place; nothing left
    when it fails). Returns how many tensors took each type."""
    import gguf

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    kinds: dict[str, int] = {}
    try:
        writer = gguf.GGUFWriter(tmp, ARCH)
        writer.add_name(name)
        writer.add_file_type(FILE_TYPES[outtype])
        writer.add_context_length(model_cfg.block_size)
        writer.add_embedding_length(model_cfg.n_embd)
        writer.add_feed_forward_length(4 * model_cfg.n_embd)
        writer.add_block_count(model_cfg.n_layer)
        writer.add_head_count(model_cfg.n_head)
        writer.add_layer_norm_eps(model_cfg.layer_norm_eps)
        writer.add_string(MODEL_KEY, json.dumps(to_dict(model_cfg)))
        _write_vocab(writer, to_vocab(tokenizer))
        for tensor_name, array in tensors.items():
            kind = tensor_type(tensor_name, array, outtype)
            kinds[kind] = kinds.get(kind, 0) + 1
            data, qtype = encoded(array, kind)
            writer.add_tensor(tensor_name, data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.chmod(tmp, rundir.umask_mode())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise GptlabError(f"cannot write {path}: {exc.strerror or exc}; check free space and permissions") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    rundir.fsync_dir(path.parent)
    return kinds


@dataclass
class GGUFExport:
    """What `export_gguf` wrote."""

    path: Path
    bytes: int
    types: dict[str, int]  # tensor type -> how many tensors
    kl: float | None = None  # exact GELU run exported with the tanh form: mean KL divergence (nats per token)
    agree: float | None = None  # ... and the share of positions whose most likely token stays the same
    kl_text: str = ""  # what the KL was measured on


def check_out(out: Path, overwrite: bool) -> None:
    """GptlabError when `out` cannot take the file: a folder, a folder that does not exist, a name not ending in
    .gguf, or an existing file without `overwrite`."""
    if out.is_dir():
        raise GptlabError(f"--out {out} is a folder; --format gguf writes one file: give its name (e.g. model.gguf)")
    if out.exists() and not overwrite:
        raise GptlabError(f"{out} exists; give another --out, or pass --overwrite to replace it")
    if not out.parent.is_dir():
        raise GptlabError(f"the folder of --out {out} does not exist; create it first")
    if out.suffix != ".gguf":
        raise GptlabError(f"--out {out} should end in .gguf, the name llama.cpp and ollama look for")


def export_gguf(run_dir: str | Path, out: str | Path, outtype: str = "f32", approximate_gelu: bool = False,
                overwrite: bool = False) -> GGUFExport:
    """Write the run's model (its best checkpoint, else its latest; a LoRA run's with its adapters merged) as a
    GGUF file of `outtype`. Raises GptlabError on bad input, before anything is written."""
    out = Path(out)
    if outtype not in OUTTYPES:
        raise GptlabError(f"--outtype {outtype}: choose one of {', '.join(OUTTYPES)}")
    check_out(out, overwrite)
    loaded = ck.load_run(run_dir)
    if not is_gpt(loaded.model):
        raise GptlabError(f"{run_dir} holds a {loaded.model_cfg.arch} model; only GPT models have llama.cpp's GPT-2 "
                          "form")
    cfg = loaded.model_cfg
    kl = None
    if cfg.activation != "gelu_tanh":
        if not approximate_gelu:
            raise GptlabError(f"{run_dir} was trained with the exact GELU, and llama.cpp's GPT-2 always computes its "
                              "tanh form: train with --activation gelu_tanh, or export with --approximate-gelu (it "
                              "reports the KL divergence the tanh form costs)")
        from gptlab.ggml.gelu import gelu_kl

        kl = gelu_kl(run_dir, loaded)
    tensors = gguf_tensors(loaded.model, loaded.tokenizer.vocab_size)
    kinds = write_gguf(out, cfg, loaded.tokenizer, tensors, outtype, Path(run_dir).resolve().name)
    report = GGUFExport(out, out.stat().st_size, kinds)
    if kl is not None:
        report.kl, report.agree, report.kl_text = kl
    return report
