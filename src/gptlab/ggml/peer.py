"""llama.cpp itself, as a peer: a GGUF file loaded by llama.cpp's C library through llama-cpp-python's bindings
(`pip install 'gptlab[peers]'`, built from source; `make peers`), for the peer tests and `gptlab bench generate
--peer llama.cpp`. Only llama.cpp's C API is called (the bindings' high-level `Llama` class is not used): the
model and context take llama.cpp's own default parameters, except the context length, the threads and, for
parity checks, an fp32 KV cache without flash attention (by default llama.cpp keeps keys and values in fp16);
greedy decoding is llama.cpp's greedy sampler.
llama.cpp's log lines are silenced."""

from __future__ import annotations

import ctypes
import importlib.util
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gptlab.errors import GptlabError

GGML_TYPE_F32 = 0  # ggml_type of an fp32 KV cache
FLASH_ATTN_DISABLED = 0  # llama_flash_attn_type (llama.cpp's default is -1, auto: on where it can run)
PEER_INSTALL = "pip install 'gptlab[peers]' (builds llama-cpp-python from source), or `make peers`"
_LOG_SINK = None  # the silent log callback, kept alive for as long as the library


def available() -> bool:
    """Whether llama-cpp-python is installed."""
    return importlib.util.find_spec("llama_cpp") is not None


def _library():
    global _LOG_SINK
    if not available():
        raise GptlabError(f"llama.cpp is not installed; {PEER_INSTALL}")
    import llama_cpp

    if _LOG_SINK is None:
        _LOG_SINK = llama_cpp.llama_log_callback(lambda level, text, data: None)
        llama_cpp.llama_log_set(_LOG_SINK, ctypes.c_void_p())
        llama_cpp.llama_backend_init()
    return llama_cpp


def version() -> str:
    """llama-cpp-python's version and the llama.cpp build inside it."""
    import llama_cpp

    return f"llama-cpp-python {llama_cpp.__version__}"


class LlamaCpp:
    """One GGUF model and one context (one sequence) in llama.cpp."""

    def __init__(self, path: str | Path, n_ctx: int, threads: int = 2, f32_cache: bool = False,
                 n_batch: int = 512):
        lib = self.lib = _library()
        self.model = lib.llama_model_load_from_file(str(path).encode(), lib.llama_model_default_params())
        if not self.model:
            raise GptlabError(f"llama.cpp could not load {path}")
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_threads, params.n_threads_batch = n_ctx, threads, threads
        params.n_batch = params.n_ubatch = max(n_batch, 1)
        if f32_cache:  # parity: fp32 keys and values, and no flash attention (its CPU kernel works in fp16)
            params.type_k = params.type_v = GGML_TYPE_F32
            params.flash_attn_type = FLASH_ATTN_DISABLED
        self.ctx = lib.llama_init_from_model(self.model, params)
        if not self.ctx:
            lib.llama_model_free(self.model)
            raise GptlabError(f"llama.cpp could not make a context of {n_ctx} tokens for {path}")
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = lib.llama_vocab_n_tokens(self.vocab)
        self.n_batch, self.pos = params.n_batch, 0
        self.greedy = lib.llama_sampler_init_greedy()

    def close(self) -> None:
        if self.ctx:
            self.lib.llama_sampler_free(self.greedy)
            self.lib.llama_free(self.ctx)
            self.lib.llama_model_free(self.model)
            self.ctx = None

    def __enter__(self) -> LlamaCpp:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def clear(self) -> None:
        """Forget the sequence (the KV cache): the next decode starts at position 0."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        self.pos = 0

    def decode(self, ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Run `ids` after the sequence so far, in batches of n_batch; the logits of every position
        (len(ids), vocab) with `all_logits`, else of the last one (1, vocab)."""
        rows = []
        for start in range(0, len(ids), self.n_batch):
            chunk = ids[start:start + self.n_batch]
            last = start + len(chunk) == len(ids)
            self._decode_chunk(chunk, all_logits, last)
            if all_logits or last:
                n = len(chunk) if all_logits else 1
                flat = np.ctypeslib.as_array(self.lib.llama_get_logits(self.ctx), shape=(n * self.n_vocab,))
                rows.append(flat.reshape(n, self.n_vocab).copy())
        return np.concatenate(rows)

    def _decode_chunk(self, chunk: Sequence[int], all_logits: bool, last: bool) -> None:
        lib = self.lib
        batch = lib.llama_batch_init(len(chunk), 0, 1)
        try:
            batch.n_tokens = len(chunk)
            for i, token in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = int(token), self.pos + i, 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = all_logits or (last and i == len(chunk) - 1)
            if lib.llama_decode(self.ctx, batch) != 0:
                raise GptlabError(f"llama.cpp could not decode {len(chunk)} tokens at position {self.pos}")
        finally:
            lib.llama_batch_free(batch)
        self.pos += len(chunk)

    def step(self, token: int) -> int:
        """Decode one token after the sequence and return llama.cpp's greedy choice of the next one."""
        self._decode_one(token)
        return int(self.lib.llama_sampler_sample(self.greedy, self.ctx, -1))

    def _decode_one(self, token: int) -> None:
        ids = (self.lib.llama_token * 1)(int(token))
        if self.lib.llama_decode(self.ctx, self.lib.llama_batch_get_one(ids, 1)) != 0:
            raise GptlabError(f"llama.cpp could not decode a token at position {self.pos}")
        self.pos += 1

    def generate(self, prompt: Sequence[int], new_tokens: int) -> list[int]:
        """Greedy continuation of `prompt` (from position 0) by llama.cpp's sampler: `new_tokens` ids."""
        self.clear()
        self.decode(prompt)
        self.pos = len(prompt)
        out = [int(self.lib.llama_sampler_sample(self.greedy, self.ctx, -1))]
        while len(out) < new_tokens:
            out.append(self.step(out[-1]))
        return out

    def tokenize(self, text: str, special: bool = False) -> list[int]:
        """llama.cpp's token ids of `text` (no BOS added; special tokens parsed with `special`)."""
        raw = text.encode("utf-8")
        room = len(raw) + 8
        buf = (self.lib.llama_token * room)()
        n = self.lib.llama_tokenize(self.vocab, raw, len(raw), buf, room, False, special)
        if n < 0:
            raise AssertionError(f"llama.cpp wants {-n} tokens for {len(raw)} bytes")
        return list(buf[:n])

    def detokenize(self, ids: Sequence[int]) -> bytes:
        """The bytes llama.cpp writes for `ids` (special tokens written out)."""
        out = bytearray()
        buf = ctypes.create_string_buffer(256)
        for token in ids:
            n = self.lib.llama_token_to_piece(self.vocab, int(token), buf, len(buf), 0, True)
            out += buf.raw[:n]
        return bytes(out)
