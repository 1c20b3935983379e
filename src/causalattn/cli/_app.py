"""The one-line errors, what every command shares (``_fail``, ``_library_errors``,
``--json``, ``--max-bytes``), and the groups whose modes are sub-commands.

Every failure is one ``error: ...`` line on stderr and exit 2 (usage errors too, followed
by a hint to ``--help``); nothing prints a traceback. Each command's module makes its own
typer app (:func:`command_app`); :mod:`causalattn.cli` loads it when the command runs.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Annotated, NoReturn

import typer
from typer.core import TyperCommand, TyperGroup
from typer.exceptions import Abort

from .._internals.typer import click  # the click typer raises from (no public name)


class _OneLineErrors(TyperGroup):
    """typer's group, but every failure is one leading ``error: ...`` line and exit 2.

    Usage errors (unknown option, missing argument, bad value) keep click's exit 2 and
    add a ``Try ... --help`` line; anything unexpected becomes ``error: internal error``
    instead of a traceback (``CAUSALATTN_DEBUG=1`` shows the traceback).
    """

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            rv = super().main(
                args=args,
                prog_name=prog_name,
                complete_var=complete_var,
                standalone_mode=False,
                **extra,
            )
        except click.exceptions.NoArgsIsHelpError as exc:
            click.echo(exc.ctx.get_help())
            rv = 2
        except click.exceptions.UsageError as exc:
            click.echo(f"error: {exc.format_message()}", err=True)
            cmd = exc.ctx.command_path if exc.ctx is not None else "causalattn"
            click.echo(f"Try '{cmd} --help' for help.", err=True)
            rv = 2
        except click.exceptions.ClickException as exc:
            click.echo(f"error: {exc.format_message()}", err=True)
            rv = 2
        except Abort as exc:
            cause = exc.__cause__
            if isinstance(cause, KeyboardInterrupt) or cause is None:
                click.echo("error: interrupted", err=True)
                rv = 130
            else:
                click.echo(f"error: unexpected end of input ({type(cause).__name__})", err=True)
                rv = 2
        except BrokenPipeError:  # `causalattn ... | head`: the reader left; say nothing
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (flushed at exit, never read)
            rv = 1
        except MemoryError:
            click.echo("error: out of memory; lower --max-bytes or the input size", err=True)
            rv = 2
        except RecursionError:
            click.echo("error: input nested too deeply", err=True)
            rv = 2
        except Exception as exc:  # a bug: still one line, unless debugging
            if os.environ.get("CAUSALATTN_DEBUG"):
                raise
            msg = str(exc).splitlines()[0] if str(exc) else ""
            click.echo(
                f"error: internal error: {type(exc).__name__}: {msg} (CAUSALATTN_DEBUG=1 "
                "shows the traceback; please report it)",
                err=True,
            )
            rv = 2
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)


# Arrays past this many bytes are refused (--max-bytes raises it): a 100,000-token
# sentence's N×N float64 stage alone is 80 GB.
DEFAULT_MAX_BYTES = 2**30
_MAX_BYTES_HELP = "Refuse to build arrays larger than this many bytes (default 1 GiB)."
_Json = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]


# -- shared helpers (every command uses them) --------------------------------------------


def _fail(message: str, code: int = 2) -> NoReturn:
    """Print ``error: message`` on stderr and exit with ``code`` (2), no traceback."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


@contextmanager
def _library_errors():
    """Turn the library's ValueError (and file errors) into :func:`_fail`."""
    try:
        yield
    except (ValueError, OSError) as exc:
        _fail(str(exc))
    except MemoryError:
        _fail("out of memory; lower the input size or --max-bytes")


# -- groups whose modes are sub-commands (bench, explore) ---------------------------------


class _ModeGroup(TyperGroup):
    """A group of modes (``causalattn bench cpu|layer|...``) that still takes its older
    spelling: arguments that do not start with a mode's name (none, an option, a sentence)
    go to the hidden command ``LEGACY``, which keeps every flag the command took before its
    modes became sub-commands (issue 26). ``--help`` alone shows the modes."""

    LEGACY = "legacy"

    def parse_args(self, ctx, args):
        args = list(args)
        if not args or (args[0] not in self.commands and args[0] not in ctx.help_option_names):
            args.insert(0, self.LEGACY)
        return super().parse_args(ctx, args)


class _ModeCommand(TyperCommand):
    """A mode of a :class:`_ModeGroup`: an option that belongs to another mode (or to the
    older spelling, ``bench --patterns``) is one ``error:`` line naming the mode it goes
    with, not click's "no such option"."""

    def parse_args(self, ctx, args):
        group = ctx.parent.command if ctx.parent is not None else None
        if isinstance(group, _ModeGroup) and self.name != group.LEGACY:
            mine = {o for p in self.params for o in (*p.opts, *p.secondary_opts)}
            for arg in args:
                if arg == "--":
                    break
                flag = arg.split("=", 1)[0]
                if not flag.startswith("--") or flag in mine:
                    continue
                where = _mode_of(group, flag)
                if where is not None:
                    _fail(f"{flag} does not go with 'causalattn {group.name} {self.name}'; {where}")
        return super().parse_args(ctx, args)


def _mode_of(group: _ModeGroup, flag: str) -> str | None:
    """Where ``flag`` goes instead, as advice: another mode's option, or an older spelling's
    mode flag (``--patterns`` -> ``bench patterns``). None: no mode takes it."""
    modes = group.commands
    if flag.removeprefix("--") in modes:  # bench layer --patterns
        return f"run 'causalattn {group.name} {flag.removeprefix('--')}' for that mode"
    others = [
        name
        for name, cmd in modes.items()
        if name != group.LEGACY and any(flag in p.opts for p in cmd.params)
    ]
    if others:
        return "it goes with " + " or ".join(f"'causalattn {group.name} {n}'" for n in others)
    return None


def command_app(name: str | None = None, help: str | None = None) -> typer.Typer:
    """The typer app of one command's module: give it one command, or (with ``name``) the
    modes of a :class:`_ModeGroup`. ``causalattn.cli`` loads the module when its command
    runs (or ``--help`` lists it)."""
    if name is None:
        return typer.Typer(add_completion=False)
    return typer.Typer(name=name, cls=_ModeGroup, add_completion=False, help=help)
