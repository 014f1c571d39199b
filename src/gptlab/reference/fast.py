"""The naive engine made fast, rung by rung (csrc/fast.cpp; docs/to-the-metal.md): one C++ source compiled once per
rung, each rung a compile-time level that keeps the ideas of the rungs below it and adds one (RUNGS: loop order,
cache tiles, vectors, threads, fusion). Every rung exports the naive engine's structs and functions (float only),
so the naive engine's Python (naive_gpt.step, NaiveGPT, NaiveAdamW) drives it unchanged: `FastGPT` is a NaiveGPT
computed by a rung's library, and its checkpoints are a GPT's.

A rung is built for this CPU's target (compiled.build_for_cpu: AVX-512, AVX2 + FMA, NEON or plain; never
-march=native, never -ffast-math) with -O3, -fno-math-errno and OpenMP, into the folder every gptlab library is
built into, keyed by the source, its headers and the decode kernel's vector layer (inference/csrc/simd.h), which it
includes.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from gptlab import compiled
from gptlab.config import TrainConfig
from gptlab.model import GPT, is_gpt
from gptlab.optim import param_groups
from gptlab.reference import library
from gptlab.reference.naive_adamw import NaiveAdamW
from gptlab.reference.naive_gpt import DropoutMasks, NaiveGPT

FAST_SOURCE = Path(__file__).parent / "csrc" / "fast.cpp"
VECTORS = Path(__file__).parents[1] / "inference" / "csrc" / "simd.h"  # included by fast.cpp from beside decode.cpp
# never -ffast-math (IEEE -inf in the causal mask); -fno-math-errno changes no result (sqrt stays IEEE's) but lets a
# loop with std::sqrt vectorise: with errno kept, every sqrt may call the C library for a negative argument, so
# AdamW ran one float at a time (docs/to-the-metal.md)
FAST_FLAGS = ("-O3", "-fno-math-errno", "-fopenmp", "-std=c++17", "-shared", "-fPIC")
RUNGS = ("loops", "tiles", "simd", "threads", "fused")  # fast.cpp's GPTLAB_RUNG 1 .. 5, each adding one idea
TOP_RUNG = RUNGS[-1]  # what `--engine fast` runs


def rung_level(rung: str) -> int:
    """fast.cpp's GPTLAB_RUNG for `rung` (1 for loops .. 5 for fused); ValueError naming the rungs otherwise."""
    if rung not in RUNGS:
        raise ValueError(f"no rung named {rung!r}: the rungs are {', '.join(RUNGS)}")
    return RUNGS.index(rung) + 1


def build_fast(rung: str = TOP_RUNG, build: compiled.Build | str | None = None, folder: Path | None = None,
               source: Path = FAST_SOURCE) -> ctypes.CDLL:
    """Compile `source` (default fast.cpp) at `rung` for `build` (default: this CPU's, compiled.build_for_cpu)
    into `folder` (default compiled.build_folder()) unless built already, load it, check its structs (the naive
    engine's) and type its functions. Raises compiled.BuildError where it fails to compile or load,
    compiled.ABIError where its structs differ, compiled.UnknownBuild for a build this CPU cannot run."""
    target_build = build if isinstance(build, compiled.Build) else compiled.build_for_cpu(build)
    flags = (*FAST_FLAGS, *target_build.target, f"-DGPTLAB_RUNG={rung_level(rung)}")
    target = compiled.build_shared(source, flags, folder or compiled.build_folder(),
                                   f"fast-{rung}-{target_build.name}", key=compiled.source_key(VECTORS))
    lib = compiled.load_shared(target)  # after torch: its libgomp is the one OpenMP runtime in the process
    compiled.check_abi(lib, str(target), library.STRUCTS, library.LAYOUT_VERSION)
    library.declare(lib, ("f32",))
    i = ctypes.c_int
    lib.gptlab_fast_rung.argtypes, lib.gptlab_fast_rung.restype = [], i
    lib.gptlab_fast_vectors.argtypes, lib.gptlab_fast_vectors.restype = [], ctypes.c_char_p
    lib.gptlab_fast_set_threads.argtypes, lib.gptlab_fast_set_threads.restype = [i], None
    lib.gptlab_fast_threads.argtypes, lib.gptlab_fast_threads.restype = [], i
    lib.gptlab_fast_tiles.argtypes, lib.gptlab_fast_tiles.restype = [ctypes.POINTER(i)], None
    lib.gptlab_fast_masks.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_double, ctypes.c_void_p,
                                      ctypes.c_int64]
    lib.gptlab_fast_masks.restype = None
    lib.gptlab_build = target_build.name
    return lib


@functools.cache
def fast_library(rung: str = TOP_RUNG) -> ctypes.CDLL:
    """The rung's library for this CPU, built once per source and compiler (build_fast); ReferenceUnavailable (one
    line saying what to install) where there is no C++ compiler."""
    lack = library.missing()
    if lack is not None:
        raise library.ReferenceUnavailable(lack.replace("the reference engine", "the fast engine"))
    rung_level(rung)
    return build_fast(rung)


def use_threads(lib: ctypes.CDLL, threads: int | None = None) -> None:
    """The threads the rung's loops use from now on (rungs below `threads` use one whatever is asked): `threads`,
    default torch's count (the two never run at once, so neither oversubscribes the other)."""
    lib.gptlab_fast_set_threads(threads or torch.get_num_threads())


def tiles(lib: ctypes.CDLL) -> dict[str, int]:
    """The library's kernel block (MR x NR) and cache tiles (MC, KC, NC), from the caches this machine reports."""
    out = (ctypes.c_int * 5)()
    lib.gptlab_fast_tiles(out)
    return dict(zip(("mr", "nr", "mc", "kc", "nc"), out))


def describe_rung(lib: ctypes.CDLL) -> str:
    """Which rung and build, e.g. "fused (rung 5 of 5), x86-64-v3, avx2 vectors, 2 threads"."""
    rung = lib.gptlab_fast_rung()
    return (f"{RUNGS[rung - 1]} (rung {rung} of {len(RUNGS)}), {lib.gptlab_build}, "
            f"{lib.gptlab_fast_vectors().decode()} vectors, {lib.gptlab_fast_threads()} "
            f"thread{'s' * (lib.gptlab_fast_threads() != 1)}")


def draw_masks(model: GPT, B: int, T: int, p: float, lib: ctypes.CDLL, into: torch.Tensor | None = None,
               ) -> DropoutMasks:
    """One forward's dropout multipliers (0 or 1 / (1 - p), each kept with probability 1 - p) drawn by the engine
    (gptlab_fast_masks: counter-based, over the threads) from one seed that torch's generator draws, so a run is
    reproduced by torch.manual_seed and resumed by the generator's state as the torch path's is. The masks are new
    tensors, or views of the flat fp32 `into` (at least mask_floats of them), written over."""
    c = model.config
    seed = int(torch.randint(0, 2**62, (1,)).item())
    streams, used = iter(range(1 + 3 * c.n_layer)), 0
    if into is not None and into.numel() < mask_floats(model, B, T):
        raise ValueError(f"{into.numel()} floats cannot hold the masks of {B} x {T}")

    def mask(*shape: int) -> torch.Tensor:
        nonlocal used
        n = torch.Size(shape).numel()
        out = torch.empty(shape) if into is None else into[used:used + n].view(shape)
        used += n
        lib.gptlab_fast_masks(seed, next(streams), p, out.data_ptr(), n)
        return out
    return DropoutMasks(mask(B, T, c.n_embd), [mask(B, c.n_head, T, T) for _ in range(c.n_layer)],
                        [mask(B, T, c.n_embd) for _ in range(c.n_layer)], [mask(B, T, c.n_embd) for _ in range(c.n_layer)])


def mask_floats(model: GPT, B: int, T: int) -> int:
    """How many multipliers one forward's masks hold: (B, T, C) after the embeddings and twice a block, (B, H, T, T)
    on each block's attention."""
    c = model.config
    return B * T * c.n_embd * (1 + 2 * c.n_layer) + c.n_layer * B * c.n_head * T * T


class FastGPT(NaiveGPT):
    """A GPT computed by one rung of the fast engine (fp32, CPU): a NaiveGPT whose library is the rung's, and whose
    dropout masks the engine draws (draw_masks). Its state dict, checkpoints and run folders are a GPT's."""

    fast_rung: str = TOP_RUNG

    def engine_library(self) -> ctypes.CDLL:
        lib = fast_library(self.fast_rung)
        use_threads(lib)
        return lib

    def draw_masks(self, B: int, T: int) -> DropoutMasks | None:
        """The next forward's masks (None without dropout or in eval mode), drawn into a buffer the model keeps and
        writes over at its next draw: a step of char-small draws 120 MB of them, and fresh memory each step cost
        more page faults than the draws themselves."""
        p = self.config.dropout
        if not (self.training and p > 0):
            return None
        kept = self.__dict__.get("_kept_masks")
        if kept is None or kept.numel() < mask_floats(self, B, T):
            kept = self.__dict__["_kept_masks"] = torch.empty(mask_floats(self, B, T))
        return draw_masks(self, B, T, p, self.engine_library(), into=kept)


def fast_model(model: GPT, rung: str = TOP_RUNG) -> FastGPT:
    """`model` itself, computed by the rung's library from now on (its class becomes FastGPT: no state changes);
    the library is built first, so a machine without a compiler is told before anything is written."""
    fast_library(rung)
    if not is_gpt(model):
        raise TypeError(f"the fast engine computes a GPT, not a {type(model).__name__}")
    model.__class__ = FastGPT
    model.fast_rung = rung
    return model


def fast_optimizer(model: GPT, cfg: TrainConfig, rung: str = TOP_RUNG) -> NaiveAdamW:
    """The rung's AdamW (and global-norm clipping) with cfg's learning rate and betas over the torch path's groups."""
    lib = fast_library(rung)
    use_threads(lib)
    return NaiveAdamW(param_groups(model.parameters(), cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                      library=lib)
