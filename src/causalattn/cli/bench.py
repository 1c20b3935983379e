"""``causalattn bench cpu|layer|patterns|io|tune``: time the engines against their peers,
in alternation (the benchmarks themselves live in :mod:`causalattn.bench`).

The older spellings, ``causalattn bench`` (= cpu), ``bench --layer``, ``--patterns``,
``--io`` and ``--tune [--out F]``, still work: they go to the hidden ``legacy`` command
(see :class:`._app._ModeGroup`), which runs the same code; two modes at once are one
``error:`` line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..bench import io as io_bench
from ..bench import startup
from ._app import _fail, _ModeCommand, _ModeGroup, command_app
from ._output import _console, _print_json

command = command_app(
    "bench",
    "Time the tiled engine against PyTorch's SDPA and naive attention (CPU), in alternation: "
    "cpu (the default), layer, patterns, io, tune.",
)

_Quick = Annotated[bool, typer.Option("--quick", help="a subset that runs in under a minute")]
_JsonRows = Annotated[bool, typer.Option("--json", help="print the rows as JSON")]
_TUNE_HELP = (
    "measure tiled vs SDPA per problem kind and write the table engine='auto' reads (the "
    "user cache directory: $XDG_CACHE_HOME/causalattn or ~/.cache/causalattn on Linux)"
)
_Out = Annotated[Path, typer.Option("--out", help="write the table here instead")]
_IO_PARTS = ("startup", "input")


@command.command("cpu", cls=_ModeCommand)
def bench_cpu(quick: _Quick = False, as_json: _JsonRows = False) -> None:
    """The engines at one head's shapes (CPU) vs SDPA and naive attention."""
    _run_cpu(quick, as_json)


@command.command("layer", cls=_ModeCommand)
def bench_layer(quick: _Quick = False, as_json: _JsonRows = False) -> None:
    """The whole CausalSelfAttention layer at GPT-2 small, fwd and fwd+bwd, vs SDPA."""
    _run_layer(quick, as_json)


@command.command("patterns", cls=_ModeCommand)
def bench_patterns(quick: _Quick = False, as_json: _JsonRows = False) -> None:
    """Window, packed documents, softcap, sinks, ALiBi and dropout on the tiled engine vs
    their peers."""
    _run_patterns(quick, as_json)


@command.command("io", cls=_ModeCommand)
def bench_io(
    quick: _Quick = False,
    as_json: _JsonRows = False,
    only: Annotated[
        str, typer.Option("--only", help="startup | input: one of the two tables.")
    ] = None,
) -> None:
    """The CLI's start-up (--help, shapes, masks, learn --json vs `import torch`) and huge
    input through it (100,000 words, 10,000 sentences): time, memory."""
    if only is not None and only not in _IO_PARTS:
        _fail(f"--only must be one of {', '.join(_IO_PARTS)}, got {only!r}")
    _run_io(quick, as_json, only)


@command.command("tune", cls=_ModeCommand, help=_TUNE_HELP[0].upper() + _TUNE_HELP[1:] + ".")
def bench_tune(out: _Out = None, as_json: _JsonRows = False) -> None:
    _run_tune(out, as_json)


@command.command(_ModeGroup.LEGACY, cls=_ModeCommand, hidden=True)
def bench_legacy(
    quick: _Quick = False,
    as_json: _JsonRows = False,
    layer: Annotated[bool, typer.Option("--layer", help="= bench layer")] = False,
    patterns: Annotated[bool, typer.Option("--patterns", help="= bench patterns")] = False,
    io: Annotated[bool, typer.Option("--io", help="= bench io")] = False,
    tune: Annotated[bool, typer.Option("--tune", help="= bench tune: " + _TUNE_HELP)] = False,
    out: Annotated[Path, typer.Option("--out", help="with --tune: write the table here")] = None,
) -> None:
    """The older spelling: `bench` (= cpu), `bench --layer|--patterns|--io|--tune`."""
    picked = [
        f
        for f, on in (("--layer", layer), ("--patterns", patterns), ("--io", io), ("--tune", tune))
        if on
    ]
    if len(picked) > 1:
        _fail(
            f"{' and '.join(picked)} are two modes; give one "
            "(causalattn bench cpu|layer|patterns|io|tune)"
        )
    if out is not None and not tune:
        raise typer.BadParameter("--out goes with --tune")
    if io:
        _run_io(quick, as_json, None)
    elif tune:
        _run_tune(out, as_json)
    elif patterns:
        _run_patterns(quick, as_json)
    elif layer:
        _run_layer(quick, as_json)
    else:
        _run_cpu(quick, as_json)


# The benchmarks are imported when one runs: they import torch, which the other commands'
# start-up leaves out.


def _show(mod, rows, as_json: bool) -> None:
    if as_json:
        _print_json(rows)
        return
    mod.render(rows, _console())


def _run_cpu(quick: bool, as_json: bool) -> None:
    from ..bench import cpu  # at call time: imports torch

    _show(cpu, cpu.run(quick=quick), as_json)


def _run_layer(quick: bool, as_json: bool) -> None:
    from ..bench import layer  # at call time: imports torch

    _show(layer, layer.run(budget_s=8.0 if quick else 20.0), as_json)


def _run_patterns(quick: bool, as_json: bool) -> None:
    from ..bench import patterns  # at call time: imports torch

    _show(patterns, patterns.run(quick=quick), as_json)


def _run_tune(out: Path | None, as_json: bool) -> None:
    from ..bench import tune  # at call time: imports torch

    path, table = tune.tune(out)
    if as_json:
        _print_json(table)
        return
    tune.render(table, path, _console())


def _run_io(quick: bool, as_json: bool, only: str | None) -> None:
    rows = {}
    if only in (None, "startup"):
        rows["startup"] = startup.run(reps=3 if quick else 7)
    if only in (None, "input"):
        rows["input"] = io_bench.run(reps=1 if quick else 2, quick=quick)
    if as_json:
        _print_json(rows)
        return
    console = _console()
    if "startup" in rows:
        startup.render(rows["startup"], console)
    if "input" in rows:
        io_bench.render(rows["input"], console)
