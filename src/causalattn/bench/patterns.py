"""The pattern benchmark: what a window, packed documents, softcap,
sinks, ALiBi and dropout cost on the native (cpp) and tiled engines, each against its peer
in the same run.

Every group times its engines in alternation (:func:`causalattn.bench.timing.paired_times`)
and reports each engine's median time and the median paired ratio to each named peer
(peer time / this engine's time: > 1 means this engine is faster). fp32 throughout.

- window: (1, 8, T, 64), w = 512, T = 4096 and 16384: each engine vs SDPA with the
  equivalent dense boolean mask (SDPA cannot skip blocks: O(T²) work for O(T·w) cells).
- documents: 16 documents of random lengths packed into T = 8192 (1, 8, T, 64): each
  engine with ``cu_seqlens`` vs SDPA with the dense block-diagonal causal mask.
- softcap, sinks, ALiBi: GPT-2 small (4, 12, 1024, 64) vs the same engine without them.
- dropout p = 0.1: GPT-2 small fwd+bwd vs the same engine with p = 0, and vs SDPA with
  ``dropout_p = 0.1`` (on the CPU SDPA materializes the weights for dropout).
- mask_mod: a window w = 512 plus 16 packed documents at T = 8192 (1, 8, T, 64)
  written as a ``mask_mod`` vs the same written as keywords, on tiled and cpp, fwd and
  fwd+bwd, with each call's peak extra memory and the kept table's bytes (made in the
  warm-up: the steady state); and cpp's first call, a new rule each call (its table made
  inside the timing), vs the keywords' call.
- bias: GPT-2 small on cpp with a (1, H, T, T) ``bias`` and with a (H, 2T-1)
  ``rel_bias`` (learned in fwd+bwd) vs the same engine without.
- flex: causal, a window of 256 and 8 documents, each as a mask_mod at
  (1, 8, 4096, 64) forward, FlexAttention compiled on the CPU (its BlockMask made once,
  outside the timing) vs cpp (its table made in the warm-up); fwd+bwd, which Flex cannot
  run on the CPU, cpp's mask_mod vs the same rule as keywords.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..masks import default_scale
from . import show
from .timing import median_ms, median_ratio, paired_times, reps_for

WINDOW = 512
FLEX_RULES = ("causal", "window 256", "8 documents")  # against FlexAttention, each as a mask_mod
ENGINES = ("cpp", "tiled")  # timed in every group (cpp where the native engine is built)


@dataclass
class Group:
    case: str
    shape: tuple[int, int, int, int]
    pass_: str
    peers: tuple[str, ...]
    budget_s: float = 8.0
    min_reps: int = 3
    note: str = ""
    extra: dict = field(default_factory=dict)


def groups(quick: bool = False) -> list[Group]:
    """The groups, cheapest first (the T = 16384 window against SDPA takes minutes)."""
    gpt2 = (4, 12, 1024, 64)
    budget = 4 if quick else 10
    out = [
        Group("modifiers", gpt2, p, tuple(ENGINES), budget_s=budget)
        for p in (("fwd",) if quick else ("fwd", "fwd+bwd"))
    ]
    if _native():  # the biases on the native engine, learned in fwd+bwd
        out += [
            Group("bias", gpt2, p, ("cpp",), budget_s=budget)
            for p in (("fwd",) if quick else ("fwd", "fwd+bwd"))
        ]
    peers = (*(f"{e} p=0" for e in ENGINES), "sdpa p=0.1")
    out.append(Group("dropout", gpt2, "fwd+bwd", peers, budget_s=budget))
    for p in ("fwd",) if quick else ("fwd", "fwd+bwd"):
        out.append(Group("mask_mod", (1, 8, 8192, 64), p, _mod_peers(), budget_s=budget))
    if _native():
        for p in ("fwd",) if quick else ("fwd", "fwd+bwd"):
            for rule in FLEX_RULES:
                peer = f"flex {rule} (compiled, CPU)" if p == "fwd" else f"cpp (keywords {rule})"
                out.append(
                    Group(
                        "flex", (1, 8, 4096, 64), p, (peer,), budget_s=budget, extra={"rule": rule}
                    )
                )
    for p in ("fwd",) if quick else ("fwd", "fwd+bwd"):
        out.append(Group("documents", (1, 8, 8192, 64), p, ("sdpa (bool mask)",), budget_s=budget))
    for T in (4096,) if quick else (4096, 16384):
        for p in ("fwd",) if quick else ("fwd", "fwd+bwd"):
            # SDPA's fwd+bwd at T = 16384 takes minutes a call here: tiled alone there
            peers = () if (T, p) == (16384, "fwd+bwd") else ("sdpa (bool mask)",)
            out.append(
                Group(
                    "window",
                    (1, 8, T, 64),
                    p,
                    peers,
                    budget_s=budget,
                    min_reps=2 if T > 4096 else 3,
                )
            )
    return out


def _native() -> bool:
    from ..engines import cpp

    return not cpp.unavailable()


def _mod_peers() -> tuple[str, ...]:
    return ("tiled (keywords)",) + (("cpp (keywords)",) if _native() else ())


def _window_docs(T: int):
    """(keywords, the same rule as a mask_mod) for a window of WINDOW plus 16 documents."""
    lengths = _doc_lengths(T, 16)
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))

    def window_documents(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx > q_idx - WINDOW) & (doc[q_idx] == doc[kv_idx])

    return {"window": WINDOW, "cu_seqlens": cu}, window_documents


def _flex_rule(rule: str, T: int):
    """(keywords, the same rule as a mask_mod) for one of :data:`FLEX_RULES`."""
    if rule == "causal":

        def causal(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        return {}, causal
    if rule == "window 256":

        def window(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < 256)

        return {"window": 256}, window
    lengths = _doc_lengths(T, 8)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))

    def documents(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc[q_idx] == doc[kv_idx])

    return {"cu_seqlens": [0, *torch.tensor(lengths).cumsum(0).tolist()]}, documents


def _table_mib(fn) -> float:
    """The bytes of the tables kept for rule ``fn`` (its row forms), in MiB."""
    from ..masks_table import _KEPT

    per = _KEPT.get(fn) or {}
    return sum(f[4] for t, _ in per.values() for f in t.forms.values()) / 2**20


def _doc_lengths(T: int, n: int, seed: int = 0) -> list[int]:
    """n document lengths >= 16 summing to T, drawn at random (fixed seed)."""
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(((torch.randperm(T // 16 - 1, generator=g)[: n - 1] + 1) * 16).tolist())
    edges = [0, *cuts, T]
    return [b - a for a, b in zip(edges, edges[1:])]


def _calls(gr: Group) -> tuple[dict[str, Callable], dict]:
    """Engines to time for a group: name -> call, and facts for the rows."""
    from ..engines import attention
    from ..masks import Pattern

    B, H, T, d = gr.shape
    grad = gr.pass_ == "fwd+bwd"
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, d, generator=gen).requires_grad_(grad) for _ in range(3))
    dout = torch.randn(B, H, T, d, generator=gen)
    scale = default_scale(d)
    info: dict = {"note": gr.note}
    learned: tuple = ()  # pattern tensors that take a gradient too

    from ..engines import cpp

    engines = [e for e in ENGINES if e != "cpp" or not cpp.unavailable()]

    def on(engine, **kw):
        return lambda: attention(q, k, v, engine=engine, **kw)

    def sdpa_masked(allowed, **kw):
        def run():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, **kw)
            return out.masked_fill(~allowed.any(-1, keepdim=True), 0.0)

        return run

    if gr.case == "window":
        allowed = Pattern(window=WINDOW).allowed(B, H, T, T, like=q)
        calls = {f"{e} (window {WINDOW})": on(e, window=WINDOW) for e in engines}
        if gr.peers:
            calls["sdpa (bool mask)"] = sdpa_masked(allowed)
        info["note"] = f"w = {WINDOW}: readable cells {T * WINDOW / (T * T / 2):.0%} of causal"
    elif gr.case == "documents":
        lengths = _doc_lengths(T, 16)
        cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        allowed = Pattern(cu_seqlens=cu).allowed(B, H, T, T, like=q)
        calls = {f"{e} (cu_seqlens)": on(e, cu_seqlens=cu) for e in engines}
        calls["sdpa (bool mask)"] = sdpa_masked(allowed)
        readable = sum(L * (L + 1) / 2 for L in lengths)
        info["causal_over_readable"] = (T * (T + 1) / 2) / readable
        info["note"] = (
            f"16 documents, lengths {min(lengths)}..{max(lengths)}: dense causal "
            f"work / readable work = {info['causal_over_readable']:.1f}"
        )
    elif gr.case == "modifiers":
        slopes = torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)])
        sinks = torch.randn(H, generator=gen)
        calls = {}
        for e in engines:
            calls[e] = on(e)
            calls[f"{e} (softcap 30)"] = on(e, softcap=30.0)
            calls[f"{e} (sinks)"] = on(e, sinks=sinks)
            calls[f"{e} (ALiBi)"] = on(e, alibi_slopes=slopes)
    elif gr.case == "bias":  # (1, H, T, T) and (H, 2T - 1), learned when timed with a backward
        bias = torch.randn(1, H, T, T, generator=gen).requires_grad_(grad)
        rel = torch.randn(H, 2 * T - 1, generator=gen).requires_grad_(grad)
        learned = (bias, rel)
        calls = {
            "cpp": on("cpp"),
            "cpp (bias)": on("cpp", bias=bias),
            "cpp (rel_bias)": on("cpp", rel_bias=rel),
        }
        info["note"] = "bias (1, H, T, T), rel_bias (H, 2T-1); learned in fwd+bwd"
    elif gr.case == "mask_mod":
        kw, fn = _window_docs(T)
        calls = {}
        for e in ("tiled", "cpp") if _native() else ("tiled",):
            calls[f"{e} (mask_mod)"] = lambda e=e: attention(
                q, k, v, engine=e, causal=False, mask_mod=fn
            )
            calls[f"{e} (keywords)"] = lambda e=e: attention(q, k, v, engine=e, **kw)
        if _native():

            def first_call():  # a new rule (a new closure): a new table, made in the call
                return attention(q, k, v, engine="cpp", causal=False, mask_mod=_window_docs(T)[1])

            calls["cpp (mask_mod, first call)"] = first_call
        info["note"] = (
            f"window {WINDOW} + 16 documents; the mask_mod's table made in the warm-up "
            "(the first call row: made in every call)"
        )
        info["memory"] = True
        info["table_mib"] = {"cpp (mask_mod)": lambda: _table_mib(fn)}
    elif gr.case == "flex":
        rule = gr.extra["rule"]
        kw, fn = _flex_rule(rule, T)
        calls = {
            f"cpp (mask_mod {rule})": lambda: attention(
                q, k, v, engine="cpp", causal=False, mask_mod=fn
            )
        }
        if grad:
            calls[f"cpp (keywords {rule})"] = lambda: attention(q, k, v, engine="cpp", **kw)
            info["note"] = "fwd+bwd: FlexAttention does not support backward on the CPU"
        else:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            bm = create_block_mask(fn, None, None, T, T, device="cpu")
            flex = torch.compile(flex_attention, dynamic=False)
            calls[f"flex {rule} (compiled, CPU)"] = lambda: flex(
                q, k, v, block_mask=bm, scale=scale
            )
            info["note"] = (
                "Flex's BlockMask and our table made once, outside the timing (in the warm-up)"
            )
    else:  # dropout
        calls = {}
        for e in engines:
            calls[f"{e} p=0.1"] = on(e, dropout_p=0.1, generator=torch.Generator().manual_seed(1))
            calls[f"{e} p=0"] = on(e)
        calls["sdpa p=0.1"] = lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, dropout_p=0.1
        )
        info["note"] = "SDPA draws its own dropout pattern (torch's RNG); ours is counter-based"
    if not grad:
        return calls, info

    def fwd_bwd(f):
        def run():
            for t in (q, k, v, *learned):
                t.grad = None
            f().backward(dout)

        return run

    return {n: fwd_bwd(f) for n, f in calls.items()}, info


def _rows(gr: Group) -> list[dict]:
    import time

    fns, info = _calls(gr)
    for fn in fns.values():  # warm-up: compiles, the tables made once
        fn()
    t0 = time.perf_counter()
    for fn in fns.values():  # the cost of one round, warm
        fn()
    reps = reps_for(time.perf_counter() - t0, gr.budget_s, lo=gr.min_reps, hi=9)
    times = paired_times(fns, reps=reps, warmup=0)
    peaks = {}
    if info.get("memory"):
        from .timing import peak_extra_mib

        peaks = {name: peak_extra_mib(fn)[0] for name, fn in fns.items()}
    rows = []
    tables = {name: f() for name, f in info.get("table_mib", {}).items()}
    if gr.case == "flex" and gr.pass_ == "fwd+bwd":  # the row Flex cannot run
        rows.append(
            {
                "case": "flex",
                "shape": list(gr.shape),
                "dtype": "float32",
                "pass": "fwd+bwd",
                "engine": f"flex {gr.extra['rule']} (compiled, CPU)",
                "ms": None,
                "vs": {},
                "reps": 0,
                "note": "FlexAttention does not support backward on CPU",
            }
        )
    for name, ts in times.items():
        rows.append(
            {
                "case": gr.case,
                "shape": list(gr.shape),
                "dtype": "float32",
                "pass": gr.pass_,
                "engine": name,
                "ms": round(median_ms(ts), 2),
                "vs": {
                    peer: round(median_ratio(times[peer], ts), 3)
                    for peer in gr.peers
                    if peer != name and peer in times
                },
                "reps": len(ts),
                "note": info["note"],
                **({"peak_mib": round(peaks[name], 1)} if peaks.get(name) is not None else {}),
                **({"table_mib": round(tables[name], 3)} if name in tables else {}),
                **(
                    {"causal_over_readable": round(info["causal_over_readable"], 2)}
                    if "causal_over_readable" in info
                    else {}
                ),
            }
        )
    return rows


def run(quick: bool = False, show_progress: bool = True) -> list[dict]:
    """Run every group; a rich progress bar on stderr; returns the rows."""
    gs = groups(quick)
    rows: list[dict] = []
    with show.progress(show_progress) as prog:
        task = prog.add_task("patterns", total=len(gs))
        for gr in gs:
            prog.update(task, description=f"{gr.case} {list(gr.shape)} {gr.pass_}")
            rows.extend(_rows(gr))
            prog.advance(task)
    from . import score_mods  # its own rows (case "score_mod"), its own table

    return rows + score_mods.run(quick, show_progress)


def _find(rows, case, engine, pass_, T=None):
    for r in rows:
        if (r["case"], r["engine"], r["pass"]) == (case, engine, pass_) and (
            T is None or r["shape"][2] == T
        ):
            return r
    return None


# Where the targets come from: the project's own bars for the native engine and for the
# tiled engine (patterns, modifiers, dropout, mask_mod, Flex, biases), set on a 2-core machine.
TARGETS_FROM = "the project's bars for cpp and tiled, set on a 2-core machine"
LIMITS = {  # engine -> (window speed-up vs SDPA at T=16384, documents' share of the work
    # ratio, modifier cost, dropout cost)
    "cpp": (20.0, 0.9, 1.1, 1.2),
    "tiled": (4.0, 0.8, 1.15, 1.3),
}


def targets(rows: list[dict]) -> list[tuple[str, bool | None, str]]:
    """The targets of :data:`TARGETS_FROM`, checked on these rows: (target, reached or None
    for a figure only reported, the numbers)."""
    out = []
    for e, (win, docs, mods, drop) in LIMITS.items():
        w = f"{e} (window {WINDOW})"
        r16 = _find(rows, "window", w, "fwd", 16384)
        if r16 and "sdpa (bool mask)" in r16["vs"]:
            x = r16["vs"]["sdpa (bool mask)"]
            out.append(
                (f"window T=16384 fwd: {e} >= {win:g}x SDPA (bool mask)", x >= win, f"{x:.2f}x")
            )
        for p in ("fwd", "fwd+bwd"):
            r16, r4 = _find(rows, "window", w, p, 16384), _find(rows, "window", w, p, 4096)
            if r16 and r4:
                g = r16["ms"] / r4["ms"]
                out.append(
                    (f"window {p}: {e} time T=4096 -> 16384 grows <= 5x", g <= 5, f"{g:.2f}x")
                )
        for p in ("fwd", "fwd+bwd"):
            r = _find(rows, "documents", f"{e} (cu_seqlens)", p)
            if r:
                need = docs * r["causal_over_readable"]
                x = r["vs"]["sdpa (bool mask)"]
                out.append(
                    (
                        f"documents {p}: {e} >= {docs:g} x causal/readable = {need:.1f}x SDPA",
                        x >= need,
                        f"{x:.2f}x",
                    )
                )
        for p in ("fwd", "fwd+bwd"):
            for mod in ("softcap 30", "sinks", "ALiBi"):
                r = _find(rows, "modifiers", f"{e} ({mod})", p)
                if r and e in r["vs"]:
                    cost = 1 / r["vs"][e]
                    out.append(
                        (f"{mod} {p}: {e} <= {mods:g}x without", cost <= mods, f"{cost:.2f}x")
                    )
        r = _find(rows, "dropout", f"{e} p=0.1", "fwd+bwd")
        if r:
            cost = 1 / r["vs"][f"{e} p=0"]
            out.append((f"dropout 0.1 fwd+bwd: {e} <= {drop:g}x p=0", cost <= drop, f"{cost:.2f}x"))
            x = r["vs"]["sdpa p=0.1"]
            out.append((f"dropout 0.1 fwd+bwd: {e} vs SDPA p=0.1 (report)", None, f"{x:.2f}x"))
    for p in ("fwd", "fwd+bwd"):
        for e in ("tiled", "cpp"):
            r = _find(rows, "mask_mod", f"{e} (mask_mod)", p)
            if r and f"{e} (keywords)" in r["vs"]:
                cost = 1 / r["vs"][f"{e} (keywords)"]
                mem = f", peak {r['peak_mib']:.0f} MiB" if "peak_mib" in r else ""
                out.append(
                    (
                        f"mask_mod window+documents T=8192 {e} {p}: <= 1.2x keywords",
                        cost <= 1.2,
                        f"{cost:.2f}x{mem}",
                    )
                )
    for p in ("fwd", "fwd+bwd"):
        for kind, bar in (("bias", 1.5), ("rel_bias", 1.2)):
            r = _find(rows, "bias", f"cpp ({kind})", p)
            if r and "cpp" in r["vs"]:
                cost = 1 / r["vs"]["cpp"]
                out.append((f"{kind} {p}: cpp <= {bar:g}x without", cost <= bar, f"{cost:.2f}x"))
    for p in ("fwd", "fwd+bwd"):
        r = _find(rows, "mask_mod", "cpp (mask_mod, first call)", p)
        if r and "cpp (keywords)" in r["vs"]:
            cost = 1 / r["vs"]["cpp (keywords)"]
            out.append(
                (
                    f"mask_mod window+documents T=8192 cpp {p}: first call <= 3x keywords",
                    cost <= 3,
                    f"{cost:.2f}x",
                )
            )
        r, kw = (
            _find(rows, "mask_mod", "cpp (mask_mod)", p),
            _find(rows, "mask_mod", "cpp (keywords)", p),
        )
        if r and kw and r.get("peak_mib") is not None and kw.get("peak_mib") is not None:
            extra = r["peak_mib"] - r.get("table_mib", 0.0)
            out.append(
                (
                    f"mask_mod cpp {p}: peak extra memory (table aside) <= 1.1x keywords'",
                    extra <= 1.1 * kw["peak_mib"] + 0.5,  # 0.5 MiB: the page-level noise
                    f"{r['peak_mib']:.1f} MiB (table {r.get('table_mib', 0.0):.2f}) vs "
                    f"{kw['peak_mib']:.1f} MiB",
                )
            )
    for rule in FLEX_RULES:
        r = _find(rows, "flex", f"cpp (mask_mod {rule})", "fwd")
        if r and f"flex {rule} (compiled, CPU)" in r["vs"]:
            x = r["vs"][f"flex {rule} (compiled, CPU)"]
            out.append(
                (f"flex T=4096 fwd {rule} as mask_mod: cpp >= 1.5x Flex", x >= 1.5, f"{x:.2f}x")
            )
        r = _find(rows, "flex", f"cpp (mask_mod {rule})", "fwd+bwd")
        if r:
            x = r["vs"].get(f"cpp (keywords {rule})")
            vs = f", {1 / x:.2f}x keywords" if x else ""
            out.append(
                (
                    f"flex T=4096 fwd+bwd {rule} as mask_mod: Flex cannot (CPU); cpp (report)",
                    None,
                    f"{r['ms']:.0f} ms{vs}",
                )
            )
    return out


def render(rows: list[dict], console=None) -> None:
    """Print the table and the targets with rich (the score_mod rows: their own table)."""
    from . import score_mods

    smod = [r for r in rows if r["case"] == "score_mod"]
    rows = [r for r in rows if r["case"] != "score_mod"]
    columns = ("case", "shape", "pass", "engine", "ms", "vs peers (peer time / this)")
    t = show.table(
        f"causalattn pattern benchmark ({torch.get_num_threads()} threads, "
        f"torch {torch.__version__})",
        columns,
        left=[c for c in columns if c != "ms"],
    )
    for r in rows:
        vs = ", ".join(f"{x:.2f}x {p}" for p, x in r["vs"].items()) or "(peer)"
        ms = "-" if r["ms"] is None else f"{r['ms']:.1f}"
        if "peak_mib" in r:
            vs += f"; peak {r['peak_mib']:.0f} MiB"
        t.add_row(r["case"], "x".join(map(str, r["shape"])), r["pass"], r["engine"], ms, vs)
    console = show.print_table(t, console)
    for case, note in sorted({(r["case"], r["note"]) for r in rows if r["note"]}):
        console.print(f"  {case}: {note}")
    show.print_targets(console, TARGETS_FROM, targets(rows))
    if smod:
        score_mods.render(smod, console)
