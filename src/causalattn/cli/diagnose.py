"""``causalattn diagnose``: measure an attention function or module and name the first stage
that differs (the target file is executed in a worker process)."""

from __future__ import annotations

import typer

from ..check import diagnose
from ._app import _fail, _Json, _library_errors, command_app
from ._options import (
    _declared,
    _MaxMemory,
    _memory_bytes,
    _Scale,
    pattern_options,
)
from ._output import _console, _print_json
from ._positions import shown

command = command_app()


@command.command("diagnose")
@pattern_options
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
    scale: _Scale = None,
    max_memory: _MaxMemory = None,
    as_json: _Json = False,
    **keywords,
):
    """Measure an attention function or module; name the first stage that differs.
    Exit 0 clean, 1 it differs, 2 it could not run.

    The target file is EXECUTED, in a worker process stopped after --timeout seconds.
    """
    if ":" not in target:
        _fail(f"expected path/to/file.py:function_or_class, got {target!r}")
    declared = _declared(keywords)
    with _library_errors():
        d = diagnose(
            target,
            signature=signature,
            timeout=timeout,
            scale=scale,
            max_memory=_memory_bytes(max_memory),
            **declared,
        )
    if d.not_run:  # it could not run: the one error format, its diagnosis under --json
        _fail(d.message, diagnosis=_one_based_findings(d.to_dict()))
    if as_json:
        _print_json(_one_based_findings(d.to_dict()))
    else:
        # every finding, one line each (never wrapped), the first in full
        _console().print(str(d), markup=False, soft_wrap=True)
    if not d.ok:
        raise typer.Exit(1)


def _one_based_findings(d: dict) -> dict:
    """Diagnosis JSON with each finding's rows, slice, heads, patched and value rows 1-based."""

    def shift(f: dict) -> dict:
        m = dict(f.get("measurement") or {})
        for k in ("heads", "patched_rows", "value_rows"):
            if isinstance(m.get(k), list):
                m[k] = shown(m[k])
        rows, sl = shown(f.get("rows", [])), shown(f.get("slice", []))
        return {**f, "rows": rows, "slice": sl, "measurement": m}

    return {**d, "findings": [shift(f) for f in d.get("findings", [])]}
