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
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from gptlab.machine import cache_root

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
