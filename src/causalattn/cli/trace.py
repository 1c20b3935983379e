"""``causalattn trace``: every stage of attention in dependency order."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import typer

from .. import text
from ..matrix_form import trace as run_trace
from ._app import _MAX_BYTES_HELP, DEFAULT_MAX_BYTES, _fail, _Json, _library_errors, command_app
from ._figures import _write_pngs
from ._inputs import _CHAPTER, _load_trace_inputs
from ._output import (
    _check_out_dir,
    _check_out_file,
    _console,
    _explain_json,
    _fmt,
    _markup_escape,
    _print_json,
)
from ._positions import given

command = command_app()


@command.command("trace")
def trace_cmd(
    input_file: Path = typer.Option(
        None, "--input", "-i", help=".npz or .json with X, W_q, W_k, W_v (optional W_o, mask)."
    ),
    query: int = typer.Option(None, "--query", "-q", help="Explain query i (1-based, as h_i)."),
    save: Path = typer.Option(None, "--save", help="Write the whole trace to FILE.npz."),
    png: Path = typer.Option(
        None, "--png", help="Also draw M, S, A and ‖A_ij v_j‖ into DIR as PNG."
    ),
    max_bytes: int = typer.Option(DEFAULT_MAX_BYTES, "--max-bytes", help=_MAX_BYTES_HELP),
    as_json: _Json = False,
) -> None:
    """Every stage of attention in dependency order (default: the chapter's example)."""

    for flag, out in (("--save", save), ("--png", png)):
        if out is not None:
            (_check_out_dir if flag == "--png" else _check_out_file)(flag, out)
    data = _load_trace_inputs(input_file, max_bytes) if input_file is not None else dict(_CHAPTER)
    with _library_errors():
        tr = run_trace(
            data["X"],
            data["W_q"],
            data["W_k"],
            data["W_v"],
            data.get("W_o"),
            mask=data.get("mask"),
            tokens=data.get("tokens"),
        )
        T = tr.A.shape[-1]
        ex = None
        if query is not None:
            ex = tr.explain(given(query, "--query", T))
        if save is not None:
            try:
                tr.save(save)
            except OSError as exc:
                _fail(f"--save: cannot write {save} ({exc.strerror or exc})")
        if as_json:  # about 20 characters a value
            text.check_bytes(
                "trace --json: the printed stages",
                20 * sum(st.value.size for st in tr),
                max_bytes,
                "use --save for a .npz instead, or raise --max-bytes",
            )
    allowed = np.ones(tr.A.shape, bool) if tr.allowed is None else tr.allowed
    readable = np.broadcast_to(allowed, tr.A.shape).any(-1)  # rows that read a key
    if not np.isfinite(tr.H[readable]).all():
        typer.echo(
            "warning: H holds NaN or inf in rows that read keys: the inputs overflow "
            "float64 (values near 1e308?) or hold NaN/inf",
            err=True,
        )
    if png is not None:
        _write_pngs(png, lambda viz: viz.trace_figures(tr))
    if as_json:
        out = {
            "positions": "1-based",
            "scale": tr.scale,
            "stages": [
                {
                    "name": st.name,
                    "symbol": st.symbol,
                    "formula": st.formula,
                    "notation": st.notation,
                    "shape": list(st.shape),
                    "value": st.value,
                }
                for st in tr
            ],
        }
        if ex is not None:
            out["explain"] = _explain_json(ex)
        _print_json(out)
        return
    console = _console()
    for st in tr:
        console.print(
            f"[bold cyan]{st.symbol}[/]  {_markup_escape(st.formula)}   [dim]{st.notation} = "
            f"{'×'.join(map(str, st.shape))}[/]"
        )
        if st.value.size <= 256:
            console.print(_fmt(st.value), markup=False)
        else:
            console.print(f"({st.value.size} values: see --json or --save)", style="dim")
        console.print()
    if ex is not None:
        console.print(f"[bold]The four quantities for query {query} (h_{query}):[/]")
        console.print(ex.format(base=1), markup=False)
    if save is not None:
        saved = save if save.suffix == ".npz" else save.with_name(save.name + ".npz")  # as np.savez
        console.print(f"saved the trace to {saved}", markup=False)
