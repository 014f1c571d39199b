"""Tokenizers in Hugging Face's formats, both ways: GPT-2's vocab.json / merges.txt / tokenizer.json derived from the
bundled tiktoken ranks, the tokenizer of an imported folder, and the tokenizer files an export writes (which
transformers' AutoTokenizer loads)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING

from gptlab.errors import GptlabError
from gptlab.rundir import write_atomic
from gptlab.tokenizer import (CHAT_TEMPLATE, CHAT_TOKENS, EOT, CharTokenizer, ChatTokenizer, GPT2Tokenizer, Tokenizer,
                              byte_decoder, gpt2_ranks)
from gptlab.tokenizer import load as load_tokenizer

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HFTokenizer

GPTLAB_TOKENIZER = "gptlab_tokenizer.json"  # written by export, so that importing the folder back is exact


# ---- GPT-2's vocabulary in Hugging Face's format, derived from the bundled tiktoken ranks -----------------------

@functools.lru_cache(maxsize=1)
def _byte_encoder() -> dict[int, str]:
    return {b: ch for ch, b in byte_decoder().items()}


def _byte_piece(token: bytes) -> str:
    """A byte string in GPT-2's printable byte alphabet, as vocab.json and merges.txt spell it."""
    encoder = _byte_encoder()
    return "".join(encoder[b] for b in token)


@functools.lru_cache(maxsize=1)
def gpt2_vocab() -> dict[str, int]:
    """GPT-2's vocab.json: 50,257 byte-level pieces -> ids, `<|endoftext|>` last."""
    vocab = {_byte_piece(token): rank for token, rank in gpt2_ranks().items()}
    vocab[EOT] = len(vocab)
    return vocab


def _split(token: bytes, ranks: dict[bytes, int], max_rank: int) -> list[bytes]:
    """BPE of `token` using only merges ranked below max_rank: for a token of rank r this yields the two parts
    whose merge made it, which is how the merge list is recovered from tiktoken's ranks."""
    parts = [bytes([b]) for b in token]
    while True:
        best: tuple[int, int] | None = None  # (position, rank) of the lowest-ranked adjacent pair
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < max_rank and (best is None or rank < best[1]):
                best = (i, rank)
        if best is None:
            return parts
        i = best[0]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


@functools.lru_cache(maxsize=1)
def gpt2_merges() -> list[tuple[str, str]]:
    """GPT-2's 50,000 merges in rank order, as merges.txt lists them."""
    ranks = gpt2_ranks()
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            left, right = _split(token, ranks, rank)
            merges.append((_byte_piece(left), _byte_piece(right)))
    return merges


def has_gpt2_vocabulary(folder: Path) -> bool:
    """Whether the tokenizer files in `folder` (vocab.json, else tokenizer.json) hold GPT-2's vocabulary."""
    try:
        if (folder / "vocab.json").is_file():
            vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
        else:
            vocab = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        raise GptlabError(f"the tokenizer files in {folder} are damaged; download them again") from None
    return vocab == gpt2_vocab()


def read_hf_tokenizer(folder: str | Path, vocab_size: int) -> Tokenizer:
    """The tokenizer of a HF folder: the one gptlab exported there, else GPT-2's (which the folder's tokenizer
    files, if any, must hold). Raises GptlabError for another tokenizer or one larger than the model's vocab."""
    folder = Path(folder)
    if (folder / GPTLAB_TOKENIZER).is_file():
        tokenizer = load_tokenizer(folder / GPTLAB_TOKENIZER)
    elif any((folder / name).is_file() for name in ("vocab.json", "tokenizer.json")) \
            and not has_gpt2_vocabulary(folder):
        raise GptlabError(f"{folder} has its own tokenizer, not GPT-2's; gptlab imports models with GPT-2's "
                          "vocabulary or folders written by `gptlab export`")
    else:
        tokenizer = GPT2Tokenizer()  # GPT-2 files, or none: a GPT-2 checkpoint implies GPT-2's vocabulary
    if tokenizer.vocab_size > vocab_size:
        raise GptlabError(f"the model in {folder} has vocab_size {vocab_size}, fewer than the {tokenizer.vocab_size} "
                          f"ids of its {tokenizer.kind} tokenizer; it was not trained with that tokenizer")
    return tokenizer


def _hf_tokenizer(tokenizer: Tokenizer) -> HFTokenizer:
    """The tokenizer as a Hugging Face `tokenizers.Tokenizer`, which transformers loads from tokenizer.json."""
    from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    if isinstance(tokenizer, ChatTokenizer):  # the base's, with the chat markers added after its ids
        hf = HFTokenizer.from_str(_hf_tokenizer(tokenizer.base).to_str())  # a copy: a trained BPE is shared
        hf.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in CHAT_TOKENS])
        return hf
    if isinstance(tokenizer, GPT2Tokenizer):
        hf = HFTokenizer(models.BPE(vocab=gpt2_vocab(), merges=gpt2_merges()))
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        hf.add_special_tokens([AddedToken(EOT, special=True)])
        return hf
    if isinstance(tokenizer, CharTokenizer):
        hf = HFTokenizer(models.WordLevel(vocab=tokenizer.stoi, unk_token=None))
        hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one piece per character
        hf.decoder = decoders.Fuse()  # join the characters back with nothing between them
        return hf
    return tokenizer.hf  # a trained byte-level BPE is a Hugging Face tokenizer already


def write_tokenizer_files(out: Path, tokenizer: Tokenizer, max_length: int) -> list[str]:
    """Write tokenizer.json + tokenizer_config.json (and GPT-2's vocab.json + merges.txt for a GPT-2 run) that
    transformers' AutoTokenizer loads, plus gptlab's own tokenizer file. Returns the names written."""
    special = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT} if tokenizer.eot_id is not None else {}
    gpt2 = isinstance(tokenizer, GPT2Tokenizer)  # a chat tokenizer is GPT-2's with added tokens: tokenizer.json only
    config = {"tokenizer_class": "GPT2Tokenizer" if gpt2 else "PreTrainedTokenizerFast",
              "model_max_length": max_length, "clean_up_tokenization_spaces": False, **special}
    if isinstance(tokenizer, ChatTokenizer):
        config.update(chat_template=CHAT_TEMPLATE, additional_special_tokens=list(CHAT_TOKENS))
    files = {"tokenizer.json": _hf_tokenizer(tokenizer).to_str(),
             GPTLAB_TOKENIZER: json.dumps(tokenizer.to_dict(), ensure_ascii=False)}
    if gpt2:
        config.update(add_prefix_space=False, errors="replace")
        files["vocab.json"] = json.dumps(gpt2_vocab(), ensure_ascii=False)
        files["merges.txt"] = "#version: 0.2\n" + "".join(f"{left} {right}\n" for left, right in gpt2_merges())
    files["tokenizer_config.json"] = json.dumps(config, indent=2) + "\n"
    for name, text in files.items():
        write_atomic(out / name, text.encode())
    return list(files)
