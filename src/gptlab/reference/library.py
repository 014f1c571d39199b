"""The naive engine's library (csrc/reference.cpp): building it, loading it, and the structs passed across.

Plain C++17 compiled with -O2 -ffp-contract=off (never -ffast-math or -march=native: IEEE -inf in the causal
mask, finite differences that mean something, and the same numbers on every CPU), on first use, into the folder
the decode kernel uses (compiled.build_folder). Its structs are checked as the kernel's are (compiled.check_abi):
a library whose layout differs from the ctypes structs below is refused, never called.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from gptlab import compiled
from gptlab.errors import GptlabError

SOURCE = Path(__file__).parent / "csrc" / "reference.cpp"
FLAGS = ("-O2", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC")
LAYOUT_VERSION = 1  # reference.cpp's LAYOUT_VERSION: raise both with any change to the structs' fields or meaning
SCALARS = ("f32", "f64")  # the library's two builds of every function: float and double tensors
_P = ctypes.c_void_p
LAYER_TENSORS = ("ln_1_w", "ln_1_b", "c_attn_w", "c_attn_b", "attn_proj_w", "attn_proj_b",
                 "ln_2_w", "ln_2_b", "c_fc_w", "c_fc_b", "mlp_proj_w", "mlp_proj_b")


class Layer(ctypes.Structure):
    """reference.cpp's `Layer`: one block's tensors, or their gradients (NULL for an absent bias)."""

    _fields_ = [(name, _P) for name in LAYER_TENSORS]


class Model(ctypes.Structure):
    """reference.cpp's `Model`: the shape and the tensors (or, in another Model, the gradients)."""

    _fields_ = [(name, ctypes.c_int) for name in (
        "n_layer", "n_head", "n_embd", "vocab_size", "block_size", "gelu_tanh")] + [
        ("eps", ctypes.c_double), ("wte", _P), ("wpe", _P), ("ln_f_w", _P), ("ln_f_b", _P),
        ("layers", ctypes.POINTER(Layer))]


class Masks(ctypes.Structure):
    """reference.cpp's `Masks`: one block's dropout multipliers (0 or 1 / (1 - p)), NULL where none."""

    _fields_ = [("attn", _P), ("attn_resid", _P), ("mlp_resid", _P)]


class Batch(ctypes.Structure):
    """reference.cpp's `Batch`: the token ids, the targets (NULL: no loss), the dropout masks, the logits out and
    the loss out."""

    _fields_ = [("B", ctypes.c_int), ("T", ctypes.c_int), ("idx", _P), ("targets", _P), ("emb_mask", _P),
                ("masks", ctypes.POINTER(Masks)), ("logits", _P), ("loss", ctypes.c_double)]


STRUCTS = (Layer, Model, Masks, Batch)


class ReferenceUnavailable(GptlabError):
    """The naive engine cannot run here (no C++ compiler): the message says what to install."""


def missing() -> str | None:
    """What this machine lacks to build the naive engine (a C++17 compiler), as one line that says what to
    install; None where it has it: there a failed build is a bug, not a missing feature."""
    if compiled.compiler() is None:
        return (f"the reference engine needs a C++17 compiler and there is no {compiled.compiler_name()} on PATH: "
                "install g++ (Debian/Ubuntu: apt-get install g++; macOS: xcode-select --install) or set CXX")
    return None


def build_library(source: Path = SOURCE, folder: Path | None = None, flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL:
    """Compile `source` (default: the reference engine) with `flags` into `folder` (default
    compiled.build_folder()) unless built already, load it, check its structs and type its functions. Raises
    compiled.BuildError where it fails to compile or load, compiled.ABIError where its structs differ."""
    target = compiled.build_shared(source, flags, folder or compiled.build_folder(), "reference")
    lib = compiled.load_shared(target)
    compiled.check_abi(lib, str(target), STRUCTS, LAYOUT_VERSION)
    declare(lib)
    return lib


def declare(lib: ctypes.CDLL, scalars: tuple[str, ...] = SCALARS) -> None:
    """The exported functions' argument and return types (every tensor passed as a void pointer), for the builds
    of each scalar in `scalars` (the fast engine exports f32 alone)."""
    i, i64, d = ctypes.c_int, ctypes.c_int64, ctypes.c_double
    lib.gptlab_profile_pieces.argtypes, lib.gptlab_profile_pieces.restype = [], i
    lib.gptlab_profile_name.argtypes, lib.gptlab_profile_name.restype = [i], ctypes.c_char_p
    lib.gptlab_profile_seconds.argtypes, lib.gptlab_profile_seconds.restype = [i], d
    lib.gptlab_profile_reset.argtypes, lib.gptlab_profile_reset.restype = [], None
    for s in scalars:
        signatures = {
            "step": ([ctypes.POINTER(Model), ctypes.POINTER(Model), ctypes.POINTER(Batch)], i),
            "clip_grad_norm": ([ctypes.POINTER(_P), _P, i, d], d),
            "adamw": ([_P, _P, _P, _P, i64, d, d, d, d, d, i64], None),
            "layernorm": ([_P, _P, _P, i, i, d, _P, _P, _P, _P, _P], None),
            "attention": ([_P, _P, i, i, i, i, _P, _P, _P], None),
            "gelu": ([_P, i64, i, _P, _P, _P], None),
            "mlp": ([_P, _P, _P, _P, _P, i, i, i, _P, _P, _P, _P, _P, _P, _P], None),
            "cross_entropy": ([_P, _P, i, i, _P], d),
            "block": ([ctypes.POINTER(Model), ctypes.POINTER(Layer), ctypes.POINTER(Layer), ctypes.POINTER(Masks),
                       i, i, _P, _P, _P, _P], None),
        }
        for name, (argtypes, restype) in signatures.items():
            fn = getattr(lib, f"gptlab_{name}_{s}")
            fn.argtypes, fn.restype = argtypes, restype


@functools.cache
def load_library() -> ctypes.CDLL:
    """The naive engine's library, built once per source and compiler. ReferenceUnavailable (one line saying what
    to install) where there is no compiler; a compiler that fails to build it raises compiled.BuildError."""
    lack = missing()
    if lack is not None:
        raise ReferenceUnavailable(lack)
    return build_library()


def profile(lib: ctypes.CDLL) -> dict[str, float]:
    """Seconds the library has spent in each of its functions since the last `reset_profile` (summed over calls),
    by function name (embedding_forward, layernorm_backward, linear_forward, attention_backward, adamw, ...)."""
    return {lib.gptlab_profile_name(k).decode(): lib.gptlab_profile_seconds(k)
            for k in range(lib.gptlab_profile_pieces())}


def reset_profile(lib: ctypes.CDLL) -> None:
    lib.gptlab_profile_reset()


def tick_clock(lib: ctypes.CDLL, on: bool) -> None:
    """The tests' clock for `profile`: with `on`, every reading of the engine's clock is one tick (counted as a
    second) past the last, so each function's total is the number of its calls, exactly, as long as no timed
    function runs inside another; off, the steady clock again."""
    lib.gptlab_profile_ticking.argtypes, lib.gptlab_profile_ticking.restype = [ctypes.c_int], None
    lib.gptlab_profile_ticking(int(on))
