"""The score_mod rows of ``causalattn bench patterns``: relative bias, ALiBi and softcap
written as score_mods on the native engine (their traced programs) at GPT-2 small
(4, 12, 1024, 64), fp32, against plain cpp and against the same modifier as a keyword
(``rel_bias=``, ``alibi_slopes=``, ``softcap=``), all timed in alternation in one run; the
tables learned (requiring a gradient) in fwd+bwd.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from . import show
from .timing import median_ms, median_ratio, paired_times, reps_for

SHAPE = (4, 12, 1024, 64)
PLAIN = "cpp"
# score_mod / plain cpp, by pass
LIMITS = {"fwd": 1.5, "fwd+bwd": 2.0}
FORMS = ("relative bias", "alibi", "softcap")
KEYWORD = {"relative bias": "rel_bias=", "alibi": "alibi_slopes=", "softcap": "softcap="}


def _calls(pass_: str, shape=SHAPE) -> dict[str, Callable]:
    import causalattn as ca

    B, H, T, d = shape
    g = torch.Generator().manual_seed(0)
    grad = pass_ == "fwd+bwd"
    q, k, v = (torch.randn(B, H, T, d, generator=g).requires_grad_(grad) for _ in range(3))
    rel = (0.1 * torch.randn(H, 2 * T - 1, generator=g)).requires_grad_(grad)
    slopes = torch.tensor([2.0 ** (-8 * (i + 1) / H) for i in range(H)]).requires_grad_(grad)
    cap = 30.0
    c = T - 1

    def rel_mod(s, b, h, q_idx, kv_idx):
        return s + rel[h, kv_idx - q_idx + c]

    def alibi_mod(s, b, h, q_idx, kv_idx):
        return s - slopes[h] * (q_idx - kv_idx).abs()

    def softcap_mod(s, b, h, q_idx, kv_idx):
        return cap * torch.tanh(s / cap)

    forms = {
        PLAIN: ({}, ()),
        "cpp score_mod relative bias": ({"score_mod": rel_mod}, (rel,)),
        "cpp rel_bias=": ({"rel_bias": rel}, (rel,)),
        "cpp score_mod alibi": ({"score_mod": alibi_mod}, (slopes,)),
        "cpp alibi_slopes=": ({"alibi_slopes": slopes}, (slopes,)),
        "cpp score_mod softcap": ({"score_mod": softcap_mod}, ()),
        "cpp softcap=": ({"softcap": cap}, ()),
    }

    def call(kw, extra):
        if not grad:
            return lambda: ca.attention(q, k, v, engine="cpp", **kw)
        leaves = (q, k, v, *extra)

        def run():
            out = ca.attention(q, k, v, engine="cpp", **kw)
            return torch.autograd.grad(out.sum(), leaves)

        return run

    return {name: call(kw, extra) for name, (kw, extra) in forms.items()}


def _peers(name: str) -> tuple[str, ...]:
    for form, kw in KEYWORD.items():
        if name == f"cpp score_mod {form}":
            return (PLAIN, f"cpp {kw}")
    return (PLAIN,)


def run(quick: bool = False, show_progress: bool = True) -> list[dict]:
    """The rows (fwd, and fwd+bwd unless quick); none where the native engine is not built."""
    import time

    from ..engines import cpp

    if cpp.unavailable():
        return []
    rows = []
    passes = ("fwd",) if quick else ("fwd", "fwd+bwd")
    with show.progress(show_progress) as prog:
        task = prog.add_task("score_mods", total=len(passes))
        for pass_ in passes:
            fns = _calls(pass_)
            t0 = time.perf_counter()
            for fn in fns.values():  # warm-up (the programs traced), and one round's cost
                fn()
            reps = reps_for(time.perf_counter() - t0, 4 if quick else 30, lo=3, hi=15)
            times = paired_times(fns, reps=reps, warmup=0)
            for name, ts in times.items():
                rows.append(
                    {
                        "case": "score_mod",
                        "shape": list(SHAPE),
                        "dtype": "float32",
                        "pass": pass_,
                        "engine": name,
                        "ms": round(median_ms(ts), 2),
                        # this engine's time / the peer's (< 1 faster than the peer)
                        "vs": {
                            p: round(median_ratio(ts, times[p]), 3)
                            for p in _peers(name)
                            if p != name
                        },
                        "reps": len(ts),
                        "note": "vs: this row's time / the peer's, paired",
                    }
                )
            prog.advance(task)
    return rows


def targets(rows: list[dict]) -> list[tuple[str, bool | None, str]]:
    """score_mod / plain cpp within :data:`LIMITS`; the keyword forms reported beside."""
    out = []
    for r in rows:
        if not r["engine"].startswith("cpp score_mod"):
            continue
        x = r["vs"].get(PLAIN)
        lim = LIMITS[r["pass"]]
        ok = None if x is None or math.isnan(x) else x <= lim
        out.append((f"{r['engine']} {r['pass']} <= {lim}x plain cpp", ok, f"{x}x"))
    return out


def render(rows: list[dict], console=None) -> None:
    columns = ("case", "shape", "pass", "engine", "ms", "time / peer's")
    t = show.table(
        f"causalattn score_mod benchmark ({torch.get_num_threads()} threads)",
        columns,
        left=[c for c in columns if c != "ms"],
    )
    for r in rows:
        vs = ", ".join(f"{x:.2f}x {p}" for p, x in r["vs"].items()) or "(peer)"
        t.add_row(r["case"], "x".join(map(str, r["shape"])), r["pass"], r["engine"],
                  f"{r['ms']:.1f}", vs)  # fmt: skip
    console = show.print_table(t, console)
    show.print_targets(console, "issue's bars (score_mod on cpp)", targets(rows))
