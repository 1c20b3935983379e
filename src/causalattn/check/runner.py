"""Running a file's function in a subprocess with a deadline."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

from .report import Diagnosis

_MARK = "@@causalattn-diagnosis@@"


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
            for q in inspect.signature(obj).parameters.values()):
        obj = obj()  # a factory: returns the configured function or module
    if inspect.isclass(obj):
        try:
            obj = obj()
        except TypeError as exc:
            raise ValueError(f"diagnose: cannot construct {name}() without arguments ({exc}); "
                             "name a function without arguments that returns a configured "
                             "module") from None
    return obj


def _worker(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    spec, sig = argv[0], (argv[1] if len(argv) > 1 and argv[1] != "-" else None)
    from .diagnose import _diagnose_callable

    try:
        d = _diagnose_callable(_load_target(spec), sig)
    except Exception as exc:
        d = Diagnosis(None, None, f"{type(exc).__name__}: {exc}", status="error")
    sys.stdout.flush()
    print(_MARK + json.dumps(d.to_dict(), default=str))


def _diagnose_path(spec: str, signature: str | None, timeout: float) -> Diagnosis:
    cmd = [sys.executable, "-c", "import sys; from causalattn.check.runner import _worker; _worker()",
           spec, signature or "-"]
    env = dict(os.environ)
    pkg_root = str(Path(__file__).resolve().parents[2])  # so the child finds causalattn
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [pkg_root, env.get("PYTHONPATH")]))
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                             stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return Diagnosis(None, None, f"{spec} did not finish within {timeout:g} s (a hang?); "
                         "it was stopped", status="timeout")
    for line in reversed(res.stdout.splitlines()):
        if line.startswith(_MARK):
            return Diagnosis.from_dict(json.loads(line[len(_MARK):]))
    tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
    return Diagnosis(None, None, f"{spec} crashed (exit code {res.returncode}): "
                     + " | ".join(tail), status="crashed")

