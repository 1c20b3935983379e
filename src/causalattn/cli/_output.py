"""What every command prints with: JSON (one top-level shape), the rich console, numbers,
sizes, output paths and progress. Positions on the command line and in its output are
1-based (:mod:`._positions` converts)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import track

from ..check.report import jsonable
from ._app import _fail, document
from ._positions import shown


def _print_json(data) -> None:
    """Print a command's result as JSON in the one top-level shape (:func:`._app.document`):
    a dict's keys join ``command`` and ``positions``; a list becomes its ``rows``."""
    body = dict(data) if isinstance(data, dict) else {"rows": data}
    typer.echo(json.dumps(jsonable(document(body)), ensure_ascii=False, indent=2))


def _console() -> Console:
    return Console(highlight=False)


def _markup_escape(s: str) -> str:
    """Escape rich markup in library text (formulas like ``C[i, j]``, user tokens)."""
    return escape(s)


def _fmt(a, precision: int = 3) -> str:
    return np.array2string(np.asarray(a), precision=precision, suppress_small=True)


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _si(n: int) -> str:
    """1234567 -> '1.23 M' (decimal prefixes, as FLOP counts are usually quoted)."""
    for div, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.3g} {unit}"
    return str(n)


# Outputs: the folder that holds an output file must exist (no folder is created for
# -o/--output or --save); --png DIR creates DIR itself, never its parents.
def _check_out_file(flag: str, path: Path) -> None:
    if path.is_dir():
        _fail(f"{flag}: {path} is a folder; give a file name")
    parent = path.parent
    if not parent.is_dir():
        _fail(f"{flag}: the folder {parent} does not exist (create it first)")


def _check_out_dir(flag: str, path: Path) -> None:
    if path.exists() and not path.is_dir():
        _fail(f"{flag}: {path} exists and is not a folder")
    if not path.exists() and not path.parent.is_dir():
        _fail(f"{flag}: the folder {path.parent} does not exist (create it first)")


def _progress(items, description: str, quiet: bool):
    """``items`` with a rich progress bar on stderr when it is a terminal and not --json."""
    if quiet or not sys.stderr.isatty():
        return items
    return track(items, description=description, console=Console(stderr=True), transient=True)


def _explain_json(ex) -> dict:
    """Query and keys 1-based, as every position the command line shows."""
    rows = [{**r, "key": shown(r["key"])} for r in ex.rows()]
    return {"query": shown(ex.query), "h": ex.h, "keys": rows}


_POSITION_KEYS = ("index", "rows", "cols")  # evidence that names positions (0-based in Python)


def _one_based(report):
    """A copy of an audit Report whose evidence positions count from 1, as the CLI's do."""

    def shift(ev: dict) -> dict:
        out = dict(ev)
        for k in _POSITION_KEYS:
            if k in out:
                out[k] = shown(out[k])
        return out

    checks = [dataclasses.replace(c, evidence=shift(c.evidence)) for c in report.checks]
    return dataclasses.replace(
        report, checks=checks, empty_rows=[shift(r) for r in report.empty_rows]
    )
