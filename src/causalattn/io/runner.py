"""The one isolation runner: every piece of someone else's code causalattn executes runs here
(``diagnose("file.py:name")``, ``diagnose(callable)``, ``learn --check``).

``run(job, timeout=..., max_memory=...)`` calls ``job()`` — a callable taking no arguments
and returning JSON data — in a worker process and returns that data, or a :class:`Failure`
with its ``kind``: ``"timeout"``, ``"memory"``, ``"crashed"`` or ``"error"``. The worker:

- runs in a session (process group) of its own; at the end the whole group is killed,
  grandchildren included, so nothing it started outlives the call;
- has a deadline (``timeout`` seconds); a ``run`` inside a worker gets at most what is left
  of its own deadline, so inner calls honour the outer one, and its worker stays in the
  outer session, so the outer kill reaches it too (at its own end only the inner worker
  itself is killed; what it started goes with the outer group);
- has its address space capped at what it started with plus ``max_memory`` bytes
  (allocations past it fail: MemoryError), and its output (stdout and stderr, kept in a
  file for a crash message; any file it writes; its result) at ``max_output`` bytes each
  (past it: a Failure "error" that says so);
- turns ``sys.exit``, ``os._exit``, a signal or a hang into a Failure, never into a crash of
  the caller.

``fresh=True`` starts a fresh interpreter (the job must pickle: a module-level function, a
``functools.partial`` of one); otherwise, on Linux, the worker is a fork of this process
(a lambda or a closure works) and elsewhere the job is pickled. The runner knows nothing of
what the job does.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..memory import status_kib

__all__ = ["run", "Failure", "FAILURE_KINDS", "DEFAULT_MAX_MEMORY", "MAX_OUTPUT", "remaining"]

FAILURE_KINDS = ("timeout", "memory", "crashed", "error")
MAX_OUTPUT = 64 * 2**20  # the worker's stdout + stderr


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * 2**30


# well under the machine's memory: 4 GiB, or a quarter of a smaller machine's
DEFAULT_MAX_MEMORY = min(4 * 2**30, _physical_memory() // 4)

_DEADLINE: float | None = None  # inside a worker: time.monotonic() at which it is stopped
_MAX_MEMORY: int | None = None  # inside a worker: its memory cap (inner runs keep it)
_MEMORY_WORDS = ("can't allocate memory", "cannot allocate memory", "out of memory")


@dataclass(frozen=True)
class Failure:
    """Why a job gave no result: ``kind`` (one of FAILURE_KINDS) and a one-line message."""

    kind: str
    message: str

    def to_dict(self) -> dict:
        return {"kind": self.kind, "message": self.message}


def remaining() -> float | None:
    """Seconds left before this worker is stopped; None outside a worker."""
    return None if _DEADLINE is None else max(0.0, _DEADLINE - time.monotonic())


def run(
    job: Callable[[], Any],
    *,
    timeout: float,
    max_memory: int = DEFAULT_MAX_MEMORY,
    max_output: int = MAX_OUTPUT,
    what: str = "the job",
    fresh: bool = False,
) -> Any:
    """``job()``'s JSON result, computed in an isolated worker, or a :class:`Failure`.

    ``what`` names the job in messages ("hang.py did not finish within 3 s ...").
    """
    _check_limits(timeout, max_memory, max_output)
    left = remaining()
    if left is not None:  # a worker inside a worker: the outer deadline and cap
        timeout, max_memory = min(timeout, left), min(max_memory, _MAX_MEMORY)
    limits = {"max_memory": int(max_memory), "max_output": int(max_output), "what": what}
    with tempfile.TemporaryDirectory(prefix="causalattn-run-") as tmp:
        tmp = Path(tmp)
        result, log = tmp / "result.json", tmp / "log.txt"
        if not fresh and sys.platform.startswith("linux"):
            pid = _fork(job, limits, timeout, result, log)
        else:
            try:
                pickled = pickle.dumps(job)
            except Exception as exc:
                raise ValueError(
                    f"{what} cannot be sent to a worker process ({exc}); define it at module level"
                ) from None
            pid = _spawn(pickled, limits, timeout, result, log)
        rc, timed_out = _wait(pid, timeout)
        return _outcome(what, rc, timed_out, timeout, result, log, int(max_memory))


def _check_limits(timeout, max_memory, max_output) -> None:
    """A bad limit is the caller's error, named here, before anything runs."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ValueError(f"run: timeout must be a number of seconds, got {timeout!r}")
    if not (timeout > 0 and timeout < float("inf")):  # (NaN fails both)
        raise ValueError(f"run: timeout must be a finite number of seconds > 0, got {timeout!r}")
    for name, v in (("max_memory", max_memory), ("max_output", max_output)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"run: {name} must be a number of bytes > 0, got {v!r}")


# -- in the worker -------------------------------------------------------------------------
def _limit(max_memory: int, max_output: int) -> None:
    """Cap this (worker) process: address space (current + max_memory), bytes it writes."""
    import resource

    vm = (status_kib("VmSize") or 0) * 1024
    for which, cap in ((resource.RLIMIT_AS, vm + max_memory), (resource.RLIMIT_FSIZE, max_output)):
        hard = resource.getrlimit(which)[1]
        if hard != resource.RLIM_INFINITY:
            cap = min(cap, hard)  # a worker inside a worker keeps the outer cap
        try:  # soft and hard: the code cannot raise it again
            resource.setrlimit(which, (cap, cap))
        except (ValueError, OSError):
            pass
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the cap fails, not kills


def _execute(job, max_memory: int, max_output: int) -> dict:
    """{"ok": result} or {"failure": kind, "message": ...}: whatever the job does."""
    try:
        value = job()
        json.dumps(value)  # a result that is not JSON is the job's error, reported here
        return {"ok": value}
    except SystemExit as exc:
        return {"failure": "crashed", "message": f"called sys.exit({exc.code!r})"}
    except MemoryError:
        return _out_of_memory(max_memory)
    except OSError as exc:
        if exc.errno == errno.EFBIG:  # RLIMIT_FSIZE: its output (or a file it wrote)
            return {"failure": "error", "message": _too_much_output(max_output)}
        return {"failure": "error", "message": f"{type(exc).__name__}: {exc}"[:2000]}
    except BaseException as exc:  # someone else's code may raise anything
        if isinstance(exc, RuntimeError) and any(w in str(exc).lower() for w in _MEMORY_WORDS):
            return _out_of_memory(max_memory)
        return {"failure": "error", "message": f"{type(exc).__name__}: {exc}"[:2000]}


def _too_much_output(max_output: int) -> str:
    return (
        f"wrote more than the output cap of {max_output / 2**20:.3g} MiB (stdout and stderr, "
        "any file it writes, its result; max_output)"
    )


def _out_of_memory(max_memory: int) -> dict:
    kib = status_kib("VmHWM")  # the worker's high-water mark: what the job took
    peak = "" if kib is None else f" at a peak of {kib / 1024:.0f} MiB"
    return {
        "failure": "memory",
        "message": f"ran out of memory{peak} (the worker is capped at {max_memory / 2**30:.3g} "
        "GiB more than it started with; max_memory / --max-memory)",
    }


def _in_worker(job, limits: dict, deadline: float, result: Path) -> None:
    global _DEADLINE, _MAX_MEMORY
    _DEADLINE, _MAX_MEMORY = deadline, limits["max_memory"]
    _limit(limits["max_memory"], limits["max_output"])
    out = _execute(job, limits["max_memory"], limits["max_output"])
    text = json.dumps(out)  # (_execute made sure the job's value is JSON)
    if len(text) > limits["max_output"]:  # (the result file is capped too)
        text = json.dumps({"failure": "error", "message": _too_much_output(limits["max_output"])})
    result.write_text(text)


def _worker() -> None:
    """Entry point of a fresh worker interpreter: a pickled job on stdin (written by us)."""
    payload = pickle.load(sys.stdin.buffer)
    sys.path[:0] = [p for p in payload.pop("sys_path") if p not in sys.path]
    deadline = time.monotonic() + payload.pop("timeout")
    pickled = payload.pop("job")
    try:  # the job's modules load here, before the cap: the worker's start-up, not the job
        job = pickle.loads(pickled)
    except BaseException:  # noqa: BLE001 - the same error again, inside: the job's failure
        job = lambda: pickle.loads(pickled)()  # noqa: E731
    _in_worker(job, payload, deadline, Path(payload.pop("result")))


# -- starting and stopping it -----------------------------------------------------------------
def _fork(job, limits: dict, timeout: float, result: Path, log: Path) -> int:
    deadline = time.monotonic() + timeout
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 0  # the worker
    try:
        if _DEADLINE is None:  # not inside a worker: a session of its own
            os.setsid()
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.set_num_threads(1)  # the parent's thread pool did not survive the fork
        _in_worker(job, limits, deadline, result)
    except BaseException:
        code = 70
    finally:
        os._exit(code)


def _spawn(pickled: bytes, limits: dict, timeout: float, result: Path, log: Path) -> int:
    # the job stays pickled inside the payload: the worker unpickles it once sys.path is set
    payload = {**limits, "job": pickled, "sys_path": list(sys.path), "timeout": timeout}
    job_file = result.with_name("job.pickle")
    job_file.write_bytes(pickle.dumps({**payload, "result": str(result)}))
    env = dict(os.environ)
    pkg_root = str(Path(__file__).resolve().parents[2])  # so the worker finds causalattn
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [pkg_root, env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-c", "from causalattn.io.runner import _worker; _worker()"]
    with open(job_file, "rb") as stdin, open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdin=stdin,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=_DEADLINE is None,  # inside a worker: stay in its session
        )
    proc.returncode = 0  # reaped by _wait (os.waitpid), not by Popen: no warning at exit
    return proc.pid


def _wait(pid: int, timeout: float) -> tuple[int | None, bool]:
    """(exit code or -signal, timed out); the worker's whole group is killed after."""
    deadline = time.monotonic() + timeout
    rc, timed_out, delay = None, False, 0.002
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            rc = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() >= deadline:
            timed_out = True
            break
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    try:
        if _DEADLINE is None:
            os.killpg(pid, signal.SIGKILL)  # the session the worker leads: all it started
        elif rc is None:  # (not yet reaped: the pid is still the worker's)
            os.kill(pid, signal.SIGKILL)  # the outer worker's session is killed at its end
    except (ProcessLookupError, PermissionError):
        pass
    if rc is None:
        os.waitpid(pid, 0)
    return rc, timed_out


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            n = fh.tell()
            fh.seek(max(0, n - 2000))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [s for s in text.strip().splitlines() if s.strip()][-3:]
    return " | ".join(s[:300] for s in lines)


def _outcome(what, rc, timed_out, timeout, result: Path, log: Path, max_memory: int):
    if timed_out:
        return Failure(
            "timeout",
            f"{what} did not finish within {timeout:g} s (a hang?); it was stopped, "
            "with everything it started",
        )
    try:
        out = json.loads(result.read_text())
    except (OSError, ValueError):
        out = None
    if isinstance(out, dict) and "ok" in out:
        return out["ok"]
    if isinstance(out, dict) and out.get("failure") in FAILURE_KINDS:
        return Failure(out["failure"], f"{what} {out.get('message', '')}")
    if rc is not None and rc < 0:
        why = f"killed by signal {-rc}"
        if -rc in (signal.SIGKILL, signal.SIGSEGV):
            why += " (out of memory?)" if -rc == signal.SIGKILL else " (a segfault)"
    else:
        why = f"exit code {rc}"
    tail = _tail(log)
    return Failure("crashed", f"{what} crashed ({why})" + (f": {tail}" if tail else ""))
