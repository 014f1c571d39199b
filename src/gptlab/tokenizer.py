"""Text <-> token ids: char-level, byte-level BPE trained here, and GPT-2's BPE.

All three share one small interface (`encode`, `decode`, `decode_bytes`, `vocab_size`, `save`, `load`) and are
saved as JSON, never pickled. GPT-2's merge ranks ship inside the package, so nothing is downloaded.
"""

from __future__ import annotations

import base64
import codecs
import functools
import gzip
import json
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptlab.errors import GptlabError

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HFTokenizer

EOT = "<|endoftext|>"
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class Tokenizer:
    """The interface every tokenizer implements."""

    kind: str = ""
    eot_id: int | None = None

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def end_ids(self) -> frozenset[int]:
        """The ids that end a generation: end-of-text, and a chat tokenizer's markers."""
        return frozenset() if self.eot_id is None else frozenset([self.eot_id])

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of `text`. `<|endoftext|>` in the text is a special token only with allow_special=True;
        otherwise it raises GptlabError. Raises GptlabError for text the vocabulary cannot represent."""
        raise NotImplementedError

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """The UTF-8 bytes of `ids`; a byte-level token can hold part of a multi-byte character."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def text_of(self, ids: Sequence[int]) -> tuple[str, int]:
        """The documents' own text that `ids` spell, and how many special tokens (end-of-text, chat markers) it
        leaves out: a special token is predicted like any other, but is no character of anybody's text, so bits
        per character and per byte count it as none (never as the 13 characters of its spelling)."""
        specials = self.end_ids
        kept = [i for i in ids if i not in specials] if specials else list(ids)
        return self.decode(kept), len(ids) - len(kept)

    def to_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), ensure_ascii=False), encoding="utf-8")

    def _refuse_special(self, text: str, allow_special: bool) -> None:
        if self.eot_id is not None and not allow_special and EOT in text:
            raise GptlabError(f"the text contains the special token {EOT}; remove it, or allow special tokens "
                              "(--allow-special) to encode it as end-of-text")


class CharTokenizer(Tokenizer):
    """One token per Unicode character; the vocabulary is the sorted set of characters of the training text."""

    kind = "char"

    def __init__(self, chars: Iterable[str]):
        self.chars = sorted(set(chars))
        if not self.chars:
            raise GptlabError("cannot build a char vocabulary from empty text; give a corpus with some text in it")
        self.stoi = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def train(cls, chunks: Iterable[str]) -> CharTokenizer:
        seen: set[str] = set()
        for chunk in chunks:
            seen.update(chunk)
        return cls(seen)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError:
            unseen = sorted({c for c in text if c not in self.stoi})
            shown = ", ".join(repr(c) for c in unseen[:10]) + (" ..." if len(unseen) > 10 else "")
            raise GptlabError(f"the text has {len(unseen)} character(s) the char vocabulary has never seen: {shown}; "
                              "remove them or train on a corpus that contains them") from None

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return self.decode(ids).encode("utf-8")

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.kind, "chars": self.chars}


@functools.lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable stand-ins for the 256 byte values, mapped back to the bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes)}


class BPETokenizer(Tokenizer):
    """Byte-level BPE trained on the corpus with Hugging Face `tokenizers`; any text encodes, nothing is unseen."""

    kind = "bpe"

    def __init__(self, hf_tokenizer: HFTokenizer):
        self.hf = hf_tokenizer
        self.eot_id = hf_tokenizer.token_to_id(EOT)
        self._pieces = [hf_tokenizer.id_to_token(i) for i in range(hf_tokenizer.get_vocab_size())]

    @classmethod
    def train(cls, chunks: Iterable[str], vocab_size: int) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

        if vocab_size < 257:
            raise GptlabError(f"a byte-level BPE needs vocab_size >= 257 (256 bytes + end-of-text), not {vocab_size}")
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(chunks, trainer=trainer)
        return cls(tok)

    @property
    def vocab_size(self) -> int:
        return len(self._pieces)

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        self._refuse_special(text, allow_special)
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        table = byte_decoder()
        out = bytearray()
        for i in ids:
            piece = self._pieces[i]
            out += piece.encode("utf-8") if i == self.eot_id else bytes(table[ch] for ch in piece)
        return bytes(out)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.kind, "tokenizer": json.loads(self.hf.to_str())}


@functools.lru_cache(maxsize=1)
def gpt2_ranks() -> dict[bytes, int]:
    """GPT-2's 50,256 merge ranks, read from the copy bundled in the package."""
    blob = resources.files("gptlab").joinpath("assets/gpt2.tiktoken.gz").read_bytes()
    ranks = {}
    for line in gzip.decompress(blob).splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


class GPT2Tokenizer(Tokenizer):
    """GPT-2's byte-level BPE (50,257 ids, `<|endoftext|>` = 50256) through tiktoken."""

    kind = "gpt2"

    def __init__(self) -> None:
        import tiktoken

        ranks = gpt2_ranks()
        self.eot_id = len(ranks)
        self.enc = tiktoken.Encoding(name="gptlab-gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                     special_tokens={EOT: self.eot_id})

    @property
    def vocab_size(self) -> int:
        return self.enc.n_vocab

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        self._refuse_special(text, allow_special)
        if allow_special:
            return self.enc.encode(text, allowed_special={EOT})
        return self.enc.encode_ordinary(text)

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return self.enc.decode_bytes(list(ids))

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.kind}


# ---- chat: role markers added after a tokenizer's own ids, and the template that renders conversations --------

ROLES = ("system", "user", "assistant")
CHAT_END = "<|end|>"
CHAT_TOKENS = tuple(f"<|{role}|>" for role in ROLES) + (CHAT_END,)
# The template as transformers keeps it (tokenizer_config.json's chat_template): each message is its role's marker,
# its content and the end marker, nothing between; the generation prompt is the assistant's marker.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('unknown role ' + message['role'] + '; use system, user or assistant') -}}"
    "{%- endif -%}"
    "{{- '<|' + message['role'] + '|>' + message['content'] + '<|end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}")


class ChatTokenizer(Tokenizer):
    """A tokenizer with the chat template's four special tokens (`<|system|>`, `<|user|>`, `<|assistant|>`,
    `<|end|>`) added after its own ids. Message contents encode with the base tokenizer; `render` turns messages
    into ids exactly as transformers' `apply_chat_template` does with CHAT_TEMPLATE and the exported tokenizer."""

    def __init__(self, base: Tokenizer):
        if isinstance(base, ChatTokenizer):
            base = base.base
        self.base, self.kind, self.eot_id = base, base.kind, base.eot_id
        self.special_ids = {token: base.vocab_size + i for i, token in enumerate(CHAT_TOKENS)}
        self.role_ids = {role: self.special_ids[f"<|{role}|>"] for role in ROLES}
        self.end_id = self.special_ids[CHAT_END]

    @property
    def vocab_size(self) -> int:
        return self.base.vocab_size + len(CHAT_TOKENS)

    @property
    def end_ids(self) -> frozenset[int]:
        """End-of-text, the end of a turn, and every role marker: a model that starts another turn ends its own
        (a message cannot hold a marker, so an answer never does)."""
        return self.base.end_ids | set(self.special_ids.values())

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """The base tokenizer's ids of `text`; a chat marker in it is a special token only with allow_special
        (otherwise GptlabError: a message's content cannot hold one)."""
        marker = next((m for m in CHAT_TOKENS if m in text), None)
        if marker is None:
            return self.base.encode(text, allow_special)
        if not allow_special:
            raise GptlabError(f"the text contains the chat marker {marker}; a message cannot hold the chat template's "
                              f"special tokens ({', '.join(CHAT_TOKENS)})")
        ids: list[int] = []
        for piece in _split_markers(text):
            ids += [self.special_ids[piece]] if piece in self.special_ids else self.base.encode(piece, True)
        return ids

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        out, run = bytearray(), []
        first = self.base.vocab_size
        for i in list(ids) + [None]:
            if i is None or i >= first:
                out += self.base.decode_bytes(run) if run else b""
                run = []
                out += CHAT_TOKENS[i - first].encode() if i is not None else b""
            else:
                run.append(i)
        return bytes(out)

    def render(self, messages: Sequence[dict[str, str]],
               add_generation_prompt: bool = False) -> tuple[list[int], list[bool]]:
        """The ids of a conversation (messages with "role" and "content", already checked) and, for each id,
        whether training predicts it: the assistant's content and its end marker, nothing else. With
        add_generation_prompt the ids end with the assistant's marker, the prompt for its answer."""
        ids: list[int] = []
        trained: list[bool] = []
        for message in messages:
            content = self.encode(message["content"]) + [self.end_id]
            ids += [self.role_ids[message["role"]]] + content
            trained += [False] + [message["role"] == "assistant"] * len(content)
        if add_generation_prompt:
            ids.append(self.role_ids["assistant"])
            trained.append(False)
        return ids, trained

    def to_dict(self) -> dict[str, Any]:
        return {**self.base.to_dict(), "chat": {"tokens": list(CHAT_TOKENS), "template": CHAT_TEMPLATE}}


def _split_markers(text: str) -> list[str]:
    """`text` cut before and after every chat marker."""
    import re

    return [piece for piece in re.split("(" + "|".join(re.escape(m) for m in CHAT_TOKENS) + ")", text) if piece]


def chat_of(tokenizer: Tokenizer) -> ChatTokenizer:
    """`tokenizer` as a ChatTokenizer; GptlabError when it has no chat template."""
    if not isinstance(tokenizer, ChatTokenizer):
        raise GptlabError("this run's tokenizer has no chat template; fine-tune it on conversations first: "
                          "`gptlab prepare --chat CONVERSATIONS.jsonl --tokenizer-from RUN --out DATA`, then "
                          "`gptlab train --data DATA --init-from RUN`")
    return tokenizer


def train_tokenizer(kind: str, chunks: Iterable[str], vocab_size: int = 1024) -> Tokenizer:
    """A tokenizer of `kind` ("char", "bpe", "gpt2") built from the text chunks (gpt2 needs none)."""
    if kind == "char":
        return CharTokenizer.train(chunks)
    if kind == "bpe":
        return BPETokenizer.train(chunks, vocab_size)
    if kind == "gpt2":
        return GPT2Tokenizer()
    raise GptlabError(f"unknown tokenizer {kind!r}; choose char, bpe or gpt2")


def from_dict(data: dict[str, Any]) -> Tokenizer:
    if "chat" in data:
        chat = data["chat"]
        if chat != {"tokens": list(CHAT_TOKENS), "template": CHAT_TEMPLATE}:
            raise GptlabError("the tokenizer file's chat template is not the one this gptlab renders; prepare the "
                              "conversations again with this version")
        return ChatTokenizer(from_dict({k: v for k, v in data.items() if k != "chat"}))
    kind = data.get("type")
    if kind == "char":
        return CharTokenizer(data["chars"])
    if kind == "bpe":
        from tokenizers import Tokenizer as HFTokenizer

        return BPETokenizer(HFTokenizer.from_str(json.dumps(data["tokenizer"])))
    if kind == "gpt2":
        return GPT2Tokenizer()
    raise GptlabError(f"unknown tokenizer type {kind!r} in tokenizer file")


def load(path: str | Path) -> Tokenizer:
    """The tokenizer saved at `path` (JSON); raises GptlabError when it is missing or unreadable."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise GptlabError(f"tokenizer file {path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise GptlabError(f"tokenizer file {path} is not valid JSON; it is damaged") from None
    try:
        return from_dict(data)
    except GptlabError:
        raise
    except Exception as exc:  # a hand-edited or truncated file can fail in many ways inside the libraries
        raise GptlabError(f"tokenizer file {path} could not be read ({exc}); it is damaged") from None


class StreamDecoder:
    """Turns token ids into text as they arrive, never emitting half of a multi-byte UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: Sequence[int]) -> str:
        return self._utf8.decode(self.tokenizer.decode_bytes(ids))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
