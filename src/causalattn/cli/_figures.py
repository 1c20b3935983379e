"""``--png``: the figures of :mod:`causalattn.viz` drawn into a folder (`masks`, `trace`)."""

from __future__ import annotations

from pathlib import Path

import typer

from .. import viz
from ._app import _fail, _library_errors
from ._output import _check_out_dir


def _write_pngs(out_dir: Path, make) -> None:
    """Draw ``make(causalattn.viz)``'s named figures into ``out_dir`` as PNG (needs matplotlib)."""
    try:
        import matplotlib  # noqa: F401  (at call time: heavy and optional; viz draws with it)
    except ImportError:
        _fail("--png needs matplotlib: pip install 'causalattn[viz]'")
    _check_out_dir("--png", out_dir)
    try:
        out_dir.mkdir(exist_ok=True)
    except OSError as exc:
        _fail(f"--png: cannot create {out_dir} ({exc.strerror or exc})")
    with _library_errors():
        paths = viz.write_figures(make(viz), out_dir)
    typer.echo(f"wrote {len(paths)} PNG files to {out_dir}", err=True)
