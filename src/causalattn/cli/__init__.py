"""The `causalattn` command: a thin shell over the library (typer + rich).

Every command takes ``--json`` for machine-readable output. Positions on the command
line and in its output (text and JSON) are 1-based, as in the chapter (h_1 … h_T); the
Python API is 0-based. Every failure is one ``error: ...`` line on stderr and exit 2
(usage errors too, followed by a hint to ``--help``); nothing prints a traceback.
Commands that would build large arrays refuse past ``--max-bytes`` (1 GiB by default)
with the size they would need.

One module per command (``shapes``, ``masks``, ``trace``, ``demo``, ``audit``,
``diagnose``, ``learn``, ``heads``, ``explore``, ``bench``), each registering itself on
:data:`app` (``_app``: the app and its one-line errors); what they share is in ``_output``
(JSON, console, sizes, output paths), ``_present`` (mask tables), ``_inputs`` (sentences,
trace inputs, models) and ``_options``. Start-up imports no torch: ``--help``, ``shapes``,
``masks`` and ``learn``'s questions never load it (a command that computes with torch
imports it when it runs).
"""

from __future__ import annotations

from . import audit, bench, demo, diagnose, explore, heads, learn, masks, shapes, trace
from ._app import DEFAULT_MAX_BYTES, app

__all__ = ["app", "main", "DEFAULT_MAX_BYTES"]
_COMMANDS = (shapes, masks, trace, demo, audit, diagnose, learn, heads, explore, bench)

# --help lists the commands in this order (typer lists in registration order, and the
# modules register as they are imported): `demo`, the main job, first.
_ORDER = ("demo", "shapes", "masks", "trace", "audit", "diagnose", "learn", "heads")
app.registered_commands.sort(key=lambda c: _ORDER.index(c.name or c.callback.__name__))
app.registered_groups.sort(key=lambda g: ("explore", "bench").index(g.name))


def main() -> None:
    app()
