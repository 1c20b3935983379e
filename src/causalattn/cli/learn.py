"""``causalattn learn``: the chapter's check questions, exercise scaffolds, graded exercises."""

from __future__ import annotations

from pathlib import Path

import typer

from ..learn import exercises, grade, questions, session
from ._app import _fail, _library_errors, command_app
from ._options import _MaxMemory, _memory_bytes
from ._output import _console, _print_json

command = command_app()


@command.command("learn")
def learn(
    seed: int = typer.Option(0, "--seed", help="Seed of the question set (hand out the same one)."),
    n: int = typer.Option(None, "--n", "-n", help="Number of questions (default: one per kind)."),
    kind: list[str] = typer.Option(None, "--kind", help="Only these kinds (repeat; see --json)."),
    exercise: str = typer.Option(
        None, "--exercise", help="Write a scaffold: scores|mask|softmax|attention|multihead."
    ),
    output: Path = typer.Option(None, "--output", "-o", help="Scaffold path (default NAME.py)."),
    framework: str = typer.Option("numpy", "--framework", help="numpy | torch (the scaffold's)."),
    force: bool = typer.Option(False, "--force", help="Write the scaffold over an existing file."),
    check: Path = typer.Option(None, "--check", help="Grade a filled-in exercise (EXECUTES it)."),
    timeout: float = typer.Option(
        None, "--timeout", help="Seconds before --check stops the file (default 60)."
    ),
    max_memory: _MaxMemory = None,
    as_json: bool = typer.Option(False, "--json", help="The question bank (or the grade) as JSON."),
) -> None:
    """Check questions (answers from stdin or the keyboard), scaffolds, graded exercises.

    --check exits 0 when every stage is right, 1 when a stage is wrong, 2 when it could not run.
    """
    if (output is not None or force or framework != "numpy") and (exercise is None or check):
        _fail("--output, --framework and --force go with --exercise NAME (writing a scaffold)")
    if check is None and (timeout is not None or max_memory is not None):
        _fail("--timeout and --max-memory go with --check FILE (grading a file)")
    if check is not None:
        limit = 60.0 if timeout is None else timeout
        with _library_errors():
            g = grade.check(check, exercise, timeout=limit, max_memory=_memory_bytes(max_memory))
        if as_json:
            _print_json(g.to_dict())
        else:
            session.render_grade(g, _console())
        raise typer.Exit(g.exit_code)
    if exercise is not None:
        with _library_errors():
            p = exercises.write(exercise, output, framework, force=force)
        if as_json:
            _print_json({"exercise": exercise, "framework": framework, "output": str(p)})
            return
        typer.echo(f"wrote {p}: fill in the function, then run `causalattn learn --check {p}`")
        return
    with _library_errors():
        qs = questions(seed=seed, n=n, kinds=kind or None)
    if as_json:
        _print_json({"questions": qs})
        return
    console = _console()
    console.rule(f"causalattn learn: {len(qs)} question{'s' * (len(qs) != 1)} (seed {seed})")
    session.run_quiz(qs, console, session.stdin_reader(console=console))
