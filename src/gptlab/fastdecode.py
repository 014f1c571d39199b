"""The fused decode step: one new token per row through the whole GPT in one native call (csrc/decode.cpp).

Decoding reads every weight once per token, so memory bandwidth sets its pace; launched op by op from Python, a
12-layer model pays hundreds of dispatches per token, and the library kernels for a single row stop well short of
the memory bus (docs/benchmarks.md). `FusedDecoder.step` runs embeddings, every block (LayerNorm, QKV, attention
over the KV cache, W_O, residual adds, the GELU feed-forward) and the LM head for R rows at once, streaming each
weight row a single time for all rows, in fp32 activations over fp32 or bf16 weights.

The kernel is C++ with AVX-512 intrinsics, compiled on first use with the machine's g++ into
$GPTLAB_KERNELS (default ~/.cache/gptlab/kernels; one build per source, compiler and CPU feature set, as it is
compiled with -march=native) and loaded with ctypes; it shares torch's OpenMP runtime and thread count. Where it
cannot run (no AVX-512, no g++, not a CPU: `missing` says which) `fused_decoder` returns None, and where a cache
is neither fp32 nor bf16 `accepts` says no: the engine then decodes with the torch model, which stays the
reference (tests/test_fastdecode.py holds the two together; tests/test_kernel_mutants.py checks that those tests
catch a broken kernel).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import mmap
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from gptlab.model import GPT, KVCache

log = logging.getLogger("gptlab")
SOURCE = Path(__file__).with_name("csrc") / "decode.cpp"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
_P = ctypes.c_void_p


class _Layer(ctypes.Structure):
    _fields_ = [(name, _P) for name in (
        "c_attn_w", "attn_proj_w", "c_fc_w", "mlp_proj_w",
        "ln_1_w", "ln_1_b", "c_attn_b", "attn_proj_b", "ln_2_w", "ln_2_b", "c_fc_b", "mlp_proj_b")]


class _Model(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int) for name in (
        "n_layer", "n_head", "head_dim", "n_embd", "vocab_size", "block_size", "bf16_weights", "gelu_tanh")] + [
        ("eps", ctypes.c_float), ("wte", _P), ("wpe", _P), ("lm_head", _P), ("ln_f_w", _P), ("ln_f_b", _P),
        ("layers", ctypes.POINTER(_Layer))]


class _Step(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int) for name in ("R", "max_len", "n_threads", "cache_bf16")] + [
        (name, _P) for name in ("ids", "pos", "k", "v", "x", "h", "qkv", "att", "fc", "logits", "scores")]


def cpu_has_avx512() -> bool:
    """Whether this CPU runs the kernel's instructions (AVX-512 F, BW and VL)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return False
    return all(f" {flag}" in flags for flag in ("avx512f", "avx512bw", "avx512vl"))


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def missing() -> str | None:
    """What this machine lacks to build and run the kernel ("not an x86-64 CPU", "no AVX-512", "no g++"), or None
    where it has all of it: there a kernel that fails to build is a bug, not a missing feature."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    if not cpu_has_avx512():
        return "no AVX-512 (F, BW and VL) on this CPU"
    if _compiler() is None:
        return f"no {os.environ.get('CXX', 'g++')} on PATH"
    return None


class KernelBuildError(RuntimeError):
    """The kernel's source did not compile or load on a machine that has what it needs."""


def _build_dir() -> Path:
    """$GPTLAB_KERNELS, else kernels/ in $GPTLAB_CACHE (default ~/.cache/gptlab)."""
    if os.environ.get("GPTLAB_KERNELS"):
        return Path(os.environ["GPTLAB_KERNELS"])
    root = os.environ.get("GPTLAB_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME")
                                                            or os.path.expanduser("~/.cache"), "gptlab")
    return Path(root) / "kernels"


@functools.cache
def _machine_key(compiler: str) -> str:
    """What a -march=native build depends on besides its source: the compiler's version, the instruction set it
    targets on this CPU (gcc's `-march=native -Q --help=target`) and the CPU's model and feature flags. Two
    machines of one name but different CPUs get different keys, so neither loads a binary with instructions the
    other lacks (SIGILL)."""
    version = subprocess.run([compiler, "--version"], check=True, capture_output=True, text=True, timeout=60).stdout
    target = subprocess.run([compiler, "-march=native", "-Q", "--help=target"], capture_output=True, text=True,
                            timeout=60)  # gcc only; elsewhere the CPU's flags below still tell CPUs apart
    try:
        lines = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    cpu = [next((line for line in lines if line.startswith(key)), "") for key in ("model name", "flags")]
    return hashlib.sha256("\n".join([compiler, *FLAGS, version, target.stdout, *cpu]).encode()).hexdigest()[:12]


def build_library(source: Path = SOURCE, build_dir: Path | None = None) -> ctypes.CDLL:
    """Compile `source` (default: the kernel) with the machine's g++ into `build_dir` (default $GPTLAB_KERNELS,
    see the module docstring), unless this source was built for this CPU and compiler already, and load it.
    Earlier builds for this CPU are removed; builds for other CPUs sharing the folder are left alone.
    Raises KernelBuildError (with the compiler's message) where it fails to compile or load."""
    compiler = _compiler()
    if compiler is None:
        raise KernelBuildError(f"no {os.environ.get('CXX', 'g++')} on PATH")
    try:
        machine, code = _machine_key(compiler), hashlib.sha256(source.read_bytes()).hexdigest()[:12]
        target = (build_dir or _build_dir()) / f"decode-{machine}-{code}.so"
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # compile aside, then publish atomically
                built = Path(tmp) / target.name
                subprocess.run([compiler, *FLAGS, str(source), "-o", str(built)], check=True,
                               capture_output=True, text=True, timeout=300)
                os.replace(built, target)
            # this CPU's builds of earlier sources, and those named before builds were keyed by CPU (decode-KEY.so)
            for old in target.parent.glob("decode-*.so"):
                if old != target and (old.name.startswith(f"decode-{machine}-") or old.stem.count("-") == 1):
                    old.unlink(missing_ok=True)
        lib = ctypes.CDLL(str(target))  # after torch: its libgomp is the one OpenMP runtime in the process
    except subprocess.CalledProcessError as exc:
        raise KernelBuildError(f"{' '.join(exc.cmd)} failed:\n{exc.stderr}") from None  # all of it is here
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"building {source} failed: {exc}") from exc
    lib.gptlab_decode_step.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Step)]
    lib.gptlab_decode_step.restype = ctypes.c_int
    return lib


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernel (`build_library`), built once per source, compiler and CPU; None where this machine
    lacks what it needs (`missing`) or the build fails (then with a warning: decoding falls back to torch)."""
    if missing() is not None:
        return None
    try:
        return build_library()
    except KernelBuildError as exc:
        log.warning("the fused decode step is unavailable, decoding with torch ops: %s", exc)
        return None


def move_to_huge_pages(model: torch.nn.Module) -> bool:
    """Move every parameter of `model` (CPU, inference only) into one anonymous mapping backed by 2 MB pages
    (Linux transparent huge pages, madvise mode): a decode step streams all the weights, and with 4 KB pages
    the reads cross a page, a TLB entry and a hardware-prefetch boundary every 4 KB (a small gain, measured by
    `gptlab bench decode --pages both`, docs/benchmarks.md). Returns whether it did; memory stays
    one copy (the old storage is released), tied parameters stay tied."""
    params = list(model.parameters())  # unique: a tied weight appears once
    if not params or any(p.device.type != "cpu" for p in params) or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += -(-p.numel() * p.element_size() // 64) * 64  # 64-byte aligned, a cache line each
    try:
        arena = mmap.mmap(-1, max(total, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        arena.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return False
    raw = torch.frombuffer(arena, dtype=torch.uint8)  # keeps the mapping alive as long as a view of it lives
    with torch.no_grad():
        for p, offset in zip(params, offsets):
            nbytes = p.numel() * p.element_size()
            home = raw[offset:offset + nbytes].view(p.dtype).view(p.shape)
            home.copy_(p.detach())
            p.data = home
    return True


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedDecoder:
    """Runs `GPT.forward(ids[:, None], kv_cache=cache, last_only=True)` for one new token per row, natively.

    Holds the model's weights as they are (fp32 or bf16 matrices, shared, not copied) and fp32 copies of the small
    vectors (LayerNorm, biases). The model must not change afterwards: this is for inference only."""

    def __init__(self, model: GPT, lib: ctypes.CDLL):
        self.config = c = model.config
        dtype = model.transformer.wte.weight.dtype
        self._keep: list[torch.Tensor] = []

        def matrix(linear: torch.nn.Module) -> int:
            w = linear.weight.detach().contiguous()
            self._keep.append(w)
            return w.data_ptr()

        def vector(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            t = t.detach().float().contiguous()
            self._keep.append(t)
            return t.data_ptr()

        layers = (_Layer * c.n_layer)()
        for i, block in enumerate(model.transformer.h):
            attn, mlp = block.attn, block.mlp
            layers[i] = _Layer(matrix(attn.c_attn), matrix(attn.c_proj), matrix(mlp.c_fc), matrix(mlp.c_proj),
                               vector(block.ln_1.weight), vector(block.ln_1.bias), vector(attn.c_attn.bias),
                               vector(attn.c_proj.bias), vector(block.ln_2.weight), vector(block.ln_2.bias),
                               vector(mlp.c_fc.bias), vector(mlp.c_proj.bias))
        t = model.transformer
        self._layers = layers  # the struct below points into it
        self._model = _Model(c.n_layer, c.n_head, c.head_dim, c.n_embd, c.vocab_size, c.block_size,
                             int(dtype == torch.bfloat16), int(c.activation == "gelu_tanh"), c.layer_norm_eps,
                             matrix(t.wte), matrix(t.wpe), matrix(model.lm_head), vector(t.ln_f.weight),
                             vector(t.ln_f.bias), layers)
        self._call, self._model_ref = lib.gptlab_decode_step, ctypes.byref(self._model)
        self._plan: _Plan | None = None  # the last step's

    def accepts(self, cache: KVCache) -> bool:
        """Whether `cache` has the layout the kernel reads: fp32 or bf16, contiguous, on the CPU."""
        return (cache.k.dtype in (torch.float32, torch.bfloat16) and cache.k.device.type == "cpu"
                and cache.k.is_contiguous() and cache.v.is_contiguous() and cache.pos.is_contiguous())

    def step(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """ids (R,) the new token of each row -> next-token logits (R, V) in fp32, valid until the next step
        (they live in the decoder's buffer); writes the rows' keys and values at cache.pos and advances cache.pos
        by one, like the model's forward. Raises ValueError, and changes nothing, for a cache the kernel cannot
        read (`accepts`), one of another shape or number of rows, a token id outside the vocabulary, or a
        position past the cache or block_size."""
        plan = self._plan
        threads = torch.get_num_threads()
        if plan is None or not plan.serves(cache, ids.numel(), threads):
            self._check(cache, ids.numel())
            plan = self._plan = _Plan.make(self.config, cache, ids.numel(), threads)
        plan.ids.copy_(ids)
        plan.args.n_threads = threads
        status = self._call(self._model_ref, ctypes.byref(plan.args))
        if status != 0:  # the kernel checks every row before it touches memory
            r, c = status - 1, self.config
            raise ValueError(f"fused decode refused row {r}: token id {int(plan.ids[r])} (vocabulary {c.vocab_size}) "
                             f"at position {int(cache.pos[r])} (cache {cache.max_len}, block_size {c.block_size})")
        return plan.logits

    def _check(self, cache: KVCache, R: int) -> None:
        """Raises ValueError unless the kernel can read and write `cache` for R rows of this model."""
        c = self.config
        shape = (c.n_layer, R, c.n_head, cache.max_len, c.head_dim)
        if not self.accepts(cache):
            raise ValueError("the fused step reads fp32 or bf16 caches, contiguous, on the CPU")
        if (tuple(cache.k.shape) != shape or cache.v.shape != cache.k.shape or cache.v.dtype != cache.k.dtype
                or tuple(cache.pos.shape) != (R,) or cache.pos.dtype != torch.int64
                or cache.v.device != cache.k.device or cache.pos.device != cache.k.device):
            raise ValueError(f"a cache of k, v {tuple(cache.k.shape)} and pos {tuple(cache.pos.shape)} does not fit "
                             f"{R} rows of this model: k and v {shape}, pos ({R},) int64, all on the CPU")


@dataclass
class _Plan:
    """Everything a step of R rows over one cache passes to the kernel, built once per cache (a few dozen
    microseconds a token otherwise): the kernel's arguments and the buffers they point to."""

    tensors: tuple[torch.Tensor, ...]  # the cache's k, v and pos, which the pointers below point into
    ids: torch.Tensor  # (R,) int64, the step's tokens are copied here
    logits: torch.Tensor  # (R, V) fp32, written by the kernel
    threads: int  # the most threads the scratch serves
    args: _Step
    scratch: tuple[torch.Tensor, ...]  # x, h, qkv, att, fc, and a row of scores per thread

    def serves(self, cache: KVCache, R: int, threads: int) -> bool:
        """Whether this plan's pointers are still those of `cache` (not reallocated since) for R rows."""
        same = all(a is b for a, b in zip(self.tensors, (cache.k, cache.v, cache.pos)))
        return same and self.ids.numel() == R and self.threads >= threads

    @classmethod
    def make(cls, config, cache: KVCache, R: int, threads: int) -> _Plan:
        C, V = config.n_embd, config.vocab_size
        ids, logits = torch.zeros(R, dtype=torch.int64), torch.empty(R, V)
        scratch = tuple(torch.empty(n) for n in (R * C, R * C, R * 3 * C, R * C, R * 4 * C, threads * cache.max_len))
        args = _Step(R, cache.max_len, threads, int(cache.k.dtype == torch.bfloat16), *(
            _ptr(t) for t in (ids, cache.pos, cache.k, cache.v, *scratch[:5], logits, scratch[5])))
        return cls((cache.k, cache.v, cache.pos), ids, logits, threads, args, scratch)


def fused_decoder(model: torch.nn.Module) -> FusedDecoder | None:
    """A FusedDecoder for `model`, or None where the native step cannot run it (not a GPT, not on a CPU with
    AVX-512, weights neither fp32 nor bf16, heads wider than 256, no compiler)."""
    if not isinstance(model, GPT):
        return None
    weight = model.transformer.wte.weight
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if model.config.head_dim > 256:  # the kernel holds a head's query and output in registers
        return None
    lib = load_library()
    return None if lib is None else FusedDecoder(model, lib)
