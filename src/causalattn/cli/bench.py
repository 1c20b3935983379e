"""``causalattn bench cpu|layer|patterns|io|shape|tune``: time the engines against their
peers, in alternation (the benchmarks themselves live in :mod:`causalattn.bench`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..bench import io as io_bench
from ..bench import startup
from ._app import (
    _MAX_BYTES_HELP,
    DEFAULT_MAX_BYTES,
    _fail,
    _library_errors,
    _ModeCommand,
    command_app,
)
from ._output import _console, _print_json

command = command_app(
    "bench",
    "Time the engines against PyTorch's SDPA and naive attention (CPU), in alternation: "
    "cpu, layer, patterns, io, shape B,H,T,d, tune.",
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


@command.command("shape", cls=_ModeCommand)
def bench_shape(
    shape: Annotated[
        str, typer.Argument(help="B,H,T,d, e.g. 1,4,256,64 (a causal call).", show_default=False)
    ],
    engine: Annotated[
        list[str],
        typer.Option(
            "--engine",
            help="An engine to time (again for more; default: cpp where built, tiled, sdpa, auto).",
            show_default=False,
        ),
    ] = None,
    peer: Annotated[str, typer.Option("--peer", help="The engine each ratio is to.")] = "sdpa",
    pass_: Annotated[str, typer.Option("--pass", help="fwd | fwd+bwd.")] = "fwd",
    dtype: Annotated[str, typer.Option("--dtype", help="float32 | bfloat16.")] = "float32",
    reps: Annotated[
        int, typer.Option("--reps", help="Rounds of the alternation (default: ~4 s of them).")
    ] = None,
    max_bytes: Annotated[
        int, typer.Option("--max-bytes", help=_MAX_BYTES_HELP)
    ] = DEFAULT_MAX_BYTES,
    as_json: _JsonRows = False,
) -> None:
    """The engines on one causal shape, timed in alternation, each as a ratio to --peer."""
    from ..bench import shape as shape_bench  # at call time: imports torch

    if dtype not in ("float32", "bfloat16"):
        _fail(f"--dtype must be float32 or bfloat16, got {dtype!r}")
    if reps is not None and reps < 1:
        _fail(f"--reps must be a positive integer, got {reps}")
    with _library_errors():
        dims = shape_bench.parse_shape(shape)
        shape_bench.check_size(dims, pass_, dtype, max_bytes)
        rows = shape_bench.run(dims, tuple(engine or ()), peer, pass_, dtype, reps=reps)
    _show(shape_bench, rows, as_json)


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
