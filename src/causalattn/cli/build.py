"""``causalattn build``: compile the native engine ahead of time (else the first
``engine="cpp"`` call does, for a minute or two) and say what it used: the compiler, the
flags, torch, the cache key and the build folder."""

from __future__ import annotations

import time
import warnings

import typer

from ._app import _Json, command_app
from ._output import _print_json

command = command_app()


@command.command("build")
def build_cmd(as_json: _Json = False) -> None:
    """Build the native C++ engine now (a terminal shows its progress) and report the
    compiler, flags and cache folder. Exit 0 built, 1 it cannot be built here."""
    from ..engines import cpp

    info = cpp.build_info()
    t0 = time.perf_counter()
    with warnings.catch_warnings():  # the one line below says why, not a warning too
        warnings.simplefilter("ignore", RuntimeWarning)
        why = cpp.unavailable()
    info["seconds"] = round(time.perf_counter() - t0, 1)
    info["built"] = not why
    info["why"] = why
    if as_json:
        _print_json(info)
    else:
        for k in ("compiler", "flags", "torch", "cache_key", "folder"):
            v = info[k]
            typer.echo(f"{k:>9}: {' '.join(v) if isinstance(v, list) else v}")
        typer.echo(f"    built: yes ({info['seconds']} s)" if not why else f"    built: no: {why}")
    if why:
        raise typer.Exit(1)
