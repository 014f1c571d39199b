"""A/B of two decode kernels on GPT-2-124M's shape: step times alternating kernel by kernel, round by round, in one
process, so both see the same moments of the machine (a fair ratio on a loaded machine, where absolute figures are
not). Each side is a build name (gptlab.inference.native.BUILDS, built for this CPU), a decode.cpp file (built with
-O3 -march=native, as kernels were built before they named their targets), or FILE@BUILD (that file, with the headers
beside it (simd.h, products.h: copy them too), for a named build: an older source against today's for the same target).

    .venv/bin/python scripts/kernel_ab.py A B [--rounds N] [--threads T]
    .venv/bin/python scripts/kernel_ab.py x86-64-v3 x86-64-v4+vnni+bf16 --threads 1
    git show 0c43430:src/gptlab/inference/csrc/decode.cpp > /tmp/old.cpp
    .venv/bin/python scripts/kernel_ab.py /tmp/old.cpp x86-64-v4+vnni+bf16 --threads 1
    mkdir /tmp/v && git show HEAD~1:src/gptlab/inference/csrc/decode.cpp > /tmp/v/decode.cpp \
        && git show HEAD~1:src/gptlab/inference/csrc/simd.h > /tmp/v/simd.h \
        && git show HEAD~1:src/gptlab/inference/csrc/products.h > /tmp/v/products.h
    .venv/bin/python scripts/kernel_ab.py /tmp/v/decode.cpp@x86-64-v3 x86-64-v3 --threads 1

Prints, per precision (fp32, bf16, int8) and batch (1, 8 rows at 144 cached positions), the median step of each
side and B's time over A's.
"""

import argparse
import copy
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from gptlab import compiled
from gptlab.bench.generate import GEN_MODELS
from gptlab.config import ModelConfig, build
from gptlab.inference import fused, native
from gptlab.inference.loading import prepare_for_inference
from gptlab.model import GPT


def kernel(side: str, folder: Path) -> ctypes.CDLL:
    if side in native.BUILDS:
        return native.build_library(build=side)
    if "@" in side:  # FILE@BUILD: that source (with simd.h and products.h beside it) for a named build
        source, build = side.rsplit("@", 1)
        (folder / side.replace("/", "_")).mkdir()
        return native.build_library(Path(source), folder / side.replace("/", "_"), build)
    target = folder / f"{Path(side).stem}.so"
    subprocess.run(["g++", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-I",
                    str(compiled.INCLUDE), "-I", str(native.SOURCE.parent), side, "-o", str(target)], check=True)
    lib = ctypes.CDLL(str(target))
    native.check_layout(lib, side)
    lib.gptlab_decode_step.argtypes = [ctypes.POINTER(native.Model), ctypes.POINTER(native.Step)]
    lib.gptlab_decode_step.restype = ctypes.c_int
    lib.gptlab_int8_vnni.argtypes, lib.gptlab_int8_vnni.restype = [], ctypes.c_int
    return lib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {side: kernel(side, Path(tmp)) for side in (args.a, args.b)}
        torch.manual_seed(0)
        base = GPT(build(ModelConfig, GEN_MODELS["gpt2-124M"], {})).eval()
        print(f"A: {args.a}, B: {args.b}; {args.threads} threads, median of {args.rounds} rounds")
        for precision in ("fp32", "bf16", "int8"):
            models = {}
            for side, lib in libs.items():  # each side's own prepared copy, decoding on its kernel
                fused.load_library = lambda lib=lib: lib
                models[side] = prepare_for_inference(copy.deepcopy(base), precision)
            decoders = {side: model.decoder for side, model in models.items()}
            for rows in (1, 8):
                ids = torch.randint(0, base.config.vocab_size, (rows,))
                caches = {side: model.new_kv_cache(rows, max_len=160) for side, model in models.items()}
                for cache in caches.values():
                    cache.pos.fill_(144)
                times = {side: [] for side in decoders}
                for _ in range(args.rounds):
                    for side, decoder in decoders.items():
                        start = time.perf_counter()
                        decoder.step(ids, caches[side])
                        times[side].append(time.perf_counter() - start)
                        caches[side].pos -= 1  # every round decodes at the same position
                a, b = (statistics.median(times[side]) for side in (args.a, args.b))
                print(f"{precision} batch {rows}: A {a * 1e3:.2f} ms, B {b * 1e3:.2f} ms, B/A {b / a:.3f}")


if __name__ == "__main__":
    main()
