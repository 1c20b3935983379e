"""This checkout's benchmarks against another commit's, paired in one run.

    python tools/bench_against.py REV [--modes cpu,patterns] [--rounds 2] [--full]

REV is checked out into a scratch worktree with its own extension folder (the native
engine builds there once). Then `causalattn bench MODE --quick --json` runs in the two
checkouts in alternation (old, new, new, old, ...), so drift hits both sides alike, and
each row's median time is compared: `new/old` above 1 is slower. Beside it, each row's own
in-run ratio to its peer (`vs_sdpa`, or the first of `vs`) on both sides, the figure that
drift cancels out of. Rows one side lacks are listed as such. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _key(row: dict) -> tuple:
    return (row.get("case"), tuple(row.get("shape") or ()), row.get("pass"), row.get("engine"))


def _peer(row: dict):
    if "vs_sdpa" in row:
        return row["vs_sdpa"]
    vs = row.get("vs") or {}
    return next(iter(vs.values()), None)


def _bench(tree: Path, mode: str, quick: bool) -> list[dict]:
    env = {
        **os.environ,
        "PYTHONPATH": str(tree / "src"),
        "TORCH_EXTENSIONS_DIR": str(tree / ".ext"),
    }
    argv = [sys.executable, "-m", "causalattn", "bench", mode, "--json"]
    res = subprocess.run(
        argv + (["--quick"] if quick else []),
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if res.returncode != 0:
        raise SystemExit(f"error: bench {mode} failed in {tree}: {res.stderr.strip()[-400:]}")
    out = json.loads(res.stdout)
    return out["rows"] if isinstance(out, dict) else out  # the CLI's document, or bare rows


def _median(runs: list[list[dict]]) -> dict:
    ms: dict = {}
    peer: dict = {}
    for rows in runs:
        for r in rows:
            if r.get("ms") is None:  # a row the peer cannot run (Flex's backward): no time
                continue
            ms.setdefault(_key(r), []).append(r["ms"])
            if _peer(r) is not None:
                peer.setdefault(_key(r), []).append(_peer(r))
    return {
        k: (statistics.median(v), statistics.median(peer[k]) if k in peer else None)
        for k, v in ms.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev")
    ap.add_argument("--modes", default="cpu,patterns")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--full", action="store_true", help="the full benches, not --quick")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(old), a.rev],
            check=True,
        )
        try:
            for mode in a.modes.split(","):
                runs: dict = {"old": [], "new": []}
                for i in range(a.rounds):
                    order = ("old", "new") if i % 2 == 0 else ("new", "old")
                    for side in order:
                        runs[side].append(_bench(old if side == "old" else ROOT, mode, not a.full))
                _print(mode, a.rev, _median(runs["old"]), _median(runs["new"]))
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False
            )


def _print(mode: str, rev: str, old: dict, new: dict) -> None:
    print(f"\n### bench {mode}: this checkout (new) against {rev} (old), medians\n")
    print("| case | shape | pass | engine | old ms | new ms | new/old | peer ratio old → new |")
    print("|---|---|---|---|---|---|---|---|")
    for k in list(old) + [k for k in new if k not in old]:
        case, shape, pas, engine = k
        o, n = old.get(k), new.get(k)
        cells = [str(case), "×".join(map(str, shape)), str(pas), str(engine)]
        if o and n:
            peer = f"{o[1]:.3g} → {n[1]:.3g}" if o[1] is not None and n[1] is not None else ""
            cells += [f"{o[0]:.3g}", f"{n[0]:.3g}", f"{n[0] / o[0]:.2f}", peer]
        else:
            cells += [f"{o[0]:.3g}" if o else "(none)", f"{n[0]:.3g}" if n else "(none)", "", ""]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
