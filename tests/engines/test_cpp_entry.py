"""The native extension's surface: each entry point takes its tensors and one ``Call`` (at
most 8 arguments, read from pybind11's docstring signatures), and the constants Python and
C++ share have one definition, causalattn/constants.py: the build passes them to the
compiler, the extension exports what it was compiled with, and no C++ or Python file keeps
a copy of its own."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from causalattn import constants
from causalattn.engines import cpp

SRC = Path(cpp.__file__).resolve().parents[1]
ext_needed = pytest.mark.skipif(bool(cpp.unavailable()), reason=cpp.unavailable() or "built")


def _arity(doc: str) -> int:
    """The number of parameters in a pybind11 docstring's first line ``name(a: T, ...) -> R``
    (commas inside brackets, as in ``tuple[int, int]``, do not count)."""
    inside = doc.splitlines()[0].split("(", 1)[1].rsplit(") ->", 1)[0]
    depth, n = 0, 1 if inside.strip() else 0
    for ch in inside:
        depth += ch in "[("
        depth -= ch in "])"
        n += ch == "," and depth == 0
    return n


def test_the_arity_reader_counts_parameters_not_commas():
    assert _arity("f(a: int, b: tuple[int, int], c: dict[str, list[int]]) -> None") == 3
    assert _arity("g() -> None") == 0


@ext_needed
def test_no_entry_point_of_the_extension_takes_more_than_8_arguments():
    ext = cpp._ops()
    seen = {}
    for name in dir(ext):
        obj = getattr(ext, name)
        if callable(obj) and not name.startswith("__"):
            targets = [obj] if not isinstance(obj, type) else [obj.__init__]
            for t in targets:
                seen[f"{name}"] = _arity(t.__doc__)
    assert {"fwd", "bwd", "Call"} <= set(seen)
    assert max(seen.values()) <= 8, seen
    assert seen["fwd"] == 4 and seen["bwd"] == 8  # q, k, v (out, dout, lse, dlse) and a Call


@ext_needed
def test_a_call_names_every_field_and_defaults_to_none_and_off():
    c = cpp._ops().Call()
    assert c.mask is None and c.bias is None and c.smod_code is None and c.drop_thr == 0
    assert c.scale == 1.0 and c.splits == 1 and not c.decode
    with pytest.raises(AttributeError):
        c.masks = None  # a misspelt field is refused, not silently added


@ext_needed
def test_the_extension_was_compiled_with_pythons_constants():
    ext = cpp._ops()
    assert {n: getattr(ext, n) for n in constants.SHARED} == constants.SHARED
    assert cpp._disagreeing(ext) == ""

    class Other:  # an extension built with another hash would refuse to run
        pass

    for n, v in constants.SHARED.items():
        setattr(Other, n, v)
    Other.HASH_GOLD = constants.HASH_GOLD + 1
    assert "HASH_GOLD" in cpp._disagreeing(Other)


def test_the_build_passes_each_shared_constant_exactly():
    flags = dict(f[len("-DCAUSALATTN_") :].split("=", 1) for f in cpp.DEFINES)
    assert set(flags) == set(constants.SHARED)
    assert float(flags["LOG2E"]) == constants.LOG2E and float(flags["LN2"]) == constants.LN2
    assert int(flags["HASH_C1"].rstrip("u"), 16) == constants.HASH_C1
    assert int(flags["PARTIAL_TILE"].rstrip("u"), 16) == constants.PARTIAL_TILE
    key = cpp.cache_key()
    old = cpp.DEFINES
    try:  # another value of a constant is another binary: another build folder
        cpp.DEFINES = (*old[:-1], "-DCAUSALATTN_PARTIAL_TILE=0x4u")
        assert cpp.cache_key() != key
    finally:
        cpp.DEFINES = old


LITERALS = [
    "1.4426950408889634",
    "0.6931471805599453",
    *(f"{v:#x}" for k, v in constants.SHARED.items() if k.startswith("HASH_")),
]


def test_no_source_keeps_its_own_copy_of_a_shared_constant():
    hits = []
    for path in sorted(SRC.rglob("*")):
        if path.suffix not in (".py", ".h", ".cpp") or path.name == "constants.py":
            continue
        text = path.read_text().lower()
        hits += [f"{path.relative_to(SRC)}: {lit}" for lit in LITERALS if lit.lower() in text]
        if re.search(r"PARTIAL_TILE\s*=\s*3\b", path.read_text()):
            hits.append(f"{path.relative_to(SRC)}: the tile kinds")
    assert not hits, hits
