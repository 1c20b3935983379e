"""The other libraries' private names that causalattn keeps (src/causalattn/_internals/):
each test fails when its library changes the name, so the change is seen here first."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from causalattn._internals.typer import click


def _app():
    app = typer.Typer(no_args_is_help=True, add_completion=False)

    @app.command()
    def one(n: int):
        raise click.exceptions.ClickException(f"got {n}")

    @app.command()
    def two():
        pass

    return typer.main.get_command(app)


def test_typer_raises_the_click_exceptions_the_cli_catches():
    cmd = _app()
    with pytest.raises(click.exceptions.NoArgsIsHelpError):
        cmd.main([], standalone_mode=False)
    with pytest.raises(click.exceptions.UsageError):
        cmd.main(["one", "--nope"], standalone_mode=False)
    with pytest.raises(click.exceptions.UsageError):  # typer's own BadParameter is one
        cmd.main(["one", "x"], standalone_mode=False)
    with pytest.raises(click.exceptions.ClickException, match="got 3"):
        cmd.main(["one", "3"], standalone_mode=False)
    assert issubclass(typer.BadParameter, click.exceptions.UsageError)
    assert click.echo is typer.echo


def test_the_cli_turns_them_into_one_error_line():
    from causalattn.cli import app

    r = CliRunner().invoke(app, ["masks", "--no-such-flag"])
    assert r.exit_code == 2
    assert r.output.splitlines()[0].startswith("error: "), r.output


def test_internals_import_only_their_own_library():
    import causalattn._internals as pkg

    allowed = {"typer.py": {"__future__", "typer", "click"}, "transformers.py": {"__future__"}}
    allowed["__init__.py"] = set()
    for path in Path(pkg.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert {m.split(".")[0] for m in names} <= allowed[path.name], (path.name, names)


def test_the_attention_implementation_reads_what_set_attn_implementation_set():
    pytest.importorskip("transformers")
    import _hf_tiny as tiny

    from causalattn._internals.transformers import attn_implementation

    model = tiny.model("llama", impl="eager")
    assert attn_implementation(model) == "eager"
    model.set_attn_implementation("sdpa")
    assert attn_implementation(model) == "sdpa"
    model.set_attn_implementation("eager")
    assert attn_implementation(model) == "eager"
