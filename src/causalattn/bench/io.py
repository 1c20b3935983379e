"""Huge input through the command line: time and peak memory (``causalattn bench --io``).

Each case runs the CLI in a fresh process (as a user would: Python, torch import and
all), with its output sent to a file, and reports the process's wall time, the time of
the command itself (after imports) and the process's peak resident memory (ru_maxrss).
The peer, measured in the same run and in alternation with every case, is the cheapest
command there is (``shapes --json``): what importing the package alone costs here.

Bars: a 100,000-word sentence to a ``masks --json`` summary in < 10 s and
< 1 GiB; 10,000 sentences to ``explore`` in < 20 s with a page < 20 MB; 2,048-token
sentences through both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from . import show

# The child: run the CLI in-process, then report its own figures to a side file.
_CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
from causalattn.cli import app
t1 = time.perf_counter()
rc = app(json.loads(sys.argv[1]), standalone_mode=False)
t2 = time.perf_counter()
with open(sys.argv[2], "w") as f:
    json.dump({"rc": rc, "import_s": t1 - t0, "command_s": t2 - t1,
               "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}, f)
"""

GiB = 2**30


def _corpus(folder: Path, rng) -> dict[str, Path]:
    words = np.array([f"w{k}" for k in range(5000)])
    files = {}
    files["huge"] = folder / "huge.txt"  # one sentence of 100,000 words
    files["huge"].write_text(" ".join(rng.choice(words, 100_000)) + "\n")
    files["many"] = folder / "many.txt"  # 10,000 sentences of 3..30 words
    files["many"].write_text(
        "\n".join(" ".join(rng.choice(words, rng.integers(3, 31))) for _ in range(10_000)) + "\n"
    )
    files["long"] = folder / "long.txt"  # 8 sentences of 2,048 tokens
    files["long"].write_text("\n".join(" ".join(rng.choice(words, 2048)) for _ in range(8)) + "\n")
    return files


def _cases(files: dict[str, Path], out: Path, quick: bool) -> list[dict]:
    cases = [
        {
            "case": "masks --json, 1 sentence of 100,000 words",
            "bar_s": 10.0,
            "bar_mib": 1024,
            "args": ["masks", "--file", str(files["huge"]), "--json"],
            "out": out / "huge.json",
        },
        {
            "case": "explore, 10,000 sentences of 3-30 words",
            "bar_s": 20.0,
            "bar_bytes": 20e6,
            "args": [
                "explore",
                "--file",
                str(files["many"]),
                "-o",
                str(out / "many.html"),
                "--json",
            ],
            "out": out / "many.out",
            "page": out / "many.html",
        },
        {
            "case": "masks --json, 8 sentences of 2,048 tokens",
            "bar_s": None,
            "bar_mib": 1024,
            "args": ["masks", "--file", str(files["long"]), "--json"],
            "out": out / "long.json",
        },
        {
            "case": "explore, 8 sentences of 2,048 tokens",
            "bar_s": None,
            "bar_mib": 1024,
            "args": [
                "explore",
                "--file",
                str(files["long"]),
                "-o",
                str(out / "long.html"),
                "--json",
            ],
            "out": out / "long.out",
            "page": out / "long.html",
        },
    ]
    return cases[:2] if quick else cases


def _run(args: list[str], out: Path, side: Path, timeout: float) -> dict:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])  # the package this bench belongs to
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    t0 = time.perf_counter()
    with open(out, "w") as fh:
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(args), str(side)],
            stdout=fh,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=timeout,
        )
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not side.exists():
        raise RuntimeError(f"bench --io: {' '.join(args[:1])} failed: {proc.stderr[-500:]}")
    figures = json.loads(side.read_text())
    side.unlink()
    return {"wall_s": wall, **figures}


def run(reps: int = 2, quick: bool = False, timeout: float = 300.0) -> list[dict]:
    """One row per case: median wall, command time and peak memory over ``reps`` runs,
    alternating with the peer (``shapes --json``), and whether each bar is met."""
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="causalattn-bench-io-") as tmp:
        folder = Path(tmp)
        files = _corpus(folder, rng)
        side = folder / "figures.json"
        for c in _cases(files, folder, quick):
            ours, peer = [], []
            for _ in range(reps):  # alternate: case, peer, case, peer
                ours.append(_run(c["args"], c["out"], side, timeout))
                peer.append(_run(["shapes", "--json"], folder / "peer.out", side, timeout))

            def med(runs, key):
                return float(np.median([r[key] for r in runs]))

            row = {
                "case": c["case"],
                "wall_s": med(ours, "wall_s"),
                "command_s": med(ours, "command_s"),
                "peak_mib": med(ours, "peak_mib"),
                "peer_wall_s": med(peer, "wall_s"),
                "peer_peak_mib": med(peer, "peak_mib"),
                "output_bytes": c["out"].stat().st_size,
                "reps": reps,
            }
            if "page" in c:
                row["page_bytes"] = c["page"].stat().st_size
                row["sentences_on_page"] = json.loads(c["out"].read_text())["sequences"]
            ok = []
            if c.get("bar_s"):
                ok.append(row["wall_s"] < c["bar_s"])
            if c.get("bar_mib"):
                ok.append(row["peak_mib"] < c["bar_mib"])
            if c.get("bar_bytes"):
                ok.append(row["page_bytes"] < c["bar_bytes"])
            row["bar"] = ", ".join(
                filter(
                    None,
                    [
                        f"< {c['bar_s']:.0f} s" if c.get("bar_s") else "",
                        f"< {c['bar_mib'] / 1024:.0f} GiB" if c.get("bar_mib") else "",
                        f"page < {c['bar_bytes'] / 1e6:.0f} MB" if c.get("bar_bytes") else "",
                    ],
                )
            )
            row["meets_bar"] = all(ok)
            rows.append(row)
    return rows


def render(rows: list[dict], console=None) -> None:
    t = show.table(
        "Huge input through the CLI: one fresh process per run (imports included)",
        (
            "case",
            "bar",
            "wall s",
            "command s",
            "peak MiB",
            "peer wall s",
            "peer MiB",
            "output",
            "page",
            "met",
        ),
        left=("case", "bar"),
    )
    for r in rows:
        page = (
            f"{r['page_bytes'] / 1e6:.1f} MB, {r['sentences_on_page']} sent."
            if "page_bytes" in r
            else ""
        )
        t.add_row(
            r["case"],
            r["bar"],
            f"{r['wall_s']:.1f}",
            f"{r['command_s']:.1f}",
            f"{r['peak_mib']:.0f}",
            f"{r['peer_wall_s']:.1f}",
            f"{r['peer_peak_mib']:.0f}",
            f"{r['output_bytes'] / 1e6:.1f} MB",
            page,
            "yes" if r["meets_bar"] else "NO",
        )
    console = show.print_table(t, console, width=160)
    console.print(
        "  peer: `causalattn shapes --json` in the same run, alternating (the cost of "
        "starting Python and importing the package); medians of the runs."
    )
