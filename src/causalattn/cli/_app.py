"""The one-line errors, what every command shares (``_fail``, ``_library_errors``,
``--json`` and its one top-level shape, ``--max-bytes``, positions counted from 1), and the
groups whose modes are sub-commands.

Every failure is one ``error: ...`` line on stderr and exit 2 (usage errors too, followed
by a hint to ``--help``); under ``--json`` it is one JSON document on stdout instead, with
the same exit code. Nothing prints a traceback. Each command's module makes its own typer
app (:func:`command_app`); :mod:`causalattn.cli` loads it when the command runs.
"""

from __future__ import annotations

import json
import os
import re
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

    def parse_args(self, ctx, args):
        return super().parse_args(ctx, _renamed(list(args)))

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        args = list(sys.argv[1:] if args is None else args)
        _STATE.update(json=_asks_json(args), command=None, leaf=None)
        try:
            _STATE.update(self._command_of(args))  # loads the command's module
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
            cmd = exc.ctx.command_path if exc.ctx is not None else "causalattn"
            rv = _error(exc.format_message(), 2, hint=f"Try '{cmd} --help' for help.")
        except click.exceptions.ClickException as exc:
            rv = _error(exc.format_message(), 2)
        except Abort as exc:
            cause = exc.__cause__
            if isinstance(cause, KeyboardInterrupt) or cause is None:
                rv = _error("interrupted", 130)
            else:
                rv = _error(f"unexpected end of input ({type(cause).__name__})", 2)
        except BrokenPipeError:  # `causalattn ... | head`: the reader left; say nothing
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (flushed at exit, never read)
            rv = 1
        except MemoryError:
            rv = _error("out of memory; lower --max-bytes or the input size", 2)
        except RecursionError:
            rv = _error("input nested too deeply", 2)
        except Exception as exc:  # a bug: still one line, unless debugging
            if os.environ.get("CAUSALATTN_DEBUG"):
                raise
            msg = str(exc).splitlines()[0] if str(exc) else ""
            rv = _error(
                f"internal error: {type(exc).__name__}: {msg} (CAUSALATTN_DEBUG=1 "
                "shows the traceback; please report it)",
                2,
            )
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)

    def _command_of(self, args: list[str]) -> dict:
        """The command that ``args`` run: its name as JSON says it (``bench shape``; None:
        none) and the click command (``leaf``)."""
        words = []
        leaf = self
        for arg in args:
            if not isinstance(leaf, TyperGroup) or arg not in leaf.commands:
                break
            words.append(arg)
            leaf = leaf.commands[arg]
        return {"command": " ".join(words) or None, "leaf": leaf}


# What the running command line asked for: --json (errors as JSON too), its command's name
# and its click command.
_STATE: dict = {"json": False, "command": None, "leaf": None}


def _asks_json(args: list[str]) -> bool:
    """``--json`` among the options (not after ``--``, where it is a sentence)."""
    return "--json" in (args[: args.index("--")] if "--" in args else args)


# The sequence length is --max-len in every command; until the next release the name it had
# in one command each still works there, unlisted in --help (command -> its old name).
SEQ_LEN = "--max-len"
_OLD_SEQ_LEN = {"shapes": "--seq-len", "heads": "--length"}


def _renamed(args: list[str]) -> list[str]:
    """``args`` with a command's old name of the sequence length spelled ``--max-len``."""
    old = _OLD_SEQ_LEN.get(args[0]) if args else None
    if old is None:
        return args
    out = []
    for i, arg in enumerate(args):
        if arg == "--":
            return out + args[i:]
        name, eq, value = arg.partition("=")
        out.append(SEQ_LEN + eq + value if name == old else arg)
    return out


def document(body: dict, command: str | None = None) -> dict:
    """The one top-level shape of every ``--json`` output, errors included:
    ``{"command": "bench shape", "positions": "1-based", ...body}``."""
    if command is None:
        command = _STATE["command"]
    return {"command": command, "positions": "1-based", **body}


# A library message may start with the Python name of the function that refused
# ("compare_masks: ...") or of an argument ("alibi_slopes: ..."); the command line says what
# it ran in its own words.
_CODE_NAME = re.compile(r"^((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*)(?:\(\))?: ")


def _user_message(message: str) -> str:
    """``message`` as the command line says it: one line; a leading argument name that is
    the running command's option (``alibi_slopes:``) spelled as that option
    (``--alibi-slopes:``); a leading causalattn function (``compare_masks:``,
    ``Trace.load:``), or the command's own name (``diagnose:`` in ``causalattn diagnose``),
    left out."""
    line = message.strip().splitlines()[0] if message.strip() else "failed"
    command = (_STATE["command"] or "").split(" ")[0]
    while (m := _CODE_NAME.match(line)) is not None:
        name, rest = m.group(1), line[m.end() :]
        flag = "--" + name.replace("_", "-")
        if flag in _options_of_running_command():
            return f"{flag}: {rest}"
        code = ("_" in name or "." in name) and _a_function(name)
        if not (code or name == command):
            break
        line = rest
    return line


def _options_of_running_command() -> set[str]:
    cmd = _STATE["leaf"]
    return {o for p in getattr(cmd, "params", ()) for o in (*p.opts, *p.secondary_opts)}


def _a_function(name: str) -> bool:
    """Whether ``name`` (``compare_masks``, ``Trace.load``) names something callable in a
    loaded causalattn module (a data key such as ``n_heads`` does not)."""
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith("causalattn"):
            continue
        obj = mod
        for part in name.split("."):
            obj = getattr(obj, part, None)
        if callable(obj):
            return True
    return False


def _error(message: str, code: int, hint: str | None = None, **details) -> int:
    """Report one failure: ``error: message`` (and ``hint``) on stderr, or under --json
    one document ``{"command", "positions", "error", "exit_code", ...}`` on stdout.
    Returns ``code``."""
    message = _user_message(message)
    if _STATE["json"]:
        body = {"error": message, "exit_code": code, **details}
        typer.echo(json.dumps(document(body), ensure_ascii=False, indent=2, default=str))
    else:
        typer.echo(f"error: {message}", err=True)
        if hint:
            typer.echo(hint, err=True)
    return code


# Arrays past this many bytes are refused (--max-bytes raises it): a 100,000-token
# sentence's N×N float64 stage alone is 80 GB.
DEFAULT_MAX_BYTES = 2**30
_MAX_BYTES_HELP = "Refuse to build arrays larger than this many bytes (default 1 GiB)."
_Json = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]


# -- shared helpers (every command uses them) --------------------------------------------


def _fail(message: str, code: int = 2, **details) -> NoReturn:
    """Report ``message`` (one ``error:`` line on stderr, or JSON under --json, with
    ``details``) and exit with ``code`` (2), no traceback."""
    raise typer.Exit(_error(message, code, **details))


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
    """A group of modes (``causalattn bench cpu|layer|...``); alone, it shows its modes
    (exit 2, as the bare ``causalattn`` does)."""

    def __init__(self, *args, **kwargs):
        kwargs["no_args_is_help"] = True
        super().__init__(*args, **kwargs)


class _ModeCommand(TyperCommand):
    """A mode of a :class:`_ModeGroup`: an option that belongs to another mode (or names a
    mode, ``bench layer --patterns``) is one ``error:`` line naming the mode it goes with,
    not click's "no such option"."""

    def parse_args(self, ctx, args):
        group = ctx.parent.command if ctx.parent is not None else None
        if isinstance(group, _ModeGroup):
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
    """Where ``flag`` goes instead, as advice: another mode's option, or a mode's name as a
    flag (``--patterns`` -> ``bench patterns``). None: no mode takes it."""
    modes = group.commands
    if flag.removeprefix("--") in modes:  # bench layer --patterns
        return f"run 'causalattn {group.name} {flag.removeprefix('--')}' for that mode"
    others = [name for name, cmd in modes.items() if any(flag in p.opts for p in cmd.params)]
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
