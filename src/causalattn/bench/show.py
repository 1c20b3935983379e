"""How the benchmarks show themselves: a progress bar on stderr while they run, a rich
table that a pipe or file gets whole, and the targets with where they come from.
rich is imported only when something is shown."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def progress(show: bool):
    """A transient rich progress bar on stderr (description, bar, done/total, elapsed);
    ``show=False`` disables it. Use as a context manager."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=not show,
        transient=True,
    )


def table(title: str, columns: Sequence[str], left: Iterable[str]):
    """A rich Table with these columns: those in ``left`` left-justified, the rest right."""
    from rich.table import Table

    left = set(left)
    t = Table(title=title)
    for col in columns:
        t.add_column(col, justify="left" if col in left else "right")
    return t


def print_table(t, console=None, width: int = 150):
    """Print ``t`` on ``console`` (a new rich Console when None) and return the console. A
    pipe or file gets the whole table (at least ``width`` columns), not 80 squeezed ones."""
    from rich.console import Console

    console = console or Console()
    if not console.is_terminal:
        console.width = max(console.width, width)
    console.print(t)
    return console


def print_targets(console, source: str, targets) -> None:
    """The targets as ``(name, reached: True/False/None for a report only, numbers)``."""
    console.print(f"targets (from {source}):")
    for name, ok, nums in targets:
        tag = "[green]reached[/]" if ok else "[red]not yet[/]" if ok is False else "       "
        console.print(f"  {tag} {name}: {nums}")
