"""Sliding-window attention on one GPU: the Triton engine with ``window=w`` against SDPA with
the equivalent dense boolean mask, and against itself causal (issue 11's GPU row).

    PYTHONPATH=src python benchmarks/bench_window_gpu.py [--T 32768] [--window 4096] [--quick]

(``TRITON_INTERPRET=1 ... --device cpu --T 64 --window 16 --heads 1 --reps 1`` is a smoke
test of the script itself, on the CPU.)

Shape (1, 8, T, 128) bf16, causal + window (Hugging Face's ``sliding_window``). Forward and
forward+backward are timed in alternation (triton window, triton causal, SDPA masked, ...),
each call synchronized, and compared by the median of the paired ratios. The readable work
of a window is about (T·w - w²/2) / (T²/2) of causal, so a window that skips every
unreadable block runs about (T²/2) / (T·w - w²/2) times faster than causal (4.3× at
T = 32768, w = 4096). SDPA cannot skip anything with a dense mask (memory-efficient backend,
T² mask in memory). Accuracy: the accuracy rule against the float64 reference on a small
window problem (forward and gradients), and the largest difference to SDPA on the big one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from causalattn.engines import contract, make_problem
from causalattn.engines import exact as ref_engine
from causalattn.engines import triton as tri
from causalattn.masks import Pattern

DEV = "cuda"
DT = torch.bfloat16


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def _timed(fn) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def _alternate(fns: dict, reps: int) -> dict:
    """Seconds per call of each function, in alternation, after one warm-up call each."""
    for fn in fns.values():
        _timed(fn)
    times = {n: [] for n in fns}
    for _ in range(reps):
        for n, fn in fns.items():
            times[n].append(_timed(fn))
    return times


def _step(f, inputs, dO, backward: bool):
    def run():
        for t in inputs:
            t.grad = None
        out = f(*inputs)
        if backward:
            out.backward(dO)

    return run


def accuracy(w: int = 256, T: int = 2048) -> dict:
    """max error / bound of the accuracy rule on (1, 2, T, 64), window w: out, dQ, dK, dV."""
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (
        torch.randn(1, 2, T, 64, device=DEV, generator=g).to(DT).requires_grad_() for _ in range(3)
    )
    out = tri.forward(make_problem(q, k, v, window=w))
    dO = torch.randn(out.shape, device=DEV, generator=g).to(DT)
    out.backward(dO)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = ref_engine.forward(make_problem(q64, k64, v64, window=w))
    ref.backward(dO.double())
    qp, kp, vp = (t.detach().requires_grad_() for t in (q, k, v))
    plain = contract.plain(make_problem(qp, kp, vp, window=w), DT)  # the yardstick, in bf16
    plain.backward(dO)
    res = {}
    for name, got, want, base in (
        ("H", out, ref, plain),
        ("dQ", q.grad, q64.grad, qp.grad),
        ("dK", k.grad, k64.grad, kp.grad),
        ("dV", v.grad, v64.grad, vp.grad),
    ):
        err = (got.double() - want).abs().max().item()
        bound = 2 * (base.double() - want).abs().max().item() + 1e-3
        res[name] = (err, bound, err <= bound)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="T = 8192, window 1024")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    global DEV
    DEV = args.device
    T, w = (8192, 1024) if args.quick else (args.T, args.window)
    B, H, d = 1, args.heads, 128
    name = torch.cuda.get_device_name() if DEV == "cuda" else DEV
    print(
        f"device {name}, torch {torch.__version__}, shape ({B}, {H}, {T}, {d}) bf16, window {w}",
        flush=True,
    )
    T_acc, w_acc = min(T, 2048), min(w, 256)
    acc = accuracy(w_acc, T_acc)
    print(
        f"accuracy (1, 2, {T_acc}, 64) window {w_acc}, err / bound: "
        + ", ".join(
            f"{n} {e:.2e}/{b:.2e} {'ok' if ok else 'FAIL'}" for n, (e, b, ok) in acc.items()
        )
    )

    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (
        torch.randn(B, H, T, d, device=DEV, dtype=DT, generator=g).requires_grad_()
        for _ in range(3)
    )
    dO = torch.randn_like(q)
    allowed = Pattern(window=w).allowed(B, H, T, T, like=q)  # (1, 1, T, T) bool, T² bytes
    peers = {
        "triton window": lambda q, k, v: tri.forward(make_problem(q, k, v, window=w)),
        "triton causal": lambda q, k, v: tri.forward(make_problem(q, k, v)),
        "sdpa dense mask": lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed
        ),
    }
    with torch.no_grad():
        a = peers["triton window"](q, k, v)
        b = peers["sdpa dense mask"](q, k, v)
        diff = (a.float() - b.float()).abs().max().item()
    print(f"max |triton window - sdpa dense mask| = {diff:.3g} (bf16)")
    readable = (T * w - w * (w - 1) / 2) / (T * (T + 1) / 2)
    rows = []
    for backward in (False, True):
        fns = {n: _step(f, (q, k, v), dO, backward) for n, f in peers.items()}
        times = _alternate(fns, args.reps)
        ours = times["triton window"]
        ms = {n: 1000 * statistics.median(t) for n, t in times.items()}
        ratio = {n: statistics.median(p / o for p, o in zip(t, ours)) for n, t in times.items()}
        pass_ = "fwd+bwd" if backward else "fwd"
        rows.append({"pass": pass_, "ms": ms, "ratio_vs_window": ratio})
        print(
            f"{pass_:8s} " + "  ".join(f"{n} {ms[n]:.2f} ms (×{ratio[n]:.2f})" for n in ms),
            flush=True,
        )
    print(
        f"work: the window reads {readable:.3f} of causal's cells, so at most "
        f"×{1 / readable:.2f} faster than causal"
    )
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_window.json"), "w") as f:
            json.dump(
                {
                    "T": T,
                    "window": w,
                    "shape": [B, H, T, d],
                    "rows": rows,
                    "accuracy": acc,
                    "max_diff_vs_sdpa": diff,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
