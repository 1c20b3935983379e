"""What several test modules share (tests never import from benchmarks/)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_in_triton_interpreter(test_file: str, timeout: float = 600) -> str:
    """Run a test module under TRITON_INTERPRET=1 in a subprocess (the variable must be set
    before triton is first imported); fail with its output's tail; return the summary line."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    here = Path(test_file)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(here),
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "--rootdir",
        str(here.parent.parent),
    ]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    tail = (run.stdout + run.stderr)[-6000:]
    assert run.returncode == 0, f"{here.name} failed in Triton's interpreter:\n{tail}"
    assert " passed" in tail, tail
    return tail.strip().splitlines()[-1]


QUESTIONS = [  # the shape causalattn.learn.questions() returns
    {
        "id": "q1",
        "kind": "softmax-axis",
        "prompt": "Along which axis does softmax run?",
        "choices": ["down each key column", "across each query row", "over all T×T scores"],
        "answer": 1,
        "hint": "Each query's weights must sum to 1.",
        "explanation": "Row i holds query i's scores over keys j.",
        "highlight": {"matrix": "A", "axis": "row", "row": 2},
        "data": {
            "X": [[1, 0], [0, 1], [1, 1], [-1, 1]],
            "W_q": [[1, 0], [0, 1]],
            "W_k": [[1, 0], [0, 1]],
            "W_v": [[1, 1], [1, -1]],
            "tokens": ["x1", "x2", "x3", "x4"],
        },
    },
    {
        "id": "q2",
        "kind": "mask-cell",
        "prompt": "Why is cell (8, 2) of sentence 4 blocked?",
        "choices": ["future", "padding"],
        "answer": 1,
        "hint": "Look at row 8's token.",
        "explanation": "Row 8 is <PAD>.",
        "highlight": {"matrix": "M", "cells": [[7, 1]]},
        "sentence": 3,
    },
]


# -- hostile files and capped children ---------------------------------------------------------
GiB = 2**30
SRC = str(Path(__file__).resolve().parents[1] / "src")


def deflated_zeros(prefix: bytes, n_mib: int) -> tuple[bytes, int, int]:
    """A raw deflate stream of ``prefix`` followed by ``n_mib`` MiB of zero bytes, without
    compressing them: after a full flush the compressor's state is the same each time, so
    one compressed MiB repeats. (stream, CRC-32 of the content, content size)."""
    import zlib

    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = c.compress(prefix) + c.flush(zlib.Z_FULL_FLUSH)
    zeros = bytes(2**20)
    block = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
    assert c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH) == block  # the trick holds
    tail = c.flush(zlib.Z_FINISH)
    crc, big = zlib.crc32(prefix), bytes(16 * 2**20)
    for _ in range(n_mib // 16):
        crc = zlib.crc32(big, crc)
    for _ in range(n_mib % 16):
        crc = zlib.crc32(zeros, crc)
    return head + block * n_mib + tail, crc, len(prefix) + n_mib * 2**20


def write_zip(path: Path, members: dict[str, bytes | tuple[bytes, int, int]]) -> Path:
    """A zip written by hand: a member is stored bytes, or (deflate stream, crc, size) as
    :func:`deflated_zeros` gives, so a small file can declare a huge member (a zip bomb)."""
    import struct
    import zlib

    out, central = bytearray(), bytearray()
    for name, m in members.items():
        raw = name.encode()
        if isinstance(m, bytes):
            method, data, crc, size = 0, m, zlib.crc32(m), len(m)
        else:
            method, (data, crc, size) = 8, m
        assert size < 2**32, "no zip64 here"
        fields = (20, 0, method, 0, 0x21, crc, len(data), size, len(raw))
        offset = len(out)
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, *fields, 0) + raw + data
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, *fields, 0, 0, 0, 0, 0, offset)
        central += raw
    eocd = struct.pack(
        "<IHHHHIIH", 0x06054B50, 0, 0, len(members), len(members), len(central), len(out), 0
    )
    path.write_bytes(bytes(out + central + eocd))
    return path


def npy_header(shape, dtype: str = "<f8") -> bytes:
    """The bytes of a .npy header (version 1) declaring ``shape`` and ``dtype``."""
    import struct

    header = repr({"descr": dtype, "fortran_order": False, "shape": tuple(shape)}).encode()
    header += b" " * (63 - (len(header) + 10) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header


# printed by the child at exit: its own high-water resident memory (VmHWM is the process's
# own since its exec; ru_maxrss is not: it keeps the RSS of the forked parent it replaced)
_PEAK_PRELUDE = """
import atexit as _atexit, os as _os
def _peak():
    with open("/proc/self/status") as fh:
        kib = next(int(s.split()[1]) for s in fh if s.startswith("VmHWM:"))
    _os.write(2, ("\\n@@peak-kib@@ %d\\n" % kib).encode())
_atexit.register(_peak)
"""


def peak_run(code: str, *, mem: int = 3 * GiB, timeout: float = 120, cwd=None):
    """Run ``python -c code`` in a session of its own, address space capped at ``mem``;
    (exit code, stdout + stderr, its peak resident MiB, start-up included). The peak is the
    process's VmHWM at exit (None when it never exited normally)."""
    import re
    import resource

    def caps():
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))

    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        res = subprocess.run(
            [sys.executable, "-c", _PEAK_PRELUDE + code],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            preexec_fn=caps,
            start_new_session=True,
            env=env,
            cwd=cwd,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"did not finish within {timeout} s: {exc.output}") from None
    out = res.stdout + res.stderr
    found = re.findall(r"@@peak-kib@@ (\d+)", out)
    out = re.sub(r"\n?@@peak-kib@@ \d+\n", "", out)
    return res.returncode, out, int(found[-1]) / 1024 if found else None


# CLI calls in ONE capped process (torch imported once): each argv's exit code, output, seconds
_MANY = """
import json, sys, time
from typer.testing import CliRunner
from causalattn.cli import app

def _call(argv):
    t0 = time.monotonic()
    r = CliRunner().invoke(app, argv)
    return [r.exit_code, r.output, time.monotonic() - t0]

print("@@many@@" + json.dumps([_call(argv) for argv in json.loads(sys.argv[1])]))
"""


def cli_many(*argvs, timeout: float = 120, mem: int = 3 * GiB) -> list:
    """``causalattn ARGV`` for each argv, in one process run by :func:`peak_run` (address
    space capped at ``mem``): [(exit code, output, seconds)] in order."""
    import json

    code = f"import sys\nsys.argv[1:] = {[json.dumps(argvs)]!r}\n" + _MANY
    rc, out, _ = peak_run(code, mem=mem, timeout=timeout)
    assert rc == 0 and "@@many@@" in out, out
    return [tuple(r) for r in json.loads(out.split("@@many@@")[1].splitlines()[0])]
