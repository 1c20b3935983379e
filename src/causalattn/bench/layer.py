"""The whole layer: CausalSelfAttention forward and forward+backward, ours against the same layer on
SDPA.

GPT-2 small by default: x ``(4, 1024, 768)``, 12 heads of d_k = 64, fp32 on the CPU. Both
layers hold the same weights and differ only in ``engine`` ("auto", the tiled engine on
CPU, against "sdpa"); calls alternate (:mod:`causalattn.bench.timing`) and the ratio is
the median of the paired ratios, measured in the same run. GFLOP/s count the whole layer:
the four projections (2·m·n·k each, backward 2× the forward) plus attention by
docs/design.md's convention (4·B·H·T²·d halved for causal, backward 2.5× the forward).
"""

from __future__ import annotations

import copy
import time

import torch

from ..shapes import BACKWARD_FACTOR, score_flops
from . import show
from .timing import median_ms, median_ratio, paired_times, peak_extra_mib, reps_for


def layer_flops(
    B: int, T: int, d_model: int, n_heads: int, d_k: int, d_v: int, pass_: str
) -> float:
    """FLOPs of one layer call: projections X W_Q, X W_K, X W_V, H W_O plus causal attention."""
    proj = 2 * B * T * d_model * n_heads * (2 * d_k + d_v) + 2 * B * T * n_heads * d_v * d_model
    attn = score_flops(B * n_heads * T * T / 2, d_k, d_v)  # causal: half the entries
    return proj + attn if pass_ == "fwd" else 3 * proj + (1 + BACKWARD_FACTOR) * attn


def _time(fns: dict, budget_s: float):
    """Peak memory and warm-up in one call each, then alternating rounds within the budget."""
    mem, secs = {}, {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        mem[name], _ = peak_extra_mib(fn)
        secs[name] = time.perf_counter() - t0
    reps = reps_for(sum(secs.values()), budget_s)
    return paired_times(fns, reps=reps, warmup=0), mem


def run(
    B: int = 4,
    T: int = 1024,
    d_model: int = 768,
    n_heads: int = 12,
    *,
    dtype: torch.dtype = torch.float32,
    engine: str = "auto",
    budget_s: float = 20.0,
    passes: tuple[str, ...] = ("fwd", "fwd+bwd"),
) -> list[dict]:
    """Time the layer on ``engine`` against the same layer on SDPA; returns one row per (pass,
    engine)."""
    from ..engines import make_problem, pick_engine
    from ..layer import CausalSelfAttention

    torch.manual_seed(0)
    ours = CausalSelfAttention(d_model, n_heads, engine=engine, dtype=dtype)
    peer = copy.deepcopy(ours)
    peer.engine = "sdpa"
    x = torch.randn(B, T, d_model, dtype=dtype, requires_grad=True)
    grad = torch.randn(B, T, d_model, dtype=dtype)
    h, dk = n_heads, ours.d_k
    probe = torch.empty(B, h, T, dk, dtype=dtype)
    name = (
        engine if engine != "auto" else f"auto ({pick_engine(make_problem(probe, probe, probe))})"
    )

    # same weights, same x: the two layers must agree before their times mean anything
    with torch.no_grad():
        diff = (ours(x) - peer(x)).abs().max().item()

    def fwd(layer):
        def call():
            with torch.no_grad():
                layer(x)

        return call

    def fwd_bwd(layer):
        def call():
            layer.zero_grad(set_to_none=True)
            x.grad = None
            layer(x).backward(grad)

        return call

    rows = []
    for pass_ in passes:
        make = fwd if pass_ == "fwd" else fwd_bwd
        flops = layer_flops(B, T, d_model, h, dk, ours.d_v, pass_)
        times, mem = _time({name: make(ours), "sdpa": make(peer)}, budget_s)
        for eng, ts in times.items():
            ms = median_ms(ts)
            rows.append(
                {
                    "case": "layer gpt2-small"
                    if (B, T, d_model, h) == (4, 1024, 768, 12)
                    else "layer",
                    "shape": [B, T, d_model, h],
                    "dtype": str(dtype).replace("torch.", ""),
                    "pass": pass_,
                    "engine": eng,
                    "ms": round(ms, 3),  # a small layer runs in tens of µs: 0.1 ms would read 0
                    "gflops": round(flops / (ms / 1000) / 1e9, 1),
                    "vs_sdpa": round(median_ratio(times["sdpa"], ts), 3),
                    "peak_extra_mib": None if mem[eng] is None else round(mem[eng], 1),
                    "reps": len(ts),
                    "max_abs_diff_vs_sdpa": diff,
                }
            )
    return rows


def render(rows: list[dict], console=None) -> None:
    """Print the rows as a rich table."""
    t = show.table(
        f"CausalSelfAttention, whole layer ({torch.get_num_threads()} threads, "
        f"torch {torch.__version__})",
        (
            "case",
            "B×T×d_model×h",
            "dtype",
            "pass",
            "engine",
            "ms",
            "GFLOP/s",
            "vs SDPA",
            "peak MiB",
            "reps",
        ),
        left=("case", "dtype", "pass", "engine"),
    )
    for r in rows:
        t.add_row(
            r["case"],
            "×".join(map(str, r["shape"])),
            r["dtype"],
            r["pass"],
            r["engine"],
            f"{r['ms']:.3f}",
            f"{r['gflops']:.1f}",
            f"{r['vs_sdpa']:.2f}",
            "-" if r["peak_extra_mib"] is None else f"{r['peak_extra_mib']:.1f}",
            str(r["reps"]),
        )
    console = show.print_table(t, console)
    if rows:
        console.print(
            "  vs SDPA: median of paired (SDPA time / this time), alternating calls; > 1 is "
            "faster. "
            f"Outputs agree to max|Δ| = {rows[0]['max_abs_diff_vs_sdpa']:.2g}."
        )
