"""Every door through which a user hands causalattn a file reads it with the one reader
(check.files): a zip bomb — a 2.6 MB file declaring a 2.5 GiB member — is refused by its
headers, in under 400 MiB of peak memory, start-up included.

Each door runs as its own process, address space capped at 3 GiB: a reader that inflated
the member would fail its allocation there (and say "out of memory", which the tests
refuse), never take the machine. The peak is that process's own (os.wait4).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _helpers import deflated_zeros, npy_header, peak_run, write_zip  # noqa: E402

BAR_MIB = 400
BOMB_MIB = 2560  # above every door's default budget (audit: 2 GiB; trace, explore: 1 GiB)


def _stored(name: str, a: np.ndarray) -> bytes:
    return npy_header(a.shape, a.dtype.str) + np.ascontiguousarray(a).tobytes()


@pytest.fixture(scope="module")
def bombs(tmp_path_factory):
    d = tmp_path_factory.mktemp("bombs")
    member = deflated_zeros(npy_header((BOMB_MIB * 2**20 // 8,)), BOMB_MIB)
    small = {f"{k}.npy": _stored(k, np.eye(2)) for k in ("W_q", "W_k", "W_v")}
    npz = write_zip(d / "bomb.npz", {"X.npy": member, **small})
    trace_npz = write_zip(d / "trace.npz", {"A.npy": member})
    py = write_zip(d / "attention.py", {"__main__.py": deflated_zeros(b"x = 1\n", BOMB_MIB)})
    assert npz.stat().st_size < 4 * 2**20 and py.stat().st_size < 4 * 2**20
    return {"npz": npz, "trace": trace_npz, "py": py, "dir": d}


def _cli(*args: str) -> str:
    return (
        f"import sys; from causalattn.cli import main; sys.argv = {['causalattn', *args]!r}; main()"
    )


def _refused(rc, out, peak, *words):
    assert rc == 2, out
    assert "out of memory" not in out.lower() and "Traceback" not in out, out
    for w in words:
        assert w in out, (w, out)
    assert peak < BAR_MIB, f"peak {peak:.0f} MiB"
    print(f"peak {peak:.0f} MiB")  # the measured figure, with -s


def test_trace_input(bombs):
    rc, out, peak = peak_run(_cli("trace", "-i", str(bombs["npz"])))
    _refused(rc, out, peak, "error: trace input", "above the limit")


def test_explore_trace(bombs):
    html = bombs["dir"] / "e.html"
    rc, out, peak = peak_run(_cli("explore", "--trace", str(bombs["trace"]), "-o", str(html)))
    _refused(rc, out, peak, "error: trace file", "above the limit")
    assert not html.exists()


def test_audit(bombs):
    rc, out, peak = peak_run(_cli("audit", str(bombs["npz"])))
    _refused(rc, out, peak, "error:", "above the limit")


def test_learn_check(bombs):
    rc, out, peak = peak_run(_cli("learn", "--check", str(bombs["py"]), "--json"))
    _refused(rc, out, peak, "not Python source")


def test_diagnose_file(bombs):
    rc, out, peak = peak_run(_cli("diagnose", f"{bombs['py']}:attention"))
    _refused(rc, out, peak, "error:", "not Python source")


def test_trace_load_in_python(bombs):
    code = (
        "from causalattn import Trace\n"
        "try:\n"
        f"    Trace.load({str(bombs['trace'])!r})\n"
        "except ValueError as exc:\n"
        "    print('refused:', exc)\n"
        "    raise SystemExit(2)\n"
    )
    rc, out, peak = peak_run(code)
    _refused(rc, out, peak, "refused: trace file", "above the limit")


def test_json_is_charged_before_it_is_parsed(tmp_path):
    p = tmp_path / "big.json"
    p.write_text('{"X": [' + ", ".join(["0.5"] * 300_000) + "]}")  # 1.5 MB; 24 MB as lists
    rc, out, _ = peak_run(_cli("trace", "-i", str(p), "--max-bytes", str(8 * 2**20)))
    assert rc == 2 and "once parsed" in out and "above the limit" in out, out


def test_a_fifo_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "corpus.txt"
    os.mkfifo(fifo)
    for args in (
        ["masks", "--file", str(fifo)],
        ["trace", "-i", str(fifo)],
        ["learn", "--check", str(fifo)],
    ):
        rc, out, _ = peak_run(_cli(*args), timeout=60)
        assert rc == 2 and "not a regular file" in " ".join(out.split()), (args, out)
