"""The CPU benchmark: the native (cpp) and tiled engines against PyTorch's SDPA and naive
materialized attention, and what "auto" picks.

One table from one run. Every group (shape, pass) times its engines in alternation and
reports each one's median time, GFLOP/s (docs/design.md's convention: forward 4·B·H·T_q·T_k·d,
halved for square causal; forward+backward 3.5× that), the median paired ratio to SDPA
(SDPA's time / this engine's time), the ratio to this machine's fp32 GEMM rate for the
same matrices (a batched Q Kᵀ at most 2048 rows at a time, timed in the same alternation)
and the peak extra resident memory of one call (see :mod:`causalattn.bench.timing`).
"auto" is compared round by round with the fastest engine of its group. The full run also
times building the native engine from nothing (a fresh extension folder, in a subprocess).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..masks import Pattern, default_scale
from ..shapes import attention_flops
from . import show
from .timing import median_ms, median_ratio, paired_times, peak_extra_mib, reps_for

_GEMM_RATE: dict = {}  # (case, dtype) -> FLOP/s of the same Q Kᵀ, from the forward group
NAIVE_MAX_SCORES_MIB = 512  # naive attention materializes B·H·T² scores; skip it above this


@dataclass
class Case:
    name: str
    B: int
    H: int
    T: int
    d: int
    dtype: torch.dtype = torch.float32
    passes: tuple[str, ...] = ("fwd", "fwd+bwd")
    kind: str = "causal"  # causal | padded | decode | memory
    budget_s: float = 6.0  # timing budget per group (beyond warm-up)
    naive: bool = True  # also time naive materialized attention (where its scores fit)
    extra: dict = field(default_factory=dict)


def cases(quick: bool = False) -> list[Case]:
    if quick:
        return [
            Case("seed", 1, 1, 2048, 1000, passes=("fwd",), budget_s=2, naive=False),
            Case("gpt2-small", 4, 12, 1024, 64, budget_s=3, naive=False),
            Case(
                "padded", 8, 12, 1024, 64, kind="padded", passes=("fwd",), budget_s=3, naive=False
            ),
            Case("decode", 1, 12, 4096, 64, kind="decode", passes=("fwd",), budget_s=1),
            Case("one call", 1, 1, 8, 16, passes=("fwd",), budget_s=1, naive=False),
        ]
    return [
        Case("seed", 1, 1, 2048, 1000),
        Case("gpt2-small", 4, 12, 1024, 64),
        Case("gpt2-small", 4, 12, 1024, 64, dtype=torch.bfloat16),
        Case("long", 1, 8, 4096, 128, budget_s=12),
        Case("padded", 8, 12, 1024, 64, kind="padded"),
        Case("memory", 1, 1, 32768, 64, kind="memory", passes=("fwd+bwd",)),
        Case("decode", 1, 12, 4096, 64, kind="decode", passes=("fwd",)),
        Case("one call", 1, 1, 8, 16, naive=False, budget_s=2),
    ]


def flops_fwd(B: int, H: int, T_q: int, T_k: int, d: int, causal: bool = True) -> float:
    return float(attention_flops(T_q, d, H, B, causal, keys=T_k))


def _naive(q, k, v, allowed, scale):
    """Plain PyTorch: materialized scores, masked softmax, weighted values (in q's dtype)."""
    S = (q @ k.transpose(-1, -2)) * scale
    A = torch.softmax(S.masked_fill(~allowed, float("-inf")), dim=-1)
    return A.nan_to_num(0.0) @ v


def _lengths(B: int, T: int) -> list[int]:
    """Lengths spread evenly between 64 and T."""
    return [round(64 + (T - 64) * i / max(1, B - 1)) for i in range(B)]


def _fwd_bwd(f: Callable, inputs: list[torch.Tensor], g: torch.Tensor) -> Callable[[], None]:
    def reset():  # drop the last call's gradients (outside a memory measurement)
        for t in inputs:
            t.grad = None

    def run():
        reset()
        f().backward(g)

    run.reset = reset
    return run


def _group(case: Case, pass_: str) -> tuple[dict[str, Callable], dict]:
    """Engines to time for one (case, pass): name -> call, plus facts for the rows."""
    from ..engines import KVCache, attention, make_problem

    B, H, T, d, dt = case.B, case.H, case.T, case.d, case.dtype
    scale = default_scale(d)
    gen = torch.Generator().manual_seed(0)
    grad = pass_ == "fwd+bwd"

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dt).requires_grad_(grad)

    info = {"flops": flops_fwd(B, H, T, T, d), "note": ""}
    fns: dict[str, Callable] = {}
    if case.kind == "decode":
        cache = KVCache(capacity=2 * T)
        cache.append(rnd(B, H, T, d).detach(), rnd(B, H, T, d).detach())
        q1, k1, v1 = rnd(B, H, 1, d), rnd(B, H, 1, d), rnd(B, H, 1, d)
        full = [rnd(B, H, T, d) for _ in range(3)]

        def step(engine):
            def run():
                k, v = cache.append(k1, v1)
                return attention(q1, k, v, engine=engine)

            return run

        for name in (*_native(), "tiled", "sdpa", "auto"):
            fns[name] = step(name)
        fns["recompute"] = lambda: attention(*full, engine=_native()[0] if _native() else "tiled")
        info["flops"] = flops_fwd(B, H, 1, T, d, causal=False)
        info["flops_by"] = {"recompute": flops_fwd(B, H, T, T, d)}
        info["note"] = f"one new token against a {T}-token KV cache"
        info["shape"] = [B, H, 1, d]
        return fns, info

    q, k, v = rnd(B, H, T, d), rnd(B, H, T, d), rnd(B, H, T, d)
    g = torch.randn(B, H, T, d, generator=gen).to(dt)
    if case.kind == "padded":
        L = _lengths(B, T)
        lengths = torch.tensor(L)
        allowed = make_problem(q, k, v, lengths=lengths).allowed()  # (B, 1, T, T)
        # packed: the real tokens of every sequence, one after another
        packed = [
            torch.cat([t[b, :, : L[b]] for b in range(B)], dim=1)[None]
            .detach()
            .requires_grad_(grad)
            for t in (q, k, v)
        ]
        gp = torch.cat([g[b, :, : L[b]] for b in range(B)], dim=1)[None]
        cu = torch.tensor([0, *torch.tensor(L).cumsum(0).tolist()])
        pad = 1 - sum(L) / (B * T)
        info["note"] = f"lengths {min(L)}..{max(L)}, padding fraction {pad:.2f}"
        info["padding_fraction"] = pad

        def sdpa_masked():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
            return out.masked_fill(~allowed.any(-1, keepdim=True), 0.0)

        calls = {}
        for e in (*_native(), "tiled"):
            calls[f"{e} (lengths)"] = lambda e=e: attention(q, k, v, lengths=lengths, engine=e)
            calls[f"{e} (cu_seqlens)"] = lambda e=e: attention(*packed, cu_seqlens=cu, engine=e)
        calls["sdpa (bool mask)"] = sdpa_masked
        calls["auto (lengths)"] = lambda: attention(q, k, v, lengths=lengths)
        if case.naive and B * H * T * T * 4 / 2**20 <= NAIVE_MAX_SCORES_MIB:
            calls["naive (bool mask)"] = lambda: _naive(q, k, v, allowed, scale)
        if not grad:
            return calls, info
        for name, f in calls.items():
            if "cu_seqlens" in name:
                fns[name] = _fwd_bwd(f, packed, gp)
            else:
                fns[name] = _fwd_bwd(f, [q, k, v], g)
        return fns, info

    causal_mask = Pattern().allowed(1, 1, T, T, like=q)[0, 0]  # the one M
    calls = {e: (lambda e=e: attention(q, k, v, engine=e)) for e in (*_native(), "tiled")}
    calls["sdpa"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    calls["auto"] = lambda: attention(q, k, v)
    if case.name == "one call":  # the cost of a call: the tiled engine's Python is not the point
        calls.pop("tiled")
    if case.naive and case.kind != "memory" and B * H * T * T * 4 / 2**20 <= NAIVE_MAX_SCORES_MIB:
        calls["naive"] = lambda: _naive(q, k, v, causal_mask, scale)
    elif case.naive and case.kind != "memory":
        info["note"] = f"naive skipped: its scores alone are {B * H * T * T * 4 / 2**30:.1f} GiB"
    if case.kind == "memory":
        info["note"] = f"materialized scores would be {B * H * T * T * 4 / 2**30:.0f} GiB"
    if not grad:
        # the GEMM ceiling: this problem's Q Kᵀ in fp32, at most 2048 rows at a time
        t = min(T, 2048)
        a = torch.randn(B * H, t, d, generator=gen)
        b = torch.randn(B * H, d, t, generator=gen)
        calls["gemm"] = lambda: torch.bmm(a, b)
        info["gemm_flops"] = 2.0 * B * H * t * t * d
        return calls, info
    for name, f in calls.items():
        fns[name] = _fwd_bwd(f, [q, k, v], g)
    return fns, info


def _native() -> tuple[str, ...]:
    """("cpp",) where the native engine is built here, else () (its rows are left out)."""
    from ..engines import cpp

    return () if cpp.unavailable() else ("cpp",)


def _key(case: Case, pass_: str, engine: str) -> str:
    return f"{case.name}|{case.dtype}|{pass_}|{engine}"


def memory_table(quick: bool = False) -> dict[str, float | None]:
    """Peak extra MiB of one call of every engine in every group (run in a fresh process:
    it pins glibc's mmap threshold, which would slow the timed calls down)."""
    out = {}
    for c in cases(quick):
        for p in c.passes:
            fns, _ = _group(c, p)
            for name, fn in fns.items():
                if name != "gemm":
                    for other in fns.values():  # gradients freed inside would hide a peak
                        getattr(other, "reset", lambda: None)()
                    out[_key(c, p, name)] = peak_extra_mib(fn)[0]
    return out


def _memory_subprocess(quick: bool) -> dict[str, float | None]:
    cmd = [sys.executable, "-m", "causalattn.bench.cpu", "--memory"] + (
        ["--quick"] if quick else []
    )
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (subprocess.CalledProcessError, json.JSONDecodeError, IndexError):
        return {}


def _rows(case: Case, pass_: str, memory: dict) -> list[dict]:
    fns, info = _group(case, pass_)
    peer = next((n for n in fns if n.startswith("sdpa")), None)
    # naive attention churns gigabytes; in the same alternation its page faults and cache
    # misses land on the next engine, so it gets its own alternation with the peer
    naive = {n: f for n, f in fns.items() if n.startswith("naive")}
    main = {n: f for n, f in fns.items() if n not in naive}
    t0 = time.perf_counter()
    for fn in main.values():  # warm-up, and the cost of one round
        fn()
    per_round = time.perf_counter() - t0
    reps = 1 if case.kind == "memory" else reps_for(per_round, case.budget_s)
    times = paired_times(main, reps=reps, warmup=0)
    ratios = {n: median_ratio(times[peer], ts) for n, ts in times.items()} if peer else {}
    for n, f in naive.items():
        t = paired_times({"peer": main[peer], n: f}, reps=3, warmup=1)
        times[n] = t[n]
        ratios[n] = median_ratio(t["peer"], t[n])
    mem = {name: memory.get(_key(case, pass_, name)) for name in fns}
    mult = 3.5 if pass_ == "fwd+bwd" else 1.0
    key = (case.name, case.dtype)
    if "gemm" in times:
        _GEMM_RATE[key] = info["gemm_flops"] / (median_ms(times["gemm"]) / 1000)
    gemm_rate = _GEMM_RATE.get(key)
    shape = info.get("shape", [case.B, case.H, case.T, case.d])
    # auto against the fastest engine of the group, round by round (as called with lengths)
    best = [
        n for n in times if n.split(" (")[0] in ("cpp", "tiled", "sdpa") and "cu_seqlens" not in n
    ]
    auto = next((n for n in times if n.startswith("auto")), None)
    vs_best = None
    if auto and best:
        vs_best = median_ratio(
            [min(times[n][i] for n in best) for i in range(len(times[auto]))], times[auto]
        )
    rows = []
    for name, ts in times.items():
        if name == "gemm":
            continue
        ms = median_ms(ts)
        flops = info.get("flops_by", {}).get(name, info["flops"]) * mult
        gflops = flops / (ms / 1000) / 1e9
        row = {
            "case": case.name,
            "shape": [case.B, case.H, case.T, case.d] if name.endswith("recompute") else shape,
            "dtype": str(case.dtype).replace("torch.", ""),
            "pass": pass_,
            "engine": name,
            "ms": round(ms, 2),
            "gflops": round(gflops, 2),
            "vs_sdpa": round(ratios[name], 3) if peer else None,
            "vs_gemm": round(gflops * 1e9 / gemm_rate, 3) if gemm_rate else None,
            "peak_extra_mib": None if mem[name] is None else round(mem[name], 1),
            "reps": len(ts),
            "note": info["note"],
        }
        if case.kind == "decode" and name in ("cpp", "tiled"):
            row["recompute_over_decode"] = round(median_ratio(times["recompute"], ts), 1)
        if name == auto:
            row["vs_best"] = round(vs_best, 3)
        if case.kind == "padded":
            row["padding_fraction"] = round(info["padding_fraction"], 3)
        rows.append(row)
    return rows


def run(quick: bool = False, show_progress: bool = True) -> list[dict]:
    """Run the benchmark; a rich progress bar on stderr while it runs; returns the rows."""
    groups = [(c, p) for c in cases(quick) for p in c.passes]
    rows: list[dict] = []
    with show.progress(show_progress) as prog:
        task = prog.add_task("peak memory (a separate process)", total=len(groups) + 1)
        memory = _memory_subprocess(quick)
        prog.advance(task)
        for c, p in groups:
            prog.update(
                task, description=f"{c.name} {list((c.B, c.H, c.T, c.d))} {str(c.dtype)[6:]} {p}"
            )
            rows.extend(_rows(c, p, memory))
            prog.advance(task)
        if not quick:
            prog.update(task, description="building the native engine from nothing")
            rows.append(build_row())
    return rows


# Where the targets come from: the project's bars for the native CPU engine, set on a
# 2-core machine; another machine may reach or miss them for its own reasons.
TARGETS_FROM = "the project's bars for the native CPU engine, set on a 2-core machine"
BUILD_TARGET_S = 120.0


def targets(rows: list[dict]) -> list[tuple[str, bool | None, str]]:
    """The targets of :data:`TARGETS_FROM`, checked on these rows: (target, reached, the
    numbers)."""

    def find(case, engine, pass_="fwd", dtype="float32"):
        for r in rows:
            if (
                r["case"] == case
                and r["engine"] == engine
                and r["pass"] == pass_
                and r["dtype"] == dtype
            ):
                return r
        return None

    out = []
    for p in ("fwd", "fwd+bwd"):
        r = find("gpt2-small", "cpp", p)
        if r:
            out.append(
                (f"GPT-2 small {p}: cpp >= 1.2x SDPA", r["vs_sdpa"] >= 1.2, f"{r['vs_sdpa']:.2f}x")
            )
    r = find("long", "cpp")
    if r:
        out.append(
            ("(1, 8, 4096, 128) fwd: cpp >= 1.1x SDPA", r["vs_sdpa"] >= 1.1, f"{r['vs_sdpa']:.2f}x")
        )
    r = find("seed", "cpp")
    if r:
        ok = r["vs_sdpa"] >= 1.3 and (r["vs_gemm"] or 0) >= 0.8
        sgemm = _GEMM_RATE.get(("seed", torch.float32))
        rate = f", sgemm {sgemm / 1e9:.0f} GFLOP/s" if sgemm else ""
        out.append(
            (
                "seed (1, 1, 2048, 1000) fwd: cpp >= 1.3x SDPA and >= 80% of sgemm",
                ok,
                f"{r['vs_sdpa']:.2f}x SDPA, {r['vs_gemm'] or 0:.0%} of sgemm{rate}",
            )
        )
    for p in ("fwd", "fwd+bwd"):
        r = find("gpt2-small", "cpp", p, "bfloat16")
        if r:
            out.append(
                (
                    f"GPT-2 small bf16 {p}: cpp >= 1.0x SDPA bf16",
                    r["vs_sdpa"] >= 1.0,
                    f"{r['vs_sdpa']:.2f}x",
                )
            )
    r = find("decode", "cpp")
    if r:
        out.append(
            (
                "decode, 1 query vs 4096 keys: cpp >= 1.2x SDPA",
                r["vs_sdpa"] >= 1.2,
                f"{r['vs_sdpa']:.2f}x",
            )
        )
        out.append(
            (
                "decode: >= 20x faster than recomputing",
                r["recompute_over_decode"] >= 20,
                f"{r['recompute_over_decode']:.0f}x",
            )
        )
    for eng in ("cpp", "auto"):
        r = find("one call", eng)
        if r:
            out.append(
                (
                    f"one call (1, 1, 8, 16): {eng} <= 2x SDPA's time",
                    r["vs_sdpa"] >= 0.5,
                    f"{1 / r['vs_sdpa']:.2f}x SDPA's time",
                )
            )
    for p in ("fwd", "fwd+bwd"):
        for eng in ("cpp (lengths)", "cpp (cu_seqlens)"):
            r = find("padded", eng, p)
            if r:
                need = 1 / (1 - r["padding_fraction"])
                out.append(
                    (
                        f"padded {p} {eng} >= 1/(1-padding) = {need:.2f}x masked SDPA",
                        r["vs_sdpa"] >= need,
                        f"{r['vs_sdpa']:.2f}x",
                    )
                )
    for r in rows:
        if "vs_best" in r:
            out.append(
                (
                    f"{r['case']} {r['dtype']} {r['pass']}: auto >= 0.95x the fastest engine",
                    r["vs_best"] >= 0.95,
                    f"{r['vs_best']:.2f}x",
                )
            )
    r = find("memory", "cpp", "fwd+bwd")
    if r and r["peak_extra_mib"] is not None:
        out.append(
            (
                "T=32768 fwd+bwd: cpp < 100 MiB extra",
                r["peak_extra_mib"] < 100,
                f"{r['peak_extra_mib']:.1f} MiB",
            )
        )
    for r in rows:
        if r.get("case") == "build":
            out.append(
                (
                    f"building the native engine from nothing <= {BUILD_TARGET_S:.0f} s",
                    r["seconds"] is not None and r["seconds"] <= BUILD_TARGET_S,
                    "failed" if r["seconds"] is None else f"{r['seconds']:.0f} s",
                )
            )
    return out


def build_row() -> dict:
    """The native engine built from nothing: a subprocess with an empty extension folder."""
    from ..engines import cpp

    seconds, why = cpp.build_from_nothing()
    return {"case": "build", "engine": "cpp", "seconds": seconds, "note": why}


def render(rows: list[dict], console=None) -> None:
    """Print the table and the targets with rich."""
    t = show.table(
        f"causalattn CPU benchmark ({torch.get_num_threads()} threads, torch {torch.__version__})",
        (
            "case",
            "shape",
            "dtype",
            "pass",
            "engine",
            "ms",
            "GFLOP/s",
            "vs SDPA",
            "vs GEMM",
            "peak MiB",
        ),
        left=("case", "engine", "pass", "dtype"),
    )

    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    for r in rows:
        if r["case"] == "build":
            continue
        t.add_row(
            r["case"],
            "x".join(map(str, r["shape"])),
            r["dtype"],
            r["pass"],
            r["engine"],
            fmt(r["ms"], ".1f"),
            fmt(r["gflops"], ".1f"),
            fmt(r["vs_sdpa"], ".2f"),
            fmt(r["vs_gemm"], ".0%"),
            fmt(r["peak_extra_mib"], ".1f"),
        )
    console = show.print_table(t, console)
    notes = sorted({(r["case"], r["note"]) for r in rows if r["note"] and r["case"] != "build"})
    for case, note in notes:
        console.print(f"  {case}: {note}")
    for r in rows:
        if "recompute_over_decode" in r:
            console.print(
                f"  decode: recomputing the whole pass takes {r['recompute_over_decode']:.0f}x one "
                "decode step"
            )
    show.print_targets(console, TARGETS_FROM, targets(rows))


if __name__ == "__main__":  # the memory pass runs here, in a fresh process
    if "--memory" in sys.argv:
        print(json.dumps(memory_table(quick="--quick" in sys.argv)))
