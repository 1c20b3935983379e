"""The one isolation runner (io.runner) and the doors that use it — diagnose FILE,
diagnose(callable), learn --check: a result or a typed failure; nothing a job starts
outlives it; deadlines honoured end to end; memory capped. Whatever could run away runs in
a subprocess with an address-space cap of its own and short deadlines."""

from __future__ import annotations

import functools
import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from causalattn import diagnose
from causalattn.io import runner
from causalattn.learn import grade

sys.path.insert(0, str(Path(__file__).parents[1]))
from _helpers import cli_many  # noqa: E402

MiB = 2**20


# -- the runner on its own ----------------------------------------------------------------------
def _sleep_and_tell(path: str):
    Path(path).write_text(str(os.getpid()))
    time.sleep(120)


def test_result_or_a_typed_failure():
    assert runner.run(lambda: {"x": [1, 2]}, timeout=30) == {"x": [1, 2]}
    cases = [
        (lambda: 1 / 0, "error", "ZeroDivisionError"),
        (lambda: sys.exit(3), "crashed", "sys.exit(3)"),
        (lambda: os._exit(4), "crashed", "exit code 4"),
        (lambda: object(), "error", "not JSON"),
        (lambda: bytearray(512 * MiB), "memory", "ran out of memory at a peak of"),
    ]
    for job, kind, words in cases:
        f = runner.run(job, timeout=30, max_memory=128 * MiB, what="the job")
        assert isinstance(f, runner.Failure) and f.kind == kind and words in f.message, f
        assert f.kind in runner.FAILURE_KINDS

    def spam():
        while True:
            print("x" * 1000)

    for job in (spam, lambda: "z" * (3 * MiB)):  # printing, or a result, past the cap
        f = runner.run(job, timeout=30, max_output=MiB)
        assert f.kind == "error" and "more than the output cap of 1 MiB" in f.message, f
    t0 = time.monotonic()
    f = runner.run(lambda: time.sleep(60), timeout=1, what="sleeper")
    assert f.kind == "timeout" and "sleeper did not finish within 1 s" in f.message, f
    assert time.monotonic() - t0 < 15


def test_bad_limits_are_refused_before_anything_runs():
    ran = []
    for kw, word in [
        ({"timeout": 0}, "timeout"),
        ({"timeout": float("nan")}, "timeout"),
        ({"timeout": float("inf")}, "timeout"),
        ({"timeout": "5"}, "timeout"),
        ({"timeout": 5, "max_memory": 0}, "max_memory"),
        ({"timeout": 5, "max_memory": True}, "max_memory"),
        ({"timeout": 5, "max_output": -1}, "max_output"),
    ]:
        with pytest.raises(ValueError, match=f"run: {word} must be"):
            runner.run(lambda: ran.append(1), **kw)
    for kw in ({"max_memory": 0}, {"max_memory": 2.5e9}, {"timeout": -1}):
        word = next(iter(kw))
        with pytest.raises(ValueError, match=f"diagnose: {word} must be"):
            diagnose("nowhere.py:f", **kw)
        with pytest.raises(ValueError, match=f"learn: {word} must be"):
            grade.check("nowhere.py", **kw)
    assert not ran


def test_cli_refuses_bad_limits_in_one_line():
    from typer.testing import CliRunner

    from causalattn.cli import app

    target = str(Path(__file__).parents[1] / "faulty" / "numpy_qkv.py")
    cases = [
        (["diagnose", f"{target}:correct", "--max-memory", bad], "--max-memory must be")
        for bad in ("0", "-1", "lots", "1.5G", "")
    ] + [
        (["learn", "--check", target, "--max-memory", "2X"], "--max-memory must be"),
        (["learn", "--check", target, "--timeout", "0"], "timeout"),
        (["learn", "--max-memory", "1G"], "go with --check"),
        (["learn", "--timeout", "5"], "go with --check"),
    ]
    for args, words in cases:
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 2 and r.output.count("error:") == 1, (args, r.output)
        assert words in r.output and "Traceback" not in r.output, (args, r.output)


def test_fresh_interpreter_and_what_cannot_be_sent():
    assert runner.run(functools.partial(json.loads, "[1, 2]"), timeout=120, fresh=True) == [1, 2]
    f = runner.run(functools.partial(os._exit, 5), timeout=120, fresh=True, what="exit")
    assert f.kind == "crashed" and "exit code 5" in f.message, f
    with pytest.raises(ValueError, match="cannot be sent to a worker"):
        runner.run(lambda: 1, timeout=10, fresh=True)


def test_a_run_inside_a_run_honours_the_outer_deadline(tmp_path):
    pid_file = tmp_path / "pid"
    inner = functools.partial(_sleep_and_tell, str(pid_file))

    def outer():
        assert runner.remaining() is not None and runner.remaining() <= 5
        r = runner.run(inner, timeout=100)  # asks 100 s; gets what is left of 5
        return r.to_dict() if isinstance(r, runner.Failure) else r

    assert runner.remaining() is None  # (not inside a worker here)
    t0 = time.monotonic()
    f = runner.run(outer, timeout=5)
    # the two deadlines are the same instant: either the outer worker is stopped, or the
    # inner run ends first and the outer job returns its timeout — a timeout either way
    kind = f.kind if isinstance(f, runner.Failure) else f["kind"]
    assert kind == "timeout" and time.monotonic() - t0 < 30, f
    _assert_gone(int(pid_file.read_text()))


# -- nothing outlives a job ---------------------------------------------------------------------
def _group(pgid: int) -> list[int]:
    """Live (not zombie) processes in process group ``pgid``."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()  # state, ppid, pgrp, ...
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(d.name))
    return out


def _assert_gone(pid: int) -> None:
    for _ in range(100):
        try:
            state = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return
        if state[state.rindex(")") + 2] == "Z":
            return
        time.sleep(0.05)
    pytest.fail(f"process {pid} survived")


FORKS = textwrap.dedent(
    """
    import os, time
    import numpy as np

    def _fork_and_tell():  # children, and each a grandchild, left sleeping
        if os.environ.get("PGID_FILE") and not os.path.exists(os.environ["PGID_FILE"]):
            with open(os.environ["PGID_FILE"], "w") as fh:
                fh.write(str(os.getpgid(0)))
            for _ in range(3):
                if os.fork() == 0:
                    if os.fork() == 0:
                        time.sleep(300)
                    time.sleep(300)
                    os._exit(0)

    if os.environ.get("FORK_AT_IMPORT"):  # a file: it forks as soon as it is loaded
        _fork_and_tell()

    def attention(q, k, v):
        _fork_and_tell()
        s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
        T_q, T_k = s.shape[-2:]
        z = np.where(np.tril(np.ones((T_q, T_k), bool), T_k - T_q), s, -np.inf)
        e = np.exp(z - z.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True) @ v
    """
)


@pytest.mark.parametrize("door", ["diagnose FILE", "diagnose(callable)", "learn --check"])
def test_a_forking_file_leaves_no_process_behind(tmp_path, monkeypatch, door):
    src = tmp_path / "attention.py"
    src.write_text("# causalattn-exercise: attention (numpy)\n" + FORKS)
    pgid_file = tmp_path / "pgid"
    monkeypatch.setenv("PGID_FILE", str(pgid_file))
    if door == "diagnose(callable)":
        ns: dict = {}
        exec(compile(FORKS, str(src), "exec"), ns)
        assert diagnose(ns["attention"], timeout=60).ok
    else:  # a file: it also forks as soon as it is loaded (in the worker)
        monkeypatch.setenv("FORK_AT_IMPORT", "1")
        if door == "diagnose FILE":
            assert diagnose(f"{src}:attention", timeout=120).ok
        else:
            g = grade.check(src, timeout=120)
            assert g.ok, str(g)
    pgid = int(pgid_file.read_text())
    assert pgid != os.getpgid(0)  # the job ran in a session of its own
    for _ in range(100):
        if not _group(pgid):
            break
        time.sleep(0.05)
    assert not _group(pgid), f"left behind in group {pgid}: {_group(pgid)}"


# -- deadlines and memory, end to end -----------------------------------------------------------
LOOPS = textwrap.dedent(
    """
    # causalattn-exercise: attention (numpy)
    import numpy as np

    def attention(q, k, v):
        if q.shape[-2] != 5:  # the shape check (T = 5) passes; diagnose's probes hang
            with open(PID_FILE, "w") as fh:
                fh.write(str(__import__("os").getpid()))
            while True:
                pass
        return np.zeros((q.shape[-2], v.shape[-1]))
    """
)


def test_an_infinite_loop_ends_at_the_deadline_given(tmp_path):
    # learn: the loop is in the inner diagnose, which must get what is left of the outer 12 s
    # (the worker must start and reach it: 12 s); diagnose: the loop is the worker's own.
    # Both doors in one process (torch imported once), each its own file and PID file.
    doors, pid_files = {}, {}
    for door, limit in (("learn --check", 12), ("diagnose FILE", 5)):
        name = door.split()[0]
        pid_files[door] = tmp_path / f"{name}.pid"
        src = tmp_path / f"{name}.py"
        src.write_text(f"PID_FILE = {str(pid_files[door])!r}\n" + LOOPS)
        target = ["--check", str(src)] if name == "learn" else [f"{src}:attention"]
        doors[door] = (limit, [name, *target, "--timeout", str(limit), "--json"])
    results = cli_many(*(argv for _, argv in doors.values()), timeout=150)
    for (door, (limit, _)), (rc, out, secs) in zip(doors.items(), results):
        assert rc == 2 and "did not finish within" in out, (door, out)
        said = float(out.split("did not finish within ")[1].split(" s")[0])
        assert said <= limit and secs < limit + 45, (door, said, secs)
        if door == "learn --check":
            assert pid_files[door].exists(), "the probes never reached the loop (start > 12 s?)"
        if pid_files[door].exists():
            _assert_gone(int(pid_files[door].read_text()))


HOG = textwrap.dedent(
    """
    # causalattn-exercise: attention (numpy)
    def attention(q, k, v):
        keep = []
        while True:
            keep.append(bytearray(32 * 2**20))
    """
)


def test_a_memory_hog_ends_as_memory_within_the_cap(tmp_path):
    src = tmp_path / "attention.py"
    src.write_text(HOG)
    doors = {
        "learn --check": ["learn", "--check", str(src), "--max-memory", "256M", "--json"],
        "diagnose FILE": ["diagnose", f"{src}:attention", "--max-memory", "256M", "--json"],
    }
    results = cli_many(*doors.values(), timeout=180)  # the test's own cap: 3 GiB of address
    for door, (rc, out, _) in zip(doors, results):
        assert rc == 2 and "ran out of memory" in out and "0.25 GiB" in out, (door, out)
        peak = float(out.split("at a peak of ")[1].split(" MiB")[0])  # the worker's VmHWM
        assert 256 <= peak < 256 + 600, f"{door}: peak {peak:.0f} MiB"  # cap + start-up
        print(f"{door}: the hog's worker peaked at {peak:.0f} MiB under --max-memory 256M")
