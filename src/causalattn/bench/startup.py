"""The command line's start-up: how long the commands that compute nothing with torch take,
next to ``python -c "import torch"`` (``causalattn bench io``).

Each command runs as a user runs it, a fresh ``python -m causalattn.cli ...`` process with
its output sent to /dev/null, and the peer, ``python -c "import torch"``, runs in the same
round: one round runs the peer and the four commands once each, in an order rotated from
round to round, so drift on a busy machine reaches all five alike. Per command: the wall
time over the rounds (median, min-max) and its ratio to the peer's time in the same round
(median, min-max). The bar: each command in <= 25% of the peer's time, which it
can meet only by not importing torch (tests/cli/test_cli_startup.py pins that it does not).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from . import show

BAR = 0.25  # command wall time / `import torch` wall time, median over the rounds
PEER = "python -c 'import torch'"
COMMANDS = {  # name -> arguments of `causalattn`
    "causalattn --help": ["--help"],
    "causalattn shapes": ["shapes"],
    'causalattn masks "I love pizza"': ["masks", "I love pizza"],
    "causalattn learn --json": ["learn", "--json"],
}


def _argv(name: str) -> list[str]:
    if name == PEER:
        return [sys.executable, "-c", "import torch"]
    return [sys.executable, "-m", "causalattn.cli", *COMMANDS[name]]


def _env() -> dict:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])  # the package this bench belongs to
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    return env


def _wall(name: str, env: dict, timeout: float) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(
        _argv(name),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        timeout=timeout,
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"bench io: {name} exited {proc.returncode}: {proc.stderr[-500:]}")
    return wall


def run(reps: int = 7, timeout: float = 120.0) -> list[dict]:
    """One row per command and one for the peer: wall seconds over ``reps`` rounds and each
    command's ratio to the peer in the same round, with whether the bar is met."""
    if reps < 1:
        raise ValueError(f"bench io: reps must be >= 1, got {reps}")
    env = _env()
    names = [PEER, *COMMANDS]
    walls: dict[str, list[float]] = {n: [] for n in names}
    _wall(PEER, env, timeout)  # warm the file cache once, untimed
    for r in range(reps):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            walls[name].append(_wall(name, env, timeout))
    rows = []
    for name in names:
        w = walls[name]
        row = {
            "case": name,
            "reps": reps,
            "wall_s": statistics.median(w),
            "wall_min_s": min(w),
            "wall_max_s": max(w),
        }
        if name != PEER:
            ratios = [a / b for a, b in zip(w, walls[PEER])]
            row.update(
                ratio=statistics.median(ratios),
                ratio_min=min(ratios),
                ratio_max=max(ratios),
                bar=BAR,
                meets_bar=statistics.median(ratios) <= BAR,
            )
        rows.append(row)
    return rows


def render(rows: list[dict], console=None) -> None:
    t = show.table(
        f"Start-up: fresh processes, {rows[0]['reps']} rounds in alternation with the peer",
        ("case", "wall s (median)", "wall s (min-max)", "/ import torch", "(min-max)", "met"),
        left=("case",),
    )
    for r in rows:
        peer = "ratio" not in r
        t.add_row(
            r["case"] + (" (peer)" if peer else ""),
            f"{r['wall_s']:.2f}",
            f"{r['wall_min_s']:.2f}-{r['wall_max_s']:.2f}",
            "" if peer else f"{r['ratio']:.0%}",
            "" if peer else f"{r['ratio_min']:.0%}-{r['ratio_max']:.0%}",
            "" if peer else ("yes" if r["meets_bar"] else "NO"),
        )
    console = show.print_table(t, console)
    console.print(
        f"  bar: each command in <= {BAR:.0%} of `import torch`'s time, median of the paired "
        "ratios in the same round."
    )
