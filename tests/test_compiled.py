"""The build every native library shares (gptlab/compiled.py) and the layout header they include (csrc/abi.h): a
changed header rebuilds, and a header that misreports the structs gets the library refused before any call."""

import shutil

import pytest

from gptlab import compiled
from gptlab.reference import library

O0 = ("-O0", *library.FLAGS[1:])  # the quickest build: these tests check the layout, not the numbers


@pytest.fixture
def headers(tmp_path, monkeypatch):
    """A copy of gptlab's headers, made the ones builds include."""
    folder = tmp_path / "include"
    shutil.copytree(compiled.INCLUDE, folder)
    monkeypatch.setattr(compiled, "INCLUDE", folder)
    return folder / "abi.h"


def edited(header, old, new):
    text = header.read_text()
    assert old in text, f"{old!r} is not in abi.h: the edit no longer applies"
    header.write_text(text.replace(old, new))


def test_a_changed_header_rebuilds_the_library(headers, tmp_path):
    first = compiled.build_shared(library.SOURCE, O0, tmp_path / "kernels", "reference")
    assert compiled.build_shared(library.SOURCE, O0, tmp_path / "kernels", "reference") == first  # built once
    headers.write_text(headers.read_text() + "\n// a comment changes nothing the compiler makes, but it is new\n")
    second = compiled.build_shared(library.SOURCE, O0, tmp_path / "kernels", "reference")
    assert second != first and second.is_file()
    assert not first.exists()  # the older build of the same compiler and flags is removed


# abi.h's planted bugs -> what the refusal says: each header misreports the layout of every library built with it
HEADER_MUTANTS = {
    "offsets one field off": (("return e.off;", "return e.off + 8;"), r"Layer\.ln_1_w is at byte 8 in .* but at "
                                                                      r"byte 0 in gptlab's ctypes"),
    "sizes a byte long": (("return e.size;", "return e.size + 1;"), r"struct Layer is 97 bytes in .* but 96 bytes"),
    "a field not counted": (("n += !std::strcmp(e.s, s);", "n += !std::strcmp(e.s, s) && e.off;"),
                            r"struct Layer has 11 fields in .* but 12 in gptlab's ctypes"),
}


@pytest.mark.parametrize("name", HEADER_MUTANTS)
def test_a_header_that_misreports_the_structs_gets_the_library_refused(name, headers, tmp_path):
    (old, new), message = HEADER_MUTANTS[name]
    edited(headers, old, new)
    with pytest.raises(compiled.ABIError, match=message):
        library.build_library(library.SOURCE, tmp_path / "kernels", O0)



def test_a_header_beside_the_source_is_part_of_its_key(tmp_path):
    """An #include "x.h" finds a header beside the source first (the kernel mutants put a changed simd.h there): a
    change to it must change the build's key, or a build of the old header would be loaded."""
    source = tmp_path / "lib.cpp"
    source.write_text('#include "x.h"\n')
    (tmp_path / "x.h").write_text("int a = 1;\n")
    before = compiled.source_key(source)
    (tmp_path / "x.h").write_text("int a = 2;\n")
    assert compiled.source_key(source) != before


def test_without_a_compiler_the_line_names_cxx_or_else_g_plus_plus(monkeypatch, tmp_path):
    """No compiler on PATH: the build is refused naming the one looked for, $CXX where it is set, else g++."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    assert compiled.compiler() is None and compiled.compiler_name() == "g++"
    with pytest.raises(compiled.BuildError, match="^no g\\+\\+ on PATH$"):
        compiled.build_shared(library.SOURCE, O0, tmp_path / "k", "t")
    monkeypatch.setenv("CXX", "clang++-99")
    assert compiled.compiler() is None and compiled.compiler_name() == "clang++-99"
