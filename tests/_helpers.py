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


def peak_run(args: list[str], *, mem: int = 3 * GiB, timeout: float = 120, cwd=None):
    """Run ``python args`` in a session of its own, address space capped at ``mem``;
    (exit code, stdout + stderr, peak resident MiB of it and the children it waited for).
    The peak is this child's alone (``os.wait4``), start-up included."""
    import resource
    import signal
    import tempfile
    import threading

    def caps():
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))

    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [sys.executable, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=caps,
            start_new_session=True,
            env=env,
            cwd=cwd,
        )
        timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        log.seek(0)
        out = log.read().decode("utf-8", "replace")
    assert proc.returncode != -signal.SIGKILL, f"killed at the {timeout} s deadline:\n{out}"
    return proc.returncode, out, usage.ru_maxrss / 1024
