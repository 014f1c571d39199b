r"""gptlab's tokenizers as the vocabulary of a GGUF file, and back.

llama.cpp reads a vocabulary from a GGUF file's `tokenizer.ggml.*` keys. GPT-2's BPE and a BPE trained here are
its "gpt2" kind: the tokens in GPT-2's printable byte alphabet (a space is `Ġ`), the merges in rank order, and the
"gpt-2" pre-tokenizer (the split GPT-2's regex makes, as tiktoken and Hugging Face's ByteLevel make it).

A char vocabulary has no merges to give: as "gpt2" it would fall back to single bytes, which a char vocabulary does
not hold for any character past ASCII, and llama.cpp would call its token 11 the end of text (the kind's default).
It is written as llama.cpp's greedy longest-match kind ("rwkv"): each token its character's UTF-8 bytes, escaped
as that kind escapes them (`\\`, `\n`, `\t`, `\r`, `\xNN`); UTF-8 is prefix-free, so the longest match at every
byte is exactly the next character, which is gptlab's char tokenization, and that kind has no end-of-text token.

A chat tokenizer's four markers follow its base's tokens as control tokens, with its chat template. The gptlab
tokenizer file itself travels in the `gptlab.tokenizer` key, so a file gptlab wrote imports back exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from gptlab.errors import GptlabError
from gptlab.hf.hf_tokenizer import gpt2_merges, gpt2_vocab
from gptlab.tokenizer import (CHAT_TEMPLATE, CHAT_TOKENS, BPETokenizer, CharTokenizer, ChatTokenizer,
                              GPT2Tokenizer, Tokenizer, byte_decoder)
from gptlab.tokenizer import from_dict as tokenizer_from_dict

NORMAL, CONTROL = 1, 3  # gguf.TokenType's values (llama.cpp's token attributes) for the two kinds written here
GPTLAB_KEY = "gptlab.tokenizer"  # gptlab's own tokenizer file, as JSON
RWKV_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


@dataclass
class Vocab:
    """A GGUF vocabulary: the `tokenizer.ggml.*` values."""

    model: str  # "gpt2" (byte-level BPE) or "rwkv" (greedy longest match)
    tokens: list[str]
    types: list[int]
    merges: list[str] = field(default_factory=list)  # "left right", rank order ("gpt2" only)
    eot_id: int | None = None  # end of text: bos and eos ("gpt2" only)
    chat_template: str | None = None
    gptlab: dict[str, Any] | None = None  # gptlab's own tokenizer file


def escape_char(ch: str) -> str:
    """One character as llama.cpp's "rwkv" vocabulary spells it (its unescaping reads lower-case hex)."""
    if ch in RWKV_ESCAPES:
        return RWKV_ESCAPES[ch]
    return f"\\x{ord(ch):02x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch


def unescape_token(text: str) -> bytes:
    """The bytes of a "rwkv" token, as llama.cpp unescapes it (a backslash ending the token is dropped)."""
    out, raw, i = bytearray(), text.encode("utf-8"), 0
    while i < len(raw):
        if raw[i] != ord("\\"):
            out.append(raw[i])
            i += 1
        elif raw[i + 1:i + 2] == b"x":
            out.append(int(raw[i + 2:i + 4], 16))
            i += 4
        else:
            out += {b"n": b"\n", b"t": b"\t", b"r": b"\r"}.get(raw[i + 1:i + 2], raw[i + 1:i + 2])
            i += 2
    return bytes(out)


def _bpe_vocab(tokenizer: GPT2Tokenizer | BPETokenizer) -> Vocab:
    if isinstance(tokenizer, GPT2Tokenizer):
        pieces = sorted(gpt2_vocab(), key=gpt2_vocab().__getitem__)
        merges = [f"{left} {right}" for left, right in gpt2_merges()]
    else:
        model = json.loads(tokenizer.hf.to_str())["model"]
        pieces = [tokenizer.hf.id_to_token(i) for i in range(tokenizer.vocab_size)]
        merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [CONTROL if i == tokenizer.eot_id else NORMAL for i in range(len(pieces))]
    return Vocab("gpt2", pieces, types, merges, tokenizer.eot_id)


def to_vocab(tokenizer: Tokenizer) -> Vocab:
    """The GGUF vocabulary that makes llama.cpp tokenize and detokenize as `tokenizer` does."""
    base = tokenizer.base if isinstance(tokenizer, ChatTokenizer) else tokenizer
    if isinstance(base, CharTokenizer):
        vocab = Vocab("rwkv", [escape_char(ch) for ch in base.chars], [NORMAL] * base.vocab_size)
    elif isinstance(base, (GPT2Tokenizer, BPETokenizer)):
        vocab = _bpe_vocab(base)
    else:
        raise GptlabError(f"a {base.kind} tokenizer has no GGUF form in this gptlab")
    if isinstance(tokenizer, ChatTokenizer):
        vocab.tokens += list(CHAT_TOKENS)
        vocab.types += [CONTROL] * len(CHAT_TOKENS)
        vocab.chat_template = CHAT_TEMPLATE
    vocab.gptlab = tokenizer.to_dict()
    return vocab


def _byte_level_tokenizer(vocab: Vocab) -> Tokenizer:
    """A foreign "gpt2" vocabulary: GPT-2's own, or a byte-level BPE of its tokens and merges."""
    if vocab.tokens == sorted(gpt2_vocab(), key=gpt2_vocab().__getitem__):
        return GPT2Tokenizer()
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    alphabet = set(byte_decoder())
    specials = [t for t, kind in zip(vocab.tokens, vocab.types) if kind == CONTROL]
    odd = next((t for t in vocab.tokens if t not in specials and not set(t) <= alphabet), None)
    if odd is not None:
        raise GptlabError(f"the GGUF vocabulary's token {odd!r} is not in GPT-2's byte alphabet; gptlab imports "
                          "byte-level BPE vocabularies (tokenizer.ggml.model gpt2)")
    merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    try:
        hf = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab.tokens)}, merges=merges))
    except Exception as exc:  # tokenizers refuses merges of tokens the vocabulary lacks, and more
        raise GptlabError(f"the GGUF file's BPE cannot be built from its tokens and merges ({exc}); the file is "
                          "damaged") from None
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(t, special=True) for t in specials])
    return BPETokenizer(hf)


def _char_tokenizer(vocab: Vocab) -> Tokenizer:
    """A foreign "rwkv" vocabulary of single characters in gptlab's order (sorted), as a char tokenizer."""
    try:
        chars = [unescape_token(t).decode("utf-8") for t in vocab.tokens]
    except (UnicodeDecodeError, ValueError):
        chars = []
    if not chars or any(len(ch) != 1 for ch in chars) or chars != sorted(set(chars)):
        raise GptlabError("the GGUF file's greedy-match (rwkv) vocabulary is not one character per token in "
                          "sorted order; gptlab imports such a vocabulary only as a char tokenizer")
    return CharTokenizer(chars)


def from_vocab(vocab: Vocab) -> Tokenizer:
    """The tokenizer a GGUF vocabulary describes: gptlab's own (its `gptlab.tokenizer` key) when the file has it,
    else GPT-2's, a byte-level BPE, or a char vocabulary; GptlabError for any other kind."""
    if vocab.gptlab is not None:
        tokenizer = tokenizer_from_dict(vocab.gptlab)
        if to_vocab(tokenizer).tokens != vocab.tokens:
            raise GptlabError(f"the GGUF file's {GPTLAB_KEY} does not describe its own vocabulary; the file was "
                              "edited after gptlab wrote it")
        return tokenizer
    if vocab.model == "gpt2":
        tokenizer = _byte_level_tokenizer(vocab)
    elif vocab.model == "rwkv":
        tokenizer = _char_tokenizer(vocab)
    else:
        raise GptlabError(f"the GGUF file's vocabulary is of kind {vocab.model!r} (tokenizer.ggml.model); gptlab "
                          "imports GPT-2's byte-level BPE (gpt2) and char vocabularies")
    if tokenizer.vocab_size != len(vocab.tokens):
        raise GptlabError(f"the GGUF vocabulary has {len(vocab.tokens)} tokens, its tokenizer {tokenizer.vocab_size}"
                          "; the file is damaged")
    return tokenizer

