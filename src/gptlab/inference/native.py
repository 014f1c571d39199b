"""The native decode library (csrc/decode.cpp): building it for this machine, loading it, and checking that its
structs are the ones this module passes across.

The kernel is C++ with AVX-512 intrinsics, compiled on first use with the machine's g++ into $GPTLAB_KERNELS
(default kernels/ in gptlab's cache folder, machine.cache_root; one build per source, compiler and CPU feature set,
as it is compiled with
-march=native) and loaded with ctypes; it shares torch's OpenMP runtime and thread count. Where it cannot run (no
AVX-512, no g++, not a CPU: `missing` says which) `load_library` returns None and the engine decodes with torch.

The ABI. Python fills the ctypes structs below and the kernel reads them as the C structs of decode.cpp: the two
must agree field for field, or the kernel reads pointers where there are none. The library exports its layout
version, the size of each struct and the offset of each field (by name); `build_library` compares them with the
structs here and refuses a library that differs (`KernelABIError`), so a stale or mismatched build is never called.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
from pathlib import Path

from gptlab import compiled
from gptlab.compiled import ABIError, BuildError, compiler
from gptlab.machine import X86_64, cpu_flags, cpu_has, cpu_model

log = logging.getLogger("gptlab")
SOURCE = Path(__file__).parent / "csrc" / "decode.cpp"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
LAYOUT_VERSION = 2  # decode.cpp's LAYOUT_VERSION: raise both with any change to the structs' fields or meaning
_P = ctypes.c_void_p


class Layer(ctypes.Structure):
    """decode.cpp's `Layer`: one block's weights (matrices in the model's dtype, vectors fp32, NULL if absent; int8
    matrices' per-row scales and sums, NULL for float weights)."""

    _fields_ = [(name, _P) for name in (
        "c_attn_w", "attn_proj_w", "c_fc_w", "mlp_proj_w",
        "ln_1_w", "ln_1_b", "c_attn_b", "attn_proj_b", "ln_2_w", "ln_2_b", "c_fc_b", "mlp_proj_b",
        "c_attn_s", "attn_proj_s", "c_fc_s", "mlp_proj_s", "c_attn_sum", "attn_proj_sum", "c_fc_sum", "mlp_proj_sum")]


WEIGHTS = {"fp32": 0, "bf16": 1, "int8 fma": 2, "int8 vnni": 3}  # decode.cpp's enum Weights: Model.weights


class Model(ctypes.Structure):
    """decode.cpp's `Model`: the shape, the embeddings, the final LayerNorm and LM head, and the layers."""

    _fields_ = [(name, ctypes.c_int) for name in (
        "n_layer", "n_head", "head_dim", "n_embd", "vocab_size", "block_size", "weights", "gelu_tanh")] + [
        ("eps", ctypes.c_float), ("wte", _P), ("wpe", _P), ("lm_head", _P), ("ln_f_w", _P), ("ln_f_b", _P),
        ("layers", ctypes.POINTER(Layer)), ("lm_head_s", _P), ("lm_head_sum", _P)]


class Step(ctypes.Structure):
    """decode.cpp's `Step`: one call's rows, the KV cache and the scratch buffers."""

    _fields_ = [(name, ctypes.c_int) for name in ("R", "max_len", "n_threads", "cache_bf16")] + [
        (name, _P) for name in ("ids", "pos", "k", "v", "x", "h", "qkv", "att", "fc", "logits", "scores")]


STRUCTS = (Layer, Model, Step)  # every struct passed across, by its C name


KernelBuildError = BuildError  # the kernel's source did not compile or load on a machine that has what it needs
KernelABIError = ABIError  # the library's structs are not the ones this module passes: never called


def cpu_has_avx512() -> bool:
    """Whether this CPU runs the kernel's instructions (AVX-512 F, BW and VL)."""
    return cpu_has("avx512f", "avx512bw", "avx512vl")


def cpu_has_int8_vnni() -> bool:
    """Whether this CPU has AVX512-VNNI (the kernel's int8 byte products, vpdpbusd), besides AVX-512."""
    return cpu_has_avx512() and cpu_has("avx512_vnni")


def _compiler() -> str | None:
    return compiler()


def missing() -> str | None:
    """What this machine lacks to build and run the kernel ("not an x86-64 CPU", "no AVX-512", "no g++"), or None
    where it has all of it: there a kernel that fails to build is a bug, not a missing feature."""
    if platform.machine() not in X86_64:
        return f"not an x86-64 CPU ({platform.machine()})"
    if not cpu_has_avx512():
        return "no AVX-512 (F, BW and VL) on this CPU"
    if _compiler() is None:
        return f"no {os.environ.get('CXX', 'g++')} on PATH"
    return None


def _build_dir() -> Path:
    """$GPTLAB_KERNELS, else kernels/ in gptlab's cache folder (compiled.build_folder)."""
    return compiled.build_folder()


@functools.cache
def _machine_key(compiler: str) -> str:
    """What a -march=native build depends on besides its source: the compiler's version, the instruction set it
    targets on this CPU (gcc's `-march=native -Q --help=target`) and the CPU's model and feature flags. Two
    machines of one name but different CPUs get different keys, so neither loads a binary with instructions the
    other lacks (SIGILL)."""
    version = compiled.compiler_version(compiler)
    target = subprocess.run([compiler, "-march=native", "-Q", "--help=target"], capture_output=True, text=True,
                            timeout=60)  # gcc only; elsewhere the CPU's flags below still tell CPUs apart
    cpu = [cpu_model(), " ".join(sorted(cpu_flags()))]
    return hashlib.sha256("\n".join([compiler, *FLAGS, version, target.stdout, *cpu]).encode()).hexdigest()[:12]


def build_library(source: Path = SOURCE, build_dir: Path | None = None) -> ctypes.CDLL:
    """Compile `source` (default: the kernel) with the machine's g++ into `build_dir` (default $GPTLAB_KERNELS,
    see the module docstring), unless this source was built for this CPU and compiler already, load it and check
    its structs (`check_layout`). Earlier builds for this CPU are removed; builds for other CPUs sharing the folder
    are left alone. Raises KernelBuildError (with the compiler's message) where it fails to compile or load, and
    KernelABIError where its structs differ from this module's."""
    compiler = _compiler()
    if compiler is None:
        raise KernelBuildError(f"no {os.environ.get('CXX', 'g++')} on PATH")
    try:
        machine, code = _machine_key(compiler), compiled.source_key(source)
        target = (build_dir or _build_dir()) / f"decode-{machine}-{code}.so"
        if not target.is_file():
            compiled.compile_into(compiler, FLAGS, source, target)
            # this CPU's builds of earlier sources, and those named before builds were keyed by CPU (decode-KEY.so)
            for old in target.parent.glob("decode-*.so"):
                if old != target and (old.name.startswith(f"decode-{machine}-") or old.stem.count("-") == 1):
                    old.unlink(missing_ok=True)
        lib = ctypes.CDLL(str(target))  # after torch: its libgomp is the one OpenMP runtime in the process
    except subprocess.CalledProcessError as exc:
        raise KernelBuildError(f"{' '.join(exc.cmd)} failed:\n{exc.stderr}") from None  # all of it is here
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"building {source} failed: {exc}") from exc
    check_layout(lib, str(target))
    lib.gptlab_decode_step.argtypes = [ctypes.POINTER(Model), ctypes.POINTER(Step)]
    lib.gptlab_decode_step.restype = ctypes.c_int
    lib.gptlab_int8_vnni.argtypes, lib.gptlab_int8_vnni.restype = [], ctypes.c_int
    return lib


def check_layout(lib: ctypes.CDLL, name: str = "the decode library") -> None:
    """Raises KernelABIError unless `lib` reports this module's LAYOUT_VERSION and the size, field count and field
    offsets of every struct in STRUCTS (compiled.check_abi)."""
    compiled.check_abi(lib, name, STRUCTS, LAYOUT_VERSION)


def has_int8_vnni(lib: ctypes.CDLL) -> bool:
    """Whether `lib` was built with AVX512-VNNI (this CPU has it): int8 products by vpdpbusd, else by fp32 FMAs."""
    return bool(lib.gptlab_int8_vnni())


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernel (`build_library`), built once per source, compiler and CPU; None where this machine
    lacks what it needs (`missing`) or the build fails or is refused (then with a warning: decoding falls back to
    torch)."""
    if missing() is not None:
        return None
    try:
        return build_library()
    except KernelBuildError as exc:
        log.warning("the fused decode step is unavailable, decoding with torch ops: %s", exc)
        return None
