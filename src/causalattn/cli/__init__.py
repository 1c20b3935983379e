"""The `causalattn` command: a thin shell over the library (typer + rich).

Every command takes ``--json`` for machine-readable output, one top-level shape for all
(``{"command": ..., "positions": "1-based", ...}``). Positions on the command line and in
its output (text and JSON) are 1-based, as in the chapter (h_1 … h_T); the Python API is
0-based (``_positions`` converts). Every failure is one ``error: ...`` line on stderr and
exit 2 (usage errors too, followed by a hint to ``--help``); under ``--json`` it is that
shape with ``error`` and ``exit_code`` on stdout. Nothing prints a traceback.
Commands that would build large arrays refuse past ``--max-bytes`` (1 GiB by default)
with the size they would need.

One module per command (``shapes``, ``masks``, ``trace``, ``demo``, ``audit``,
``diagnose``, ``learn``, ``heads``, ``explore``, ``bench``, ``build``), each with its own typer app
(``command``); what they share is in ``_app`` (the one-line errors, modes as
sub-commands, the JSON shape), ``_output`` (JSON, console, sizes, output paths),
``_positions`` (counting from 1), ``_present`` (mask tables), ``_inputs`` (sentences,
trace inputs, models) and ``_options``. A command's module
is loaded when it runs (``--help`` loads them all), so a command's start-up imports only
what it uses; ``--help``, ``shapes``, ``masks`` and ``learn``'s questions import no torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, MutableMapping

import typer

from ._app import DEFAULT_MAX_BYTES, _OneLineErrors

__all__ = ["app", "main", "DEFAULT_MAX_BYTES"]

# command -> its module; --help lists them in this order (`demo`, the main job, first)
COMMANDS = {
    "demo": "demo",
    "shapes": "shapes",
    "masks": "masks",
    "trace": "trace",
    "audit": "audit",
    "diagnose": "diagnose",
    "learn": "learn",
    "heads": "heads",
    "explore": "explore",
    "bench": "bench",
    "build": "build",
}


class _LazyCommands(MutableMapping):
    """The group's commands by name, each built from its module on first use: the names
    (for --help's order and click's suggestions) without importing any module."""

    def __init__(self, loaded: dict):
        self._loaded = dict(loaded)

    def __getitem__(self, name: str):
        if name not in self._loaded and name in COMMANDS:
            module = importlib.import_module(f".{COMMANDS[name]}", __name__)
            self._loaded[name] = typer.main.get_command(module.command)
        return self._loaded[name]

    def __setitem__(self, name: str, command) -> None:
        self._loaded[name] = command

    def __delitem__(self, name: str) -> None:
        del self._loaded[name]

    def __iter__(self) -> Iterator[str]:
        yield from COMMANDS
        yield from (n for n in self._loaded if n not in COMMANDS)

    def __len__(self) -> int:
        return len(set(COMMANDS) | set(self._loaded))


class _Commands(_OneLineErrors):
    """The `causalattn` group: :class:`_OneLineErrors` over the lazily built commands."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.commands = _LazyCommands(self.commands)

    def list_commands(self, ctx) -> list[str]:
        return list(self.commands)  # the names only (typer's reads every command)


app = typer.Typer(
    cls=_Commands,
    add_completion=False,
    no_args_is_help=True,
    help="Causal self-attention in matrix form: H = softmax_last(Q Kᵀ/√d_k + M) V.",
)


def _version(value: bool) -> None:
    if value:
        from .. import __version__

        typer.echo(f"causalattn {__version__}")
        raise typer.Exit(0)


@app.callback()
def _group(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    # typer builds a group (not one command) only for an app with a callback or commands;
    # this app's commands come from COMMANDS, so its callback only takes --version
    pass


def main() -> None:
    app()
