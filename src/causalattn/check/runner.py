"""Running the user's code in a worker process with a deadline and resource limits.

The worker runs in a session of its own (its own process group), so on the deadline the
whole group is killed, grandchildren included; it is killed again when it finishes, so
nothing it spawned outlives the diagnosis. Its output goes to a capped log file, its
address space is capped, and ``sys.exit`` or an ``os._exit`` inside the user's code
comes back as status "crashed", a hang as "timeout", never as a crash of the caller.

A ``"file.py:name"`` target runs in a fresh interpreter. A callable is sent to a fresh
interpreter when it pickles; otherwise (a lambda, a closure), on Linux, the worker is a
fork of this process.
"""

from __future__ import annotations

import inspect
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .report import Diagnosis, Status

__all__ = ["diagnose_path", "diagnose_isolated"]

MAX_LOG_BYTES = 64 * 2**20  # the worker's stdout + stderr


def _load_target(spec: str):
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise ValueError(f"diagnose: expected path/to/file.py:function_or_class, got {spec!r}")
    import importlib.util

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"diagnose: {path}: no such file")
    sys.path.insert(0, str(p.parent.resolve()))
    mod_spec = importlib.util.spec_from_file_location(f"_diagnosed_{p.stem}", p)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    if not hasattr(mod, name):
        raise ValueError(f"diagnose: {path} has no {name!r}")
    obj = getattr(mod, name)
    if inspect.isfunction(obj) and not any(
        q.default is q.empty and q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD)
        for q in inspect.signature(obj).parameters.values()
    ):
        obj = obj()  # a factory: returns the configured function or module
    if inspect.isclass(obj):
        try:
            obj = obj()
        except TypeError as exc:
            raise ValueError(
                f"diagnose: cannot construct {name}() without arguments ({exc}); "
                "name a function without arguments that returns a configured "
                "module"
            ) from None
    return obj


def _limit(max_memory: int) -> None:
    """Cap this (worker) process: address space (current + max_memory), files it writes."""
    import resource

    try:
        with open("/proc/self/status") as fh:
            vm = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        vm = 0
    try:
        resource.setrlimit(resource.RLIMIT_AS, (vm + max_memory, vm + max_memory))
    except (ValueError, OSError):
        pass
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the cap fails, not kills
    resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_LOG_BYTES, MAX_LOG_BYTES))


def _diagnose_in_worker(job: dict) -> dict:
    """Run one diagnosis in the worker; always a Diagnosis dict, whatever the code does."""
    from .diagnose import diagnose_here

    try:
        _limit(job["max_memory"])
        fn = _load_target(job["spec"]) if "spec" in job else job["fn"]
        if job["signature"] is None:
            from .callers import _discover_signature

            job["signature"] = _discover_signature(fn)
        d = diagnose_here(fn, job["signature"], job["declared"], job["scale"])
    except MemoryError:
        d = Diagnosis(
            None,
            None,
            f"the function ran out of memory (the worker is capped at "
            f"{job['max_memory'] / 2**30:.3g} GiB more than it started with)",
            status=Status.CRASHED,
        )
    except SystemExit as exc:
        d = Diagnosis(
            None, None, f"the function called sys.exit({exc.code!r})", status=Status.CRASHED
        )
    except BaseException as exc:  # the user's code may raise anything
        d = Diagnosis(None, None, f"{type(exc).__name__}: {exc}", status=Status.ERROR)
    return d.to_dict()


def _worker() -> None:
    """Entry point of a fresh worker interpreter: a pickled job on stdin (written by us)."""
    job = pickle.load(sys.stdin.buffer)
    sys.path[:0] = [p for p in job.pop("sys_path") if p not in sys.path]
    if "fn_pickle" in job:
        job["fn"] = pickle.loads(job.pop("fn_pickle"))
    out = _diagnose_in_worker(job)
    Path(job["result"]).write_text(json.dumps(out, default=str))


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


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


def _finish(what: str, rc, timed_out: bool, timeout: float, result: Path, log: Path) -> Diagnosis:
    if timed_out:
        return Diagnosis(
            None,
            None,
            f"{what} did not finish within {timeout:g} s (a hang?); "
            "it was stopped, with everything it started",
            status=Status.TIMEOUT,
        )
    try:
        return Diagnosis.from_dict(json.loads(result.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    if rc is not None and rc < 0:
        why = f"killed by signal {-rc}"
        if -rc in (signal.SIGKILL, signal.SIGSEGV):
            why += " (out of memory?)" if -rc == signal.SIGKILL else " (a segfault)"
    else:
        why = f"exit code {rc}"
    tail = _tail(log)
    return Diagnosis(
        None, None, f"{what} crashed ({why})" + (f": {tail}" if tail else ""), status=Status.CRASHED
    )


def _job(signature, declared, scale, max_memory, result) -> dict:
    return {
        "signature": signature,
        "declared": declared,
        "scale": scale,
        "max_memory": int(max_memory),
        "result": str(result),
    }


def _spawn(job: dict, what: str, timeout: float, tmp: Path) -> Diagnosis:
    job["sys_path"] = list(sys.path)
    payload = tmp / "job.pickle"
    payload.write_bytes(pickle.dumps(job))
    log = tmp / "log.txt"
    env = dict(os.environ)
    pkg_root = str(Path(__file__).resolve().parents[2])  # so the worker finds causalattn
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [pkg_root, env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-c", "from causalattn.check.runner import _worker; _worker()"]
    with open(payload, "rb") as stdin, open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdin=stdin, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_group(proc.pid)
        proc.wait()
    return _finish(what, proc.returncode, timed_out, timeout, Path(job["result"]), log)


def _fork(job: dict, what: str, timeout: float, tmp: Path) -> Diagnosis:
    log = tmp / "log.txt"
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the worker
        code = 0
        try:
            os.setsid()
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            try:
                import torch

                torch.set_num_threads(1)  # the parent's thread pool did not survive the fork
            except ImportError:
                pass
            out = _diagnose_in_worker(job)
            Path(job["result"]).write_text(json.dumps(out, default=str))
        except BaseException:
            code = 70
        finally:
            os._exit(code)
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
    _kill_group(pid)
    if rc is None:
        os.waitpid(pid, 0)
    return _finish(what, rc, timed_out, timeout, Path(job["result"]), log)


def diagnose_path(spec, signature, declared, scale, timeout, max_memory) -> Diagnosis:
    """``file.py:name``: load and diagnose it in a fresh worker interpreter."""
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise ValueError(f"diagnose: expected path/to/file.py:function_or_class, got {spec!r}")
    with tempfile.TemporaryDirectory(prefix="causalattn-diagnose-") as tmp:
        tmp = Path(tmp)
        job = _job(signature, declared, scale, max_memory, tmp / "result.json")
        job["spec"] = spec
        return _spawn(job, spec, timeout, tmp)


def diagnose_isolated(fn, signature, declared, scale, timeout, max_memory) -> Diagnosis:
    """A callable: pickled to a fresh worker when it can be, else a forked worker (Linux)."""
    what = getattr(fn, "__qualname__", None) or type(fn).__name__
    with tempfile.TemporaryDirectory(prefix="causalattn-diagnose-") as tmp:
        tmp = Path(tmp)
        job = _job(signature, declared, scale, max_memory, tmp / "result.json")
        if sys.platform.startswith("linux"):
            job["fn"] = fn
            return _fork(job, what, timeout, tmp)
        try:
            job["fn_pickle"] = pickle.dumps(fn)
        except Exception as exc:
            raise ValueError(
                f"diagnose: {what} cannot be sent to a worker process ({exc}); "
                "define it at module level, or pass isolate=False to run it in "
                "this process (without the timeout)"
            ) from None
        return _spawn(job, what, timeout, tmp)
