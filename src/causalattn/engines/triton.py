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
this module's kernels are first imported; that is how the tests run them without a GPU).
"""

from __future__ import annotations

import contextlib
import math
import sys

import numpy as np
import torch

from .. import dropout as _dropout
from .._internals.triton import interpreter_fixes
from . import autograd as _autograd
from .problem import Problem

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


DTYPE_NAMES_OF = ("float16", "bfloat16", "float32")


def refusal(f) -> str:
    """What the kernels do not run ("" when they run ``f``): every pattern, modifier and
    dropout, fp16 / bf16 / fp32, head sizes 1..1024, on CUDA (or the CPU under
    TRITON_INTERPRET=1)."""
    if triton is None:
        return "engine 'triton': the triton package is not installed (pip install '.[gpu]')"
    if f.device == "cpu" and not _interpreting():
        return (
            "engine 'triton': the kernels need CUDA tensors (or TRITON_INTERPRET=1 to run "
            "them, slowly, on the CPU)"
        )
    if f.dtype not in DTYPE_NAMES_OF:
        return f"engine 'triton': dtype {f.dtype} not supported; use {DTYPE_NAMES}"
    if not (1 <= f.d_k <= 1024 and 1 <= f.d_v <= 1024):
        return f"engine 'triton': head sizes d_k={f.d_k}, d_v={f.d_v} must lie in 1..1024"
    missing = not_yet(f)
    if missing:
        return (
            f"engine 'triton': {missing}: not in the kernels; engines that run it: "
            "'reference' (any device) and 'tiled' (CPU)"
        )
    return ""


def not_yet(f) -> str:
    """What the kernels do not compute, as a phrase ("" when nothing): a score_mod (a
    Python function; the kernels cannot call it per tile), a relative bias and slope
    gradients."""
    what = ["score_mod"] if f.score_mod else []
    if "rel_bias" in f.present:
        what.append("rel_bias")
    if "alibi_slopes" in f.learned:
        what.append("learnable alibi_slopes (requires_grad)")
    return ", ".join(what)


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


# -- host side ---------------------------------------------------------------------------
def _device_tensor(x, dev, dtype) -> torch.Tensor:
    """A pattern array (NumPy, list or torch) as a contiguous tensor on the kernels' device."""
    t = x.detach() if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
    return t.to(device=dev, dtype=dtype).contiguous()


def _broadcast_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """Batch, head and row strides of a (B', H', rows, cols) tensor, 0 along a broadcast
    axis of size 1 (the kernels then read the one slice for every b or h)."""
    st = t.stride()
    return (st[0] if t.shape[0] > 1 else 0, st[1] if t.shape[1] > 1 else 0, st[2])


class _Plan:
    """Everything the kernels read besides Q, K, V, derived once from ``p.pattern`` and the
    dropout settings, named as in the kernels (see ``_triton_kernels``' words): per-row key
    intervals ``LO <= j < HI`` ((B, T_q) int32, from
    :meth:`causalattn.masks.Pattern.row_ranges`; plain causal and full attention compute
    them in the kernels), the key padding, the dense mask with its tile kinds per tile
    size, ALiBi slopes (B, H_q), sinks (H_q,) and the dropout hash's inputs."""

    def __init__(self, p: Problem):
        pat = self.pattern = p.pattern
        B, H_q, T_q, d_k = p.q.shape
        T_k = p.k.shape[2]
        dev = p.q.device
        self.dims = (B, H_q, T_q, T_k)
        self.d_k, self.d_v, self.group = d_k, p.v.shape[-1], p.group
        # query i sits at key index i + offset (bottom-right, or as the pattern places it)
        self.offset = pat.query_start(T_q, T_k) - pat.k_start
        self.T_k, self.causal = T_k, pat.causal
        none8 = torch.zeros(1, dtype=torch.int8, device=dev)
        self.none32 = torch.zeros(1, dtype=torch.int32, device=dev)
        nonef = torch.zeros(1, dtype=torch.float32, device=dev)

        self.has_key_padding = pat.key_padding_mask is not None
        self.key_padding = none8
        if self.has_key_padding:
            self.key_padding = _device_tensor(pat.key_padding_mask, dev, torch.int8)
        # plain causal / full attention: the kernels compute the intervals themselves
        self.host_intervals = any(
            x is not None
            for x in (pat.lengths, pat.cu_seqlens, pat.window, pat.chunk, pat.prefix_lengths)
        )
        if self.host_intervals:
            lo, hi = pat.row_ranges(B, T_q, T_k)
            self.lo64, self.hi64 = (
                torch.from_numpy(np.array(np.broadcast_to(x, (B, T_q)), order="C")).to(dev)
                for x in (lo, hi)
            )
            self.lo, self.hi = self.lo64.to(torch.int32), self.hi64.to(torch.int32)
        else:
            self.lo = self.hi = self.none32

        self.has_mask_mod = pat.mask_mod is not None
        self.has_dense_mask = pat.mask is not None or self.has_mask_mod
        self.dense_mask, self.dense_mask_strides, self._tile_kinds = none8, (0, 0, 0), {}
        if pat.mask is not None and not self.has_mask_mod:
            m = pat.mask if isinstance(pat.mask, torch.Tensor) else torch.as_tensor(pat.mask)
            m = m.reshape((1,) * (4 - m.dim()) + tuple(m.shape)).to(dev).contiguous()
            self.dense_mask_bool = m
            self.dense_mask = m.view(torch.int8)
            self.dense_mask_strides = _broadcast_strides(m)

        self.has_bias = pat.bias is not None
        self.bias, self.bias_strides = nonef, (0, 0, 0, 0)
        if self.has_bias:
            bb = (
                pat.bias.detach()
                if isinstance(pat.bias, torch.Tensor)
                else torch.as_tensor(pat.bias)
            )
            bb = bb.reshape((1,) * (4 - bb.dim()) + tuple(bb.shape)).to(dev)
            self.bias = bb.expand(B, H_q, T_q, T_k)  # stride 0 along the broadcast axes
            self.bias_strides = tuple(self.bias.stride())

        self.has_alibi = pat.alibi_slopes is not None
        self.slopes = nonef
        if self.has_alibi:
            a = _device_tensor(pat.alibi_slopes, dev, torch.float32)
            self.slopes = (a[None] if a.dim() == 1 else a).expand(B, H_q).contiguous()
        self.softcap = pat.softcap
        self.has_sinks = pat.sinks is not None
        self.sinks = _device_tensor(pat.sinks, dev, torch.float32) if self.has_sinks else nonef

        self.dropout = p.dropout_p > 0
        self.seed = self.seed_offset = self.drop_thr = 0
        self.drop_scale = 1.0
        self.q_pos = self.k_pos = self.none32
        if self.dropout:
            self.seed, self.seed_offset = p.dropout_seed
            self.drop_thr = _dropout.threshold(p.dropout_p)
            self.drop_scale = 0.0 if p.dropout_p >= 1 else 1.0 / (1.0 - p.dropout_p)
            self.q_pos = p.dropout_rows().to(dev, torch.int32).contiguous()
            self.k_pos = p.dropout_cols().to(dev, torch.int32).contiguous()

    def flags(self) -> dict:
        return dict(
            HAS_KEY_PADDING=self.has_key_padding,
            HOST_INTERVALS=self.host_intervals,
            CAUSAL=self.causal,
            HAS_DENSE_MASK=self.has_dense_mask,
            SOFTCAP=self.softcap is not None,
            ALIBI=self.has_alibi,
            HAS_BIAS=self.has_bias,
            DROPOUT=self.dropout,
        )

    def arrays(self, block_m: int, block_n: int) -> tuple:
        """The kernels' pattern arguments, in their order: LO, HI, KEY_PADDING, DENSE_MASK
        (or this tile size's tile masks) and its strides, TILE_KINDS (for this tile size) and
        its strides, SLOPES, Q_POS, K_POS, BIAS and its strides."""
        kinds, kinds_strides, mask, mask_strides = self.tile_kinds(block_m, block_n)
        return (
            self.lo,
            self.hi,
            self.key_padding,
            mask,
            *mask_strides,
            kinds,
            *kinds_strides,
            self.slopes,
            self.q_pos,
            self.k_pos,
            self.bias,
            *self.bias_strides,
        )

    def scalars(self, scale: float) -> tuple:
        """The kernels' sizes and scalars, in their order: H_q, T_q, T_k, D_K, D_V, GROUP,
        q_offset, scale, softcap, seed, seed_offset, drop_thr, drop_scale."""
        _, H_q, T_q, T_k = self.dims
        sizes = (H_q, T_q, T_k, self.d_k, self.d_v, self.group, self.offset)
        drop = (self.seed, self.seed_offset, self.drop_thr, self.drop_scale)
        return (*sizes, scale, self.softcap or 1.0, *drop)

    def tile_kinds(self, block_m: int, block_n: int):
        """(kinds, their (batch, head, row-block) strides, the mask the kernels read, its
        strides) for (BLOCK_M × BLOCK_N) tiles: the dense mask's kinds, int8 (B', H', n_m,
        n_n) (:meth:`causalattn.masks.Pattern.mask_tile_kinds`) with the mask itself; with a
        mask_mod, :func:`causalattn.masks_mod.tile_table`'s int32 kinds with its tile masks
        (n, BLOCK_M, BLOCK_N), made on the host block by block."""
        if not self.has_dense_mask:
            return self.dense_mask, (0, 0, 0), self.dense_mask, (0, 0, 0)
        key = (block_m, block_n)
        if key in self._tile_kinds:
            return self._tile_kinds[key]
        dev = self.dense_mask.device
        if self.has_mask_mod:
            from ..masks_mod import tile_table

            B, H_q, T_q, T_k = self.dims
            lo, hi = self.pattern.row_ranges(B, T_q, T_k)
            kinds, tiles = tile_table(self.pattern, B, H_q, T_q, T_k, block_m, block_n, lo, hi)
            kinds = kinds.to(dev).contiguous()
            mask = tiles.to(dev).view(torch.int8).contiguous()
            entry = (kinds, _broadcast_strides(kinds), mask, (0, 0, block_n))
        else:
            kinds = self.pattern.mask_tile_kinds(block_m, block_n, like=self.dense_mask_bool)
            entry = (kinds, _broadcast_strides(kinds), self.dense_mask, self.dense_mask_strides)
        self._tile_kinds[key] = entry
        return entry

    def key_tile_rows(self, block_n: int) -> torch.Tensor:
        """For each key tile: the rows that may read it [q_lo, q_hi) and the rows that read
        all of it [r1, r2) (empty when the tile is partial or keys are padded) -> (B, n, 4)."""
        T_k = self.T_k
        if not self.host_intervals:  # computed in the kernel
            return torch.zeros(1, 1, 4, dtype=torch.int32, device=self.key_padding.device)
        B = self.lo64.shape[0]
        s = torch.arange(0, T_k, block_n, device=self.lo64.device, dtype=torch.int64)
        e = torch.clamp(s + block_n, max=T_k)
        S, E, F = (x.expand(B, -1).contiguous() for x in (s, e, s + block_n))
        q_lo = torch.searchsorted(self.hi64, S, right=True)  # first row with HI > s
        q_hi = torch.searchsorted(self.lo64, E, right=False)  # first row with LO >= e
        r1 = torch.searchsorted(self.hi64, F, right=False)  # first row with HI >= s + n
        r2 = torch.searchsorted(self.lo64, S, right=True)  # first row with LO > s
        if self.has_key_padding:
            r1 = r2 = torch.zeros_like(r1)
        return torch.stack([q_lo, q_hi, r1, r2], dim=-1).to(torch.int32).contiguous()


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


def _launch(name: str, grid, tiles: dict, tensors, own, plan: _Plan, scale: float, **constexprs):
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


def _launch_fwd(q, k, v, plan: _Plan, scale: float, cfg: dict):
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


def _launch_bwd(q, k, v, do, lse, D, plan: _Plan, scale: float, cfg: dict, dbias=None):
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


def _sinks_grad(plan: _Plan, lse: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """d loss / d sink_h = -Σ_{b,i} A_sink·D over rows with a readable key, where
    A_sink = exp(sink_h - lse) is the sink's weight and D = rowsum(dH ∘ H) - dlse."""
    w = torch.exp(plan.sinks[None, :, None] - lse)
    w = torch.where(torch.isfinite(lse), w, 0.0)
    return -(w * D).sum(dim=(0, 2))


def _backward(p: Problem, plan: _Plan, cfg: dict, q, k, v, out, lse, dout, dlse, dbias=None):
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
    return _configs(d_k, d_v, q.dtype, _interpreting()), _Plan(p)


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
    "refusal",
    "prefers",
    "available",
    "MEASURED",
]
