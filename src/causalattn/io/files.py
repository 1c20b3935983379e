"""The one reader of files someone hands in: headers first, one budget, nothing executed.

Every command and function that reads a user's file goes through here: ``audit`` (arrays),
``trace -i`` and ``explore --trace`` (arrays, JSON), ``explore --file`` / ``masks --file``
(a corpus, :func:`read_text`), ``diagnose file.py`` and ``learn --check`` (Python source,
:func:`read_source`; the worker then executes it).

Array formats: .npy, .npz (a zip of .npy members), a folder of .npy files, .safetensors
(parsed here, bf16 included, so no extra package is needed: hand-written on purpose, for
hostile files) and a JSON object of (nested) lists. A JSON file is told by its first
byte past any leading whitespace, not by its name. Before a single array byte is read,
every header is read and checked: only regular files (a FIFO would block forever), only
numeric arrays (no pickles, no structured or object dtypes, zip members must be .npy; text
only under the names a caller allows, such as ``tokens``), declared sizes against ONE total
budget (JSON: its size times what parsed lists cost), and the declared shapes are handed to
the caller to check against each other. Arrays are then read by their declared size,
streaming from the zip, so a 2 MB zip that declares 1.9 GiB of zeros is refused before it
inflates. Messages never echo the file's bytes.
"""

from __future__ import annotations

import ast
import json
import math
import os
import stat
import zipfile
from pathlib import Path

import numpy as np

__all__ = [
    "AuditInputError",
    "ArrayFile",
    "open_arrays",
    "read_arrays",
    "read_source",
    "read_text",
    "ARRAY_FORMATS",
    "FORMATS",
]


class AuditInputError(ValueError):
    """The input cannot be audited or read (unreadable file, wrong ranks, non-numeric data ...)."""


MAX_MEMBERS = 256
MAX_SAFETENSORS_HEADER = 16 * 2**20
MAX_SOURCE_BYTES = 8 * 2**20  # a Python file handed to diagnose or learn --check
JSON_COST = 16  # bytes of memory one byte of JSON can take once parsed (lists of floats)
_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGIC = b"PK\x03\x04"
_EMPTY_ZIP = b"PK\x05\x06"  # an archive with no members (np.savez of nothing)

# format -> how messages name it
FORMATS = {
    "npy": ".npy",
    "npz": ".npz",
    "folder": "a folder of .npy files",
    "safetensors": ".safetensors",
    "json": "JSON",
}
ARRAY_FORMATS = ("npy", "npz", "folder", "safetensors")  # what audit reads
_ST_DTYPES = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "BF16": "bf16",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "i1",
    "U64": "<u8",
    "U32": "<u4",
    "U16": "<u2",
    "U8": "u1",
    "BOOL": "?",
}


def _refuse(p, why: str):
    raise AuditInputError(f"{p}: {why}")


def _names(formats) -> str:
    words = [FORMATS[f] for f in formats]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _regular(p: Path) -> os.stat_result:
    try:
        st = os.stat(p)  # follows a symlink: what is read is its target
    except FileNotFoundError:
        _refuse(p, "no such file or folder")
    except OSError as exc:
        _refuse(p, f"cannot be read ({exc.strerror})")
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        _refuse(p, "not a regular file (a FIFO, socket or device could block forever); refused")
    return st


def _numeric(name: str, dtype: np.dtype, text: bool = False) -> np.dtype:
    """``dtype`` when it is plain numbers (or fixed-width text, where ``text``)."""
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise AuditInputError(
            f"{name}: holds Python objects (a pickle) and cannot be read; only numeric "
            "arrays are read (allow_pickle=False)"
        )
    if dtype.fields is not None or dtype.kind not in ("biufU" if text else "biuf"):
        raise AuditInputError(f"{name}: dtype {dtype} is not a plain numeric array")
    return dtype


def _human(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} bytes"


def _nbytes(shape, dtype) -> int:
    return math.prod(int(s) for s in shape) * np.dtype(dtype).itemsize


class ArrayFile:
    """The headers of a file's arrays (``headers``: name -> (shape, dtype)), checked against
    the budget; ``read()`` then reads the arrays."""

    def __init__(self, path: Path, max_bytes: int, text=()):
        self.path, self.max_bytes, self.text = path, max_bytes, frozenset(text)
        self.headers: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        self._where: dict = {}  # name -> how to read it
        self._total = 0

    def _within(self, nbytes: int, what: str, detail: str = "") -> None:
        """Refuse when ``nbytes`` (what ``what`` costs) passes the budget."""
        if nbytes > self.max_bytes:
            _refuse(
                self.path,
                f"{what} {_human(nbytes)} in all{detail}, above the limit of "
                f"{_human(self.max_bytes)} (raise it with max_bytes / --max-bytes)",
            )

    def _add(self, name, shape, dtype, where):
        if name in self.headers:
            _refuse(self.path, f"two arrays named {name!r}")
        try:
            dtype = _numeric(name, dtype, name in self.text)
        except AuditInputError as exc:
            _refuse(self.path, f"array {exc}")
        self._total += _nbytes(shape, dtype)
        detail = f" (up to {name[:80]!r}, {tuple(shape)} {dtype})"
        self._within(self._total, "its arrays declare", detail)
        self.headers[name] = (tuple(int(s) for s in shape), dtype)
        self._where[name] = where

    def read(self) -> dict[str, np.ndarray]:
        try:
            return {n: self._read(n) for n in self.headers}
        except AuditInputError:
            raise
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError):
            _refuse(self.path, "its array data is truncated or corrupt")

    def _read(self, name) -> np.ndarray:
        kind, src = self._where[name][0], self._where[name][1:]
        if kind == "json":  # parsed already (its cost was charged before parsing)
            return src[0]
        if kind == "npy":
            with open(src[0], "rb") as fh:
                return _read_npy(fh)
        if kind == "zip":
            with zipfile.ZipFile(self.path) as zf, zf.open(src[0]) as fh:
                return _read_npy(fh)
        lo, hi, code, shape = src
        with open(self.path, "rb") as fh:
            fh.seek(lo)
            buf = fh.read(hi - lo)
        if len(buf) != hi - lo:
            _refuse(self.path, f"{name!r}: the data is shorter than its offsets say")
        if code == "bf16":  # bfloat16 is the top half of a float32
            return (np.frombuffer(buf, "<u2").astype("<u4") << 16).view("<f4").reshape(shape)
        return np.frombuffer(buf, code).reshape(shape).copy()


def _npy_header(fh):
    """(shape, dtype) of a .npy stream, positioned at its data."""
    if fh.read(len(_NPY_MAGIC)) != _NPY_MAGIC:
        raise ValueError("not .npy")
    major = fh.read(2)[:1]
    if major == b"\x01":
        n = int.from_bytes(fh.read(2), "little")
    elif major in (b"\x02", b"\x03"):
        n = int.from_bytes(fh.read(4), "little")
    else:
        raise ValueError("unknown .npy version")
    if n > 1 << 20:
        raise ValueError("header too long")
    d = ast.literal_eval(fh.read(n).decode("latin1"))
    if not isinstance(d, dict) or set(d) != {"descr", "fortran_order", "shape"}:
        raise ValueError("bad header")
    shape = d["shape"]
    if not isinstance(shape, tuple) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise ValueError("bad shape")
    return shape, np.lib.format.descr_to_dtype(d["descr"]), bool(d["fortran_order"])


def _read_npy(fh) -> np.ndarray:
    """Read a .npy stream by its declared size (the header was checked already)."""
    shape, dtype, fortran = _npy_header(fh)
    count = math.prod(shape)
    buf = bytearray(count * dtype.itemsize)
    view, got = memoryview(buf), 0
    while got < len(buf):
        chunk = fh.read(min(1 << 24, len(buf) - got))
        if not chunk:
            raise ValueError("truncated")
        view[got : got + len(chunk)] = chunk
        got += len(chunk)
    arr = np.frombuffer(buf, dtype=dtype, count=count)
    return arr.reshape(shape[::-1]).T if fortran else arr.reshape(shape)


def open_arrays(path: str | Path, max_bytes: int, *, formats=ARRAY_FORMATS, text=()) -> ArrayFile:
    """Check a file's (or folder's) array headers; see the module docstring.

    ``formats``: the ones accepted (keys of :data:`FORMATS`); ``text``: the names that may
    hold fixed-width text (e.g. a trace's ``tokens``) instead of numbers.
    """
    p = Path(path)
    st = _regular(p)
    af = ArrayFile(p, max_bytes, text)
    if stat.S_ISDIR(st.st_mode) and "folder" not in formats:
        _refuse(p, f"is a folder; give a {_names(formats)} file")
    if not stat.S_ISDIR(st.st_mode) and st.st_size == 0:
        _refuse(p, f"the file is empty; expected {_names(formats)}")
    try:
        if stat.S_ISDIR(st.st_mode):
            _folder_headers(p, af)
            return af
        with open(p, "rb") as fh:
            head = fh.read(64)
        suffix = p.suffix.lower()
        if head.startswith(_NPY_MAGIC) and "npy" in formats:
            with open(p, "rb") as fh:
                shape, dtype, _ = _npy_header(fh)
            af._add(p.stem, shape, dtype, ("npy", p))
        elif head.startswith((_ZIP_MAGIC, _EMPTY_ZIP)) and "npz" in formats:
            _zip_headers(p, af)
        elif "json" in formats and _opens_json(p, head, max_bytes):
            _json_arrays(p, af, st.st_size)
        elif "safetensors" in formats and (suffix == ".safetensors" or len(head) >= 8):
            _safetensors_headers(p, af, st.st_size)
        else:
            raise ValueError("unknown format")
    except AuditInputError:
        raise
    except (
        OSError,
        ValueError,
        EOFError,
        zipfile.BadZipFile,
        KeyError,
        SyntaxError,
        RecursionError,
        TypeError,
    ):
        _refuse(
            p,
            f"cannot be read as {_names(formats)} (its contents match none of these "
            "formats, or its headers are corrupt); refused",
        )
    if not af.headers:
        _refuse(p, f"holds no arrays; expected {_names(formats)} of named arrays")
    return af


def read_arrays(path: str | Path, max_bytes: int, *, formats=ARRAY_FORMATS, text=()) -> dict:
    """The arrays of a file, name -> ndarray: :func:`open_arrays`, then ``read()``."""
    return open_arrays(path, max_bytes, formats=formats, text=text).read()


def _capped_bytes(p: Path, max_bytes: int, what: str) -> bytes:
    """The bytes of a regular file no larger than ``max_bytes`` (checked before reading)."""
    st = _regular(p)
    if stat.S_ISDIR(st.st_mode):
        _refuse(p, f"is a folder; give {what}")
    if st.st_size > max_bytes:
        _refuse(
            p,
            f"is {_human(st.st_size)}, above the limit of {_human(max_bytes)} for {what} "
            "(raise it with max_bytes / --max-bytes)",
        )
    try:
        with open(p, "rb") as fh:
            data = fh.read(max_bytes + 1)
    except OSError as exc:
        _refuse(p, f"cannot be read ({exc.strerror})")
    if len(data) > max_bytes:  # it grew while we looked
        _refuse(p, f"is larger than the limit of {_human(max_bytes)} for {what}")
    return data


def read_source(path: str | Path, max_bytes: int = MAX_SOURCE_BYTES) -> bytes:
    """A Python file's bytes, for ``compile``: a regular file of at most ``max_bytes``, and
    text (a zip, which ``python file`` would run from its ``__main__.py``, is refused)."""
    p = Path(path)
    data = _capped_bytes(p, max_bytes, "a Python file")
    if data.startswith((_ZIP_MAGIC, _EMPTY_ZIP)) or b"\x00" in data:
        _refuse(p, "is not Python source (it holds binary data, such as a zip archive)")
    return data


def read_text(path: str | Path, max_bytes: int) -> str:
    """A UTF-8 text file (a corpus): a regular file of at most ``max_bytes``."""
    p = Path(path)
    data = _capped_bytes(p, max_bytes, "a text file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        _refuse(p, f"is not UTF-8 text (byte {exc.start})")


def _opens_json(p: Path, head: bytes, max_bytes: int) -> bool:
    """Whether the first byte after the leading whitespace (of any length, read on past
    ``head`` within ``max_bytes``) opens a JSON object or list."""
    rest = head.lstrip()
    if not rest:  # whitespace so far: read on, a chunk at a time
        with open(p, "rb") as fh:
            fh.seek(len(head))
            for _ in range(0, max_bytes, 1 << 16):
                chunk = fh.read(1 << 16)
                rest = chunk.lstrip()
                if rest or not chunk:
                    break
    return rest[:1] in (b"{", b"[")


def _folder_headers(p: Path, af: ArrayFile) -> None:
    files = sorted(p.glob("*.npy"))
    if not files:
        _refuse(p, "folder holds no .npy files")
    if len(files) > MAX_MEMBERS:
        _refuse(p, f"folder holds {len(files)} .npy files, more than {MAX_MEMBERS}")
    for f in files:
        if not stat.S_ISREG(_regular(f).st_mode):
            _refuse(f, "not a regular file")
        with open(f, "rb") as fh:
            shape, dtype, _ = _npy_header(fh)
        af._add(f.stem, shape, dtype, ("npy", f))


def _json_arrays(p: Path, af: ArrayFile, size: int) -> None:
    """A JSON object of arrays (nested lists). Parsed lists cost up to JSON_COST bytes per
    byte of file: that is charged to the budget before the file is read."""
    af._within(JSON_COST * size, f"its JSON ({_human(size)}) can take, once parsed, up to")
    try:
        data = json.loads(p.read_bytes().decode("utf-8"))
    except RecursionError:
        _refuse(p, "JSON nested too deeply")
    except UnicodeDecodeError:
        _refuse(p, "not valid JSON (not UTF-8 text)")
    except json.JSONDecodeError as exc:
        _refuse(p, f"not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})")
    if not isinstance(data, dict):
        _refuse(p, f"expected a JSON object of named arrays, got a {type(data).__name__}")
    for name, value in data.items():
        try:
            arr = np.asarray(value)
        except (ValueError, TypeError, RecursionError):
            _refuse(p, f"{name[:80]} is not a rectangular array")
        kinds = "biufU" if name in af.text else "biuf"
        if arr.dtype.kind not in kinds:
            _refuse(
                p,
                f"{name[:80]} must hold numbers or booleans"
                + (" (or text)" if name in af.text else "")
                + f", got dtype {'object' if arr.dtype.hasobject else arr.dtype}",
            )
        af._add(name, arr.shape, arr.dtype, ("json", arr))


def _zip_headers(p: Path, af: ArrayFile) -> None:
    with zipfile.ZipFile(p) as zf:
        infos = zf.infolist()
        if len(infos) > MAX_MEMBERS:
            _refuse(p, f"the archive holds {len(infos)} members, more than {MAX_MEMBERS}")
        for info in infos:
            name = info.filename
            if info.is_dir() or not name.endswith(".npy"):
                _refuse(
                    p,
                    f"member {name[:80]!r} is not a .npy array; an .npz holds only "
                    "arrays (np.savez)",
                )
            with zf.open(info) as fh:
                try:
                    shape, dtype, _ = _npy_header(fh)
                except (ValueError, SyntaxError, TypeError, EOFError):
                    _refuse(p, f"member {name[:80]!r} is not a .npy array")
            af._add(name[:-4], shape, dtype, ("zip", info.filename))


def _safetensors_headers(p: Path, af: ArrayFile, size: int) -> None:
    """Check a .safetensors header and declare its arrays, reading no array byte.

    Hand-written on purpose, not the ``safetensors`` package: that package is only in the
    ``hf`` extra (``audit`` must read these files without it); its ``safe_open`` memory-maps
    the file and raises errors of its own, where this reader must first weigh every declared
    size against the one budget of :class:`ArrayFile` with the other formats' rules, refuse
    a hostile header (impossible length, deep nesting, a non-numeric dtype, offsets outside
    the data or not matching the shape) with a message that never echoes its bytes, and
    read bf16 (which numpy lacks) into float32."""
    with open(p, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        if n < 2 or n > min(MAX_SAFETENSORS_HEADER, size - 8):
            _refuse(p, "not a .safetensors file (its header length is impossible)")
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError, UnicodeDecodeError):
        _refuse(p, "the .safetensors header is not JSON (or nests too deeply)")
    if not isinstance(header, dict):
        _refuse(p, f"the .safetensors header must be a JSON object, got a {type(header).__name__}")
    data0, data_size = 8 + n, size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        label = f"tensor {name[:80]!r}"
        if not isinstance(info, dict):
            _refuse(p, f"{label}: its header entry must be an object, got {type(info).__name__}")
        code = _ST_DTYPES.get(info.get("dtype")) if isinstance(info.get("dtype"), str) else None
        if code is None:
            _refuse(
                p,
                f"{label}: dtype {str(info.get('dtype'))[:20]!r} is not a numeric type "
                f"({', '.join(_ST_DTYPES)})",
            )
        shape, offs = info.get("shape"), info.get("data_offsets")
        if not (
            isinstance(shape, list)
            and len(shape) <= 8
            and all(type(s) is int and s >= 0 for s in shape)
        ):
            _refuse(p, f"{label}: shape must be a list of integers >= 0")
        if not (
            isinstance(offs, list)
            and len(offs) == 2
            and all(type(o) is int for o in offs)
            and 0 <= offs[0] <= offs[1] <= data_size
        ):
            _refuse(
                p, f"{label}: data_offsets must be two integers within the data (0..{data_size})"
            )
        item = 2 if code == "bf16" else np.dtype(code).itemsize
        if offs[1] - offs[0] != math.prod(shape) * item:
            _refuse(
                p,
                f"{label}: data_offsets span {offs[1] - offs[0]} bytes but shape "
                f"{tuple(shape)} needs {math.prod(shape) * item}",
            )
        dtype = np.dtype("<f4") if code == "bf16" else np.dtype(code)
        af._add(name, shape, dtype, ("st", data0 + offs[0], data0 + offs[1], code, tuple(shape)))
