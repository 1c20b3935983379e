"""The Benchmarks page: tables and matplotlib plots from recorded `causalattn bench --json`.

docs/bench/*.json are the rows `causalattn bench <mode> --quick --json` printed, as they
came out; docs/bench/machine.json names the machine and the run. The docs hook calls
:func:`page` at every `make docs`; as a script, `python tools/bench_page.py OUT_DIR` writes
benchmarks.md's tables and the PNGs there.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "docs" / "bench"
SKIP = {"reps", "note"}  # columns the tables leave out (the notes go below, once a case)


def _fmt(value) -> str:
    if isinstance(value, list):
        return "×".join(str(v) for v in value)
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value).replace("|", "\\|")


def table(rows: list[dict]) -> str:
    """A Markdown table of the rows, with every key any row has (in first-seen order)."""
    keys = [k for r in rows for k in r if k not in SKIP]
    keys = list(dict.fromkeys(keys))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_fmt(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def flat(row: dict) -> dict:
    """A row with its nested ratios (``"vs": {"tiled": 2.0}``) as columns (``vs_tiled``)."""
    out = {}
    for key, value in row.items():
        if isinstance(value, dict):
            out.update({f"{key}_{sub}": v for sub, v in value.items()})
        else:
            out[key] = value
    return out


def _ratio(row: dict) -> tuple[str, float] | None:
    """The row's ratio to its peer: ``vs_sdpa`` where it has one, else its first ``vs_*``."""
    ratios = {k: v for k, v in row.items() if k.startswith("vs_") and isinstance(v, int | float)}
    if not ratios:
        return None
    key = "vs_sdpa" if "vs_sdpa" in ratios else next(iter(ratios))
    return key[3:], float(ratios[key])


def plot(rows: list[dict], title: str) -> bytes | None:
    """PNG bytes: each row's ratio to its peer (the peer's time over the row's), a bar each."""
    shown = [(r, _ratio(r)) for r in rows if _ratio(r) is not None]
    if not shown:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [
        " · ".join(str(r[k]) for k in ("case", "pass", "engine") if r.get(k) not in (None, ""))
        + f" (vs {peer})"
        for r, (peer, _) in shown
    ]
    fig, ax = plt.subplots(figsize=(8, 0.28 * len(shown) + 1.2), dpi=90)
    ax.barh(range(len(shown)), [x for _, (_, x) in shown], color="#4c72b0")
    ax.axvline(1.0, color="#333", linewidth=0.8)
    ax.set_yticks(range(len(shown)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("the peer's time / this row's time (> 1: faster than the peer)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def page(bench: Path = BENCH) -> tuple[str, dict[str, bytes]]:
    """(the Markdown of the recorded runs, {png name: bytes}) for benchmarks.md."""
    machine = json.loads((bench / "machine.json").read_text())
    parts = [
        f"Recorded on {machine['date']}: {machine['cpu']}, {machine['cores']} cores, "
        f"{machine['os']}, Python {machine['python']}, torch {machine['torch']}. "
        f"{machine['note']}.",
        "",
    ]
    images = {}
    for path in sorted(p for p in bench.glob("*.json") if p.name != "machine.json"):
        data = json.loads(path.read_text())
        # the CLI's JSON shape, {"command", "positions", "rows"}; a list: recorded before it
        rows = [flat(r) for r in (data["rows"] if isinstance(data, dict) else data)]
        mode = path.stem
        parts += [f"## `causalattn bench {mode} --quick --json`", ""]
        png = plot(rows, f"causalattn bench {mode} --quick")
        if png is not None:
            images[f"bench/{mode}.png"] = png
            parts += [f"![bench {mode}: each row's ratio to its peer](bench/{mode}.png)", ""]
        parts += [table(rows), ""]
        notes = dict.fromkeys((r.get("case", ""), r["note"]) for r in rows if r.get("note"))
        parts += [f"- {case}: {note}" for case, note in notes] + [""]
    return "\n".join(parts), images


if __name__ == "__main__":
    out = Path(sys.argv[1])
    text, images = page()
    (out / "bench").mkdir(parents=True, exist_ok=True)
    (out / "benchmarks_tables.md").write_text(text)
    for name, data in images.items():
        (out / name).write_bytes(data)
