"""C++ libraries compiled on first use with the machine's compiler and loaded with ctypes: the fused decode kernel
(inference/native.py) and the naive reference engine (reference/library.py) share this.

A build goes into a cache folder under a name keyed by its source, its flags and the compiler's version (and what
else the caller names, such as the CPU for -march=native builds), is compiled aside and published atomically, so two
processes never load a half-written library. Then its structs are checked: the library exports its layout version,
the size of each struct and the offset of each field by name, and `check_abi` refuses one that differs from the
ctypes structs Python fills (`ABIError`), so a stale or mismatched build is never called.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gptlab.machine import ARM64, X86_64, cache_root, cpu_flags

INCLUDE = Path(__file__).parent / "csrc"  # the headers every library may include (abi.h: the layout it exports)


class BuildError(RuntimeError):
    """A source did not compile or load on a machine that has a compiler."""


class ABIError(BuildError):
    """The library's structs are not the ones Python passes (a stale or mismatched build): never called."""


def build_folder() -> Path:
    """Where builds go: $GPTLAB_KERNELS, else kernels/ in gptlab's cache folder (machine.cache_root)."""
    if os.environ.get("GPTLAB_KERNELS"):
        return Path(os.environ["GPTLAB_KERNELS"])
    return cache_root() / "kernels"


def compiler() -> str | None:
    """The C++ compiler on PATH: $CXX, else g++; None where there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))


def compiler_name() -> str:
    return os.environ.get("CXX", "g++")


@functools.cache
def compiler_version(path: str) -> str:
    return subprocess.run([path, "--version"], check=True, capture_output=True, text=True, timeout=60).stdout


def build_shared(source: Path, flags: Sequence[str], folder: Path, prefix: str, key: str = "") -> Path:
    """The library built from `source` with `flags` in `folder`, named PREFIX-KEY-CODE.so (KEY: a hash of the
    compiler, its version, the flags and the caller's `key`; CODE: a hash of the source and headers, source_key); compiled unless it is
    there already. Earlier builds of the same KEY (older sources) are removed. Raises BuildError with the compiler's
    whole message where it fails."""
    path = compiler()
    if path is None:
        raise BuildError(f"no {compiler_name()} on PATH")
    try:
        machine = hashlib.sha256("\n".join([path, *flags, compiler_version(path), key]).encode()).hexdigest()[:12]
        code = source_key(source)
        target = folder / f"{prefix}-{machine}-{code}.so"
        if not target.is_file():
            compile_into(path, flags, source, target)
            for old in target.parent.glob(f"{prefix}-{machine}-*.so"):
                if old != target:
                    old.unlink(missing_ok=True)
    except subprocess.CalledProcessError as exc:
        raise BuildError(f"{' '.join(exc.cmd)} failed:\n{exc.stderr}") from None  # all of it is here
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"building {source} failed: {exc}") from exc
    return target


def source_key(source: Path) -> str:
    """A hash of what a build compiles: `source`, the headers beside it (an #include "..." finds those first) and
    every header in INCLUDE (a changed header rebuilds)."""
    digest = hashlib.sha256(source.read_bytes())
    for header in [*sorted(source.parent.glob("*.h")), *sorted(INCLUDE.glob("*.h"))]:
        digest.update(header.name.encode() + b"\0" + header.read_bytes())
    return digest.hexdigest()[:12]


def compile_into(path: str, flags: Sequence[str], source: Path, target: Path) -> None:
    """Compile `source` into `target` with the compiler at `path` (INCLUDE on its header path): aside in a temporary
    folder, then published atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([path, *flags, "-I", str(INCLUDE), str(source), "-o", str(built)], check=True, capture_output=True, text=True,
                       timeout=300)
        os.replace(built, target)


def load_shared(target: Path) -> ctypes.CDLL:
    """The library at `target`, loaded (BuildError where the loader refuses it)."""
    try:
        return ctypes.CDLL(str(target))
    except OSError as exc:
        raise BuildError(f"loading {target} failed: {exc}") from exc


def check_abi(lib: ctypes.CDLL, name: str, structs: Sequence[type[ctypes.Structure]], version: int) -> None:
    """Raises ABIError unless `lib` reports layout `version`, and for every struct in `structs` (named as in C) the
    size, the number of fields and the offset of every field that ctypes gives it (the message names the struct or
    field and both values)."""
    layout_version, sizeof, fields, offsetof = _layout_functions(lib, name)
    if layout_version() != version:
        raise ABIError(f"{name} has struct layout version {layout_version()}, gptlab passes version {version}; "
                       "it is not called")
    for struct in structs:
        c_name = struct.__name__.encode()
        if sizeof(c_name) != ctypes.sizeof(struct):
            raise ABIError(f"struct {struct.__name__} is {sizeof(c_name)} bytes in {name} but "
                           f"{ctypes.sizeof(struct)} bytes in gptlab's ctypes; it is not called")
        if fields(c_name) != len(struct._fields_):
            raise ABIError(f"struct {struct.__name__} has {fields(c_name)} fields in {name} but "
                           f"{len(struct._fields_)} in gptlab's ctypes; it is not called")
        for field, _ in struct._fields_:
            c_offset, offset = offsetof(c_name, field.encode()), getattr(struct, field).offset
            if c_offset != offset:
                where = "absent" if c_offset < 0 else f"at byte {c_offset}"
                raise ABIError(f"{struct.__name__}.{field} is {where} in {name} but at byte {offset} in "
                               "gptlab's ctypes; it is not called")


def _layout_functions(lib: ctypes.CDLL, name: str) -> tuple:
    """The library's gptlab_layout_version(), gptlab_sizeof(struct), gptlab_fields(struct) and
    gptlab_offsetof(struct, field), typed; ABIError where it lacks them."""
    try:
        functions = lib.gptlab_layout_version, lib.gptlab_sizeof, lib.gptlab_fields, lib.gptlab_offsetof
    except AttributeError:
        raise ABIError(f"{name} exports no struct layout (built from an older source); it is not called") from None
    for fn, restype, argtypes in zip(functions, (ctypes.c_int, ctypes.c_long, ctypes.c_int, ctypes.c_long),
                                     ([], [ctypes.c_char_p], [ctypes.c_char_p], [ctypes.c_char_p] * 2)):
        fn.restype, fn.argtypes = restype, argtypes
    return functions


# ---- the builds: one source compiled for a named target, chosen by the CPU's instructions ----

@dataclass(frozen=True)
class Build:
    """One compiled form of the kernel: its `name`, the compiler flags naming its `target`, the CPU features it needs
    (as /proc/cpuinfo names them) and the architectures (platform.machine()) it runs on, () for any."""

    name: str
    target: tuple[str, ...]
    needs: tuple[str, ...] = ()
    arch: tuple[str, ...] = ()

    def runs_here(self) -> bool:
        return (not self.arch or platform.machine() in self.arch) and set(self.needs) <= cpu_flags()


V3 = ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")  # x86-64-v3 (abm: LZCNT)
V4 = (*V3, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")  # x86-64-v4
_VNNI, _BF16 = ("-mavx512vnni", "avx512_vnni"), ("-mavx512bf16", "avx512_bf16")
# Best first: the CPU gets the first it runs. The AVX-512 builds add the byte products (VNNI) and bf16 dot products
# where the CPU has them; ARM's dot-product build multiplies int8 weights by sdot (csrc/products.h, gemv_sdot).
BUILDS = {b.name: b for b in [
    *(Build("x86-64-v4" + "".join(f"+{flag[8:]}" for flag, _ in extra), ("-march=x86-64-v4", *(f for f, _ in extra)),
            (*V4, *(n for _, n in extra)), X86_64)
      for extra in ((_VNNI, _BF16), (_VNNI,), (_BF16,), ())),
    Build("x86-64-v3", ("-march=x86-64-v3",), V3, X86_64),
    Build("armv8.2-a+dotprod", ("-march=armv8.2-a+dotprod",), ("asimd", "asimddp"), ARM64),
    Build("armv8-a", ("-march=armv8-a",), (), ARM64),  # NEON is part of every ARM64 CPU
    Build("plain", ()),  # the compiler's default target: generic vectors
]}


class UnknownBuild(ValueError):
    """$GPTLAB_KERNEL_BUILD (or a caller) names a build that does not exist or that this CPU cannot run."""


def build_for_cpu(name: str | None = None) -> Build:
    """The build this CPU runs: `name` (else $GPTLAB_KERNEL_BUILD) if given, else the first of BUILDS whose
    instructions it has. Raises UnknownBuild for a name not in BUILDS, or one whose instructions this CPU lacks
    (it would die of SIGILL)."""
    name = name or os.environ.get("GPTLAB_KERNEL_BUILD") or None
    if name is None:
        return next(b for b in BUILDS.values() if b.runs_here())
    if name not in BUILDS:
        raise UnknownBuild(f"no kernel build named {name!r} (GPTLAB_KERNEL_BUILD): the builds are "
                           f"{', '.join(BUILDS)}")
    build = BUILDS[name]
    if not build.runs_here():
        lacks = sorted(set(build.needs) - cpu_flags()) or [f"an {'/'.join(build.arch)} CPU"]
        raise UnknownBuild(f"the {name} kernel build needs {', '.join(lacks)}, which this CPU lacks: "
                           f"pick one of {', '.join(runnable_builds())}")
    return build


def runnable_builds() -> list[str]:
    """The names of the builds this CPU runs, best first."""
    return [b.name for b in BUILDS.values() if b.runs_here()]
