"""Triton kernels of the GPU engine (imported only where triton is installed).

Notation: a program owns one tile of rows, BLOCK_M queries × BLOCK_N keys at a time.
Which keys a query row i may read is one interval per row, ``LO[b, i] <= j < HI[b, i]``
(:meth:`causalattn.masks.Pattern.row_ranges`: causal, window, chunk, prefix, lengths,
documents; ``LO = HI = T_k`` for a row with no readable key), intersected with
``key_padding_mask`` and a dense ``mask``. Because LO and HI never decrease along i, a
tile of rows reads one contiguous key range, and inside it the keys every row may read
form one contiguous run: key tiles in that run are computed without a mask, the tiles at
its two ends (the causal diagonal, a window's start, a sequence start, a length) with
``tl.where``. With a dense mask every tile is masked, and a host-made table of its kind
per tile (0 skip, 1 full, 2 partial) skips the empty ones and loads the mask only for
partial ones.

Scores: S = Q Kᵀ·scale, then softcap c·tanh(S/c), then ALiBi -slope·|pos(i) - j|, kept in
log2 units (times LOG2E: exp2 is the fast exponential). Sinks join the denominator after
the key loop. Dropout drops P after the softmax with the counter-based hash of
:mod:`causalattn.dropout` (the same fmix32 levels and constants in uint32 arithmetic, so
the pattern is bit for bit the reference's), regenerated in the backward.

Head sizes: when d fits one tile (``NUM_DK == NUM_DV == 1``) Q (or K, V in the backward)
stay in registers. Otherwise the scores ``Q Kᵀ`` are accumulated over d-chunks of
BLOCK_DK (loaded inside the loop), and the output columns are split over a grid axis
(BLOCK_DV columns per program), each program recomputing the scores for its columns:
the accumulator of a 1024-wide head never fits registers, recomputing ``Q Kᵀ`` does.
The saved log-sum-exp is in natural units, -inf for an empty row (the backward reads it
as +inf: ``exp2(s - lse)`` = 0).
"""

import triton
import triton.language as tl

from .. import dropout as _dropout

LOG2E = tl.constexpr(1.4426950408889634)
# causalattn.dropout's hash constants, the one definition
_C1 = tl.constexpr(_dropout._C1)
_C2 = tl.constexpr(_dropout._C2)
_GOLD = tl.constexpr(_dropout._GOLD)
_ROW = tl.constexpr(_dropout._ROW)
_COL = tl.constexpr(_dropout._COL)
_OFFSET = tl.constexpr(_dropout._OFFSET)


# ---- dropout: causalattn.dropout.keep_mask in uint32 ------------------------------------
@triton.jit
def _fmix(x):
    """MurmurHash3's fmix32 on uint32 (products wrap mod 2³², as the reference's & M32)."""
    x = x ^ (x >> 16)
    x = x * _C1
    x = x ^ (x >> 13)
    x = x * _C2
    return x ^ (x >> 16)


@triton.jit
def _head_key(seed, seed_offset, b, h):
    """The (seed, offset, b, h) level of the hash: one uint32 per program and head."""
    key = _fmix(b.to(tl.uint32) * _GOLD + h.to(tl.uint32) + seed_offset.to(tl.uint32) * _OFFSET)
    return _fmix(key ^ seed.to(tl.uint32))


@triton.jit
def _row_keys(head, ROWPOS, offs_m, ok):
    pos = tl.load(ROWPOS + offs_m, mask=ok, other=0).to(tl.uint32)
    return _fmix(head ^ (pos * _GOLD + _ROW))


@triton.jit
def _col_keys(COLPOS, offs_n, ok):
    pos = tl.load(COLPOS + offs_n, mask=ok, other=0).to(tl.uint32)
    return _fmix(pos * _GOLD + _COL)


@triton.jit
def _keep(row_key, col_key, drop_thr):
    """Kept cells of a tile from broadcastable row and column keys (XOR: either orientation)."""
    return (_fmix(row_key ^ col_key) >> 8) >= drop_thr


# ---- scores and masks --------------------------------------------------------------------
@triton.jit
def _tanh(x):
    """tanh in fp32 from exp2 (the interpreter has no libdevice): a Taylor series where
    1 - e^(-2|x|) would cancel, about 2 ulp everywhere."""
    a = tl.abs(x)
    t = tl.math.exp2(a * (-2.0 * LOG2E))
    big = (1.0 - t) / (1.0 + t)
    x2 = a * a
    poly = 62.0 / 2835.0
    poly = -17.0 / 315.0 + x2 * poly
    poly = 2.0 / 15.0 + x2 * poly
    poly = -1.0 / 3.0 + x2 * poly
    small = a + a * x2 * poly
    r = tl.where(a < 0.3, small, big)
    return tl.where(x < 0, -r, r)


@triton.jit
def _scores(s, pos_i, j, scale, softcap, slope, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """Products Q·K -> scores in log2 units (softcap, then ALiBi, as masks.modify_scores),
    and the softcap's derivative 1 - tanh² (1 without one). pos_i, j: broadcastable key
    positions of the rows and columns."""
    if SOFTCAP:
        t = _tanh(s * (scale / softcap))
        s = t * (softcap * LOG2E)
        grad = 1.0 - t * t
    else:
        s = s * (scale * LOG2E)
        grad = 1.0
    if ALIBI:
        s = s - (slope * LOG2E) * tl.abs(pos_i - j).to(tl.float32)
    return s, grad


@triton.jit
def _dense(MASKb, stride_mt, i, j, ok, kind):
    """The dense mask on a tile (rows i, keys j, broadcastable); only partial tiles
    (kind 2) read memory, full ones (kind 1) are all True. Row offsets in int64: T_q·T_k
    passes 2³¹ at T = 46341."""
    partial = (ok.to(tl.int32) * 0 + kind) == 2  # broadcast first (the interpreter needs it)
    return tl.load(MASKb + i.to(tl.int64) * stride_mt + j, mask=ok & partial, other=1) != 0


@triton.jit
def _dot_rows_cols(
    A,
    B,
    offs_a,
    offs_b,
    a_ok,
    b_ok,
    stride_at: tl.constexpr,
    stride_ad: tl.constexpr,
    stride_bt: tl.constexpr,
    stride_bd: tl.constexpr,
    D: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_D: tl.constexpr,
    PREC: tl.constexpr,
):
    """Σ_d A[a, d] B[b, d] for rows offs_a of A and offs_b of B, over d-chunks -> fp32
    (BLOCK_A, BLOCK_B)."""
    acc = tl.zeros([BLOCK_A, BLOCK_B], dtype=tl.float32)
    for c in range(NUM_D):
        offs_d = c * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        a = tl.load(
            A + offs_a[:, None] * stride_at + offs_d[None, :] * stride_ad,
            mask=a_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        bT = tl.load(
            B + offs_b[None, :] * stride_bt + offs_d[:, None] * stride_bd,
            mask=b_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        acc += tl.dot(a, bT, input_precision=PREC)
    return acc


@triton.jit
def _row_interval(LOb, HIb, offs_m, row_ok, T_k, OFF, ROWS: tl.constexpr, CAUSAL: tl.constexpr):
    """Keys row i may read: [lo_i, hi_i), from the host's arrays (ROWS) or, for plain
    causal / full attention, computed here (no host work at all)."""
    if ROWS:
        lo = tl.load(LOb + offs_m, mask=row_ok, other=0)
        hi = tl.load(HIb + offs_m, mask=row_ok, other=0)
    else:
        lo = tl.zeros_like(offs_m)
        if CAUSAL:
            hi = tl.minimum(offs_m + OFF + 1, T_k)
        else:
            hi = tl.zeros_like(offs_m) + T_k
        hi = tl.where(row_ok, hi, 0)
    return lo, hi


@triton.jit
def _row_bounds(
    LOb,
    HIb,
    offs_m,
    T_q,
    T_k,
    OFF,
    BLOCK_N: tl.constexpr,
    HAS_KPM: tl.constexpr,
    ROWS: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """Per-row intervals of a row tile and the key tiles to visit: masked [start, u1),
    unmasked [u1, u2), masked [u2, end)."""
    row_ok = offs_m < T_q
    lo, hi = _row_interval(LOb, HIb, offs_m, row_ok, T_k, OFF, ROWS, CAUSAL)
    live = row_ok & (lo < hi)
    n_lo = tl.min(tl.where(live, lo, T_k), axis=0)
    end = tl.max(tl.where(live, hi, 0), axis=0)
    f_lo = tl.max(tl.where(live, lo, 0), axis=0)
    f_hi = tl.min(tl.where(live, hi, T_k), axis=0)
    start = (n_lo // BLOCK_N) * BLOCK_N
    u1 = tl.minimum(tl.maximum(tl.cdiv(f_lo, BLOCK_N) * BLOCK_N, start), end)
    u2 = tl.minimum(tl.maximum((f_hi // BLOCK_N) * BLOCK_N, u1), end)
    if HAS_KPM:
        u2 = u1
    return lo, hi, live, n_lo, end, start, u1, u2


@triton.jit
def _key_ok(KPMb, offs_n, n_lo, n_hi, HAS_KPM: tl.constexpr):
    """Keys some row of the tile may read; every other key is loaded as 0 (padding never leaks)."""
    ok = (offs_n >= n_lo) & (offs_n < n_hi)
    if HAS_KPM:
        ok = ok & (tl.load(KPMb + offs_n, mask=ok, other=0) != 0)
    return ok


@triton.jit
def _nonfinite_reads(p, v, PREC: tl.constexpr):
    """What ``p @ v`` gets from v's NaN and ±inf entries that a row reads (p > 0): NaN,
    +inf or -inf where it gets any, else 0. One 0/1 product counts all three kinds at once
    (NaN as 2^16, +inf as 2^8, -inf as 1: exact in fp32 for up to 255 keys a tile)."""
    code = tl.where(
        v != v, 65536.0, tl.where(v == float("inf"), 256.0, tl.where(v == float("-inf"), 1.0, 0.0))
    )
    n = tl.dot((p > 0).to(v.dtype), code.to(v.dtype), input_precision=PREC)
    n_nan = n >= 65536.0
    n_pos = (n % 65536.0) >= 256.0
    n_neg = (n % 256.0) >= 1.0
    special = tl.where(
        n_nan | (n_pos & n_neg), float("nan"), tl.where(n_pos, float("inf"), float("-inf"))
    )
    return tl.where(n > 0, special, 0.0)


@triton.jit
def _finite0(x):
    """x with NaN and ±inf replaced by 0: for products whose weight is 0 where x is unreadable."""
    return tl.where(tl.abs(x) < float("inf"), x, 0.0)


# ---- forward -----------------------------------------------------------------------------
@triton.jit
def _fwd_tile(
    acc,
    l_i,
    m_i,
    q,
    Qb,
    Kb,
    Vb,
    KPMb,
    MASKb,
    COLPOS,
    offs_m,
    row_ok,
    lo,
    hi,
    n_lo,
    n_hi,
    start_n,
    kind,
    row_keys,
    stride_qt: tl.constexpr,
    stride_qd: tl.constexpr,
    stride_kt: tl.constexpr,
    stride_kd: tl.constexpr,
    stride_vt: tl.constexpr,
    stride_vd: tl.constexpr,
    stride_mt,
    D_K: tl.constexpr,
    D_V: tl.constexpr,
    OFF,
    offs_dv,
    dv_ok,
    scale,
    softcap,
    slope,
    drop_thr,
    MASKED: tl.constexpr,
    HAS_KPM: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    NUM_DK: tl.constexpr,
    PREC: tl.constexpr,
):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if MASKED:
        k_ok = _key_ok(KPMb, offs_n, n_lo, n_hi, HAS_KPM)
    else:
        k_ok = offs_n >= 0
    if NUM_DK == 1:
        offs_d = tl.arange(0, BLOCK_DK)
        kT = tl.load(
            Kb + offs_n[None, :] * stride_kt + offs_d[:, None] * stride_kd,
            mask=k_ok[None, :] & (offs_d[:, None] < D_K),
            other=0.0,
        )
        s = tl.dot(q, kT, input_precision=PREC)
    else:
        s = _dot_rows_cols(
            Qb,
            Kb,
            offs_m,
            offs_n,
            row_ok,
            k_ok,
            stride_qt,
            stride_qd,
            stride_kt,
            stride_kd,
            D_K,
            BLOCK_M,
            BLOCK_N,
            BLOCK_DK,
            NUM_DK,
            PREC,
        )
    s, _ = _scores(s, offs_m[:, None] + OFF, offs_n[None, :], scale, softcap, slope, SOFTCAP, ALIBI)
    if MASKED:
        allowed = (offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] < hi[:, None]) & k_ok[None, :]
        if HAS_MASK:
            allowed = allowed & _dense(
                MASKb,
                stride_mt,
                offs_m[:, None],
                offs_n[None, :],
                row_ok[:, None] & k_ok[None, :],
                kind,
            )
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing yet: keep 0s
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = m_new
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, axis=1)  # the denominator counts dropped weights too
    if DROPOUT:
        col_keys = _col_keys(COLPOS, offs_n, k_ok)
        p_v = tl.where(_keep(row_keys[:, None], col_keys[None, :], drop_thr), p, 0.0)
    else:
        p_v = p
    v = tl.load(
        Vb + offs_n[:, None] * stride_vt + offs_dv[None, :] * stride_vd,
        mask=k_ok[:, None] & dv_ok[None, :],
        other=0.0,
    )
    if MASKED:
        # p is exactly 0 where a row may not read, but 0·NaN is NaN: multiply finite values
        # only, then add back the NaN/±inf of values a row does read (rare; exact IEEE sums)
        finite = tl.abs(v) < float("inf")
        acc = acc * alpha[:, None] + tl.dot(
            p_v.to(v.dtype), tl.where(finite, v, 0.0), input_precision=PREC
        )
        if tl.sum(tl.sum(tl.where(finite, 0, 1), axis=1), axis=0) > 0:
            acc += _nonfinite_reads(p, v, PREC)
    else:
        acc = acc * alpha[:, None] + tl.dot(p_v.to(v.dtype), v, input_precision=PREC)
    return acc, l_i, m_new


@triton.jit
def fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    LO,
    HI,
    KPM,
    MASK,
    BLOCKS,
    SLOPES,
    SINK_LOGITS,
    ROWPOS,
    COLPOS,
    stride_qb,
    stride_qh,
    stride_qt: tl.constexpr,
    stride_qd: tl.constexpr,
    stride_kb,
    stride_kh,
    stride_kt: tl.constexpr,
    stride_kd: tl.constexpr,
    stride_vb,
    stride_vh,
    stride_vt: tl.constexpr,
    stride_vd: tl.constexpr,
    stride_ob,
    stride_oh,
    stride_ot: tl.constexpr,
    stride_od: tl.constexpr,
    stride_mb,
    stride_mh,
    stride_mt,
    stride_tb,
    stride_th,
    stride_tm,
    H_q,
    T_q,
    T_k,
    D_K: tl.constexpr,
    D_V: tl.constexpr,
    GROUP,
    OFF,
    scale,
    softcap,
    seed,
    seed_offset,
    drop_thr,
    drop_scale,
    HAS_KPM: tl.constexpr,
    ROWS: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
    SINKS: tl.constexpr,
    DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    NUM_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PREC: tl.constexpr,
):
    """One program: BLOCK_M query rows × BLOCK_DV output columns of one (b, h)."""
    pid_m = tl.program_id(0)
    pid_c = tl.program_id(1)
    pid_bh = tl.program_id(2)
    b = pid_bh // H_q
    h = pid_bh % H_q
    hk = h // GROUP
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    Qb = Q + b64 * stride_qb + h64 * stride_qh
    Kb = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh
    Vb = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh
    KPMb = KPM + b64 * T_k
    MASKb = MASK + b64 * stride_mb + h64 * stride_mh
    BLOCKSb = BLOCKS + b64 * stride_tb + h64 * stride_th + pid_m * stride_tm
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    lo, hi, live, n_lo, n_hi, start, u1, u2 = _row_bounds(
        LO + b64 * T_q, HI + b64 * T_q, offs_m, T_q, T_k, OFF, BLOCK_N, HAS_KPM, ROWS, CAUSAL
    )
    row_ok = offs_m < T_q
    offs_dv = pid_c * BLOCK_DV + tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < D_V
    slope = 0.0
    if ALIBI:
        slope = tl.load(SLOPES + pid_bh)
    if DROPOUT:
        row_keys = _row_keys(_head_key(seed, seed_offset, b, h), ROWPOS, offs_m, row_ok)
    else:
        row_keys = offs_m  # unused

    if NUM_DK == 1:
        offs_d = tl.arange(0, BLOCK_DK)
        q = tl.load(
            Qb + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd,
            mask=row_ok[:, None] & (offs_d[None, :] < D_K),
            other=0.0,
        )
    else:
        q = tl.zeros([BLOCK_M, 16], dtype=tl.float32)  # unused: Q is loaded by d-chunks
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if HAS_MASK:  # every tile masked; the table skips empty ones
        for start_n in range(start, n_hi, BLOCK_N):
            kind = tl.load(BLOCKSb + start_n // BLOCK_N)
            if kind != 0:
                acc, l_i, m_i = _fwd_tile(
                    acc,
                    l_i,
                    m_i,
                    q,
                    Qb,
                    Kb,
                    Vb,
                    KPMb,
                    MASKb,
                    COLPOS,
                    offs_m,
                    row_ok,
                    lo,
                    hi,
                    n_lo,
                    n_hi,
                    start_n,
                    kind,
                    row_keys,
                    stride_qt,
                    stride_qd,
                    stride_kt,
                    stride_kd,
                    stride_vt,
                    stride_vd,
                    stride_mt,
                    D_K,
                    D_V,
                    OFF,
                    offs_dv,
                    dv_ok,
                    scale,
                    softcap,
                    slope,
                    drop_thr,
                    True,
                    HAS_KPM,
                    HAS_MASK,
                    SOFTCAP,
                    ALIBI,
                    DROPOUT,
                    BLOCK_M,
                    BLOCK_N,
                    BLOCK_DK,
                    NUM_DK,
                    PREC,
                )
    else:
        for start_n in range(start, u1, BLOCK_N):  # leading edge (window, document): masked
            acc, l_i, m_i = _fwd_tile(
                acc,
                l_i,
                m_i,
                q,
                Qb,
                Kb,
                Vb,
                KPMb,
                MASKb,
                COLPOS,
                offs_m,
                row_ok,
                lo,
                hi,
                n_lo,
                n_hi,
                start_n,
                2,
                row_keys,
                stride_qt,
                stride_qd,
                stride_kt,
                stride_kd,
                stride_vt,
                stride_vd,
                stride_mt,
                D_K,
                D_V,
                OFF,
                offs_dv,
                dv_ok,
                scale,
                softcap,
                slope,
                drop_thr,
                True,
                HAS_KPM,
                HAS_MASK,
                SOFTCAP,
                ALIBI,
                DROPOUT,
                BLOCK_M,
                BLOCK_N,
                BLOCK_DK,
                NUM_DK,
                PREC,
            )
        for start_n in range(u1, u2, BLOCK_N):  # every row reads every key: no mask
            acc, l_i, m_i = _fwd_tile(
                acc,
                l_i,
                m_i,
                q,
                Qb,
                Kb,
                Vb,
                KPMb,
                MASKb,
                COLPOS,
                offs_m,
                row_ok,
                lo,
                hi,
                n_lo,
                n_hi,
                start_n,
                2,
                row_keys,
                stride_qt,
                stride_qd,
                stride_kt,
                stride_kd,
                stride_vt,
                stride_vd,
                stride_mt,
                D_K,
                D_V,
                OFF,
                offs_dv,
                dv_ok,
                scale,
                softcap,
                slope,
                drop_thr,
                False,
                HAS_KPM,
                HAS_MASK,
                SOFTCAP,
                ALIBI,
                DROPOUT,
                BLOCK_M,
                BLOCK_N,
                BLOCK_DK,
                NUM_DK,
                PREC,
            )
        for start_n in range(u2, n_hi, BLOCK_N):  # trailing edge (causal diagonal): masked
            acc, l_i, m_i = _fwd_tile(
                acc,
                l_i,
                m_i,
                q,
                Qb,
                Kb,
                Vb,
                KPMb,
                MASKb,
                COLPOS,
                offs_m,
                row_ok,
                lo,
                hi,
                n_lo,
                n_hi,
                start_n,
                2,
                row_keys,
                stride_qt,
                stride_qd,
                stride_kt,
                stride_kd,
                stride_vt,
                stride_vd,
                stride_mt,
                D_K,
                D_V,
                OFF,
                offs_dv,
                dv_ok,
                scale,
                softcap,
                slope,
                drop_thr,
                True,
                HAS_KPM,
                HAS_MASK,
                SOFTCAP,
                ALIBI,
                DROPOUT,
                BLOCK_M,
                BLOCK_N,
                BLOCK_DK,
                NUM_DK,
                PREC,
            )

    has = live & (l_i != 0.0)  # rows with a readable key (NaN scores stay NaN, not 0)
    if SINKS:  # the sink joins the denominator and takes no value
        sink = tl.load(SINK_LOGITS + h) * LOG2E
        m_all = tl.maximum(m_i, sink)
        alpha = tl.math.exp2(m_i - m_all)
        l_i = l_i * alpha + tl.math.exp2(sink - m_all)
        acc = acc * alpha[:, None]
        m_i = m_all
    if DROPOUT:
        acc = acc * drop_scale
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    out = tl.where(has[:, None], out, 0.0)
    Ob = O + b64 * stride_ob + h64 * stride_oh
    tl.store(
        Ob + offs_m[:, None] * stride_ot + offs_dv[None, :] * stride_od,
        out.to(O.dtype.element_ty),
        mask=row_ok[:, None] & dv_ok[None, :],
    )
    if pid_c == 0:
        lse = tl.where(has, (m_i + tl.math.log2(tl.where(has, l_i, 1.0))) / LOG2E, float("-inf"))
        tl.store(LSE + pid_bh.to(tl.int64) * T_q + offs_m, lse, mask=row_ok)


# ---- backward ----------------------------------------------------------------------------
@triton.jit
def _dkdv_tile(
    acc_dk,
    acc_dv,
    k,
    v,
    Kb,
    Vb,
    Qb,
    DOb,
    LSEb,
    DDb,
    LOb,
    HIb,
    MASKb,
    ROWPOS,
    offs_n,
    k_ok,
    start_m,
    q_end,
    kind,
    head_key,
    col_keys,
    stride_qt: tl.constexpr,
    stride_qd: tl.constexpr,
    stride_kt: tl.constexpr,
    stride_kd: tl.constexpr,
    stride_vt: tl.constexpr,
    stride_vd: tl.constexpr,
    stride_dot: tl.constexpr,
    stride_dod: tl.constexpr,
    stride_mt,
    T_k,
    D_K: tl.constexpr,
    D_V: tl.constexpr,
    OFF,
    offs_c,
    ck_ok,
    cv_ok,
    scale,
    softcap,
    slope,
    drop_thr,
    drop_scale,
    MASKED: tl.constexpr,
    ROWS: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    NUM_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    NUM_DV: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PREC: tl.constexpr,
):
    """Transposed form: sT = K Qᵀ (BLOCK_N × BLOCK_M), so dK, dV rows stay with this program."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    if MASKED:
        m_ok = offs_m < q_end
    else:
        m_ok = offs_m >= 0
    if NUM_DK == 1:
        offs_d = tl.arange(0, BLOCK_DK)
        qT = tl.load(
            Qb + offs_m[None, :] * stride_qt + offs_d[:, None] * stride_qd,
            mask=m_ok[None, :] & (offs_d[:, None] < D_K),
            other=0.0,
        )
        sT = tl.dot(k, qT, input_precision=PREC)
    else:
        sT = _dot_rows_cols(
            Kb,
            Qb,
            offs_n,
            offs_m,
            k_ok,
            m_ok,
            stride_kt,
            stride_kd,
            stride_qt,
            stride_qd,
            D_K,
            BLOCK_N,
            BLOCK_M,
            BLOCK_DK,
            NUM_DK,
            PREC,
        )
    sT, gradT = _scores(
        sT, offs_m[None, :] + OFF, offs_n[:, None], scale, softcap, slope, SOFTCAP, ALIBI
    )
    lse = tl.load(LSEb + offs_m, mask=m_ok, other=float("-inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E  # empty: P = 0
    pT = tl.math.exp2(sT - lse[None, :])
    if MASKED:
        lo, hi = _row_interval(LOb, HIb, offs_m, m_ok, T_k, OFF, ROWS, CAUSAL)
        allowed = (
            (offs_n[:, None] >= lo[None, :])
            & (offs_n[:, None] < hi[None, :])
            & m_ok[None, :]
            & k_ok[:, None]
        )
        if HAS_MASK:
            allowed = allowed & _dense(
                MASKb,
                stride_mt,
                offs_m[None, :],
                offs_n[:, None],
                m_ok[None, :] & k_ok[:, None],
                kind,
            )
        pT = tl.where(allowed, pT, 0.0)
    if DROPOUT:
        keepT = _keep(
            _row_keys(head_key, ROWPOS, offs_m, m_ok)[None, :], col_keys[:, None], drop_thr
        )
        pT_v = tl.where(keepT, pT, 0.0)
    else:
        pT_v = pT
    do_c = tl.load(
        DOb + offs_m[:, None] * stride_dot + offs_c[None, :] * stride_dod,
        mask=m_ok[:, None] & cv_ok[None, :],
        other=0.0,
    )
    if MASKED:  # as in the forward: dH rows that may not read this key never reach dV
        finite = tl.abs(do_c) < float("inf")
        acc_dv += tl.dot(pT_v.to(do_c.dtype), tl.where(finite, do_c, 0.0), input_precision=PREC)
        if tl.sum(tl.sum(tl.where(finite, 0, 1), axis=1), axis=0) > 0:
            acc_dv += _nonfinite_reads(pT, do_c, PREC)
    else:
        acc_dv += tl.dot(pT_v.to(do_c.dtype), do_c, input_precision=PREC)
    if NUM_DV == 1:
        offs_d = tl.arange(0, BLOCK_DV)
        doT = tl.load(
            DOb + offs_m[None, :] * stride_dot + offs_d[:, None] * stride_dod,
            mask=m_ok[None, :] & (offs_d[:, None] < D_V),
            other=0.0,
        )
        dpT = tl.dot(v, doT, input_precision=PREC)
    else:
        dpT = _dot_rows_cols(
            Vb,
            DOb,
            offs_n,
            offs_m,
            k_ok,
            m_ok,
            stride_vt,
            stride_vd,
            stride_dot,
            stride_dod,
            D_V,
            BLOCK_N,
            BLOCK_M,
            BLOCK_DV,
            NUM_DV,
            PREC,
        )
    if DROPOUT:
        dpT = tl.where(keepT, dpT * drop_scale, 0.0)
    Di = tl.load(DDb + offs_m, mask=m_ok, other=0.0)
    dsT = pT * (dpT - Di[None, :])
    if SOFTCAP:
        dsT = dsT * gradT
    if MASKED:
        dsT = tl.where(allowed, dsT, 0.0)
    q_c = tl.load(
        Qb + offs_m[:, None] * stride_qt + offs_c[None, :] * stride_qd,
        mask=m_ok[:, None] & ck_ok[None, :],
        other=0.0,
    )
    if MASKED:
        q_c = _finite0(q_c)  # rows that may not read: weight 0 (a read NaN is in dsT already)
    acc_dk += tl.dot(dsT.to(q_c.dtype), q_c, input_precision=PREC)
    return acc_dk, acc_dv


@triton.jit
def dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DD,
    DK,
    DV,
    LO,
    HI,
    KPM,
    RANGES,
    MASK,
    BLOCKS,
    SLOPES,
    ROWPOS,
    COLPOS,
    stride_qb,
    stride_qh,
    stride_qt: tl.constexpr,
    stride_qd: tl.constexpr,
    stride_kb,
    stride_kh,
    stride_kt: tl.constexpr,
    stride_kd: tl.constexpr,
    stride_vb,
    stride_vh,
    stride_vt: tl.constexpr,
    stride_vd: tl.constexpr,
    stride_dob,
    stride_doh,
    stride_dot: tl.constexpr,
    stride_dod: tl.constexpr,
    stride_dkb,
    stride_dkh,
    stride_dkt: tl.constexpr,
    stride_dkd: tl.constexpr,
    stride_dvb,
    stride_dvh,
    stride_dvt: tl.constexpr,
    stride_dvd: tl.constexpr,
    stride_mb,
    stride_mh,
    stride_mt,
    stride_tb,
    stride_th,
    stride_tm,
    H_q,
    H_kv,
    T_q,
    T_k,
    D_K: tl.constexpr,
    D_V: tl.constexpr,
    GROUP,
    N_BLOCKS,
    OFF,
    scale,
    softcap,
    seed,
    seed_offset,
    drop_thr,
    drop_scale,
    HAS_KPM: tl.constexpr,
    ROWS: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    NUM_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    NUM_DV: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PREC: tl.constexpr,
):
    """One program: BLOCK_N keys × BLOCK_C columns of dK and dV for one (b, kv-head),
    summed over the GROUP query heads that share it (no atomics)."""
    pid_n = tl.program_id(0)
    pid_c = tl.program_id(1)
    pid_bh = tl.program_id(2)
    b = pid_bh // H_kv
    hk = pid_bh % H_kv
    b64 = b.to(tl.int64)
    Kb = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh
    Vb = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = offs_n < T_k
    if HAS_KPM:
        k_ok = k_ok & (tl.load(KPM + b64 * T_k + offs_n, mask=k_ok, other=0) != 0)
    # query rows that may read this key tile, from the host: [qlo, qhi), unmasked [r1, r2)
    if ROWS:
        R = RANGES + (b64 * N_BLOCKS + pid_n) * 4
        qlo = tl.load(R)
        qhi = tl.load(R + 1)
        r1 = tl.load(R + 2)
        r2 = tl.load(R + 3)
    else:  # plain causal (row i reads keys <= i + OFF) or full attention
        s0 = pid_n * BLOCK_N
        qhi = T_q
        r2 = T_q
        if CAUSAL:
            qlo = tl.maximum(s0 - OFF, 0)
            r1 = tl.maximum(s0 + BLOCK_N - 1 - OFF, 0)
        else:
            qlo = 0
            r1 = 0
        r1 = tl.where(s0 + BLOCK_N > T_k, T_q, r1)  # a partial tile: every row masked
        if HAS_KPM:
            r1 = 0
            r2 = 0
    qhi = tl.where(qhi > qlo, qhi, 0)  # nobody reads this tile (past every length)
    q_start = (qlo // BLOCK_M) * BLOCK_M
    u1 = tl.minimum(tl.maximum(tl.cdiv(r1, BLOCK_M) * BLOCK_M, q_start), qhi)
    u2 = tl.minimum(tl.maximum((r2 // BLOCK_M) * BLOCK_M, u1), qhi)

    if NUM_DK == 1:
        offs_d = tl.arange(0, BLOCK_DK)
        k = tl.load(
            Kb + offs_n[:, None] * stride_kt + offs_d[None, :] * stride_kd,
            mask=k_ok[:, None] & (offs_d[None, :] < D_K),
            other=0.0,
        )
    else:
        k = tl.zeros([BLOCK_N, 16], dtype=tl.float32)  # unused: K is loaded by d-chunks
    if NUM_DV == 1:
        offs_d = tl.arange(0, BLOCK_DV)
        v = tl.load(
            Vb + offs_n[:, None] * stride_vt + offs_d[None, :] * stride_vd,
            mask=k_ok[:, None] & (offs_d[None, :] < D_V),
            other=0.0,
        )
    else:
        v = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    ck_ok = offs_c < D_K
    cv_ok = offs_c < D_V
    acc_dk = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
    acc_dv = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
    LOb = LO + b64 * T_q
    HIb = HI + b64 * T_q
    if DROPOUT:
        col_keys = _col_keys(COLPOS, offs_n, offs_n < T_k)
    else:
        col_keys = offs_n  # unused
    for g in range(GROUP):
        h = hk * GROUP + g
        h64 = h.to(tl.int64)
        Qb = Q + b64 * stride_qb + h64 * stride_qh
        DOb = DO + b64 * stride_dob + h64 * stride_doh
        LSEb = LSE + (b64 * H_q + h64) * T_q
        DDb = DD + (b64 * H_q + h64) * T_q
        MASKb = MASK + b64 * stride_mb + h64 * stride_mh
        BLOCKSb = BLOCKS + b64 * stride_tb + h64 * stride_th + pid_n
        slope = 0.0
        if ALIBI:
            slope = tl.load(SLOPES + b64 * H_q + h64)
        head_key = 0
        if DROPOUT:
            head_key = _head_key(seed, seed_offset, b, h)
        if HAS_MASK:  # every tile masked; the table skips empty ones
            for start_m in range(q_start, qhi, BLOCK_M):
                kind = tl.load(BLOCKSb + (start_m // BLOCK_M) * stride_tm)
                if kind != 0:
                    acc_dk, acc_dv = _dkdv_tile(
                        acc_dk,
                        acc_dv,
                        k,
                        v,
                        Kb,
                        Vb,
                        Qb,
                        DOb,
                        LSEb,
                        DDb,
                        LOb,
                        HIb,
                        MASKb,
                        ROWPOS,
                        offs_n,
                        k_ok,
                        start_m,
                        qhi,
                        kind,
                        head_key,
                        col_keys,
                        stride_qt,
                        stride_qd,
                        stride_kt,
                        stride_kd,
                        stride_vt,
                        stride_vd,
                        stride_dot,
                        stride_dod,
                        stride_mt,
                        T_k,
                        D_K,
                        D_V,
                        OFF,
                        offs_c,
                        ck_ok,
                        cv_ok,
                        scale,
                        softcap,
                        slope,
                        drop_thr,
                        drop_scale,
                        True,
                        ROWS,
                        CAUSAL,
                        HAS_MASK,
                        SOFTCAP,
                        ALIBI,
                        DROPOUT,
                        BLOCK_M,
                        BLOCK_N,
                        BLOCK_DK,
                        NUM_DK,
                        BLOCK_DV,
                        NUM_DV,
                        BLOCK_C,
                        PREC,
                    )
        else:
            for start_m in range(q_start, u1, BLOCK_M):
                acc_dk, acc_dv = _dkdv_tile(
                    acc_dk,
                    acc_dv,
                    k,
                    v,
                    Kb,
                    Vb,
                    Qb,
                    DOb,
                    LSEb,
                    DDb,
                    LOb,
                    HIb,
                    MASKb,
                    ROWPOS,
                    offs_n,
                    k_ok,
                    start_m,
                    qhi,
                    2,
                    head_key,
                    col_keys,
                    stride_qt,
                    stride_qd,
                    stride_kt,
                    stride_kd,
                    stride_vt,
                    stride_vd,
                    stride_dot,
                    stride_dod,
                    stride_mt,
                    T_k,
                    D_K,
                    D_V,
                    OFF,
                    offs_c,
                    ck_ok,
                    cv_ok,
                    scale,
                    softcap,
                    slope,
                    drop_thr,
                    drop_scale,
                    True,
                    ROWS,
                    CAUSAL,
                    HAS_MASK,
                    SOFTCAP,
                    ALIBI,
                    DROPOUT,
                    BLOCK_M,
                    BLOCK_N,
                    BLOCK_DK,
                    NUM_DK,
                    BLOCK_DV,
                    NUM_DV,
                    BLOCK_C,
                    PREC,
                )
            for start_m in range(u1, u2, BLOCK_M):
                acc_dk, acc_dv = _dkdv_tile(
                    acc_dk,
                    acc_dv,
                    k,
                    v,
                    Kb,
                    Vb,
                    Qb,
                    DOb,
                    LSEb,
                    DDb,
                    LOb,
                    HIb,
                    MASKb,
                    ROWPOS,
                    offs_n,
                    k_ok,
                    start_m,
                    qhi,
                    2,
                    head_key,
                    col_keys,
                    stride_qt,
                    stride_qd,
                    stride_kt,
                    stride_kd,
                    stride_vt,
                    stride_vd,
                    stride_dot,
                    stride_dod,
                    stride_mt,
                    T_k,
                    D_K,
                    D_V,
                    OFF,
                    offs_c,
                    ck_ok,
                    cv_ok,
                    scale,
                    softcap,
                    slope,
                    drop_thr,
                    drop_scale,
                    False,
                    ROWS,
                    CAUSAL,
                    HAS_MASK,
                    SOFTCAP,
                    ALIBI,
                    DROPOUT,
                    BLOCK_M,
                    BLOCK_N,
                    BLOCK_DK,
                    NUM_DK,
                    BLOCK_DV,
                    NUM_DV,
                    BLOCK_C,
                    PREC,
                )
            for start_m in range(u2, qhi, BLOCK_M):
                acc_dk, acc_dv = _dkdv_tile(
                    acc_dk,
                    acc_dv,
                    k,
                    v,
                    Kb,
                    Vb,
                    Qb,
                    DOb,
                    LSEb,
                    DDb,
                    LOb,
                    HIb,
                    MASKb,
                    ROWPOS,
                    offs_n,
                    k_ok,
                    start_m,
                    qhi,
                    2,
                    head_key,
                    col_keys,
                    stride_qt,
                    stride_qd,
                    stride_kt,
                    stride_kd,
                    stride_vt,
                    stride_vd,
                    stride_dot,
                    stride_dod,
                    stride_mt,
                    T_k,
                    D_K,
                    D_V,
                    OFF,
                    offs_c,
                    ck_ok,
                    cv_ok,
                    scale,
                    softcap,
                    slope,
                    drop_thr,
                    drop_scale,
                    True,
                    ROWS,
                    CAUSAL,
                    HAS_MASK,
                    SOFTCAP,
                    ALIBI,
                    DROPOUT,
                    BLOCK_M,
                    BLOCK_N,
                    BLOCK_DK,
                    NUM_DK,
                    BLOCK_DV,
                    NUM_DV,
                    BLOCK_C,
                    PREC,
                )

    n_ok = offs_n < T_k
    DKb = DK + b64 * stride_dkb + hk.to(tl.int64) * stride_dkh
    tl.store(
        DKb + offs_n[:, None] * stride_dkt + offs_c[None, :] * stride_dkd,
        (acc_dk * scale).to(DK.dtype.element_ty),
        mask=n_ok[:, None] & ck_ok[None, :],
    )
    if DROPOUT:
        acc_dv = acc_dv * drop_scale
    DVb = DV + b64 * stride_dvb + hk.to(tl.int64) * stride_dvh
    tl.store(
        DVb + offs_n[:, None] * stride_dvt + offs_c[None, :] * stride_dvd,
        acc_dv.to(DV.dtype.element_ty),
        mask=n_ok[:, None] & cv_ok[None, :],
    )


@triton.jit
def _dq_tile(
    acc,
    q,
    do,
    Qb,
    Kb,
    Vb,
    DOb,
    KPMb,
    MASKb,
    COLPOS,
    offs_m,
    row_ok,
    lo,
    hi,
    lse,
    Di,
    n_lo,
    n_hi,
    start_n,
    kind,
    row_keys,
    stride_qt: tl.constexpr,
    stride_qd: tl.constexpr,
    stride_kt: tl.constexpr,
    stride_kd: tl.constexpr,
    stride_vt: tl.constexpr,
    stride_vd: tl.constexpr,
    stride_dot: tl.constexpr,
    stride_dod: tl.constexpr,
    stride_mt,
    D_K: tl.constexpr,
    D_V: tl.constexpr,
    OFF,
    offs_c,
    c_ok,
    scale,
    softcap,
    slope,
    drop_thr,
    drop_scale,
    MASKED: tl.constexpr,
    HAS_KPM: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    NUM_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    NUM_DV: tl.constexpr,
    PREC: tl.constexpr,
):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if MASKED:
        k_ok = _key_ok(KPMb, offs_n, n_lo, n_hi, HAS_KPM)
    else:
        k_ok = offs_n >= 0
    if NUM_DK == 1:
        offs_d = tl.arange(0, BLOCK_DK)
        kT = tl.load(
            Kb + offs_n[None, :] * stride_kt + offs_d[:, None] * stride_kd,
            mask=k_ok[None, :] & (offs_d[:, None] < D_K),
            other=0.0,
        )
        s = tl.dot(q, kT, input_precision=PREC)
    else:
        s = _dot_rows_cols(
            Qb,
            Kb,
            offs_m,
            offs_n,
            row_ok,
            k_ok,
            stride_qt,
            stride_qd,
            stride_kt,
            stride_kd,
            D_K,
            BLOCK_M,
            BLOCK_N,
            BLOCK_DK,
            NUM_DK,
            PREC,
        )
    s, grad = _scores(
        s, offs_m[:, None] + OFF, offs_n[None, :], scale, softcap, slope, SOFTCAP, ALIBI
    )
    p = tl.math.exp2(s - lse[:, None])
    if MASKED:
        allowed = (offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] < hi[:, None]) & k_ok[None, :]
        if HAS_MASK:
            allowed = allowed & _dense(
                MASKb,
                stride_mt,
                offs_m[:, None],
                offs_n[None, :],
                row_ok[:, None] & k_ok[None, :],
                kind,
            )
        p = tl.where(allowed, p, 0.0)
    if NUM_DV == 1:
        offs_d = tl.arange(0, BLOCK_DV)
        vT = tl.load(
            Vb + offs_n[None, :] * stride_vt + offs_d[:, None] * stride_vd,
            mask=k_ok[None, :] & (offs_d[:, None] < D_V),
            other=0.0,
        )
        dp = tl.dot(do, vT, input_precision=PREC)
    else:
        dp = _dot_rows_cols(
            DOb,
            Vb,
            offs_m,
            offs_n,
            row_ok,
            k_ok,
            stride_dot,
            stride_dod,
            stride_vt,
            stride_vd,
            D_V,
            BLOCK_M,
            BLOCK_N,
            BLOCK_DV,
            NUM_DV,
            PREC,
        )
    if DROPOUT:
        keep = _keep(row_keys[:, None], _col_keys(COLPOS, offs_n, k_ok)[None, :], drop_thr)
        dp = tl.where(keep, dp * drop_scale, 0.0)
    ds = p * (dp - Di[:, None])
    if SOFTCAP:
        ds = ds * grad
    if MASKED:
        ds = tl.where(allowed, ds, 0.0)
    k_c = tl.load(
        Kb + offs_n[:, None] * stride_kt + offs_c[None, :] * stride_kd,
        mask=k_ok[:, None] & c_ok[None, :],
        other=0.0,
    )
    if MASKED:
        k_c = _finite0(k_c)  # keys the row may not read: weight 0 (a read NaN is in ds already)
    acc += tl.dot(ds.to(k_c.dtype), k_c, input_precision=PREC)
    return acc


@triton.jit
def dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DD,
    DQ,
    LO,
    HI,
    KPM,
    MASK,
    BLOCKS,
    SLOPES,
    ROWPOS,
    COLPOS,
    stride_qb,
    stride_qh,
    stride_qt: tl.constexpr,
    stride_qd: tl.constexpr,
    stride_kb,
    stride_kh,
    stride_kt: tl.constexpr,
    stride_kd: tl.constexpr,
    stride_vb,
    stride_vh,
    stride_vt: tl.constexpr,
    stride_vd: tl.constexpr,
    stride_dob,
    stride_doh,
    stride_dot: tl.constexpr,
    stride_dod: tl.constexpr,
    stride_dqb,
    stride_dqh,
    stride_dqt: tl.constexpr,
    stride_dqd: tl.constexpr,
    stride_mb,
    stride_mh,
    stride_mt,
    stride_tb,
    stride_th,
    stride_tm,
    H_q,
    T_q,
    T_k,
    D_K: tl.constexpr,
    D_V: tl.constexpr,
    GROUP,
    OFF,
    scale,
    softcap,
    seed,
    seed_offset,
    drop_thr,
    drop_scale,
    HAS_KPM: tl.constexpr,
    ROWS: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    NUM_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    NUM_DV: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PREC: tl.constexpr,
):
    """One program: BLOCK_M query rows × BLOCK_C columns of dQ for one (b, h)."""
    pid_m = tl.program_id(0)
    pid_c = tl.program_id(1)
    pid_bh = tl.program_id(2)
    b = pid_bh // H_q
    h = pid_bh % H_q
    hk = h // GROUP
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    Qb = Q + b64 * stride_qb + h64 * stride_qh
    Kb = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh
    Vb = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh
    DOb = DO + b64 * stride_dob + h64 * stride_doh
    KPMb = KPM + b64 * T_k
    MASKb = MASK + b64 * stride_mb + h64 * stride_mh
    BLOCKSb = BLOCKS + b64 * stride_tb + h64 * stride_th + pid_m * stride_tm
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    lo, hi, live, n_lo, n_hi, start, u1, u2 = _row_bounds(
        LO + b64 * T_q, HI + b64 * T_q, offs_m, T_q, T_k, OFF, BLOCK_N, HAS_KPM, ROWS, CAUSAL
    )
    row_ok = offs_m < T_q
    lse = tl.load(LSE + pid_bh.to(tl.int64) * T_q + offs_m, mask=row_ok, other=float("-inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E  # empty: P = 0
    Di = tl.load(DD + pid_bh.to(tl.int64) * T_q + offs_m, mask=row_ok, other=0.0)
    slope = 0.0
    if ALIBI:
        slope = tl.load(SLOPES + pid_bh)
    if DROPOUT:
        row_keys = _row_keys(_head_key(seed, seed_offset, b, h), ROWPOS, offs_m, row_ok)
    else:
        row_keys = offs_m  # unused
    if NUM_DK == 1:
        offs_d = tl.arange(0, BLOCK_DK)
        q = tl.load(
            Qb + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd,
            mask=row_ok[:, None] & (offs_d[None, :] < D_K),
            other=0.0,
        )
    else:
        q = tl.zeros([BLOCK_M, 16], dtype=tl.float32)
    if NUM_DV == 1:
        offs_d = tl.arange(0, BLOCK_DV)
        do = tl.load(
            DOb + offs_m[:, None] * stride_dot + offs_d[None, :] * stride_dod,
            mask=row_ok[:, None] & (offs_d[None, :] < D_V),
            other=0.0,
        )
    else:
        do = tl.zeros([BLOCK_M, 16], dtype=tl.float32)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < D_K
    acc = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    if HAS_MASK:  # every tile masked; the table skips empty ones
        for start_n in range(start, n_hi, BLOCK_N):
            kind = tl.load(BLOCKSb + start_n // BLOCK_N)
            if kind != 0:
                acc = _dq_tile(
                    acc,
                    q,
                    do,
                    Qb,
                    Kb,
                    Vb,
                    DOb,
                    KPMb,
                    MASKb,
                    COLPOS,
                    offs_m,
                    row_ok,
                    lo,
                    hi,
                    lse,
                    Di,
                    n_lo,
                    n_hi,
                    start_n,
                    kind,
                    row_keys,
                    stride_qt,
                    stride_qd,
                    stride_kt,
                    stride_kd,
                    stride_vt,
                    stride_vd,
                    stride_dot,
                    stride_dod,
                    stride_mt,
                    D_K,
                    D_V,
                    OFF,
                    offs_c,
                    c_ok,
                    scale,
                    softcap,
                    slope,
                    drop_thr,
                    drop_scale,
                    True,
                    HAS_KPM,
                    HAS_MASK,
                    SOFTCAP,
                    ALIBI,
                    DROPOUT,
                    BLOCK_M,
                    BLOCK_N,
                    BLOCK_DK,
                    NUM_DK,
                    BLOCK_DV,
                    NUM_DV,
                    PREC,
                )
    else:
        for start_n in range(start, u1, BLOCK_N):
            acc = _dq_tile(
                acc,
                q,
                do,
                Qb,
                Kb,
                Vb,
                DOb,
                KPMb,
                MASKb,
                COLPOS,
                offs_m,
                row_ok,
                lo,
                hi,
                lse,
                Di,
                n_lo,
                n_hi,
                start_n,
                2,
                row_keys,
                stride_qt,
                stride_qd,
                stride_kt,
                stride_kd,
                stride_vt,
                stride_vd,
                stride_dot,
                stride_dod,
                stride_mt,
                D_K,
                D_V,
                OFF,
                offs_c,
                c_ok,
                scale,
                softcap,
                slope,
                drop_thr,
                drop_scale,
                True,
                HAS_KPM,
                HAS_MASK,
                SOFTCAP,
                ALIBI,
                DROPOUT,
                BLOCK_M,
                BLOCK_N,
                BLOCK_DK,
                NUM_DK,
                BLOCK_DV,
                NUM_DV,
                PREC,
            )
        for start_n in range(u1, u2, BLOCK_N):
            acc = _dq_tile(
                acc,
                q,
                do,
                Qb,
                Kb,
                Vb,
                DOb,
                KPMb,
                MASKb,
                COLPOS,
                offs_m,
                row_ok,
                lo,
                hi,
                lse,
                Di,
                n_lo,
                n_hi,
                start_n,
                2,
                row_keys,
                stride_qt,
                stride_qd,
                stride_kt,
                stride_kd,
                stride_vt,
                stride_vd,
                stride_dot,
                stride_dod,
                stride_mt,
                D_K,
                D_V,
                OFF,
                offs_c,
                c_ok,
                scale,
                softcap,
                slope,
                drop_thr,
                drop_scale,
                False,
                HAS_KPM,
                HAS_MASK,
                SOFTCAP,
                ALIBI,
                DROPOUT,
                BLOCK_M,
                BLOCK_N,
                BLOCK_DK,
                NUM_DK,
                BLOCK_DV,
                NUM_DV,
                PREC,
            )
        for start_n in range(u2, n_hi, BLOCK_N):
            acc = _dq_tile(
                acc,
                q,
                do,
                Qb,
                Kb,
                Vb,
                DOb,
                KPMb,
                MASKb,
                COLPOS,
                offs_m,
                row_ok,
                lo,
                hi,
                lse,
                Di,
                n_lo,
                n_hi,
                start_n,
                2,
                row_keys,
                stride_qt,
                stride_qd,
                stride_kt,
                stride_kd,
                stride_vt,
                stride_vd,
                stride_dot,
                stride_dod,
                stride_mt,
                D_K,
                D_V,
                OFF,
                offs_c,
                c_ok,
                scale,
                softcap,
                slope,
                drop_thr,
                drop_scale,
                True,
                HAS_KPM,
                HAS_MASK,
                SOFTCAP,
                ALIBI,
                DROPOUT,
                BLOCK_M,
                BLOCK_N,
                BLOCK_DK,
                NUM_DK,
                BLOCK_DV,
                NUM_DV,
                PREC,
            )
    dq = tl.where(live[:, None], acc * scale, 0.0)
    DQb = DQ + b64 * stride_dqb + h64 * stride_dqh
    tl.store(
        DQb + offs_m[:, None] * stride_dqt + offs_c[None, :] * stride_dqd,
        dq.to(DQ.dtype.element_ty),
        mask=row_ok[:, None] & c_ok[None, :],
    )


@triton.jit
def bwd_preprocess(
    O,
    DO,
    LSE,
    DLSE,
    DD,
    N_ROWS,
    D_V: tl.constexpr,
    HAS_DLSE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    NUM_DV: tl.constexpr,
):
    """D = rowsum(dH ∘ H) in fp32 (minus the lse gradient; 0 on empty rows), for the
    rows of contiguous (B·H_q·T_q, d_v) views of H and dH."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < N_ROWS
    rows = offs_m.to(tl.int64) * D_V
    acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    for c in range(NUM_DV):
        offs_d = c * BLOCK_DV + tl.arange(0, BLOCK_DV)
        ok = row_ok[:, None] & (offs_d[None, :] < D_V)
        o = tl.load(O + rows[:, None] + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
        do = tl.load(DO + rows[:, None] + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
        acc += tl.sum(o * do, axis=1)
    if HAS_DLSE:  # d lse / d S = A, so a gradient on lse shifts D
        acc -= tl.load(DLSE + offs_m, mask=row_ok, other=0.0)
    lse = tl.load(LSE + offs_m, mask=row_ok, other=0.0)
    tl.store(DD + offs_m, tl.where(lse == float("-inf"), 0.0, acc), mask=row_ok)
