"""The native decode library (csrc/decode.cpp): building it for this CPU, loading it, and checking that its
structs are the ones this module passes across.

The kernel is one C++ source over a small vector layer (csrc/simd.h beside it) that builds for several named targets
(BUILDS: x86-64-v4 with AVX512-VNNI and AVX512-BF16 where the CPU has them, x86-64-v3 = AVX2 + FMA, ARM64 with
NEON, and a plain build any compiler makes), never -march=native, so one machine can build and test several. The
CPU picks the build at load (`build_for_cpu`: the first in BUILDS whose instructions it has; $GPTLAB_KERNEL_BUILD
names another it can run). It is compiled on first use with the machine's g++ into $GPTLAB_KERNELS (default
kernels/ in gptlab's cache folder, machine.cache_root; one file per source, compiler and build) and loaded with
ctypes; it shares torch's OpenMP runtime and thread count. Where it cannot run (no g++: `missing` says so)
`load_library` returns None and the engine decodes with torch.

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
import subprocess
from pathlib import Path

from gptlab import compiled
from gptlab.compiled import (  # noqa: F401 (the build catalogue, re-exported: native.BUILDS)
    BUILDS,
    V4,
    ABIError,
    Build,
    BuildError,
    UnknownBuild,
    build_for_cpu,
    compiler,
    runnable_builds,
)
from gptlab.machine import cpu_has

log = logging.getLogger("gptlab")
SOURCE = Path(__file__).parent / "csrc" / "decode.cpp"
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]  # every build's; its target's flags follow
LAYOUT_VERSION = 3  # decode.cpp's LAYOUT_VERSION: raise both with any change to the structs' fields or meaning
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

    _fields_ = [(name, ctypes.c_int) for name in ("R", "max_len", "n_threads", "cache_bf16", "cache_rows")] + [
        (name, _P) for name in ("ids", "pos", "slot", "k", "v", "x", "h", "qkv", "att", "fc", "logits", "scores")]


STRUCTS = (Layer, Model, Step)  # every struct passed across, by its C name


KernelBuildError = BuildError  # the kernel's source did not compile or load on a machine that has what it needs
KernelABIError = ABIError  # the library's structs are not the ones this module passes: never called


def cpu_has_avx512() -> bool:
    """Whether this CPU runs the AVX-512 builds (x86-64-v4: AVX-512 F, BW, CD, DQ and VL)."""
    return cpu_has(*V4)


def cpu_has_int8_vnni() -> bool:
    """Whether this CPU has AVX512-VNNI (the kernel's int8 byte products, vpdpbusd), besides AVX-512."""
    return cpu_has_avx512() and cpu_has("avx512_vnni")


def _compiler() -> str | None:
    return compiler()


def missing() -> str | None:
    """What this machine lacks to build and run the kernel ("no g++": every CPU has a build, the plain one at
    least), or None where it has all of it: there a kernel that fails to build is a bug, not a missing feature."""
    if _compiler() is None:
        return f"no {os.environ.get('CXX', 'g++')} on PATH"
    return None


def _build_dir() -> Path:
    """$GPTLAB_KERNELS, else kernels/ in gptlab's cache folder (compiled.build_folder)."""
    return compiled.build_folder()


@functools.cache
def _flags_key(compiler: str, flags: tuple[str, ...]) -> str:
    """What a build depends on besides its source: the compiler (path and version) and every flag, its target's
    included. The target is named, not read from the CPU, so machines of different CPUs that share a folder each
    load only the builds their instructions run (the build's name is in the file's name too)."""
    version = compiled.compiler_version(compiler)
    return hashlib.sha256("\n".join([compiler, *flags, version]).encode()).hexdigest()[:12]


def build_library(source: Path = SOURCE, build_dir: Path | None = None, build: Build | str | None = None,
                  flags: tuple[str, ...] | list[str] = tuple(FLAGS)) -> ctypes.CDLL:
    """Compile `source` (default: the kernel) for `build` (a Build or its name; default `build_for_cpu()`) with the
    machine's g++ and `flags` (default FLAGS) into `build_dir` (default $GPTLAB_KERNELS, see the module docstring),
    unless it was built so already, load it and check its structs (`check_layout`). Earlier builds of the same
    name and flags are removed; other builds sharing the folder are left alone. Raises KernelBuildError (with the
    compiler's message) where it fails to compile or load, KernelABIError where its structs differ from this
    module's, and UnknownBuild for a build this CPU cannot run."""
    compiler = _compiler()
    if compiler is None:
        raise KernelBuildError(f"no {os.environ.get('CXX', 'g++')} on PATH")
    build = build if isinstance(build, Build) else build_for_cpu(build)
    if not build.runs_here():
        raise UnknownBuild(f"the {build.name} kernel build does not run on this CPU")
    try:
        key, code = _flags_key(compiler, (*flags, *build.target)), compiled.source_key(source)
        target = (build_dir or _build_dir()) / f"decode-{build.name}-{key}-{code}.so"
        if not target.is_file():
            compiled.compile_into(compiler, [*flags, *build.target], source, target)
            # this build's files of earlier sources, and those of before builds were named (decode-KEY[-KEY].so)
            for old in target.parent.glob("decode-*.so"):
                if old != target and (old.name.startswith(f"decode-{build.name}-{key}-")
                                      or old.stem.count("-") <= 2 and not old.stem.startswith(tuple(
                                          f"decode-{b}-" for b in BUILDS))):
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
    lib.gptlab_bf16_dot.argtypes, lib.gptlab_bf16_dot.restype = [], ctypes.c_int
    lib.gptlab_int8_sdot.argtypes, lib.gptlab_int8_sdot.restype = [], ctypes.c_int
    lib.gptlab_lanes.argtypes, lib.gptlab_lanes.restype = [], ctypes.c_int
    lib.gptlab_simd.argtypes, lib.gptlab_simd.restype = [], ctypes.c_char_p
    lib.gptlab_build = build.name  # which build this is (`describe`)
    return lib


def check_layout(lib: ctypes.CDLL, name: str = "the decode library") -> None:
    """Raises KernelABIError unless `lib` reports this module's LAYOUT_VERSION and the size, field count and field
    offsets of every struct in STRUCTS (compiled.check_abi)."""
    compiled.check_abi(lib, name, STRUCTS, LAYOUT_VERSION)


def has_int8_vnni(lib: ctypes.CDLL) -> bool:
    """Whether `lib` was built with AVX512-VNNI (this CPU has it): int8 products by vpdpbusd, else by fp32 FMAs."""
    return bool(lib.gptlab_int8_vnni())


def describe(lib: ctypes.CDLL) -> str:
    """Which build `lib` is and what its products use, e.g. "x86-64-v3 (avx2, 8 lanes)" or "x86-64-v4+vnni+bf16
    (avx512, 16 lanes, bf16 dot products, int8 by VNNI)"; an armv8.2-a+dotprod build adds "int8 by
    sdot"."""
    extra = (["bf16 dot products"] * bool(lib.gptlab_bf16_dot()) + ["int8 by VNNI"] * has_int8_vnni(lib)
             + ["int8 by sdot"] * bool(lib.gptlab_int8_sdot()))
    return (f"{getattr(lib, 'gptlab_build', '?')} ({lib.gptlab_simd().decode()}, {lib.gptlab_lanes()} lanes"
            + "".join(f", {e}" for e in extra) + ")")


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernel (`build_library`) of this CPU's build (`build_for_cpu`), built once per source, compiler
    and build; None where this machine lacks what it needs (`missing`) or the build fails or is refused (then with a
    warning: decoding falls back to torch)."""
    if missing() is not None:
        return None
    try:
        return build_library()
    except (KernelBuildError, UnknownBuild) as exc:
        log.warning("the fused decode step is unavailable, decoding with torch ops: %s", exc)
        return None
