"""``causalattn shapes``: the seed's dimension table, with params, bytes and FLOPs."""

from __future__ import annotations

import typer
from rich.table import Table

from ..shapes import shape_table
from ._app import SEQ_LEN, _fail, _Json, _library_errors, command_app
from ._output import _console, _human_bytes, _markup_escape, _print_json, _si

command = command_app()


@command.command("shapes")
def shapes(
    seq_len: int = typer.Option(2048, SEQ_LEN, "-T", help="Sequence length T (N)."),
    d_model: int = typer.Option(1000, "--d-model", help="Model (embedding) width d_model."),
    heads: int = typer.Option(1, "--heads", "-H", help="Number of heads h."),
    d_k: int = typer.Option(None, "--d-k", help="Query/key width per head (default d_model/h)."),
    d_v: int = typer.Option(None, "--d-v", help="Value width per head (default d_k)."),
    as_json: _Json = False,
) -> None:
    """The seed's dimension table for T, d_model and heads, with params, bytes and FLOPs."""
    for flag, v in ((SEQ_LEN, seq_len), ("--d-model", d_model), ("--heads", heads)):
        if v < 1:  # named as the command line spells it (the library names its arguments)
            _fail(f"{flag} must be a positive integer, got {v}")
    for flag, v in (("--d-k", d_k), ("--d-v", d_v)):
        if v is not None and v < 1:
            _fail(f"{flag} must be a positive integer, got {v}")
    if d_k is None and d_model % heads:
        _fail(f"--d-model {d_model} is not divisible by --heads {heads}; give --d-k (and --d-v)")
    with _library_errors():
        rows = shape_table(seq_len, d_model, n_heads=heads, d_k=d_k, d_v=d_v)
    by = {r.symbol: r for r in rows}
    dense = by["QKᵀ"].flops + by["H"].flops
    totals = {
        "params": sum(r.params for r in rows),
        "flops": sum(r.flops for r in rows),
        "attention_flops_dense": dense,
        "attention_flops_causal": dense // 2,
    }
    if as_json:
        _print_json(
            {
                "seq_len": seq_len,
                "d_model": d_model,
                "n_heads": heads,
                "rows": [r.to_dict() for r in rows],
                "totals": totals,
            }
        )
        return

    t = Table(
        title=f"T = {seq_len}, d_model = {d_model}, heads = {heads}", title_justify="left", box=None
    )
    for c in ("Symbol", "Shape", "Params", "fp32", "bf16", "FLOPs"):
        t.add_column(c, no_wrap=True, justify="left" if c in ("Symbol", "Shape") else "right")
    for r in rows:
        t.add_row(
            r.symbol,
            r.notation,
            _si(r.params),
            _human_bytes(r.bytes_fp32),
            _human_bytes(r.bytes_bf16),
            _si(r.flops),
        )
    console = _console()
    console.print(t)
    console.print()
    for r in rows:
        console.print(
            f"[bold]{_markup_escape(r.symbol)}[/] ({r.name}): {_markup_escape(r.explanation)}"
        )
    console.print(
        f"parameters {totals['params']:,}; attention FLOPs (QKᵀ + A V, docs/design.md's 4·H·T²·d): "
        f"dense {_si(dense)}, causal {_si(dense // 2)}; all rows {_si(totals['flops'])}"
    )
