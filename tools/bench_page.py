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
SKIP = {"reps"}  # columns the tables leave out


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


def _ratio_key(rows: list[dict]) -> str | None:
    keys = [k for r in rows for k in r if k.startswith("vs_") and isinstance(r[k], int | float)]
    return max(set(keys), key=keys.count) if keys else None


def plot(rows: list[dict], title: str) -> bytes | None:
    """PNG bytes: each row's ratio to its peer (its most common ``vs_*`` column), by case."""
    key = _ratio_key(rows)
    if key is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if isinstance(r.get(key), int | float)]
    labels = [
        " · ".join(str(r[k]) for k in ("case", "pass", "engine") if r.get(k) not in (None, ""))
        for r in shown
    ]
    fig, ax = plt.subplots(figsize=(8, 0.28 * len(shown) + 1.2), dpi=90)
    ax.barh(range(len(shown)), [r[key] for r in shown], color="#4c72b0")
    ax.axvline(1.0, color="#333", linewidth=0.8)
    ax.set_yticks(range(len(shown)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel(f"{key}: its peer's time / this row's time (> 1: faster than the peer)")
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
        rows = json.loads(path.read_text())
        mode = path.stem
        parts += [f"## `causalattn bench {mode} --quick --json`", ""]
        png = plot(rows, f"causalattn bench {mode} --quick")
        if png is not None:
            images[f"bench/{mode}.png"] = png
            parts += [f"![bench {mode}: each row's ratio to its peer](bench/{mode}.png)", ""]
        parts += [table(rows), ""]
    return "\n".join(parts), images


if __name__ == "__main__":
    out = Path(sys.argv[1])
    text, images = page()
    (out / "bench").mkdir(parents=True, exist_ok=True)
    (out / "benchmarks_tables.md").write_text(text)
    for name, data in images.items():
        (out / name).write_bytes(data)
