"""The GPU engine: fused Triton kernels for any head size 16..1024 (``engine="triton"``).

Every :class:`causalattn.masks.Pattern` runs here. Causal, window, chunk, prefix, lengths
and documents leave each query row one interval of keys
(:meth:`~causalattn.masks.Pattern.row_ranges`), so a window costs O(T·w), documents and
chunks the sum of their squares: key tiles every row may read run without a mask, only
the tiles at the edges (causal diagonal, window start, sequence start, length) are masked,
tiles nobody reads are never visited. A dense ``mask`` is the general fallback: a table
of each tile's kind, made on the host, skips the empty tiles and reads the mask only in
partial ones. Softcap and ALiBi modify the scores in the kernels, sinks join the
denominator, and dropout drops weights with :mod:`causalattn.dropout`'s counter-based hash
(the reference's pattern bit for bit, regenerated in the backward; no T×T mask is stored).

Forward: online softmax in fp32 (FlashAttention-2), one program per BLOCK_M query rows.
Backward by recomputation from the saved log-sum-exp: ``D = rowsum(dH ∘ H) - dlse``, a
dK/dV kernel (one program per key tile, summing over the query heads that share it, so
grouped-query needs no atomics), a dQ kernel, and the sinks' gradient from lse and D.

Head sizes: d up to 256 (forward) / 128 (backward) fits one tile. Wider heads are tiled
along d: the scores ``Q Kᵀ`` are summed over d-chunks, and the output columns (H in the
forward, dQ / dK / dV in the backward) are split over programs, each recomputing the
scores for its columns. Recomputing costs FLOPs, but an accumulator of BLOCK_M × 1024 fp32
values does not fit registers and would spill; the alternative of keeping the running
output in global memory costs a read and a write of it for every key tile.

The kernels run on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (set before
this module's kernels are first imported; that is how the tests run them without a GPU),
with two fixes to the interpreter held only while our launches run
(:func:`causalattn._internals.triton.interpreter_fixes`). What the kernels read besides Q,
K, V is made on the host by :class:`causalattn.engines.triton_plan.Plan`.
"""

from __future__ import annotations

import contextlib
import math
import sys

import torch

from .._internals.triton import interpreter_fixes
from . import autograd as _autograd
from .problem import Problem
from .triton_plan import Plan

try:  # triton is the optional extra `.[gpu]`; without it this module still imports
    import triton
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

# Kernel tile sizes, overridable (tests force the d-chunked path on small heads).
CONFIG_OVERRIDE: dict | None = None


def available() -> bool:
    return triton is not None


def _require_triton() -> None:
    if triton is None:
        raise ValueError(
            "engine 'triton': the triton package is not installed (pip install '.[gpu]')"
        )


def _kernels():
    _require_triton()
    from . import _triton_kernels

    return _triton_kernels


def _interpreting() -> bool:
    return triton is not None and bool(triton.knobs.runtime.interpret)


def _held():
    """What a launch runs under: in the interpreter, its two fixes, restored after
    (:mod:`causalattn._internals.triton`); compiled kernels need none."""
    return interpreter_fixes() if _interpreting() else contextlib.nullcontext()


def _pow2(n: int) -> int:
    return max(16, 1 << max(0, (n - 1).bit_length()))


def _tile_config(m: int, n: int, dk: int, dv: int, warps: int, stages: int, c=None) -> dict:
    """One kernel's tiles: BLOCK_M query rows × BLOCK_N keys, d-chunks of BLOCK_DK (scores)
    and BLOCK_DV (values), BLOCK_C output columns a program (backward only), warps and
    pipeline stages."""
    cfg = dict(BLOCK_M=m, BLOCK_N=n, BLOCK_DK=dk, BLOCK_DV=dv, num_warps=warps, num_stages=stages)
    if c is not None:
        cfg["BLOCK_C"] = c
    return cfg


def _configs(d_k: int, d_v: int, dtype: torch.dtype, interpret: bool) -> dict:
    """Tile sizes for the three kernels. bf16/fp16: the fastest of ``benchmarks/bench_gpu.py``'s
    candidates on an H200 (2026-11-29; d <= 128 tuned at (4, 32, 4096, 128), wider heads at
    (1, 8, 8192, 1000)); ``benchmarks/compile_check.py`` shows what they compile to. fp32
    tiles are smaller (twice the bytes, dots without tensor cores) and were not timed."""
    pk, pv = _pow2(d_k), _pow2(d_v)
    big = max(pk, pv)
    small = big <= 128
    if interpret:  # small tiles: several of them even at tiny T, and a fast interpreter
        fwd = _tile_config(16, 16, pk if small else 128, pv if small else 256, 1, 1)
        dkdv = _tile_config(
            16, 16, pk if small else 128, pv if small else 128, 1, 1, c=big if small else 256
        )
        dq = dict(dkdv)
    elif dtype != torch.float32:
        warps = 8 if big >= 128 else 4
        if small:
            fwd = _tile_config(128, 64, pk, pv, warps, 3)
            dkdv = _tile_config(64, 128, pk, pv, warps, 2, c=big)
            dq = _tile_config(128, 64, pk, pv, warps, 2, c=big)
        else:
            if big <= 256:
                fwd = _tile_config(64, 32, pk, pv, 8, 2)
            else:
                # 256 output columns a program (4 for d = 1000: Q Kᵀ computed 4 times); 128
                # rows with them would spill registers (benchmarks/compile_check.py)
                fwd = _tile_config(64, 64, 128, 256, 8, 3)
            dkdv = _tile_config(64, 64, 128, 128, 8, 2, c=256)
            dq = dict(dkdv)
    else:
        if small:
            fwd = _tile_config(64, 32, pk, pv, 4, 2)
            dkdv = _tile_config(32, 32, pk, pv, 4, 2, c=big)
        else:
            fwd = _tile_config(64, 32, 32, 128, 4, 1)
            dkdv = _tile_config(32, 32, 32, 32, 4, 1, c=64)
        dq = dict(dkdv)
    cfg = {"fwd": fwd, "dkdv": dkdv, "dq": dq}
    if CONFIG_OVERRIDE:
        for name, over in CONFIG_OVERRIDE.items():
            cfg[name] = {**cfg[name], **over}
    return cfg


# -- where the engine beats SDPA --------------------------------------------------------
# Measured by benchmarks/bench_gpu.py on an NVIDIA H200 (torch 2.11, triton 3.6), 2026-11-29:
# SDPA time / Triton time for forward+backward, bf16, causal, per head-size class and T.
# d <= 128 is (4, 32, T, 128) against SDPA's flash backend; d <= 1024 is (1, 1, 2048, 1000)
# and (1, 8, 16384, 1000) against its memory-efficient backend (flash stops at 256).
MEASURED = "NVIDIA H200, torch 2.11 + triton 3.6, 2026-11-29, bf16 causal forward+backward"
_RATIOS: dict[int, dict[int, float]] = {
    128: {1024: 0.97, 2048: 1.06, 4096: 1.10, 8192: 1.05, 16384: 1.07},
    1024: {2048: 3.77, 16384: 0.87},
}


# what the kernels compute in; any other dtype is refused by name (ops.refusal reads these)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DTYPE_NAMES = "fp16, bf16 or fp32"


def supports(f) -> str | None:
    """What the registry's data cannot say (:data:`causalattn.engines.registry.ENGINES`
    holds the dtypes, head sizes and what the kernels lack): None when this machine runs the
    kernels for ``f``, else why (no triton package; the CPU without TRITON_INTERPRET=1)."""
    if triton is None:
        return "the triton package is not installed (pip install '.[gpu]')"
    if f.device == "cpu" and not _interpreting():
        return (
            "the kernels need CUDA tensors (or TRITON_INTERPRET=1 to run them, slowly, on the CPU)"
        )
    return None


def prefers(f) -> bool:
    """Whether "auto" should run a call with features ``f`` on the Triton engine rather than
    SDPA (CUDA). Causal (+ padding, documents): where the measured ratio at the nearest
    measured T (log scale) of the head-size class is above 1; classes never measured
    (129..256) stay with SDPA. Any other pattern, modifier or dropout: Triton, which skips
    the blocks nobody reads and draws the reference's dropout pattern, where SDPA needs a
    dense T_q×T_k mask (not yet measured on a GPU: benchmarks/bench_window_gpu.py)."""
    if triton is None or f.device != "cuda" or f.dtype == "float64":
        return False
    if f.kind == "masked":
        return True
    cls = 128 if f.d <= 128 else 1024 if f.d > 256 else None
    if cls is None:
        return False
    T = max(1, f.T_k)
    ratios = _RATIOS[cls]
    nearest = min(ratios, key=lambda t: abs(math.log2(t) - math.log2(T)))
    return ratios[nearest] > 1.0


# -- launches ------------------------------------------------------------------------------
def _prec(dtype: torch.dtype) -> str | None:
    # fp32 inputs: full-precision dots (tf32 would break the accuracy rule against fp32 math)
    return "ieee" if dtype == torch.float32 else None


def _tile_keywords(tiles: dict, d_k: int, d_v: int) -> dict:
    """A kernel config as launch keywords: tile sizes, d-chunk counts, warps, stages."""
    names = ("BLOCK_M", "BLOCK_N", "BLOCK_DK", "BLOCK_DV", "BLOCK_C", "num_warps", "num_stages")
    kw = {n: tiles[n] for n in names if n in tiles}
    kw["NUM_DK"] = triton.cdiv(d_k, tiles["BLOCK_DK"])
    if "BLOCK_C" in tiles:
        kw["NUM_DV"] = triton.cdiv(d_v, tiles["BLOCK_DV"])
    return kw


def _strided(t: torch.Tensor) -> tuple:
    """A (B, H, T, d) tensor as the kernels take it: the tensor, then its four strides."""
    return (t, *t.stride())


def _launch(name: str, grid, tiles: dict, tensors, own, plan: Plan, scale: float, **constexprs):
    """Launch kernel ``name`` with arguments in the kernels' order: each (B, H, T, d) tensor
    with its strides, the kernel's own arrays ``own``, the pattern's arrays, the sizes and
    scalars, then the constexprs (flags, precision, tiles)."""
    kernel = getattr(_kernels(), name)[grid]
    with _held():
        kernel(
            *(x for t in tensors for x in _strided(t)),
            *own,
            *plan.arrays(tiles["BLOCK_M"], tiles["BLOCK_N"]),
            *plan.scalars(scale),
            **plan.flags(),
            **constexprs,
            PREC=_prec(tensors[0].dtype),
            **_tile_keywords(tiles, plan.d_k, plan.d_v),
        )


def _launch_fwd(q, k, v, plan: Plan, scale: float, cfg: dict):
    B, H_q, T_q, _ = q.shape
    o = torch.empty(B, H_q, T_q, plan.d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H_q, T_q, dtype=torch.float32, device=q.device)
    tiles = cfg["fwd"]
    grid = (triton.cdiv(T_q, tiles["BLOCK_M"]), triton.cdiv(plan.d_v, tiles["BLOCK_DV"]), B * H_q)
    own = (lse, plan.sinks)
    _launch("fwd_kernel", grid, tiles, (q, k, v, o), own, plan, scale, SINKS=plan.has_sinks)
    return o, lse


def _launch_preprocess(out, dout, lse, dlse, cfg: dict):
    """D = rowsum(dH ∘ H) - dlse (fp32, (B, H_q, T_q)); 0 on rows with no readable key."""
    kernels = _kernels()
    d_v = out.shape[-1]
    D = torch.empty_like(lse)
    n_rows = lse.numel()
    block_dv = min(_pow2(d_v), 128)
    block_m = cfg["dq"]["BLOCK_M"]
    has_dlse = dlse is not None
    dlse = dlse.float().contiguous() if has_dlse else lse
    kernel = kernels.bwd_preprocess[(triton.cdiv(n_rows, block_m),)]
    with _held():
        kernel(
            out,
            dout,
            lse,
            dlse,
            D,
            n_rows,
            D_V=d_v,
            HAS_DLSE=has_dlse,
            BLOCK_M=block_m,
            BLOCK_DV=block_dv,
            NUM_DV=triton.cdiv(d_v, block_dv),
        )
    return D


def _launch_bwd(q, k, v, do, lse, D, plan: Plan, scale: float, cfg: dict, dbias=None):
    """(dq, dk, dv); with ``dbias`` (B, H_q, T_q, T_k) fp32 zeros, the gradient by the
    modified scores written into it (what the bias's gradient is summed from)."""
    B, H_q, T_q, T_k = plan.dims
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    tiles = cfg["dkdv"]
    tile_rows = plan.key_tile_rows(tiles["BLOCK_N"])
    own = (lse, D, tile_rows, tile_rows.stride(0), lse if dbias is None else dbias)
    grid = (
        triton.cdiv(T_k, tiles["BLOCK_N"]),
        triton.cdiv(max(plan.d_k, plan.d_v), tiles["BLOCK_C"]),
        B * H_q // plan.group,
    )
    _launch(
        "dkdv_kernel",
        grid,
        tiles,
        (q, k, v, do, dk, dv),
        own,
        plan,
        scale,
        HAS_DBIAS=dbias is not None,
    )
    tiles = cfg["dq"]
    grid = (triton.cdiv(T_q, tiles["BLOCK_M"]), triton.cdiv(plan.d_k, tiles["BLOCK_C"]), B * H_q)
    _launch("dq_kernel", grid, tiles, (q, k, v, do, dq), (lse, D), plan, scale)
    return dq, dk, dv


def _sinks_grad(plan: Plan, lse: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """d loss / d sink_h = -Σ_{b,i} A_sink·D over rows with a readable key, where
    A_sink = exp(sink_h - lse) is the sink's weight and D = rowsum(dH ∘ H) - dlse."""
    w = torch.exp(plan.sinks[None, :, None] - lse)
    w = torch.where(torch.isfinite(lse), w, 0.0)
    return -(w * D).sum(dim=(0, 2))


def _backward(p: Problem, plan: Plan, cfg: dict, q, k, v, out, lse, dout, dlse, dbias=None):
    """(dq, dk, dv, dsinks or None) from a given out and lse."""
    dout = dout.contiguous()
    lse = lse.float().contiguous()
    D = _launch_preprocess(out.contiguous(), dout, lse, dlse, cfg)
    dq, dk, dv = _launch_bwd(q, k, v, dout, lse, D, plan, p.scale, cfg, dbias)
    return dq, dk, dv, _sinks_grad(plan, lse, D) if plan.has_sinks else None


def _prepare(p: Problem):
    """Check what the kernels can run; ``None`` when there is nothing to compute."""
    _require_triton()
    q, k, v = p.q, p.k, p.v
    if q.dtype not in DTYPES:
        raise ValueError(f"engine 'triton': dtype {q.dtype} not supported; use {DTYPE_NAMES}")
    if q.device.type != "cuda" and not _interpreting():
        raise ValueError(
            f"engine 'triton': q is on {q.device}; the kernels need CUDA tensors "
            "(or TRITON_INTERPRET=1 to run them, slowly, on the CPU)"
        )
    d_k, d_v = q.shape[-1], v.shape[-1]
    if not (1 <= d_k <= 1024 and 1 <= d_v <= 1024):
        raise ValueError(f"engine 'triton': head sizes d_k={d_k}, d_v={d_v} must lie in 1..1024")
    B, H_q, T_q, _ = q.shape
    if B * H_q * T_q == 0 or k.shape[2] == 0:
        return None
    return _configs(d_k, d_v, q.dtype, _interpreting()), Plan(p)


def _empty(p: Problem):
    B, H_q, T_q, _ = p.q.shape
    out = p.q.new_zeros(B, H_q, T_q, p.v.shape[-1])
    lse = torch.full((B, H_q, T_q), float("-inf"), dtype=torch.float32, device=p.q.device)
    return out, lse


def _contiguous(p: Problem):
    return p.q.contiguous(), p.k.contiguous(), p.v.contiguous()


def forward(p: Problem, return_lse: bool = False):
    """H ``(B, H_q, T_q, d_v)`` (and the fp32 log-sum-exp ``(B, H_q, T_q)``) on the GPU;
    differentiable in q, k, v and learned sinks (:mod:`causalattn.engines.autograd`)."""
    _prepare(p)  # refuses what the kernels do not run, by name
    return _autograd.forward(sys.modules[__name__], p, return_lse)


def fwd(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """The raw forward (no autograd): ``(out, lse)`` as :func:`causalattn.engines.tiled.fwd`."""
    prep = _prepare(p)
    if prep is None:
        return _empty(p)
    cfg, plan = prep
    with torch.no_grad():
        return _launch_fwd(*_contiguous(p), plan, p.scale, cfg)


def bwd(p: Problem, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, dlse=None):
    """The raw backward from a GIVEN (e.g. ring-merged, global) ``out`` and ``lse``, and
    optionally the gradient ``dlse`` of the lse: ``(dq, dk, dv)`` as
    :func:`causalattn.engines.tiled.bwd`, dk/dv summed over GQA groups. The dropout pattern
    is regenerated from ``p.dropout_seed``; the sinks' gradient is :func:`sinks_grad`."""
    prep = _prepare(p)
    if prep is None:
        return torch.zeros_like(p.q), torch.zeros_like(p.k), torch.zeros_like(p.v)
    cfg, plan = prep
    with torch.no_grad():
        return _backward(p, plan, cfg, *_contiguous(p), out, lse, dout, dlse)[:3]


def bwd_grads(p: Problem, out, lse, dout, dlse=None, want: tuple = ()):
    """:func:`bwd` and the gradients of the learned pattern tensors in ``want`` (the kernels
    give ``bias``'s: the gradient by the scores of every cell, summed over the bias's
    broadcast axes on the host; O(B·H_q·T_q·T_k) memory while it runs), as a dict."""
    other = set(want) - {"bias"}
    if other:
        raise ValueError(f"engine 'triton': no gradient for {sorted(other)} in the kernels")
    B, H_q, T_q, T_k = p.dims
    bias = p.pattern.bias
    prep = _prepare(p)
    if prep is None:
        zeros = (torch.zeros_like(p.q), torch.zeros_like(p.k), torch.zeros_like(p.v))
        return (*zeros, {"bias": torch.zeros(tuple(bias.shape), device=p.q.device)})
    cfg, plan = prep
    dbias = torch.zeros(B, H_q, T_q, T_k, dtype=torch.float32, device=p.q.device)
    with torch.no_grad():
        dq, dk, dv, _ = _backward(p, plan, cfg, *_contiguous(p), out, lse, dout, dlse, dbias)
    shape4 = (1,) * (4 - bias.dim()) + tuple(bias.shape)
    axes = tuple(i for i, n in enumerate(shape4) if n == 1 and dbias.shape[i] != 1)
    g = dbias.sum(dim=axes, keepdim=True) if axes else dbias
    return dq, dk, dv, {"bias": g.reshape(tuple(bias.shape))}


def sinks_grad(
    p: Problem, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, dlse=None
) -> torch.Tensor:
    """d loss / d sinks ``(H_q,)`` fp32 from the given out, lse and dout (and dlse), as
    :func:`causalattn.engines.tiled.sinks_grad`: -Σ_{b,i} exp(s_h - lse)·D."""
    H_q = p.q.shape[1]
    prep = _prepare(p)
    if prep is None or p.pattern.sinks is None:
        return torch.zeros(H_q, dtype=torch.float32, device=p.q.device)
    cfg, plan = prep
    with torch.no_grad():
        lse = lse.float().contiguous()
        D = _launch_preprocess(out.contiguous(), dout.contiguous(), lse, dlse, cfg)
        return _sinks_grad(plan, lse, D)


__all__ = [
    "forward",
    "fwd",
    "bwd",
    "bwd_grads",
    "sinks_grad",
    "supports",
    "prefers",
    "available",
    "MEASURED",
]
