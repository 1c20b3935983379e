"""``causalattn diagnose``: measure an attention function or module and name the first stage
that differs (the target file is executed in a worker process)."""

from __future__ import annotations

import typer

from ..check import diagnose
from ._app import _fail, _Json, _library_errors, command_app
from ._options import (
    _AlibiSlopes,
    _Bidirectional,
    _Chunk,
    _declared,
    _Lengths,
    _MaxMemory,
    _memory_bytes,
    _PrefixLengths,
    _Scale,
    _Sinks,
    _Softcap,
    _Window,
)
from ._output import _console, _print_json

command = command_app()


@command.command("diagnose")
def diagnose_cmd(
    target: str = typer.Argument(
        ..., help="path/to/file.py:function_or_class (the file is executed)."
    ),
    signature: str = typer.Option(
        None, "--signature", help="qkv | qkv-mask | x-weights | module (default: discovered)."
    ),
    timeout: float = typer.Option(
        60.0, "--timeout", help="Seconds before the user's code is stopped."
    ),
    window: _Window = None,
    chunk: _Chunk = None,
    lengths: _Lengths = None,
    prefix_lengths: _PrefixLengths = None,
    softcap: _Softcap = None,
    sinks: _Sinks = None,
    alibi_slopes: _AlibiSlopes = None,
    bidirectional: _Bidirectional = False,
    scale: _Scale = None,
    max_memory: _MaxMemory = None,
    as_json: _Json = False,
):
    """Measure an attention function or module; name the first stage that differs.
    Exit 0 clean, 1 it differs, 2 it could not run.

    The target file is EXECUTED, in a worker process stopped after --timeout seconds.
    """
    if ":" not in target:
        _fail(f"expected path/to/file.py:function_or_class, got {target!r}")
    declared = _declared(
        window, chunk, lengths, prefix_lengths, softcap, sinks, alibi_slopes, bidirectional
    )
    with _library_errors():
        d = diagnose(
            target,
            signature=signature,
            timeout=timeout,
            scale=scale,
            max_memory=_memory_bytes(max_memory),
            **declared,
        )
    if as_json:
        _print_json({"positions": "1-based", **_one_based_findings(d.to_dict())})
    else:
        # every finding, one line each (never wrapped), the first in full
        _console().print(str(d), markup=False, soft_wrap=True)
    if d.not_run:
        raise typer.Exit(2)
    if not d.ok:
        raise typer.Exit(1)


def _one_based_findings(d: dict) -> dict:
    """Diagnosis JSON with each finding's rows, slice, heads, patched and value rows 1-based."""

    def shift(f: dict) -> dict:
        m = dict(f.get("measurement") or {})
        for k in ("heads", "patched_rows", "value_rows"):
            if isinstance(m.get(k), list):
                m[k] = [i + 1 for i in m[k]]
        rows, sl = [i + 1 for i in f.get("rows", [])], [i + 1 for i in f.get("slice", [])]
        return {**f, "rows": rows, "slice": sl, "measurement": m}

    return {**d, "findings": [shift(f) for f in d.get("findings", [])]}
