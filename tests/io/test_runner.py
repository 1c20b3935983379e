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
import _runner_jobs  # noqa: E402  (tests/io: on sys.path as this file's folder)
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


# -- the runner's promises, one by one (each a few forks: well under a second each) ----------
def test_a_fresh_worker_is_a_new_interpreter_in_a_session_of_its_own(monkeypatch):
    """fresh=True: a new interpreter (nothing of this one loaded), leading its own session,
    that finds causalattn where this process did (whatever PYTHONPATH says) and this
    test's own module (sys.path), with the deadline given; its output is kept for a crash."""
    import warnings

    import causalattn

    elsewhere = os.path.join(os.sep, "nowhere", "causalattn-test")  # (holds no causalattn)
    monkeypatch.setenv("PYTHONPATH", elsewhere)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = runner.run(_runner_jobs.facts, timeout=60, fresh=True)
    assert not [w for w in seen if issubclass(w.category, ResourceWarning)], seen
    assert got["causalattn"] == causalattn.__file__ and got["session_leader"], got
    assert got["fresh"], got
    assert elsewhere in got["pythonpath"].split(os.pathsep), got  # the caller's, kept
    assert 0 < got["remaining"] <= 60, got
    f = runner.run(
        functools.partial(_runner_jobs.say_and_exit, 3), timeout=60, fresh=True, what="it"
    )
    assert f.kind == "crashed" and f.message == "it crashed (exit code 3): to stdout | to stderr"


def test_a_job_the_worker_cannot_load_is_its_error():
    """A job that pickles here but cannot be unpickled in the fresh worker (its module is
    not on disk): a Failure "error" that names why, not a result."""
    import types

    ghost = types.ModuleType("causalattn_test_ghost_module")
    exec("def job():\n    return 1\n", ghost.__dict__)
    sys.modules[ghost.__name__] = ghost
    try:
        f = runner.run(ghost.job, timeout=60, fresh=True)
    finally:
        del sys.modules[ghost.__name__]
    assert isinstance(f, runner.Failure) and f.kind == "error", f
    assert "ModuleNotFoundError" in f.message and ghost.__name__ in f.message, f


def test_a_failure_as_data():
    f = runner.run(lambda: 1 / 0, timeout=30)
    assert f.to_dict() == {"kind": "error", "message": f.message}
    assert f.message.startswith("the job ZeroDivisionError")  # `what` unless told


def test_a_crash_names_the_signal_and_the_last_lines_of_output():
    """A crash: its exit code or signal (SIGKILL: out of memory?, SIGSEGV: a segfault) and
    the last three non-blank lines of stdout and stderr, each cut to 300 characters."""

    def loud(sig):
        def job():  # (file descriptors 1 and 2: pytest has its own sys.stdout here)
            for line in ("one", "two", "", "three", "x" * 400):
                os.write(1, line.encode() + b"\n")
            os.write(2, b"from stderr\n")
            faulthandler.disable()  # (pytest's would print the segfault's stack on our stderr)
            os.kill(os.getpid(), sig)

        return job

    import faulthandler
    import signal

    for sig, why in (
        (signal.SIGSEGV, f"killed by signal {int(signal.SIGSEGV)} (a segfault)"),
        (signal.SIGKILL, f"killed by signal {int(signal.SIGKILL)} (out of memory?)"),
        (signal.SIGTERM, f"killed by signal {int(signal.SIGTERM)}"),
    ):
        f = runner.run(loud(sig), timeout=30, what="loud")
        assert f.kind == "crashed", f
        assert f.message == f"loud crashed ({why}): three | {'x' * 300} | from stderr", f

    # a long output: still its last lines; bytes that are not UTF-8 do not break the message
    def long_and_odd():
        os.write(1, b"y" * 5000 + b"\n")
        os.write(1, b"caf\xe9\n")
        os._exit(0)

    f = runner.run(long_and_odd, timeout=30, what="odd")
    assert f.message == f"odd crashed (exit code 0): {'y' * 300} | caf\ufffd", f
    f = runner.run(lambda: os.write(2, b"short\n") and os._exit(9), timeout=30, what="s")
    assert f.message == "s crashed (exit code 9): short", f
    f = runner.run(lambda: os._exit(2), timeout=30, what="quiet")
    assert f.message == "quiet crashed (exit code 2)", f  # no output: no tail


def test_the_job_errors_are_sorted_and_cut():
    """Memory words in a RuntimeError (a CUDA OOM) are "memory"; other errors, an OSError
    included, are "error", named by type, the job's text cut to 2000 characters."""
    cases = [
        (RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"), "memory"),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory"), "memory"),
        (RuntimeError("shapes do not match"), "error"),
        (ValueError("cannot allocate memory"), "error"),  # only a RuntimeError says OOM so
        (FileNotFoundError(2, "No such file or directory"), "error"),
        (KeyboardInterrupt(), "error"),
    ]
    for exc, kind in cases:

        def job(exc=exc):
            raise exc

        f = runner.run(job, timeout=30, max_memory=64 * MiB, what="it")
        assert f.kind == kind, (exc, f)
        if kind == "memory":
            peak = float(f.message.split("at a peak of ")[1].split(" MiB")[0])
            assert 1 < peak < 64 * 1024, f  # this worker's high-water mark, in MiB
            assert (
                "capped at 0.0625 GiB more than it started with; max_memory / --max-memory"
                in f.message
            )
        else:
            assert f.message.startswith(f"it {type(exc).__name__}: "), f
    for exc in (ValueError("v" * 5000), OSError("o" * 5000)):

        def job(exc=exc):
            raise exc

        f = runner.run(job, timeout=30, what="it")
        assert f.kind == "error" and len(f.message) == len("it ") + 2000, f
    f = runner.run(lambda: {"x": object()}, timeout=30, what="it")  # a result not JSON
    assert f.kind == "error" and f.message.startswith("it TypeError: "), f
    assert "not JSON serializable" in f.message, f
    f = runner.run(lambda: sys.exit("bye"), timeout=30, what="it")
    assert f.kind == "crashed" and f.message == "it called sys.exit('bye')", f


def test_the_output_cap_counts_files_written_and_the_result(tmp_path):
    """max_output caps each thing the worker writes: a file past it is the job's error
    (the message names the cap in MiB and what it counts); a result of exactly the cap
    comes back."""
    big = tmp_path / "big.bin"
    f = runner.run(lambda: big.write_bytes(b"\0" * (2 * MiB)) and None, timeout=30, max_output=MiB)
    assert f.kind == "error", f
    assert f.message == (
        "the job wrote more than the output cap of 1 MiB (stdout and stderr, any file it "
        "writes, its result; max_output)"
    ), f
    exact = "z" * (MiB - len(json.dumps({"ok": ""})))  # its JSON document: MiB bytes
    assert runner.run(lambda: exact, timeout=30, max_output=MiB) == exact
    f = runner.run(lambda: exact + "z", timeout=30, max_output=MiB)
    assert f.kind == "error" and "output cap" in f.message, f


def test_the_memory_cap_is_on_top_of_what_the_worker_started_with():
    """max_memory is more than the worker's start (this process's address space, torch
    included): 64 MiB fits under a cap of 256 MiB."""
    assert (
        runner.run(lambda: len(bytearray(64 * MiB)), timeout=30, max_memory=256 * MiB) == 64 * MiB
    )


def test_a_worker_runs_one_torch_thread():
    """A forked worker sets torch to one thread (the parent's pool did not survive the fork)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert runner.run(lambda: torch.get_num_threads(), timeout=30) == 1
    finally:
        torch.set_num_threads(before)


def test_remaining_counts_down_from_the_timeout_given():
    """remaining(): None outside a worker; inside, at most the timeout, never below 0."""
    assert runner.remaining() is None
    left = runner.run(runner.remaining, timeout=0.5)  # (a timeout under a second is one)
    assert 0 < left <= 0.5, left
    late = runner.run(lambda: time.sleep(0.3) or runner.remaining(), timeout=0.4)
    assert isinstance(late, float) and 0 <= late <= 0.1, late


def test_an_inner_run_with_a_shorter_deadline_ends_on_its_own():
    """An inner run's own (shorter) timeout: the inner worker is stopped and reaped, and
    the outer job goes on with the inner Failure; the outer cap stays the inner one's."""

    def outer():
        t0 = time.monotonic()
        hung = runner.run(lambda: time.sleep(60), timeout=0.5, what="inner")
        hog = runner.run(lambda: bytearray(512 * MiB), timeout=20, max_memory=2**32)
        return {"hung": hung.to_dict(), "secs": time.monotonic() - t0, "hog": hog.to_dict()}

    t0 = time.monotonic()
    got = runner.run(outer, timeout=30, max_memory=128 * MiB)
    assert time.monotonic() - t0 < 10, got
    assert (
        got["hung"]["kind"] == "timeout"
        and "inner did not finish within 0.5 s" in got["hung"]["message"]
    ), got
    assert got["secs"] < 5, got
    assert got["hog"]["kind"] == "memory" and "capped at 0.125 GiB" in got["hog"]["message"]


def test_a_timed_out_worker_is_reaped(tmp_path):
    """The stopped worker leaves no zombie behind: its pid is gone when run returns; the
    message says it was stopped with all it started."""
    pid_file = str(tmp_path / "pid")
    f = runner.run(functools.partial(_sleep_and_tell, pid_file), timeout=0.5, what="napper")
    assert f.message == (
        "napper did not finish within 0.5 s (a hang?); it was stopped, with everything it started"
    )
    assert not Path(f"/proc/{int(Path(pid_file).read_text())}").exists()


def test_a_quick_job_comes_back_quickly():
    """The wait polls often (at most 50 ms apart): a trivial job, or one of 0.6 s, does
    not wait for a slow poll."""
    took = []
    for _ in range(3):
        t0 = time.monotonic()
        assert runner.run(lambda: 1, timeout=30) == 1
        took.append(time.monotonic() - t0)
    assert min(took) < 0.9, took
    t0 = time.monotonic()
    runner.run(lambda: time.sleep(0.6), timeout=30)
    assert time.monotonic() - t0 < 1.3


def test_small_limits_are_limits_not_refusals():
    """A timeout under a second, a cap of one byte: accepted (the job then fails or not)."""
    assert runner.run(lambda: 7, timeout=0.5) == 7
    assert isinstance(runner.run(lambda: 7, timeout=30, max_output=1), runner.Failure)
    with pytest.raises(ValueError, match=r"run: timeout must be a number of seconds, got True"):
        runner.run(lambda: 7, timeout=True)
    with pytest.raises(ValueError, match=r"run: max_output must be a number of bytes > 0, got 2.5"):
        runner.run(lambda: 7, timeout=5, max_output=2.5)
    with pytest.raises(ValueError, match=r"finite number of seconds > 0, got inf"):
        runner.run(lambda: 7, timeout=float("inf"))


def test_the_default_memory_cap_is_a_quarter_of_the_machine_at_most_4_gib(monkeypatch):
    total = next(
        int(line.split()[1]) * 1024
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal:")
    )
    assert runner._physical_memory() == total
    assert runner.DEFAULT_MAX_MEMORY == min(4 * 2**30, total // 4)

    def no_sysconf(name):
        raise ValueError(name)

    monkeypatch.setattr(os, "sysconf", no_sysconf)
    assert runner._physical_memory() == 16 * 2**30  # where it cannot be read: 16 GiB assumed


def test_the_peak_is_the_workers_high_water_mark_in_mib(monkeypatch):
    """VmHWM (KiB) / 1024, to the MiB; where /proc cannot tell it, no peak is said."""
    monkeypatch.setattr(runner, "status_kib", lambda name: {"VmHWM": 3 * 2**20}[name])
    assert runner._out_of_memory(2**30)["message"] == (
        "ran out of memory at a peak of 3072 MiB (the worker is capped at 1 GiB more than it "
        "started with; max_memory / --max-memory)"
    )
    monkeypatch.setattr(runner, "status_kib", lambda name: None)
    assert runner._out_of_memory(2**30)["message"].startswith("ran out of memory (the worker")


def test_a_fresh_worker_loads_the_jobs_modules_before_the_cap():
    """Unpickling the job imports its module (torch here, ~600 MiB of address space): that
    is the worker's start-up, outside the job's max_memory."""
    import _runner_torch_job

    got = runner.run(_runner_torch_job.total, timeout=120, fresh=True, max_memory=256 * MiB)
    assert got == 3, got
