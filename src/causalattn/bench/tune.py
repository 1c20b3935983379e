"""``causalattn bench tune``: measure which CPU engine "auto" should run, and store it.

For each tune case (dtype, mask kind, head size d, T, pass) the native engine (where it is
built), the tiled engine and the sdpa engine run through :func:`causalattn.attention` —
exactly what "auto" would call — timed in alternation; the fastest by median time wins.
The table (with its provenance: machine, threads, torch, date, command) goes to the user's
cache directory (:func:`causalattn.engines.auto.user_table_path`), where "auto" reads it
from then on (a table that timed the native engine decides for it too); the package ships
one made the same way without it (``engines/auto_table.json``: tiled against sdpa). The
cases include the shapes of ``causalattn bench``, so its "auto" rows run what was measured.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import show
from .timing import median_ms, median_ratio, paired_times, reps_for


@dataclass(frozen=True)
class TuneCase:
    dtype: str
    kind: str  # causal | padded | packed | decode
    B: int
    H: int
    T: int
    d: int
    passes: tuple[str, ...] = ("fwd", "fwd+bwd")


def cases() -> list[TuneCase]:
    """Shapes of ``causalattn bench`` (heads reduced where the ratio does not depend on
    them) and T points around them."""
    return [
        TuneCase("float32", "causal", 4, 12, 256, 64),
        TuneCase("float32", "causal", 4, 12, 1024, 64),
        TuneCase("float32", "causal", 1, 4, 4096, 64),
        TuneCase("float32", "causal", 1, 1, 32768, 64, passes=("fwd+bwd",)),
        TuneCase("bfloat16", "causal", 4, 12, 1024, 64),
        TuneCase("float32", "causal", 1, 8, 1024, 128),
        TuneCase("float32", "causal", 1, 2, 8192, 128),
        TuneCase("float32", "causal", 1, 1, 2048, 1000),
        TuneCase("float32", "padded", 8, 12, 1024, 64),
        TuneCase("float32", "packed", 8, 4, 1024, 64),
        TuneCase("float32", "decode", 1, 12, 4096, 64, passes=("fwd",)),
        TuneCase("float32", "decode", 1, 12, 512, 64, passes=("fwd",)),
    ]


def _lengths(B: int, T: int) -> list[int]:
    """As ``causalattn bench``'s padded case: lengths spread evenly between 64 and T."""
    return [round(64 + (T - 64) * i / max(1, B - 1)) for i in range(B)]


def _calls(c: TuneCase, pass_: str) -> dict:
    """engine -> a call of attention() on this case (forward, or forward and backward)."""
    from ..engines import attention

    gen = torch.Generator().manual_seed(0)
    dt = getattr(torch, c.dtype)
    grad = pass_ == "fwd+bwd"
    T_q = 1 if c.kind == "decode" else c.T
    kw: dict = {}
    B, T = c.B, c.T
    if c.kind == "padded":
        kw["lengths"] = torch.tensor(_lengths(B, T))
    if c.kind == "packed":  # the real tokens of the padded case, one after another
        L = _lengths(B, T)
        kw["cu_seqlens"] = torch.tensor([0, *torch.tensor(L).cumsum(0).tolist()])
        B, T, T_q = 1, sum(L), sum(L)

    def rnd(t):
        return torch.randn(B, c.H, t, c.d, generator=gen).to(dt).requires_grad_(grad)

    q, k, v = rnd(T_q), rnd(T), rnd(T)
    g = torch.randn(B, c.H, T_q, c.d, generator=gen).to(dt)

    def make(engine):
        def run():
            out = attention(q, k, v, engine=engine, **kw)
            if grad:
                for t in (q, k, v):
                    t.grad = None
                out.backward(g)

        return run

    from ..engines import cpp

    names = ("tiled", "sdpa") if cpp.unavailable() else ("cpp", "tiled", "sdpa")
    return {n: make(n) for n in names}


def measure(budget_s: float = 2.0, progress=None) -> list[dict]:
    """One entry per (case, pass): the winner, both medians and the paired ratio."""
    entries = []
    for c in cases():
        for pass_ in c.passes:
            fns = _calls(c, pass_)
            t0 = time.perf_counter()
            for fn in fns.values():  # warm-up, and the cost of one round
                fn()
            reps = reps_for(time.perf_counter() - t0, budget_s, lo=3, hi=9)
            times = paired_times(fns, reps=reps, warmup=0)
            ratio = median_ratio(times["sdpa"], times["tiled"])  # > 1: tiled faster
            ms = {n: median_ms(ts) for n, ts in times.items()}
            entries.append(
                {
                    "device": "cpu",
                    "dtype": c.dtype,
                    "kind": c.kind,
                    "d": c.d,
                    "T": c.T,
                    "pass": pass_,
                    "best": min(ms, key=ms.get),
                    "tiled_over_sdpa_speed": round(ratio, 3),
                    "ms": {n: round(median_ms(ts), 3) for n, ts in times.items()},
                    "shape": [c.B, c.H, c.T, c.d],
                    "reps": reps,
                }
            )
            if progress is not None:
                progress(entries[-1])
    return entries


def provenance() -> dict:
    return {
        "command": "causalattn bench tune",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def tune(out: Path | None = None, budget_s: float = 2.0, progress=None) -> tuple[Path, dict]:
    """Measure, write the table to ``out`` (default: the user's cache), make "auto" read it."""
    from ..engines import auto

    out = Path(out) if out is not None else auto.user_table_path()
    table = {"provenance": provenance(), "entries": measure(budget_s, progress)}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, indent=1) + "\n")
    tmp.replace(out)
    auto.table(reload=True)
    return out, table


def render(table: dict, path: Path, console=None) -> None:
    prov = table["provenance"]
    t = show.table(
        f"auto's table ({prov['threads']} threads, torch {prov['torch']}, {prov['date']})",
        (
            "dtype",
            "kind",
            "shape",
            "pass",
            "cpp ms",
            "tiled ms",
            "sdpa ms",
            "tiled/sdpa speed",
            "auto runs",
        ),
        left=("dtype", "kind", "shape", "pass", "auto runs"),
    )
    for e in table["entries"]:
        t.add_row(
            e["dtype"],
            e["kind"],
            "x".join(map(str, e["shape"])),
            e["pass"],
            f"{e['ms']['cpp']:.2f}" if "cpp" in e["ms"] else "-",
            f"{e['ms']['tiled']:.2f}",
            f"{e['ms']['sdpa']:.2f}",
            f"{e['tiled_over_sdpa_speed']:.2f}",
            e["best"],
        )
    console = show.print_table(t, console, width=120)
    console.print(f"wrote {path}; engine='auto' reads it (CAUSALATTN_ENGINE=name overrides)")
