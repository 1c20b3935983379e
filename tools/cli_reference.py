"""The CLI reference page: every command of the typer app, walked through click, as Markdown.

Run by the docs hook (tools/docs_hooks.py) at every `make docs`; as a script it prints the
page. Nothing is typed in by hand: usage, help, arguments and options come from the app.
"""

from __future__ import annotations

import inspect
import sys

import typer

from causalattn._internals.typer import click
from causalattn.cli import app


def _cell(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def _section(cmd, ctx, depth: int) -> list[str]:
    path = ctx.command_path
    out = [f"{'#' * depth} `{path}`", ""]
    if cmd.help:
        out += [inspect.cleandoc(cmd.help), ""]
    out += ["```text", cmd.get_usage(ctx), "```", ""]
    args = [p for p in cmd.get_params(ctx) if p.param_type_name == "argument"]
    opts = [p for p in cmd.get_params(ctx) if p.param_type_name == "option" and not p.hidden]
    if args:
        out += ["| argument | help |", "|---|---|"]
        out += [f"| `{p.name.upper()}` | {_cell(getattr(p, 'help', ''))} |" for p in args]
        out.append("")
    if opts:
        out += ["| option | help |", "|---|---|"]
        for p in opts:
            record = p.get_help_record(ctx)
            name, text = record if record else (", ".join(p.opts), p.help)
            out.append(f"| `{_cell(name)}` | {_cell(text)} |")
        out.append("")
    if hasattr(cmd, "list_commands"):
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is None or sub.hidden:
                continue
            out += _section(sub, click.Context(sub, info_name=name, parent=ctx), depth + 1)
    return out


def commands() -> list[str]:
    """Every visible command path, the group's first: ['causalattn', 'causalattn demo', ...]."""
    group = typer.main.get_command(app)
    return [
        line.strip("# `")
        for line in _section(group, click.Context(group, info_name="causalattn"), 1)
        if line.startswith("#") and line.rstrip().endswith("`")
    ]


def page() -> str:
    """The whole page: the group, then each command (and each mode of bench and explore)."""
    group = typer.main.get_command(app)
    ctx = click.Context(group, info_name="causalattn")
    head = [
        "# CLI reference",
        "",
        "Generated from the typer app at every `make docs` (`tools/cli_reference.py`). Every",
        'command takes `--json` (one shape: `{"command", "positions": "1-based", ...}`);',
        "positions count from 1; bad input is one `error: ...` line and exit 2 (under `--json`,",
        "that shape with `error` and `exit_code` on stdout). `--version` prints the version.",
        "",
    ]
    body = _section(group, ctx, 1)
    return "\n".join(head + body[2:]) + "\n"  # the group's own heading is the page's


if __name__ == "__main__":
    sys.stdout.write(page())
