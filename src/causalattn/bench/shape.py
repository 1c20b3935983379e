"""``causalattn bench shape B,H,T,d``: the engines on one causal shape, timed in alternation.

Every engine runs through :func:`causalattn.attention` (what ``engine="auto"`` would call),
in turn, round after round; each row is the engine's median time and the median over the
rounds of the peer's time over its own (> 1: faster than the peer). The "auto" row also
names the engine auto ran for this shape (:func:`causalattn.engines.auto.pick`).
"""

from __future__ import annotations

import time

import torch

from . import show
from .timing import median_ms, median_ratio, paired_times, reps_for

PASSES = ("fwd", "fwd+bwd")


def parse_shape(text: str) -> tuple[int, int, int, int]:
    """'1,4,256,64' -> (B, H, T, d); anything but four positive integers is a ValueError."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(
            f"shape: expected B,H,T,d (four positive integers, e.g. 1,4,256,64), got {text!r}"
        )
    B, H, T, d = (int(p) for p in parts)
    return B, H, T, d


def check_size(shape, pass_: str, dtype: str, max_bytes: int) -> None:
    """Refuse a shape whose tensors pass ``max_bytes``: q, k, v, the output gradient and an
    output per engine (their gradients too with a backward), in the timed dtype."""
    from ..text import check_bytes

    B, H, T, d = shape
    per = B * H * T * d * (2 if dtype == "bfloat16" else 4)
    n = 4 + len(default_engines()) + (4 if pass_ == "fwd+bwd" else 0)
    check_bytes(
        f"bench shape {B},{H},{T},{d}: its tensors",
        n * per,
        max_bytes,
        "time a smaller shape, or raise --max-bytes",
    )


def default_engines() -> tuple[str, ...]:
    """The engines ``causalattn bench`` times: cpp (where it is built), tiled, sdpa, auto."""
    from ..engines import cpp

    return (*(() if cpp.unavailable() else ("cpp",)), "tiled", "sdpa", "auto")


def check_engines(engines: tuple[str, ...], peer: str) -> None:
    """Known engine names, none twice, that run a plain causal call here (cpp built)."""
    from ..engines import ENGINES, cpp

    known = ("auto", *ENGINES)
    for e in (*engines, peer):
        if e not in known:
            raise ValueError(f"--engine: unknown engine {e!r}; choose from {', '.join(known)}")
    if len(set(engines)) != len(engines):
        raise ValueError(f"--engine: an engine given twice ({', '.join(engines)})")
    if "cpp" in (*engines, peer) and cpp.unavailable():
        raise ValueError(f"--engine cpp: the native engine is not built here: {cpp.unavailable()}")


def _calls(shape, engines, pass_: str, dtype: torch.dtype) -> dict:
    """engine -> one call of attention() at ``shape`` (forward, or forward and backward)."""
    from ..engines import attention

    B, H, T, d = shape
    gen = torch.Generator().manual_seed(0)
    grad = pass_ == "fwd+bwd"

    def rnd():
        return torch.randn(B, H, T, d, generator=gen).to(dtype).requires_grad_(grad)

    q, k, v = rnd(), rnd(), rnd()
    g = torch.randn(B, H, T, d, generator=gen).to(dtype)

    def make(engine):
        def run():
            out = attention(q, k, v, engine=engine)
            if grad:
                for t in (q, k, v):
                    t.grad = None
                out.backward(g)

        return run

    return {e: make(e) for e in engines}, (q, k, v)


def auto_pick(q, k, v, grad: bool) -> str:
    """The engine ``engine="auto"`` runs for a plain causal call on these tensors."""
    from ..engines import auto, registry

    return auto.pick(registry.features(q, k, v, tensors={}, grad=grad))


def run(
    shape: tuple[int, int, int, int],
    engines: tuple[str, ...] | None = None,
    peer: str = "sdpa",
    pass_: str = "fwd",
    dtype: str = "float32",
    budget_s: float = 4.0,
    reps: int | None = None,
) -> list[dict]:
    """One row per engine at ``shape``: median ms and the median paired ratio to ``peer``
    (timed in the same alternation, added to it when not among ``engines``)."""
    engines = tuple(engines or default_engines())
    check_engines(engines, peer)
    if pass_ not in PASSES:
        raise ValueError(f"--pass must be one of {', '.join(PASSES)}, got {pass_!r}")
    timed = engines if peer in engines else (*engines, peer)
    fns, (q, k, v) = _calls(shape, timed, pass_, getattr(torch, dtype))
    t0 = time.perf_counter()
    for fn in fns.values():  # warm-up (and the native engine's first load), one round's cost
        fn()
    if reps is None:
        reps = reps_for(time.perf_counter() - t0, budget_s, lo=5, hi=41)
    times = paired_times(fns, reps=reps, warmup=1)
    picked = auto_pick(q, k, v, pass_ == "fwd+bwd")
    rows = []
    for e in engines:
        row = {
            "shape": list(shape),
            "dtype": dtype,
            "pass": pass_,
            "engine": e,
            "ms": round(median_ms(times[e]), 3),
            "peer": peer,
            "vs_peer": round(median_ratio(times[peer], times[e]), 3),
            "reps": len(times[e]),
        }
        if e == "auto":
            row["picked"] = picked
        rows.append(row)
    return rows


def render(rows: list[dict], console=None) -> None:
    """The rows as a table: engine, ms, and the peer's time over the engine's."""
    r0 = rows[0]
    t = show.table(
        f"causalattn bench shape {','.join(map(str, r0['shape']))} {r0['dtype']} {r0['pass']} "
        f"({torch.get_num_threads()} threads, torch {torch.__version__}, {r0['reps']} rounds "
        "in alternation)",
        ("engine", "ms", f"{r0['peer']}'s time / this"),
        left=("engine",),
    )
    for r in rows:
        name = f"auto (ran {r['picked']})" if "picked" in r else r["engine"]
        t.add_row(name, f"{r['ms']:.3f}", f"{r['vs_peer']:.2f}")
    show.print_table(t, console)
