"""Every door through which a user hands causalattn a file reads it with the one reader
(io.files): a zip bomb — a 2.6 MB file declaring a 2.5 GiB member — is refused by its
headers, in under 400 MiB of peak memory, start-up included.

The doors run in one process, address space capped at 3 GiB: a reader that inflated the
member would fail its allocation there (and say "out of memory", which the tests refuse),
never take the machine. Each door's peak is the process's high-water mark (VmHWM), reset to
what is resident (start-up included) before the door.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from _helpers import cli_many, deflated_zeros, npy_header, peak_run, write_zip  # noqa: E402

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
    return {"npz": npz, "trace": trace_npz, "py": py, "html": d / "e.html"}


def _cli(*args: str) -> str:
    return (
        f"import sys; from causalattn.cli import main; sys.argv = {['causalattn', *args]!r}; main()"
    )


# Every door in ONE capped process (torch imported once): before each, the high-water mark
# is reset to what is resident (start-up included); after it, the door's own peak is read.
_DOORS = """
import json, sys
from typer.testing import CliRunner
from causalattn import Trace, memory
from causalattn.cli import app

out = {}
for name, argv in json.loads(sys.argv[1]).items():
    assert memory.reset_peak(), "no /proc/self/clear_refs"
    if argv is None:  # the Python door
        try:
            Trace.load(json.loads(sys.argv[2]))
            res = {"exit_code": 0, "output": "read"}
        except ValueError as exc:
            res = {"exit_code": 2, "output": f"refused: {exc}"}
    else:
        r = CliRunner().invoke(app, argv)
        res = {"exit_code": r.exit_code, "output": r.output}
    out[name] = {**res, "peak": memory.status_kib("VmHWM") / 1024}
print("@@doors@@" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def doors(bombs):
    argvs = {
        "trace -i": ["trace", "-i", str(bombs["npz"])],
        "explore trace": ["explore", "trace", str(bombs["trace"]), "-o", str(bombs["html"])],
        "audit": ["audit", str(bombs["npz"])],
        "learn --check": ["learn", "--check", str(bombs["py"]), "--json"],
        "diagnose FILE": ["diagnose", f"{bombs['py']}:attention"],
        "Trace.load": None,
    }
    code = f"sys.argv[1:] = {[json.dumps(argvs), json.dumps(str(bombs['trace']))]!r}\n" + _DOORS
    rc, out, start = peak_run("import sys\n" + code, timeout=300)
    assert rc == 0 and "@@doors@@" in out, out
    return json.loads(out.split("@@doors@@")[1].splitlines()[0])


@pytest.mark.parametrize(
    "door, words",
    [
        ("trace -i", ["error: trace input", "above the limit"]),
        ("explore trace", ["error: trace file", "above the limit"]),
        ("audit", ["error:", "above the limit"]),
        ("learn --check", ["not Python source"]),
        ("diagnose FILE", ["error:", "not Python source"]),
        ("Trace.load", ["refused: trace file", "above the limit"]),
    ],
)
def test_a_zip_bomb_is_refused_at_every_door(doors, bombs, door, words):
    d = doors[door]
    out = d["output"]
    assert d["exit_code"] == 2, out
    assert "out of memory" not in out.lower() and "Traceback" not in out, out
    for w in words:
        assert w in out, (w, out)
    assert d["peak"] < BAR_MIB, f"{door}: peak {d['peak']:.0f} MiB"
    print(f"{door}: peak {d['peak']:.0f} MiB")  # the measured figure, with -s
    assert not bombs["html"].exists()


def test_json_is_charged_before_it_is_parsed_and_a_fifo_is_refused_not_waited_on(tmp_path):
    p = tmp_path / "big.json"
    p.write_text('{"X": [' + ", ".join(["0.5"] * 300_000) + "]}")  # 1.5 MB; 24 MB as lists
    fifo = tmp_path / "corpus.txt"
    os.mkfifo(fifo)  # a reader that opened it would wait for a writer: the call's timeout
    argvs = [
        ["trace", "-i", str(p), "--max-bytes", str(8 * 2**20)],
        ["masks", "--file", str(fifo)],
        ["trace", "-i", str(fifo)],
        ["learn", "--check", str(fifo)],
    ]
    (rc, out, _), *fifos = cli_many(*argvs, timeout=90)
    assert rc == 2 and "once parsed" in out and "above the limit" in out, out
    for args, (rc, out, _) in zip(argvs[1:], fifos):
        assert rc == 2 and "not a regular file" in " ".join(out.split()), (args, out)


def test_members_are_charged_to_one_budget_before_any_is_inflated(tmp_path):
    """Two members of 40 MiB each under a 64 MiB budget: each fits, together they do not;
    refused by the headers alone (a reader that inflated the first would hold 40 MiB)."""
    import tracemalloc

    from causalattn.check.report import AuditInputError
    from causalattn.io.files import read_arrays

    member = deflated_zeros(npy_header((40 * 2**20 // 8,)), 40)
    p = write_zip(tmp_path / "two.npz", {"A.npy": member, "B.npy": member})
    tracemalloc.start()
    try:
        with pytest.raises(AuditInputError, match=r"80 MiB in all \(up to 'B'.*above the limit"):
            read_arrays(p, 64 * 2**20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, f"{peak / 2**20:.1f} MiB allocated while refusing"
    one = write_zip(tmp_path / "one.npz", {"A.npy": member})
    assert read_arrays(one, 64 * 2**20)["A"].shape == (40 * 2**20 // 8,)  # alone, it is read
