"""The terminal front end of ``causalattn learn``: a question session and a grade, with rich.

Answers come from the keyboard, or one a line from a pipe (``printf '1\\n3\\n' | causalattn
learn``): a choice number (or letter), ``h`` for the hint, ``s`` to skip, ``q`` to stop.
Without a terminal the session never waits long: at the end of the input (or after
:data:`PIPE_WAIT_S` seconds with nothing on a pipe) the remaining questions are left
unanswered and the score is printed.
"""

from __future__ import annotations

import select
import sys
from dataclasses import dataclass

__all__ = ["Score", "run_quiz", "render_grade", "stdin_reader", "PIPE_WAIT_S"]

PIPE_WAIT_S = 10.0


@dataclass
class Score:
    right: int = 0
    wrong: int = 0
    skipped: int = 0
    total: int = 0

    def __str__(self) -> str:
        return (
            f"score: {self.right}/{self.total} right ({self.wrong} wrong, "
            f"{self.skipped} skipped or unanswered)"
        )


def stdin_reader(stream=None, console=None):
    """A ``read() -> str | None`` over stdin: a prompt on a terminal, else one line from the
    pipe (None at its end, or when nothing comes within :data:`PIPE_WAIT_S` seconds)."""
    stream = sys.stdin if stream is None else stream
    tty = stream is not None and not stream.closed and stream.isatty()

    def read(prompt: str):
        if stream is None or stream.closed:
            return None
        if tty and console is not None:
            try:
                return console.input(prompt)
            except EOFError:
                return None
        try:
            ready = select.select([stream], [], [], PIPE_WAIT_S)[0]
        except (OSError, ValueError, TypeError, AttributeError):  # no real descriptor
            ready = [stream]
        if not ready:
            return None
        line = stream.readline()
        if not line:
            return None
        if console is not None:
            console.print(f"{prompt}{line.strip()}", markup=False)
        return line

    return read


def _choice(raw: str, k: int) -> int | str | None:
    s = raw.strip().lower()
    if s in ("h", "?", "hint"):
        return "hint"
    if s in ("q", "quit", "exit"):
        return "quit"
    if s in ("", "s", "skip"):
        return "skip"
    if s.isdigit() and 1 <= int(s) <= k:
        return int(s) - 1
    if len(s) == 1 and "a" <= s < chr(ord("a") + k):
        return ord(s) - ord("a")
    return None


def run_quiz(qs: list[dict], console, read) -> Score:
    """Ask every question in ``qs`` on ``console``; ``read(prompt)`` returns a line or None."""
    from rich.markup import escape
    from rich.panel import Panel

    score = Score(total=len(qs))
    for n, q in enumerate(qs):
        k = len(q["choices"])
        body = (
            escape(q["prompt"])
            + "\n\n"
            + "\n".join(f"  [bold]{m + 1})[/bold] {escape(c)}" for m, c in enumerate(q["choices"]))
        )
        console.print(
            Panel(body, title=f"question {n + 1}/{len(qs)} · {q['kind']}", title_align="left")
        )
        picked, hinted = None, False
        for _ in range(20):  # a bad line asks again; a pipe of nonsense still ends
            raw = read(f"answer 1–{k} (h = hint, s = skip, q = quit): ")
            if raw is None:
                rest = len(qs) - n
                console.print(f"(no more answers: {rest} question(s) left unanswered)")
                score.skipped += rest
                console.print(str(score), style="bold")
                return score
            c = _choice(raw, k)
            if c == "hint":
                if not hinted:
                    console.print(f"hint: {q['hint']}", style="yellow", markup=False)
                hinted = True
                continue
            if c == "quit":
                score.skipped += len(qs) - n
                console.print(str(score), style="bold")
                return score
            if c is None:
                console.print(f"choose 1–{k}, h, s or q", style="dim")
                continue
            picked = c
            break
        if picked is None or picked == "skip":
            score.skipped += 1
            console.print(
                f"skipped: the answer is {q['answer'] + 1}) {q['choices'][q['answer']]}",
                markup=False,
            )
        elif picked == q["answer"]:
            score.right += 1
            console.print("✓ right", style="bold green")
        else:
            score.wrong += 1
            console.print(
                f"✗ not quite: the answer is {q['answer'] + 1}) {q['choices'][q['answer']]}",
                style="bold red",
                markup=False,
            )
        console.print(q["explanation"], markup=False)
        console.print()
    console.print(str(score), style="bold")
    return score


def render_grade(g, console) -> None:
    """A :class:`~causalattn.learn.grade.Grade` as a stage table, the pattern and the hint."""
    from rich.table import Table
    from rich.text import Text

    style = {"right": "bold green", "wrong": "bold red", "error": "bold red"}[g.status]
    head = {
        "right": "every stage is right",
        "wrong": "a stage is wrong",
        "error": "it could not run",
    }[g.status]
    console.print(Text(f"{g.exercise or 'exercise ?'} ({g.file}): {head}", style=style))
    if g.stages:
        t = Table(box=None, show_header=False, padding=(0, 1))
        marks = {"right": ("✓", "green"), "wrong": ("✗", "red"), "not graded": ("·", "dim")}
        for st in g.stages:
            m, s = marks[st["status"]]
            t.add_row(
                Text(m, style=s),
                Text(st["stage"], style="bold"),
                Text(st["name"]),
                Text(st["status"], style=s),
            )
        console.print(t)
    console.print(Text(g.message))
    if g.location:
        console.print(Text(f"at {g.location}", style="dim"))
    if g.pattern:
        console.print(Text(g.pattern["what"] + ":"))
        pics = []
        for title, cells in (("yours", g.pattern["measured"]), ("expected", g.pattern["expected"])):
            t = Table(
                title=title, box=None, show_header=False, padding=(0, 1), title_justify="left"
            )
            for row in cells:
                t.add_row(
                    *(
                        Text(c, style="green" if c == "0" else "dim" if c == "-∞" else "red")
                        for c in row
                    )
                )
            pics.append(t)
        from rich.columns import Columns

        console.print(Columns(pics, padding=(0, 4)))
    if g.hint:
        console.print(Text(f"hint: {g.hint}", style="yellow"))
    for a in g.also:  # every further fault measured, one line each
        console.print(Text(f"also wrong, stage {a['stage']}: {a['message']}", style="dim"))
