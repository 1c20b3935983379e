"""The one reader of user files (io.files), in process: every format read back as the arrays
it holds, every refusal one AuditInputError that names the file and what is wrong, and the
one budget weighed before any array byte is read. What would take gigabytes if the reader
read too far (a file whose size says 0, a sparse 2 GiB .npy) is read in a capped subprocess,
next to a small twin read here (mutmut maps a test to what it reaches in its own process);
everything else is a few KiB, except a 17 MiB .npy read in pieces and a 1 MiB .npy header."""

from __future__ import annotations

import json
import os
import re
import resource
import struct
import subprocess
import sys
import textwrap
import zipfile
from functools import partial
from pathlib import Path

import numpy as np
import pytest

import causalattn
from causalattn.io.files import (
    AuditInputError,
    open_arrays,
    read_arrays,
    read_source,
    read_text,
)

KiB, MiB, GiB = 2**10, 2**20, 2**30
ST_CODES = ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8")
ST_CODES += ("U64", "U32", "U16", "U8", "BOOL")
ANY = ".npy, .npz, a folder of .npy files or .safetensors"  # what open_arrays reads by default
UNREADABLE = "(its contents match none of these formats, or its headers are corrupt); refused"
RAISE_IT = "(raise it with max_bytes / --max-bytes)"


def refused(call, path, why: str) -> str:
    """``call()`` raises one AuditInputError, its message ``{path}: {why}`` in full (an "…"
    in ``why`` stands for any text); the message."""
    with pytest.raises(AuditInputError) as info:
        call()
    msg = str(info.value)
    pattern = ".*?".join(re.escape(piece) for piece in f"{path}: {why}".split("…"))
    assert re.fullmatch(pattern, msg, re.S), (why, msg)
    return msg


def npy(shape, descr="<f8", data=b"", *, version=1, extra="") -> bytes:
    """A .npy file's bytes: a header declaring ``shape`` and ``descr`` (``extra``: more
    header text before its closing brace), then ``data``."""
    text = f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': {tuple(shape)!r}, {extra}}}"
    head = text.encode("latin1")
    size = 4 if version > 1 else 2
    head += b" " * (63 - (len(head) + 8 + size) % 64) + b"\n"
    return b"\x93NUMPY" + bytes([version, 0]) + len(head).to_bytes(size, "little") + head + data


def safetensors(header: dict | bytes, data: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def write(path: Path, content: bytes | str) -> Path:
    path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    return path


# -- every format is read back as the arrays it holds -----------------------------------------
def test_each_npy_version_is_read_by_its_declared_header(tmp_path):
    """Versions 1, 2 and 3 (2-byte and 4-byte header lengths): shape (2, 3), float32."""
    a = np.arange(6, dtype="<f4").reshape(2, 3)
    for version in (1, 2, 3):
        p = write(tmp_path / f"Q{version}.npy", npy((2, 3), "<f4", a.tobytes(), version=version))
        af = open_arrays(p, 2**20)
        assert af.headers == {f"Q{version}": ((2, 3), np.dtype("<f4"))}
        got = af.read()[f"Q{version}"]
        assert got.dtype == np.float32 and got.flags.writeable
        np.testing.assert_array_equal(got, a)


def test_an_unknown_npy_version_is_refused(tmp_path):
    p = write(tmp_path / "A.npy", npy((2,), data=bytes(16), version=4))
    refused(partial(open_arrays, p, 2**20), p, f"cannot be read as {ANY} {UNREADABLE}")


def test_npz_and_folder_read_every_array_by_name(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {
        "q": rng.normal(size=(4, 2)),
        "mask": np.tril(np.ones((4, 4), bool)),
        "ids": np.arange(4, dtype=np.int16),
        "empty": np.zeros((0, 3)),
    }
    np.savez(tmp_path / "x.npz", **arrays)
    (tmp_path / "f").mkdir()
    for n, a in arrays.items():
        np.save(tmp_path / "f" / f"{n}.npy", a)
    for p in (tmp_path / "x.npz", tmp_path / "f"):
        af = open_arrays(p, 2**20)
        assert af.headers == {n: (a.shape, a.dtype) for n, a in arrays.items()}
        assert all(type(s) is int for shape, _ in af.headers.values() for s in shape)
        got = af.read()
        assert set(got) == set(arrays)
        for n, a in arrays.items():
            assert got[n].dtype == a.dtype and got[n].flags.writeable
            np.testing.assert_array_equal(got[n], a)
    assert list(read_arrays(tmp_path / "f", 2**20)) == sorted(arrays)  # by file name


def test_a_17_mib_npy_is_read_in_pieces_and_bytes_after_its_data_are_ignored(tmp_path):
    a = np.arange(17 * MiB // 8, dtype="<f8")
    p = write(tmp_path / "big.npy", npy(a.shape, "<f8", a.tobytes() + b"trailing bytes"))
    got = read_arrays(p, 32 * MiB)["big"]
    assert got.shape == a.shape
    np.testing.assert_array_equal(got, a)


def test_json_object_of_lists_is_read_with_text_only_where_allowed(tmp_path):
    d = {"X": [[1, 0], [0, 1.5]], "flags": [True, False], "tokens": ["a", "bb"]}
    p = write(tmp_path / "t.txt", json.dumps(d))  # read by content, not by suffix
    af = open_arrays(p, 2**20, formats=("json",), text=("tokens", "X"))  # X: numbers anyway
    assert af.headers == {
        "X": ((2, 2), np.dtype(float)),
        "flags": ((2,), np.dtype(bool)),
        "tokens": ((2,), np.dtype("<U2")),
    }
    got = af.read()
    np.testing.assert_array_equal(got["X"], [[1, 0], [0, 1.5]])
    assert got["flags"].dtype == bool and got["tokens"].tolist() == ["a", "bb"]
    assert got["X"].flags.writeable
    refused(
        partial(read_arrays, p, 2**20, formats=("json",)),
        p,
        "tokens must hold numbers or booleans, got dtype <U2",
    )


def _st_tensors():
    """Two float tensors at nonzero offsets after a metadata entry, and an empty one."""
    a = np.arange(6, dtype="<f4").reshape(2, 3)
    b = np.array([[1, -2], [3, 4]], dtype="<i8")
    header = {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "b": {"dtype": "I64", "shape": [2, 2], "data_offsets": [24, 56]},
        "nothing": {"dtype": "F64", "shape": [0, 4], "data_offsets": [56, 56]},
    }
    return header, a.tobytes() + b.tobytes(), {"a": a, "b": b, "nothing": np.zeros((0, 4))}


def test_safetensors_tensors_are_read_at_their_offsets(tmp_path):
    header, data, want = _st_tensors()
    p = write(tmp_path / "x.bin", safetensors(header, data))  # read by content
    af = open_arrays(p, 2**20)
    assert af.headers == {n: (w.shape, w.dtype) for n, w in want.items()}
    got = af.read()
    assert list(got) == ["a", "b", "nothing"]
    for n, w in want.items():
        assert got[n].dtype == w.dtype and got[n].flags.writeable
        np.testing.assert_array_equal(got[n], w)


def test_every_safetensors_dtype_is_read_and_bf16_becomes_float32(tmp_path):
    """Shape (2, 2) of each dtype, one after another; bf16 holds the top half of float32."""
    values = np.array([[1.5, -2.0], [0.15625, 3.0]])  # exact in every float type
    numpy_type = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4"}
    numpy_type |= {"I16": "<i2", "I8": "i1", "U64": "<u8", "U32": "<u4", "U16": "<u2"}
    numpy_type |= {"U8": "u1", "BOOL": "?"}
    header, data, want = {}, b"", {}
    for code in ST_CODES:
        if code == "BF16":
            raw, want[code] = (values.astype("<f4").view("<u4") >> 16).astype("<u2"), values
        else:
            raw = want[code] = np.abs(values).astype(numpy_type[code])
        raw = raw.tobytes()
        header[code] = {
            "dtype": code,
            "shape": [2, 2],
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw
    got = read_arrays(write(tmp_path / "all.safetensors", safetensors(header, data)), 2**20)
    assert got["BF16"].dtype == np.float32
    for code in ST_CODES:
        if code != "BF16":
            assert got[code].dtype == np.dtype(numpy_type[code]), code
        np.testing.assert_array_equal(got[code], want[code], err_msg=code)


# -- what is refused before anything is read ----------------------------------------------
def test_paths_that_are_not_a_readable_file_are_refused(tmp_path):
    missing, under_a_file = tmp_path / "nope.npz", tmp_path / "f.txt" / "x.npz"
    write(tmp_path / "f.txt", "x")
    for read in (
        lambda p: open_arrays(p, 2**20),
        lambda p: read_text(p, 2**20),
        lambda p: read_source(p),
    ):
        refused(partial(read, missing), missing, "no such file or folder")
        refused(partial(read, under_a_file), under_a_file, "cannot be read (Not a directory)")
        # a device is not opened (a FIFO or a tty would block)
        refused(
            partial(read, "/dev/null"),
            "/dev/null",
            "not a regular file (a FIFO, socket or device could block forever); refused",
        )


def test_a_folder_or_an_empty_file_is_refused_naming_the_formats_accepted(tmp_path):
    empty = write(tmp_path / "e.npz", b"")
    refused(
        partial(open_arrays, tmp_path, 2**20, formats=("npz", "json")),
        tmp_path,
        "is a folder; give a .npz or JSON file",
    )
    refused(
        partial(open_arrays, empty, 2**20),
        empty,
        "the file is empty; expected .npy, .npz, a folder of .npy files or .safetensors",
    )
    refused(
        partial(open_arrays, empty, 2**20, formats=("json",)),
        empty,
        "the file is empty; expected JSON",
    )
    refused(partial(read_text, tmp_path, 99), tmp_path, "is a folder; give a text file")
    refused(partial(read_source, tmp_path), tmp_path, "is a folder; give a Python file")


def test_a_format_not_accepted_is_refused_as_unreadable(tmp_path):
    p = tmp_path / "A.npy"
    np.save(p, np.zeros(3))
    np.savez(tmp_path / "x.npz", A=np.zeros(3))
    js = write(tmp_path / "x.json", '{"A": [1, 2]}')
    header, data, _ = _st_tensors()
    st = write(tmp_path / "x.safetensors", safetensors(header, data))
    why = "(its contents match none of these formats, or its headers are corrupt); refused"
    for path, others in (
        (p, ("npz", "json")),
        (tmp_path / "x.npz", ("npy", "json")),
        (js, ("npy", "npz")),
        (st, ("npy", "json")),
    ):
        names = {"npy": ".npy", "npz": ".npz", "json": "JSON"}
        expected = f"cannot be read as {names[others[0]]} or {names[others[1]]} {why}"
        refused(partial(open_arrays, path, 2**20, formats=others), path, expected)
    assert set(read_arrays(js, 2**20, formats=("json",))) == {"A"}


def test_a_short_file_is_taken_for_safetensors_by_its_name_or_its_length(tmp_path):
    """Under 8 bytes only a .safetensors name says so; from 8 bytes on the content may."""
    impossible = "not a .safetensors file (its header length is impossible)"
    named = write(tmp_path / "x.SafeTensors", b"\x02\x00\x00\x00")
    refused(partial(open_arrays, named, 2**20), named, impossible)
    eight = write(tmp_path / "x.bin", b"\x02\x00\x00\x00\x00\x00\x00\x00")
    refused(partial(open_arrays, eight, 2**20), eight, impossible)
    seven = write(tmp_path / "y.bin", b"\x02\x00\x00\x00\x00\x00\x00")
    refused(partial(open_arrays, seven, 2**20), seven, f"cannot be read as {ANY} {UNREADABLE}")


def test_files_holding_no_arrays_are_refused(tmp_path):
    np.savez(tmp_path / "none.npz")
    for p in (
        tmp_path / "none.npz",
        write(tmp_path / "x.json", "{}"),
        write(tmp_path / "x.safetensors", safetensors(b"{}")),
        write(tmp_path / "m.safetensors", safetensors({"__metadata__": {"a": "b"}})),
    ):
        refused(
            partial(open_arrays, p, 2**20, formats=("npz", "json", "safetensors")),
            p,
            "holds no arrays; expected .npz, JSON or .safetensors of named arrays",
        )
    (tmp_path / "f").mkdir()
    write(tmp_path / "f" / "a.txt", "x")
    refused(
        partial(open_arrays, tmp_path / "f", 2**20), tmp_path / "f", "folder holds no .npy files"
    )


# -- dtypes: numbers only, text where a caller allows it --------------------------------------
def test_pickles_structured_complex_and_text_dtypes_are_refused_by_name(tmp_path):
    np.save(tmp_path / "obj.npy", np.array([1, "x"], dtype=object), allow_pickle=True)
    refused(
        partial(open_arrays, tmp_path / "obj.npy", 2**20),
        tmp_path / "obj.npy",
        "array obj: holds Python objects (a pickle) and cannot be read; only numeric arrays "
        "are read (allow_pickle=False)",
    )
    cases = {
        "rec": np.zeros(2, dtype=[("a", "<f4"), ("b", "<i4")]),
        "cplx": np.zeros(2, dtype=complex),
        "when": np.zeros(2, dtype="datetime64[s]"),
        "raw": np.zeros(2, dtype="S3"),
        "tokens": np.array(["a", "b"]),
    }
    for name, a in cases.items():
        np.save(tmp_path / f"{name}.npy", a)
        p = tmp_path / f"{name}.npy"
        refused(
            partial(open_arrays, p, 2**20, text=("raw",)),
            p,
            f"array {name}: dtype {a.dtype} is not a plain numeric array",
        )
    got = read_arrays(tmp_path / "tokens.npy", 2**20, text=("tokens",))
    assert got["tokens"].tolist() == ["a", "b"]
    np.save(tmp_path / "ids.npy", np.arange(3))  # a name that may hold text may hold numbers
    assert read_arrays(tmp_path / "ids.npy", 2**20, text=("ids",))["ids"].tolist() == [0, 1, 2]


def test_json_after_leading_whitespace_of_any_length_is_json(tmp_path):
    """The format is told by the first byte past the whitespace, however far it is (past the
    64 bytes looked at first, and past one 64 KiB read); whitespace alone is no format."""
    for pad in (0, 63, 64, 65, 70 * KiB, 130 * KiB):
        p = write(tmp_path / f"w{pad}.json", " \n" * (pad // 2) + " " * (pad % 2) + '{"q": [[1]]}')
        assert open_arrays(p, GiB, formats=("json",)).read()["q"].tolist() == [[1]], pad
    blank = write(tmp_path / "blank.json", "\n" * (70 * KiB))
    refused(lambda: open_arrays(blank, GiB, formats=("json",)), blank, f"… {UNREADABLE}")
    far = write(tmp_path / "far.json", " " * (70 * KiB) + '{"q": [[1]]}')
    # read on only as far as the budget: past it the file is no JSON it could read anyway
    refused(lambda: open_arrays(far, 64 * KiB, formats=("json",)), far, f"… {UNREADABLE}")


def test_json_values_that_are_not_numbers_are_refused_by_name(tmp_path):
    p = write(
        tmp_path / "x.json",
        json.dumps({"W_q": {"a": 1}, "X": [[1, 0], [1]], "ok": [1], "s": ["a"], "n": [None]}),
    )

    def only(name, text=()):
        one = write(tmp_path / f"{name}.json", json.dumps({name: json.loads(p.read_text())[name]}))
        return one, partial(open_arrays, one, 2**20, formats=("json",), text=text)

    q, call = only("W_q")
    refused(call, q, "W_q must hold numbers or booleans, got dtype object")
    q, call = only("W_q", text=("W_q",))
    refused(call, q, "W_q must hold numbers or booleans (or text), got dtype object")
    q, call = only("n")
    refused(call, q, "n must hold numbers or booleans, got dtype object")
    q, call = only("s")
    msg = refused(call, q, "s must hold numbers or booleans, got dtype <U1")
    assert "(or text)" not in msg
    q, call = only("X")
    refused(call, q, "X is not a rectangular array")
    long = "L" * 100 + "tail"
    lp = write(tmp_path / "long.json", json.dumps({long: [[1], [1, 2]]}))
    msg = refused(
        partial(open_arrays, lp, 2**20, formats=("json",)),
        lp,
        "L" * 80 + " is not a rectangular array",
    )
    assert "tail" not in msg
    lp = write(tmp_path / "long.json", json.dumps({long: ["a"]}))
    msg = refused(
        partial(open_arrays, lp, 2**20, formats=("json",)),
        lp,
        "L" * 80 + " must hold numbers or booleans, got dtype <U1",
    )
    assert "tail" not in msg


def test_json_that_does_not_parse_is_refused_with_where(tmp_path):
    bad = write(tmp_path / "bad.json", '{"X": [1, 2],\n  "Y": [3,, 4]}')
    refused(
        partial(open_arrays, bad, 2**20, formats=("json",)),
        bad,
        "not valid JSON (Expecting value at line 2, column 11)",
    )
    latin = write(tmp_path / "latin.json", b'{"X": [1], "\xe9": [2]}')
    refused(
        partial(open_arrays, latin, 2**20, formats=("json",)),
        latin,
        "not valid JSON (not UTF-8 text)",
    )
    deep = write(tmp_path / "deep.json", '{"X": ' + "[" * 100_000 + "]" * 100_000 + "}")
    refused(partial(open_arrays, deep, 2**22, formats=("json",)), deep, "JSON nested too deeply")
    top = write(tmp_path / "list.json", "  [1, 2]")
    refused(
        partial(open_arrays, top, 2**20, formats=("json",)),
        top,
        "expected a JSON object of named arrays, got a list",
    )


# -- npy headers -------------------------------------------------------------------------------
def test_npy_headers_that_numpy_would_not_write_are_refused(tmp_path):
    for name, content in {
        "extra-key": npy((2,), data=bytes(16), extra="'x': 1, "),
        "negative": npy((-2,), data=bytes(16)),
        "float-dim": npy((2.0,), data=bytes(16)),
        "not-magic": b"\x93NUMPX\x01\x00" + npy((2,), data=bytes(16))[8:],
    }.items():
        p = write(tmp_path / f"{name}.npy", content)
        refused(
            partial(open_arrays, p, 2**20, formats=("npy",)),
            p,
            f"cannot be read as .npy {UNREADABLE}",
        )
    lst = write(tmp_path / "list.npy", npy((2,), data=bytes(16)).replace(b"(2,)", b"[2] "))
    refused(
        partial(open_arrays, lst, 2**20, formats=("npy",)),
        lst,
        f"cannot be read as .npy {UNREADABLE}",
    )


def test_npy_data_shorter_than_its_header_says_is_refused_when_read(tmp_path):
    p = write(tmp_path / "A.npy", npy((4, 2), data=bytes(8 * 7)))
    af = open_arrays(p, 2**20)  # the header alone is fine
    assert af.headers == {"A": ((4, 2), np.dtype("<f8"))}
    refused(af.read, p, "its array data is truncated or corrupt")
    z = tmp_path / "x.npz"
    with zipfile.ZipFile(z, "w") as zf:
        zf.writestr("A.npy", npy((4, 2), data=bytes(8 * 7)))
    refused(open_arrays(z, 2**20).read, z, "its array data is truncated or corrupt")


# -- the one budget ------------------------------------------------------------------------------
def test_the_budget_holds_every_declared_byte_and_no_more(tmp_path):
    """Two (4, 2) float64 arrays: 128 bytes declared in all."""
    np.savez(tmp_path / "x.npz", a=np.zeros((4, 2)), b=np.ones((4, 2)))
    assert set(read_arrays(tmp_path / "x.npz", 128)) == {"a", "b"}
    refused(
        partial(open_arrays, tmp_path / "x.npz", 127),
        tmp_path / "x.npz",
        "its arrays declare 128 bytes in all (up to 'b', (4, 2) float64), above the limit of "
        "127 bytes (raise it with max_bytes / --max-bytes)",
    )


def test_sizes_in_messages_are_in_binary_units(tmp_path):
    for declared, limit, says in (
        (
            GiB,
            MiB,
            "…declare 1 GiB in all (up to 'A', (134217728,) float64), above the limit of 1 MiB …",
        ),
        (3 * GiB // 2, KiB, "…declare 1.5 GiB in all…"),
        (
            MiB,
            KiB,
            "…declare 1 MiB in all (up to 'A', (131072,) float64), above the limit of 1 KiB …",
        ),
        (
            KiB,
            1023,
            "…declare 1 KiB in all (up to 'A', (128,) float64), above the limit of 1023 bytes …",
        ),
        (1000 * 8, 8, "…declare 7.81 KiB in all…"),
    ):
        p = write(tmp_path / "A.npy", npy((declared // 8,)))  # no data: refused by its header
        refused(partial(open_arrays, p, limit), p, says)


def test_long_array_names_are_cut_in_messages(tmp_path):
    name = "n" * 80 + "TAIL"
    z = tmp_path / "x.npz"
    with zipfile.ZipFile(z, "w") as zf:
        zf.writestr(f"{name}.npy", npy((1000,)))
    msg = refused(partial(open_arrays, z, 8), z, f"…(up to '{'n' * 80}', (1000,) float64)…")
    assert "TAIL" not in msg


def test_bf16_is_weighed_as_the_float32_it_becomes(tmp_path):
    """4 bf16 values: 8 bytes in the file, 16 once read."""
    p = write(
        tmp_path / "x.safetensors",
        safetensors({"A": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}}, bytes(8)),
    )
    assert open_arrays(p, 16).headers == {"A": ((4,), np.dtype("<f4"))}
    refused(
        partial(open_arrays, p, 15),
        p,
        "its arrays declare 16 bytes in all (up to 'A', (4,) float32), above the limit of "
        f"15 bytes {RAISE_IT}",
    )


def test_json_is_weighed_by_what_its_lists_can_take_before_it_is_parsed(tmp_path):
    p = write(tmp_path / "x.json", '{"A": [1, 2, 3]}')  # 16 bytes: up to 16 · 16 parsed
    assert set(read_arrays(p, 16 * 16, formats=("json",))) == {"A"}
    refused(
        partial(open_arrays, p, 16 * 16 - 1, formats=("json",)),
        p,
        "its JSON (16 bytes) can take, once parsed, up to 256 bytes in all, above the limit of "
        f"255 bytes {RAISE_IT}",
    )


# -- npz and folders: members ------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:Duplicate name")
def test_npz_members_must_be_npy_arrays(tmp_path):
    good = npy((2,), data=bytes(16))
    for name, members, says in (
        (
            "noext",
            [("q.npy", good), ("A", good)],
            "member 'A' is not a .npy array; an .npz holds only arrays (np.savez)",
        ),
        (
            "dir",
            [("q.npy", good), ("d.npy/", None)],
            "member 'd.npy/' is not a .npy array; an .npz holds only arrays (np.savez)",
        ),
        (
            "junk",
            [("q.npy", good), ("A.npy", b"not an array")],
            "member 'A.npy' is not a .npy array",
        ),
        ("twice", [("A.npy", good), ("A.npy", good)], "two arrays named 'A'"),
    ):
        p = tmp_path / f"{name}.npz"
        with zipfile.ZipFile(p, "w") as zf:
            for member, data in members:
                zf.mkdir(member) if data is None else zf.writestr(member, data)
        refused(partial(open_arrays, p, 2**20), p, says)
    long = tmp_path / "long.npz"
    with zipfile.ZipFile(long, "w") as zf:
        zf.writestr("m" * 80 + "TAIL", good)
    msg = refused(
        partial(open_arrays, long, 2**20),
        long,
        f"member '{'m' * 80}' is not a .npy array; an .npz holds only arrays (np.savez)",
    )
    assert "TAIL" not in msg
    with zipfile.ZipFile(long, "w") as zf:
        zf.writestr("m" * 80 + "TAIL.npy", b"junk")
    msg = refused(
        partial(open_arrays, long, 2**20), long, f"member '{'m' * 80}' is not a .npy array"
    )
    assert "TAIL" not in msg


def test_at_most_256_members_or_files(tmp_path):
    member = npy((1,), "<f8", bytes(8))
    for n in (256, 257):
        z = tmp_path / f"{n}.npz"
        with zipfile.ZipFile(z, "w") as zf:
            for k in range(n):
                zf.writestr(f"a{k}.npy", member)
        folder = tmp_path / f"f{n}"
        folder.mkdir()
        for k in range(n):
            write(folder / f"a{k}.npy", member)
        if n == 256:
            assert len(read_arrays(z, 2**20)) == len(read_arrays(folder, 2**20)) == 256
        else:
            refused(
                partial(open_arrays, z, 2**20), z, "the archive holds 257 members, more than 256"
            )
            refused(
                partial(open_arrays, folder, 2**20),
                folder,
                "folder holds 257 .npy files, more than 256",
            )


def test_folder_entries_must_be_npy_files(tmp_path):
    np.save(tmp_path / "a.npy", np.zeros(2))
    (tmp_path / "sub.npy").mkdir()
    refused(partial(open_arrays, tmp_path, 2**20), tmp_path / "sub.npy", "not a regular file")
    (tmp_path / "sub.npy").rmdir()
    write(tmp_path / "b.npy", b"junk")
    refused(
        partial(open_arrays, tmp_path, 2**20), tmp_path, f"cannot be read as {ANY} {UNREADABLE}"
    )


# -- safetensors headers ------------------------------------------------------------------------
def _st(tmp_path, header, data=bytes(32), name="x.safetensors"):
    return write(tmp_path / name, safetensors(header, data))


def test_safetensors_header_length_must_fit_the_file(tmp_path):
    impossible = "not a .safetensors file (its header length is impossible)"
    entry = {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
    fits = _st(tmp_path, {"A": entry}, b"")  # the header ends the file
    assert read_arrays(fits, 2**20)["A"].shape == (0,)
    raw = json.dumps({"A": entry}).encode()
    for n in (len(raw) + 1, 1, 0):
        p = write(tmp_path / f"{n}.safetensors", struct.pack("<Q", n) + raw)
        refused(partial(open_arrays, p, 2**20), p, impossible)
    big_endian = write(tmp_path / "be.safetensors", struct.pack(">Q", len(raw)) + raw)
    refused(partial(open_arrays, big_endian, 2**20), big_endian, impossible)


def test_safetensors_header_must_be_a_json_object(tmp_path):
    not_json = "the .safetensors header is not JSON (or nests too deeply)"
    for name, header, says in (
        ("list", b"[1, 2, 3]", "the .safetensors header must be a JSON object, got a list"),
        ("junk", b"{not json}", not_json),
        ("latin", b'{"\xe9": 1}', not_json),
        ("deep", b"[" * 100_000 + b"]" * 100_000, not_json),
        ("entry", b'{"A": 5}', "tensor 'A': its header entry must be an object, got int"),
    ):
        p = _st(tmp_path, header, name=f"{name}.safetensors")
        refused(partial(open_arrays, p, 2**22), p, says)


def test_safetensors_entries_must_declare_a_numeric_dtype_a_shape_and_their_offsets(tmp_path):
    every = ", ".join(ST_CODES)
    shape_msg = "tensor 'A': shape must be a list of integers >= 0"
    offs_msg = "tensor 'A': data_offsets must be two integers within the data (0..32)"
    ok = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    for change, says in (
        ({"dtype": "OBJ"}, f"tensor 'A': dtype 'OBJ' is not a numeric type ({every})"),
        ({"dtype": ["F32"]}, f"tensor 'A': dtype \"['F32']\" is not a numeric type ({every})"),
        (
            {"dtype": "OBJECT" * 5},
            f"tensor 'A': dtype {('OBJECT' * 5)[:20]!r} is not a numeric type ({every})",
        ),
        ({"dtype": None}, f"tensor 'A': dtype 'None' is not a numeric type ({every})"),
        ({"shape": "2"}, shape_msg),
        ({"shape": [1] * 9}, shape_msg),
        ({"shape": [2, -2]}, shape_msg),
        ({"shape": [2, True]}, shape_msg),
        ({"shape": [2, 2.0]}, shape_msg),
        ({"data_offsets": [0, 16, 16]}, offs_msg),
        ({"data_offsets": [0]}, offs_msg),
        ({"data_offsets": "0,16"}, offs_msg),
        ({"data_offsets": [0, 16.0]}, offs_msg),
        ({"data_offsets": [-16, 0]}, offs_msg),
        ({"data_offsets": [16, 0]}, offs_msg),
        ({"data_offsets": [17, 33]}, offs_msg),
        (
            {"data_offsets": [0, 12]},
            "tensor 'A': data_offsets span 12 bytes but shape (2, 2) needs 16",
        ),
        ({"dtype": "BF16"}, "tensor 'A': data_offsets span 16 bytes but shape (2, 2) needs 8"),
        (
            {"data_offsets": [4, 16]},
            "tensor 'A': data_offsets span 12 bytes but shape (2, 2) needs 16",
        ),
    ):
        p = _st(tmp_path, {"A": ok | change})
        refused(partial(open_arrays, p, 2**20), p, says)
    long = _st(tmp_path, {"t" * 80 + "TAIL": ok | {"dtype": "X"}})
    msg = refused(
        partial(open_arrays, long, 2**20), long, f"tensor '{'t' * 80}': dtype 'X' is not…"
    )
    assert "TAIL" not in msg


def test_safetensors_shapes_of_eight_dims_empty_tensors_and_the_last_byte_are_read(tmp_path):
    header = {
        "empty": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]},
        "cube": {"dtype": "U8", "shape": [1, 1, 1, 1, 1, 1, 1, 2], "data_offsets": [0, 2]},
        "last": {"dtype": "U8", "shape": [2], "data_offsets": [30, 32]},
    }
    got = read_arrays(_st(tmp_path, header, bytes(range(7, 39))), 2**20)
    assert got["empty"].shape == (0,) and got["cube"].shape == (1,) * 7 + (2,)
    assert got["cube"].ravel().tolist() == [7, 8] and got["last"].tolist() == [37, 38]


def test_safetensors_data_cut_after_its_header_was_read_is_refused(tmp_path):
    header, data, _ = _st_tensors()
    p = write(tmp_path / "x.safetensors", safetensors(header, data))
    af = open_arrays(p, 2**20)
    with open(p, "r+b") as fh:
        fh.truncate(p.stat().st_size - 1)
    refused(af.read, p, "'b': the data is shorter than its offsets say")


# -- text and Python source ---------------------------------------------------------------------
def test_text_and_source_are_read_up_to_their_limit(tmp_path):
    p = write(tmp_path / "c.txt", "héllo wörld\n")  # 14 bytes
    assert read_text(p, 14) == "héllo wörld\n"
    assert read_source(p, 14) == "héllo wörld\n".encode()
    for read, what in ((read_text, "a text file"), (read_source, "a Python file")):
        refused(
            partial(read, p, 13),
            p,
            f"is 14 bytes, above the limit of 13 bytes for {what} (raise it with max_bytes / "
            "--max-bytes)",
        )
    big = write(tmp_path / "big.txt", "x" * (3 * KiB // 2))
    refused(
        partial(read_text, big, KiB),
        big,
        f"is 1.5 KiB, above the limit of 1 KiB for a text file {RAISE_IT}",
    )


def test_a_file_longer_than_its_size_says_is_refused_at_the_limit():
    """/proc files report size 0 and hold more than 100 bytes."""
    for read, what in ((read_text, "a text file"), (read_source, "a Python file")):
        refused(
            partial(read, "/proc/self/status", 100),
            "/proc/self/status",
            f"is larger than the limit of 100 bytes for {what}",
        )


def test_a_file_that_fails_to_read_is_refused_with_the_reason():
    """/proc/self/mem opens, and reading its first page fails (nothing is mapped there)."""
    refused(
        partial(read_text, "/proc/self/mem", 100),
        "/proc/self/mem",
        "cannot be read (Input/output error)",
    )


def test_text_must_be_utf8_and_source_must_not_be_binary(tmp_path):
    p = write(tmp_path / "l.txt", b"abc \xe9t\xe9")
    refused(partial(read_text, p, 100), p, "is not UTF-8 text (byte 4)")
    binary = "is not Python source (it holds binary data, such as a zip archive)"
    z = tmp_path / "x.py"
    with zipfile.ZipFile(z, "w") as zf:
        zf.writestr("__main__.py", "print(1)")
    np.savez(tmp_path / "e.npz")
    for content in (z.read_bytes(), (tmp_path / "e.npz").read_bytes(), b"x = 1\n\x00\n"):
        src = write(tmp_path / "s.py", content)
        refused(partial(read_source, src), src, binary)
    assert read_source(write(tmp_path / "ok.py", "x = 'PK'\n")) == b"x = 'PK'\n"


# -- header lengths, and files larger than what is read ----------------------------------------
def _npy_v2(header_length: int, shape=(1,)) -> bytes:
    """A version 2 .npy header of float64, ``header_length`` bytes long (no data)."""
    head = repr({"descr": "<f8", "fortran_order": False, "shape": shape}).encode()
    head += b" " * (header_length - len(head) - 1) + b"\n"
    return b"\x93NUMPY\x02\x00" + struct.pack("<I", header_length) + head


def test_headers_past_their_length_limit_are_refused_before_they_are_read(tmp_path):
    """A .npy header of 1 MiB is read, one byte more is not; a .safetensors header of more
    than 16 MiB is refused by its declared length (the file is long enough: sparse)."""
    limit = write(tmp_path / "limit.npy", _npy_v2(MiB) + bytes(8))
    assert read_arrays(limit, KiB)["limit"].tolist() == [0.0]
    over = write(tmp_path / "over.npy", _npy_v2(MiB + 1) + bytes(8))
    refused(partial(open_arrays, over, KiB), over, f"cannot be read as {ANY} {UNREADABLE}")
    st = tmp_path / "over.safetensors"
    with open(st, "wb") as fh:
        fh.write(struct.pack("<Q", 16 * MiB + 1) + b"{")
        fh.truncate(8 + 16 * MiB + 1)
    refused(
        partial(open_arrays, st, GiB),
        st,
        "not a .safetensors file (its header length is impossible)",
    )


_LARGER_THAN_READ = """
import json, sys
from pathlib import Path
from causalattn.io.files import AuditInputError, open_arrays, read_text

got = {}
for name, read in (
    ("pagemap", lambda: read_text("/proc/self/pagemap", 100)),
    ("big.npy", lambda: open_arrays(Path(sys.argv[1]), 2**30)),
):
    try:
        read()
    except AuditInputError as exc:
        got[name] = str(exc)
print(json.dumps(got))
"""


def test_files_larger_than_what_is_read_are_refused_by_what_was_read(tmp_path):
    """A file whose size says 0 is read only up to the limit (/proc/self/pagemap would give
    8 bytes per page of the address space), and a 2 GiB .npy (sparse) by its header alone:
    in a capped subprocess, and their small twins here."""
    big = tmp_path / "big.npy"
    with open(big, "wb") as fh:
        fh.write(_npy_v2(128, (2**28,)))
        fh.truncate(12 + 128 + 2 * GiB)
    small = write(tmp_path / "small.npy", _npy_v2(128, (2**28,)))  # no data at all
    declares = "its arrays declare 2 GiB in all (up to '…', (268435456,) float64), above the limit…"
    refused(partial(open_arrays, small, GiB), small, declares)
    size_zero = "is larger than the limit of 100 bytes for a text file"
    refused(partial(read_text, "/proc/self/status", 100), "/proc/self/status", size_zero)
    mem = 2 * GiB

    def caps():
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (60, 60))

    src = str(Path(causalattn.__file__).parents[1])  # the package this process tests
    res = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_LARGER_THAN_READ), str(big)],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=caps,
        env={**os.environ, "PYTHONPATH": src},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout)
    assert got["pagemap"] == f"/proc/self/pagemap: {size_zero}"
    assert got["big.npy"].startswith(f"{big}: its arrays declare 2 GiB in all")
