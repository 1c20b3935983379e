"""Triton kernels of the GPU engine (imported only where triton is installed).

Notation: a program owns one tile of rows, BLOCK_M queries × BLOCK_N keys at a time.
Which keys a query row i may read under the positional rules (causal, window, chunk,
prefix, lengths, documents) is one interval per row, ``lo_i <= j < hi_i``
(:meth:`causalattn.masks.Pattern.row_ranges`; ``lo = hi = T_k`` for a row with no readable
key), to which the key padding and a dense mask are added. Because lo and hi never decrease
along i, a tile of rows reads one contiguous key range, and inside it the keys every row
may read form one contiguous run: key tiles in that run are computed without a mask, the
tiles at its two ends (the causal diagonal, a window's start, a sequence start, a length)
with ``tl.where``. With a dense mask every tile is masked, and a host-made table of the
kind of each tile skips the empty ones and loads the mask only for partial ones.

Words, one per meaning (``triton.py``, the host side, uses the same):

- *allowed*: cell (i, j) may be read, as in :meth:`causalattn.masks.Pattern.allowed`: j lies
  in row i's interval, the key is not padding and the dense mask lets the cell through.
  P and dS are exactly 0 where a cell is not allowed.
- *interval*: ``[lo_i, hi_i)``, from the host's ``LO``, ``HI`` (B, T_q) when
  ``HOST_INTERVALS``, else computed here for plain causal or full attention.
- *key padding*: the pattern's ``key_padding_mask`` (B, T_k) as int8, nonzero = a real key.
- *dense mask*: the pattern's explicit ``mask`` (B', H', T_q, T_k) as int8; *tile kinds*:
  its table per BLOCK_M × BLOCK_N tile (B', H', n_m, n_n): 0 skip, 1 full, 2 partial.
  With a ``mask_mod`` the host evaluates it (ANDed with the dense mask) tile by tile and
  hands in *tile masks* instead: DENSE_MASK is then (n, BLOCK_M, BLOCK_N) int8, kind 3 + t
  a partial tile read through tile mask t (``_tile_mask_head``).
- *bias*: the pattern's additive ``bias`` with its (b, h, row, key) strides, 0 along its
  broadcast axes, added to the scores after ALiBi; the backward writes the gradient by the
  scores (DBIAS, B × H_q × T_q × T_k) and the host sums it over the broadcast axes.
- ``*_valid``: an index inside its tensor (row < T_q, key < T_k, column < d).
- ``*_live``: a row or key a tile must touch: a key some row of the tile may read (every
  other key is loaded as 0, so padding never leaks), a row that may read some key.
- *spans*: the key tiles a row tile visits (or the query tiles a key tile visits), in three
  runs: masked ``[start, u1)``, unmasked ``[u1, u2)``, masked ``[u2, end)``; with a dense
  mask or key padding the middle run is empty.
- *hash*: a level of the dropout hash (never called a key: keys are attention's).

Arguments: every (B, H, T, d) tensor comes with its four strides on one line,
``Q, stride_qb, stride_qh, stride_qm, stride_qd`` (batch, head, token, column; the token
axis is m for queries, n for keys); ``q_head`` points at the (b, h) matrix of Q.

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

from .. import constants as _constants

LOG2E = tl.constexpr(_constants.LOG2E)
# causalattn.dropout's hash constants (causalattn.constants: the one definition)
_C1 = tl.constexpr(_constants.HASH_C1)
_C2 = tl.constexpr(_constants.HASH_C2)
_GOLD = tl.constexpr(_constants.HASH_GOLD)
_ROW = tl.constexpr(_constants.HASH_ROW)
_COL = tl.constexpr(_constants.HASH_COL)
_OFFSET = tl.constexpr(_constants.HASH_OFFSET)


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
def _head_hash(seed, seed_offset, b, h):
    """The (seed, offset, b, h) level of the hash: one uint32 per program and head."""
    x = _fmix(b.to(tl.uint32) * _GOLD + h.to(tl.uint32) + seed_offset.to(tl.uint32) * _OFFSET)
    return _fmix(x ^ seed.to(tl.uint32))


@triton.jit
def _row_hash(head_hash, Q_POS, offs_m, valid):
    """The rows' level, from the queries' global positions."""
    pos = tl.load(Q_POS + offs_m, mask=valid, other=0).to(tl.uint32)
    return _fmix(head_hash ^ (pos * _GOLD + _ROW))


@triton.jit
def _key_hash(K_POS, offs_n, valid):
    """The keys' level, from the keys' global positions."""
    pos = tl.load(K_POS + offs_n, mask=valid, other=0).to(tl.uint32)
    return _fmix(pos * _GOLD + _COL)


@triton.jit
def _keep(row_hash, key_hash, drop_thr):
    """Kept cells of a tile from broadcastable row and key hashes (XOR: either orientation)."""
    return (_fmix(row_hash ^ key_hash) >> 8) >= drop_thr


@triton.jit
def _rows_hash(seed, seed_offset, b, h, Q_POS, offs_m, valid, DROPOUT: tl.constexpr):
    """The rows' level for head (b, h) with dropout; without it a placeholder (unused)."""
    if DROPOUT:
        rows = _row_hash(_head_hash(seed, seed_offset, b, h), Q_POS, offs_m, valid)
    else:
        rows = offs_m
    return rows


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
def _slope(SLOPES, index, ALIBI: tl.constexpr):
    """The ALiBi slope of one (b, h) (0 without ALiBi)."""
    slope = 0.0
    if ALIBI:
        slope = tl.load(SLOPES + index)
    return slope


@triton.jit
def _program(H):
    """(row or key tile, column block, b, head) of this program: grid axes 0 and 1, and
    axis 2 over B·H heads."""
    pid_bh = tl.program_id(2)
    return tl.program_id(0), tl.program_id(1), pid_bh // H, pid_bh % H


@triton.jit
def _head(X, b, h, stride_b, stride_h):
    """Pointer to the (b, h) slice of X (int64 offsets: B·H·T·d passes 2³¹)."""
    return X + (b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h)


@triton.jit
def _head_rows(X, b, h, H_q, T_q):
    """Pointer to the (b, h) row of a contiguous (B, H_q, T_q) array (LSE, DELTA)."""
    return X + (b * H_q + h).to(tl.int64) * T_q


@triton.jit
def _lse_log2(lse_head, offs, valid):
    """Saved log-sum-exps of rows offs in log2 units; +inf for an empty row (P = 0)."""
    lse = tl.load(lse_head + offs, mask=valid, other=float("-inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E


@triton.jit
def _tile_kind(kinds_head, row_block, key_block, stride_tm, HAS_DENSE_MASK: tl.constexpr):
    """The dense mask's kind of one tile (0 skip, 1 full, 2 partial); 2 without one."""
    if HAS_DENSE_MASK:
        kind = tl.load(kinds_head + row_block * stride_tm + key_block)
    else:
        kind = 2
    return kind


@triton.jit
def _dense(mask_head, stride_mm, i, j, live, kind):
    """The dense mask on a tile (rows i, keys j, broadcastable); only partial tiles
    (kind >= 2) read memory, full ones (kind 1) are all True. Row offsets in int64: T_q·T_k
    passes 2³¹ at T = 46341."""
    partial = (live.to(tl.int32) * 0 + kind) >= 2  # broadcast first (the interpreter needs it)
    return tl.load(mask_head + i.to(tl.int64) * stride_mm + j, mask=live & partial, other=1) != 0


@triton.jit
def _tile_mask_head(mask_head, kind, row0, col0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Where ``_dense`` reads a tile: the dense mask itself (kind 2), or, for kind >= 3, the
    host's tile mask kind − 3 (BLOCK_M × BLOCK_N, row stride BLOCK_N: a mask_mod's partial
    tile), shifted so that mask_head + i·BLOCK_N + j addresses it at rows i, keys j of the
    tile that starts at (row0, col0)."""
    n = (kind - 3).to(tl.int64)
    shift = n * (BLOCK_M * BLOCK_N) - (row0 + n * 0) * BLOCK_N - col0  # int64 throughout
    return mask_head + tl.where(kind >= 3, shift, 0)


@triton.jit
def _add_bias(s, bias_head, i, j, live, stride_bm, stride_bn, HAS_BIAS: tl.constexpr):
    """s + bias (log2 units) on a tile (rows i, keys j broadcastable: either orientation);
    the bias's broadcast axes have stride 0."""
    if HAS_BIAS:
        ptr = bias_head + i.to(tl.int64) * stride_bm + j.to(tl.int64) * stride_bn
        s = s + tl.load(ptr, mask=live, other=0.0).to(tl.float32) * LOG2E
    return s


@triton.jit
def _allowed(lo, hi, i, j, live, mask_head, stride_mm, kind, HAS_DENSE_MASK: tl.constexpr):
    """The allowed cells of a tile: live row and key, j in [lo, hi) of row i, and the dense
    mask (broadcastable rows i, lo, hi and keys j: either orientation)."""
    allowed = (j >= lo) & (j < hi) & live
    if HAS_DENSE_MASK:
        allowed = allowed & _dense(mask_head, stride_mm, i, j, live, kind)
    return allowed


@triton.jit
def _live_keys(
    key_padding, offs_n, n_lo, n_hi, MASKED: tl.constexpr, HAS_KEY_PADDING: tl.constexpr
):
    """Keys in [n_lo, n_hi) that are not padding (all of them in an unmasked tile)."""
    if MASKED:
        live = (offs_n >= n_lo) & (offs_n < n_hi)
        if HAS_KEY_PADDING:
            live = live & (tl.load(key_padding + offs_n, mask=live, other=0) != 0)
    else:
        live = offs_n >= 0
    return live


@triton.jit
def _intervals(
    lo_b, hi_b, offs_m, valid, T_k, q_offset, HOST_INTERVALS: tl.constexpr, CAUSAL: tl.constexpr
):
    """Rows' intervals [lo, hi) (empty for invalid rows): from the host's arrays of batch
    row b, or, for plain causal / full attention, computed here (no host work at all)."""
    if HOST_INTERVALS:
        lo = tl.load(lo_b + offs_m, mask=valid, other=0)
        hi = tl.load(hi_b + offs_m, mask=valid, other=0)
    else:
        lo = tl.zeros_like(offs_m)
        if CAUSAL:
            hi = tl.minimum(offs_m + q_offset + 1, T_k)
        else:
            hi = tl.zeros_like(offs_m) + T_k
        hi = tl.where(valid, hi, 0)
    return lo, hi


@triton.jit
def _span(run: tl.constexpr, start, u1, u2, end):
    """Bounds of run 0 (masked [start, u1): a window's start, a document's or sequence's
    start), 1 (unmasked [u1, u2): every row reads every key) or 2 (masked [u2, end): the
    causal diagonal, a length), as a row tile sees its key tiles (a key tile its query tiles
    likewise). Kernels loop over runs 0..2, or over run 0 alone with a dense mask."""
    first = start
    last = u1
    if run == 1:
        first = u1
        last = u2
    if run == 2:
        first = u2
        last = end
    return first, last


# ---- tiles -------------------------------------------------------------------------------
@triton.jit
def _load_tile(ptr, offs_r, offs_c, r_valid, c_valid, stride_r, stride_c):
    """ptr[r, c] for r in offs_r, c in offs_c -> (len(offs_r), len(offs_c)), 0 outside
    r_valid × c_valid."""
    return tl.load(
        ptr + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c,
        mask=r_valid[:, None] & c_valid[None, :],
        other=0.0,
    )


@triton.jit
def _load_tile_t(ptr, offs_r, offs_c, r_valid, c_valid, stride_r, stride_c):
    """The same tile transposed: ptr[r, c] at [c, r] -> (len(offs_c), len(offs_r))."""
    return tl.load(
        ptr + offs_r[None, :] * stride_r + offs_c[:, None] * stride_c,
        mask=r_valid[None, :] & c_valid[:, None],
        other=0.0,
    )


@triton.jit
def _store_tile(ptr, x, offs_r, offs_c, r_valid, c_valid, stride_r, stride_c):
    """x -> ptr[r, c] in ptr's dtype, inside r_valid × c_valid."""
    tl.store(
        ptr + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c,
        x.to(ptr.dtype.element_ty),
        mask=r_valid[:, None] & c_valid[None, :],
    )


@triton.jit
def _rows_in_registers(
    x_head, offs_t, t_valid, stride_t, stride_d,
    D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, NUM_D: tl.constexpr,
):  # fmt: skip
    """A tile's rows of a (T, D) matrix, kept for the whole loop when D fits one chunk;
    else a placeholder (_dot_nt loads them by d-chunks)."""
    if NUM_D == 1:
        offs_d = tl.arange(0, BLOCK_D)
        x = _load_tile(x_head, offs_t, offs_d, t_valid, offs_d < D, stride_t, stride_d)
    else:
        x = tl.zeros([BLOCK_T, 16], dtype=tl.float32)
    return x


@triton.jit
def _dot_nt(
    a, a_head, b_head, offs_a, offs_b, a_live, b_live,
    stride_a, stride_ad, stride_b, stride_bd,
    D: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_D: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Σ_d A[a, d]·B[b, d] for rows offs_a of A and offs_b of B -> fp32 (BLOCK_A, BLOCK_B):
    from ``a`` (_rows_in_registers) when D fits one chunk, else over d-chunks of both."""
    if NUM_D == 1:
        offs_d = tl.arange(0, BLOCK_D)
        bT = _load_tile_t(b_head, offs_b, offs_d, b_live, offs_d < D, stride_b, stride_bd)
        acc = tl.dot(a, bT, input_precision=PREC)
    else:
        acc = tl.zeros([BLOCK_A, BLOCK_B], dtype=tl.float32)
        for c in range(NUM_D):
            offs_d = c * BLOCK_D + tl.arange(0, BLOCK_D)
            d_valid = offs_d < D
            a_c = _load_tile(a_head, offs_a, offs_d, a_live, d_valid, stride_a, stride_ad)
            bT = _load_tile_t(b_head, offs_b, offs_d, b_live, d_valid, stride_b, stride_bd)
            acc += tl.dot(a_c, bT, input_precision=PREC)
    return acc


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
def _add_weighted(acc, p_kept, p, x, MASKED: tl.constexpr, PREC: tl.constexpr):
    """acc + p_kept @ x (P·V forward, Pᵀ·dH for dV). In a masked tile p is exactly 0 where a
    row may not read, but 0·NaN is NaN: multiply finite values only, then add back the
    NaN/±inf of values a row does read (rare; exact IEEE sums)."""
    if MASKED:
        finite = tl.abs(x) < float("inf")
        acc = acc + tl.dot(p_kept.to(x.dtype), tl.where(finite, x, 0.0), input_precision=PREC)
        if tl.sum(tl.sum(tl.where(finite, 0, 1), axis=1), axis=0) > 0:
            acc += _nonfinite_reads(p, x, PREC)
    else:
        acc = acc + tl.dot(p_kept.to(x.dtype), x, input_precision=PREC)
    return acc


@triton.jit
def _finite0(x):
    """x with NaN and ±inf replaced by 0: for products whose weight is 0 where x is unreadable."""
    return tl.where(tl.abs(x) < float("inf"), x, 0.0)


@triton.jit
def _query_rows(
    LO, HI, SLOPES, Q_POS, pid_m, b, h, H_q, T_q, T_k, q_offset, seed, seed_offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_KEY_PADDING: tl.constexpr, HOST_INTERVALS: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_DENSE_MASK: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
):  # fmt: skip
    """What a program over BLOCK_M query rows of head (b, h) knows before its key loop:
    the rows, their intervals, the live rows (a readable key), the live keys [n_lo, n_hi)
    and the spans [start, u1), [u1, u2), [u2, n_hi) of key tiles, the ALiBi slope and the
    rows' dropout hash."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = offs_m < T_q
    b64 = b.to(tl.int64)
    lo, hi = _intervals(
        LO + b64 * T_q, HI + b64 * T_q, offs_m, row_valid, T_k, q_offset, HOST_INTERVALS, CAUSAL
    )
    row_live = row_valid & (lo < hi)
    n_lo = tl.min(tl.where(row_live, lo, T_k), axis=0)
    n_hi = tl.max(tl.where(row_live, hi, 0), axis=0)
    f_lo = tl.max(tl.where(row_live, lo, 0), axis=0)
    f_hi = tl.min(tl.where(row_live, hi, T_k), axis=0)
    start = (n_lo // BLOCK_N) * BLOCK_N
    u1 = tl.minimum(tl.maximum(tl.cdiv(f_lo, BLOCK_N) * BLOCK_N, start), n_hi)
    u2 = tl.minimum(tl.maximum((f_hi // BLOCK_N) * BLOCK_N, u1), n_hi)
    if HAS_KEY_PADDING:
        u2 = u1
    if HAS_DENSE_MASK:  # one masked run; the tile kinds skip the empty tiles
        u1 = n_hi
        u2 = n_hi
    slope = _slope(SLOPES, b * H_q + h, ALIBI)
    rows_hash = _rows_hash(seed, seed_offset, b, h, Q_POS, offs_m, row_valid, DROPOUT)
    return offs_m, row_valid, lo, hi, row_live, n_lo, n_hi, start, u1, u2, slope, rows_hash


@triton.jit
def _key_tile(
    q, q_head, k_head, start_n, offs_m, row_valid, key_padding, n_lo, n_hi,
    stride_qm, stride_qd, stride_kn, stride_kd,
    D_K: tl.constexpr, MASKED: tl.constexpr, HAS_KEY_PADDING: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr,
    NUM_DK: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """The key tile at start_n as a row tile sees it: its keys, the live ones (keys in
    [n_lo, n_hi) and not padding; all of them in an unmasked tile) and the products Q Kᵀ."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    key_live = _live_keys(key_padding, offs_n, n_lo, n_hi, MASKED, HAS_KEY_PADDING)
    s = _dot_nt(
        q, q_head, k_head, offs_m, offs_n, row_valid, key_live,
        stride_qm, stride_qd, stride_kn, stride_kd,
        D_K, BLOCK_M, BLOCK_N, BLOCK_DK, NUM_DK, PREC,
    )  # fmt: skip
    return offs_n, key_live, s


# ---- forward -----------------------------------------------------------------------------
@triton.jit
def _fwd_tile(
    acc, l_i, m_i, q, start_n, kind,
    q_head, stride_qm: tl.constexpr, stride_qd: tl.constexpr,
    k_head, stride_kn: tl.constexpr, stride_kd: tl.constexpr,
    v_head, stride_vn: tl.constexpr, stride_vd: tl.constexpr,
    offs_m, row_valid, lo, hi, rows_hash, key_padding, n_lo, n_hi, K_POS,
    mask_head, stride_mm, bias_head, stride_bm, stride_bn, offs_dv, dv_valid,
    q_offset, scale, softcap, slope, drop_thr,
    D_K: tl.constexpr, MASKED: tl.constexpr, HAS_KEY_PADDING: tl.constexpr,
    HAS_DENSE_MASK: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr, NUM_DK: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """One key tile of the online softmax: (acc, l_i, m_i) updated."""
    offs_n, key_live, s = _key_tile(
        q, q_head, k_head, start_n, offs_m, row_valid, key_padding, n_lo, n_hi,
        stride_qm, stride_qd, stride_kn, stride_kd, D_K, MASKED, HAS_KEY_PADDING,
        BLOCK_M, BLOCK_N, BLOCK_DK, NUM_DK, PREC,
    )  # fmt: skip
    s, _ = _scores(
        s, offs_m[:, None] + q_offset, offs_n[None, :], scale, softcap, slope, SOFTCAP, ALIBI
    )
    s = _add_bias(
        s, bias_head, offs_m[:, None], offs_n[None, :], row_valid[:, None] & key_live[None, :],
        stride_bm, stride_bn, HAS_BIAS,
    )  # fmt: skip
    if MASKED:
        allowed = _allowed(
            lo[:, None], hi[:, None], offs_m[:, None], offs_n[None, :],
            row_valid[:, None] & key_live[None, :], mask_head, stride_mm, kind, HAS_DENSE_MASK,
        )  # fmt: skip
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing yet: keep 0s
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = m_new
        if HAS_BIAS:  # a bias of -inf may leave a row nothing yet
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, axis=1)  # the denominator counts dropped weights too
    if DROPOUT:
        keys_hash = _key_hash(K_POS, offs_n, key_live)
        p_kept = tl.where(_keep(rows_hash[:, None], keys_hash[None, :], drop_thr), p, 0.0)
    else:
        p_kept = p
    v = _load_tile(v_head, offs_n, offs_dv, key_live, dv_valid, stride_vn, stride_vd)
    acc = _add_weighted(acc * alpha[:, None], p_kept, p, v, MASKED, PREC)
    return acc, l_i, m_new


@triton.jit
def fwd_kernel(
    Q, stride_qb, stride_qh, stride_qm: tl.constexpr, stride_qd: tl.constexpr,
    K, stride_kb, stride_kh, stride_kn: tl.constexpr, stride_kd: tl.constexpr,
    V, stride_vb, stride_vh, stride_vn: tl.constexpr, stride_vd: tl.constexpr,
    O, stride_ob, stride_oh, stride_om: tl.constexpr, stride_od: tl.constexpr,
    LSE, SINK_LOGITS,
    LO, HI, KEY_PADDING,
    DENSE_MASK, stride_mb, stride_mh, stride_mm,
    TILE_KINDS, stride_tb, stride_th, stride_tm,
    SLOPES, Q_POS, K_POS,
    BIAS, stride_bb, stride_bh, stride_bm, stride_bn,
    H_q, T_q, T_k, D_K: tl.constexpr, D_V: tl.constexpr, GROUP, q_offset,
    scale, softcap, seed, seed_offset, drop_thr, drop_scale,
    HAS_KEY_PADDING: tl.constexpr, HOST_INTERVALS: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_DENSE_MASK: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr, SINKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr,
    NUM_DK: tl.constexpr, BLOCK_DV: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_M query rows × BLOCK_DV output columns of one (b, h)."""
    pid_m, pid_c, b, h = _program(H_q)
    offs_m, row_valid, lo, hi, row_live, n_lo, n_hi, start, u1, u2, slope, rows_hash = _query_rows(
        LO, HI, SLOPES, Q_POS, pid_m, b, h, H_q, T_q, T_k, q_offset, seed, seed_offset,
        BLOCK_M, BLOCK_N, HAS_KEY_PADDING, HOST_INTERVALS, CAUSAL, HAS_DENSE_MASK, ALIBI, DROPOUT,
    )  # fmt: skip
    q_head = _head(Q, b, h, stride_qb, stride_qh)
    k_head = _head(K, b, h // GROUP, stride_kb, stride_kh)
    v_head = _head(V, b, h // GROUP, stride_vb, stride_vh)
    mask_head = _head(DENSE_MASK, b, h, stride_mb, stride_mh)
    kinds_head = _head(TILE_KINDS, b, h, stride_tb, stride_th)
    bias_head = _head(BIAS, b, h, stride_bb, stride_bh)
    key_padding = KEY_PADDING + b.to(tl.int64) * T_k
    offs_dv = pid_c * BLOCK_DV + tl.arange(0, BLOCK_DV)
    dv_valid = offs_dv < D_V
    q = _rows_in_registers(
        q_head, offs_m, row_valid, stride_qm, stride_qd, D_K, BLOCK_M, BLOCK_DK, NUM_DK
    )
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for run in tl.static_range(1 if HAS_DENSE_MASK else 3):
        first, last = _span(run, start, u1, u2, n_hi)
        for start_n in range(first, last, BLOCK_N):
            kind = _tile_kind(kinds_head, pid_m, start_n // BLOCK_N, stride_tm, HAS_DENSE_MASK)
            tile_mask = _tile_mask_head(mask_head, kind, pid_m * BLOCK_M, start_n, BLOCK_M, BLOCK_N)
            if kind != 0:
                acc, l_i, m_i = _fwd_tile(
                    acc, l_i, m_i, q, start_n, kind,
                    q_head, stride_qm, stride_qd,
                    k_head, stride_kn, stride_kd,
                    v_head, stride_vn, stride_vd,
                    offs_m, row_valid, lo, hi, rows_hash, key_padding, n_lo, n_hi, K_POS,
                    tile_mask, stride_mm, bias_head, stride_bm, stride_bn, offs_dv, dv_valid,
                    q_offset, scale, softcap, slope, drop_thr,
                    D_K, run != 1, HAS_KEY_PADDING, HAS_DENSE_MASK, SOFTCAP, ALIBI, HAS_BIAS,
                    DROPOUT, BLOCK_M, BLOCK_N, BLOCK_DK, NUM_DK, PREC,
                )  # fmt: skip

    has = row_live & (l_i != 0.0)  # rows with a readable key (NaN scores stay NaN, not 0)
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
    o_head = _head(O, b, h, stride_ob, stride_oh)
    _store_tile(o_head, out, offs_m, offs_dv, row_valid, dv_valid, stride_om, stride_od)
    if pid_c == 0:
        lse = tl.where(has, (m_i + tl.math.log2(tl.where(has, l_i, 1.0))) / LOG2E, float("-inf"))
        tl.store(_head_rows(LSE, b, h, H_q, T_q) + offs_m, lse, mask=row_valid)


# ---- backward ----------------------------------------------------------------------------
@triton.jit
def _bwd_weights(
    s, lse, pos_i, j, lo, hi, i, live, mask_head, stride_mm, kind,
    bias_head, stride_bm, stride_bn,
    scale, softcap, slope, MASKED: tl.constexpr, HAS_DENSE_MASK: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """The forward's weights recomputed on a tile from the products s and the saved lse
    (log2 units), either orientation (broadcastable row vectors lse, pos_i, lo, hi, i and
    key vector j): (P, the softcap's derivative, the allowed cells), P = 0 where not allowed."""
    s, softcap_grad = _scores(s, pos_i, j, scale, softcap, slope, SOFTCAP, ALIBI)
    s = _add_bias(s, bias_head, i, j, live, stride_bm, stride_bn, HAS_BIAS)
    p = tl.math.exp2(s - lse)
    if MASKED:
        allowed = _allowed(lo, hi, i, j, live, mask_head, stride_mm, kind, HAS_DENSE_MASK)
        p = tl.where(allowed, p, 0.0)
    else:
        allowed = live  # unused: nothing is masked
    return p, softcap_grad, allowed


@triton.jit
def _score_grads(
    p, dp, delta, softcap_grad, allowed, keep, drop_scale,
    MASKED: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
):  # fmt: skip
    """(dS, dZ): dZ = P ∘ (dP - D) (the gradient by the modified scores: a bias's), dP
    through the kept cells (scaled 1/(1-p)); dS = dZ times the softcap's derivative; both
    0 where not allowed."""
    if DROPOUT:
        dp = tl.where(keep, dp * drop_scale, 0.0)
    dz = p * (dp - delta)
    if MASKED:
        dz = tl.where(allowed, dz, 0.0)
    ds = dz
    if SOFTCAP:
        ds = ds * softcap_grad
    return ds, dz


@triton.jit
def _add_ds_dot(
    acc, ds, x_head, offs_t, t_live, offs_c, c_valid, stride_t, stride_c,
    MASKED: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """acc + dS @ X[offs_t, offs_c] (dQ from K, dK from Q). In a masked tile X's NaN and
    ±inf count 0 where their weight is 0 (a NaN a row does read is in dS already)."""
    x = _load_tile(x_head, offs_t, offs_c, t_live, c_valid, stride_t, stride_c)
    if MASKED:
        x = _finite0(x)
    return acc + tl.dot(ds.to(x.dtype), x, input_precision=PREC)


@triton.jit
def _dkdv_tile(
    acc_dk, acc_dv, k, v, start_m, q_end, kind, head_hash, keys_hash,
    q_head, stride_qm: tl.constexpr, stride_qd: tl.constexpr,
    k_head, stride_kn: tl.constexpr, stride_kd: tl.constexpr,
    v_head, stride_vn: tl.constexpr, stride_vd: tl.constexpr,
    do_head, stride_dom: tl.constexpr, stride_dod: tl.constexpr,
    lse_head, delta_head, lo_b, hi_b, Q_POS, mask_head, stride_mm,
    bias_head, stride_bm, stride_bn, dbias_head,
    offs_n, key_live, offs_c, ck_valid, cv_valid,
    T_k, q_offset, scale, softcap, slope, drop_thr, drop_scale,
    D_K: tl.constexpr, D_V: tl.constexpr, MASKED: tl.constexpr,
    HOST_INTERVALS: tl.constexpr, CAUSAL: tl.constexpr, HAS_DENSE_MASK: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_DBIAS: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr,
    NUM_DK: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_DV: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """One query tile, transposed: sT = K Qᵀ (BLOCK_N × BLOCK_M), so dK, dV rows stay with
    this program. Rows at or past q_end read none of these keys."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    if MASKED:
        row_live = offs_m < q_end
    else:
        row_live = offs_m >= 0
    sT = _dot_nt(
        k, k_head, q_head, offs_n, offs_m, key_live, row_live,
        stride_kn, stride_kd, stride_qm, stride_qd,
        D_K, BLOCK_N, BLOCK_M, BLOCK_DK, NUM_DK, PREC,
    )  # fmt: skip
    lse = _lse_log2(lse_head, offs_m, row_live)
    if MASKED:
        lo, hi = _intervals(lo_b, hi_b, offs_m, row_live, T_k, q_offset, HOST_INTERVALS, CAUSAL)
    else:
        lo = offs_m  # unused: nothing is masked
        hi = offs_m
    pT, softcap_gradT, allowedT = _bwd_weights(
        sT, lse[None, :], offs_m[None, :] + q_offset,
        offs_n[:, None], lo[None, :], hi[None, :], offs_m[None, :],
        row_live[None, :] & key_live[:, None], mask_head, stride_mm, kind,
        bias_head, stride_bm, stride_bn,
        scale, softcap, slope, MASKED, HAS_DENSE_MASK, SOFTCAP, ALIBI, HAS_BIAS,
    )  # fmt: skip
    if DROPOUT:
        rows_hash = _row_hash(head_hash, Q_POS, offs_m, row_live)
        keepT = _keep(rows_hash[None, :], keys_hash[:, None], drop_thr)
        pT_kept = tl.where(keepT, pT, 0.0)
    else:
        keepT = allowedT  # unused
        pT_kept = pT
    do_c = _load_tile(do_head, offs_m, offs_c, row_live, cv_valid, stride_dom, stride_dod)
    # as in the forward: dH rows that may not read this key never reach dV
    acc_dv = _add_weighted(acc_dv, pT_kept, pT, do_c, MASKED, PREC)
    dpT = _dot_nt(
        v, v_head, do_head, offs_n, offs_m, key_live, row_live,
        stride_vn, stride_vd, stride_dom, stride_dod,
        D_V, BLOCK_N, BLOCK_M, BLOCK_DV, NUM_DV, PREC,
    )  # fmt: skip
    delta = tl.load(delta_head + offs_m, mask=row_live, other=0.0)
    dsT, dzT = _score_grads(
        pT, dpT, delta[None, :], softcap_gradT, allowedT, keepT, drop_scale,
        MASKED, SOFTCAP, DROPOUT,
    )  # fmt: skip
    if HAS_DBIAS:  # each cell once: this program owns the key tile for every query head
        ptr = dbias_head + offs_m[None, :].to(tl.int64) * T_k + offs_n[:, None]
        tl.store(ptr, dzT, mask=row_live[None, :] & (offs_n[:, None] < T_k))
    acc_dk = _add_ds_dot(
        acc_dk, dsT, q_head, offs_m, row_live, offs_c, ck_valid, stride_qm, stride_qd,
        MASKED, PREC,
    )  # fmt: skip
    return acc_dk, acc_dv


@triton.jit
def dkdv_kernel(
    Q, stride_qb, stride_qh, stride_qm: tl.constexpr, stride_qd: tl.constexpr,
    K, stride_kb, stride_kh, stride_kn: tl.constexpr, stride_kd: tl.constexpr,
    V, stride_vb, stride_vh, stride_vn: tl.constexpr, stride_vd: tl.constexpr,
    DO, stride_dob, stride_doh, stride_dom: tl.constexpr, stride_dod: tl.constexpr,
    DK, stride_dkb, stride_dkh, stride_dkn: tl.constexpr, stride_dkd: tl.constexpr,
    DV, stride_dvb, stride_dvh, stride_dvn: tl.constexpr, stride_dvd: tl.constexpr,
    LSE, DELTA, KEY_TILE_ROWS, stride_rb, DBIAS,
    LO, HI, KEY_PADDING,
    DENSE_MASK, stride_mb, stride_mh, stride_mm,
    TILE_KINDS, stride_tb, stride_th, stride_tm,
    SLOPES, Q_POS, K_POS,
    BIAS, stride_bb, stride_bh, stride_bm, stride_bn,
    H_q, T_q, T_k, D_K: tl.constexpr, D_V: tl.constexpr, GROUP, q_offset,
    scale, softcap, seed, seed_offset, drop_thr, drop_scale,
    HAS_KEY_PADDING: tl.constexpr, HOST_INTERVALS: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_DENSE_MASK: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr, HAS_DBIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr,
    NUM_DK: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_DV: tl.constexpr,
    BLOCK_C: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_N keys × BLOCK_C columns of dK and dV for one (b, kv-head),
    summed over the GROUP query heads that share it (no atomics); with HAS_DBIAS also the
    gradient by the scores of its key tile, into DBIAS (B, H_q, T_q, T_k) (every program of
    the columns writes the same values)."""
    pid_n, pid_c, b, hk = _program(H_q // GROUP)
    b64 = b.to(tl.int64)
    k_head = _head(K, b, hk, stride_kb, stride_kh)
    v_head = _head(V, b, hk, stride_vb, stride_vh)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    key_valid = offs_n < T_k
    key_padding = KEY_PADDING + b64 * T_k
    key_live = _live_keys(key_padding, offs_n, 0, T_k, True, HAS_KEY_PADDING)
    # query rows that may read this key tile, from the host: [q_lo, q_hi), unmasked [r1, r2)
    if HOST_INTERVALS:
        tile_rows = KEY_TILE_ROWS + b64 * stride_rb + pid_n * 4
        q_lo = tl.load(tile_rows)
        q_hi = tl.load(tile_rows + 1)
        r1 = tl.load(tile_rows + 2)
        r2 = tl.load(tile_rows + 3)
    else:  # plain causal (row i reads keys <= i + q_offset) or full attention
        s0 = pid_n * BLOCK_N
        q_hi = T_q
        r2 = T_q
        if CAUSAL:
            q_lo = tl.maximum(s0 - q_offset, 0)
            r1 = tl.maximum(s0 + BLOCK_N - 1 - q_offset, 0)
        else:
            q_lo = 0
            r1 = 0
        r1 = tl.where(s0 + BLOCK_N > T_k, T_q, r1)  # a partial tile: every row masked
        if HAS_KEY_PADDING:
            r1 = 0
            r2 = 0
    q_hi = tl.where(q_hi > q_lo, q_hi, 0)  # nobody reads this tile (past every length)
    q_start = (q_lo // BLOCK_M) * BLOCK_M
    u1 = tl.minimum(tl.maximum(tl.cdiv(r1, BLOCK_M) * BLOCK_M, q_start), q_hi)
    u2 = tl.minimum(tl.maximum((r2 // BLOCK_M) * BLOCK_M, u1), q_hi)
    if HAS_DENSE_MASK:  # one masked run; the tile kinds skip the empty tiles
        u1 = q_hi
        u2 = q_hi

    k = _rows_in_registers(
        k_head, offs_n, key_live, stride_kn, stride_kd, D_K, BLOCK_N, BLOCK_DK, NUM_DK
    )
    v = _rows_in_registers(
        v_head, offs_n, key_live, stride_vn, stride_vd, D_V, BLOCK_N, BLOCK_DV, NUM_DV
    )
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    ck_valid = offs_c < D_K
    cv_valid = offs_c < D_V
    acc_dk = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
    acc_dv = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
    lo_b = LO + b64 * T_q  # batch row b of the intervals
    hi_b = HI + b64 * T_q
    if DROPOUT:
        keys_hash = _key_hash(K_POS, offs_n, key_valid)
    else:
        keys_hash = offs_n  # unused
    for g in range(GROUP):
        h = hk * GROUP + g
        q_head = _head(Q, b, h, stride_qb, stride_qh)
        do_head = _head(DO, b, h, stride_dob, stride_doh)
        lse_head = _head_rows(LSE, b, h, H_q, T_q)
        delta_head = _head_rows(DELTA, b, h, H_q, T_q)
        mask_head = _head(DENSE_MASK, b, h, stride_mb, stride_mh)
        kinds_head = _head(TILE_KINDS, b, h, stride_tb, stride_th)
        bias_head = _head(BIAS, b, h, stride_bb, stride_bh)
        dbias_head = DBIAS + (b64 * H_q + h) * T_q * T_k
        slope = _slope(SLOPES, b * H_q + h, ALIBI)
        head_hash = 0
        if DROPOUT:
            head_hash = _head_hash(seed, seed_offset, b, h)
        for run in tl.static_range(1 if HAS_DENSE_MASK else 3):
            first, last = _span(run, q_start, u1, u2, q_hi)
            for start_m in range(first, last, BLOCK_M):
                kind = _tile_kind(kinds_head, start_m // BLOCK_M, pid_n, stride_tm, HAS_DENSE_MASK)
                tile_mask = _tile_mask_head(
                    mask_head, kind, start_m, pid_n * BLOCK_N, BLOCK_M, BLOCK_N
                )
                if kind != 0:
                    acc_dk, acc_dv = _dkdv_tile(
                        acc_dk, acc_dv, k, v, start_m, q_hi, kind, head_hash, keys_hash,
                        q_head, stride_qm, stride_qd,
                        k_head, stride_kn, stride_kd,
                        v_head, stride_vn, stride_vd,
                        do_head, stride_dom, stride_dod,
                        lse_head, delta_head, lo_b, hi_b, Q_POS, tile_mask, stride_mm,
                        bias_head, stride_bm, stride_bn, dbias_head,
                        offs_n, key_live, offs_c, ck_valid, cv_valid,
                        T_k, q_offset, scale, softcap, slope, drop_thr, drop_scale,
                        D_K, D_V, run != 1, HOST_INTERVALS, CAUSAL, HAS_DENSE_MASK,
                        SOFTCAP, ALIBI, HAS_BIAS, HAS_DBIAS, DROPOUT,
                        BLOCK_M, BLOCK_N, BLOCK_DK, NUM_DK, BLOCK_DV, NUM_DV, PREC,
                    )  # fmt: skip

    dk_head = _head(DK, b, hk, stride_dkb, stride_dkh)
    _store_tile(
        dk_head, acc_dk * scale, offs_n, offs_c, key_valid, ck_valid, stride_dkn, stride_dkd
    )
    if DROPOUT:
        acc_dv = acc_dv * drop_scale
    dv_head = _head(DV, b, hk, stride_dvb, stride_dvh)
    _store_tile(dv_head, acc_dv, offs_n, offs_c, key_valid, cv_valid, stride_dvn, stride_dvd)


@triton.jit
def _dq_tile(
    acc, q, do, start_n, kind,
    q_head, stride_qm: tl.constexpr, stride_qd: tl.constexpr,
    k_head, stride_kn: tl.constexpr, stride_kd: tl.constexpr,
    v_head, stride_vn: tl.constexpr, stride_vd: tl.constexpr,
    do_head, stride_dom: tl.constexpr, stride_dod: tl.constexpr,
    offs_m, row_valid, lo, hi, lse, delta, rows_hash, key_padding, n_lo, n_hi, K_POS,
    mask_head, stride_mm, bias_head, stride_bm, stride_bn, offs_c, c_valid,
    q_offset, scale, softcap, slope, drop_thr, drop_scale,
    D_K: tl.constexpr, D_V: tl.constexpr, MASKED: tl.constexpr,
    HAS_KEY_PADDING: tl.constexpr, HAS_DENSE_MASK: tl.constexpr, SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr,
    NUM_DK: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_DV: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """One key tile of dQ = dS K."""
    offs_n, key_live, s = _key_tile(
        q, q_head, k_head, start_n, offs_m, row_valid, key_padding, n_lo, n_hi,
        stride_qm, stride_qd, stride_kn, stride_kd, D_K, MASKED, HAS_KEY_PADDING,
        BLOCK_M, BLOCK_N, BLOCK_DK, NUM_DK, PREC,
    )  # fmt: skip
    p, softcap_grad, allowed = _bwd_weights(
        s, lse[:, None], offs_m[:, None] + q_offset, offs_n[None, :], lo[:, None], hi[:, None],
        offs_m[:, None], row_valid[:, None] & key_live[None, :], mask_head, stride_mm, kind,
        bias_head, stride_bm, stride_bn,
        scale, softcap, slope, MASKED, HAS_DENSE_MASK, SOFTCAP, ALIBI, HAS_BIAS,
    )  # fmt: skip
    dp = _dot_nt(
        do, do_head, v_head, offs_m, offs_n, row_valid, key_live,
        stride_dom, stride_dod, stride_vn, stride_vd,
        D_V, BLOCK_M, BLOCK_N, BLOCK_DV, NUM_DV, PREC,
    )  # fmt: skip
    if DROPOUT:
        keep = _keep(rows_hash[:, None], _key_hash(K_POS, offs_n, key_live)[None, :], drop_thr)
    else:
        keep = allowed  # unused
    ds, _ = _score_grads(
        p, dp, delta[:, None], softcap_grad, allowed, keep, drop_scale, MASKED, SOFTCAP, DROPOUT
    )  # fmt: skip
    return _add_ds_dot(
        acc, ds, k_head, offs_n, key_live, offs_c, c_valid, stride_kn, stride_kd, MASKED, PREC
    )  # fmt: skip


@triton.jit
def dq_kernel(
    Q, stride_qb, stride_qh, stride_qm: tl.constexpr, stride_qd: tl.constexpr,
    K, stride_kb, stride_kh, stride_kn: tl.constexpr, stride_kd: tl.constexpr,
    V, stride_vb, stride_vh, stride_vn: tl.constexpr, stride_vd: tl.constexpr,
    DO, stride_dob, stride_doh, stride_dom: tl.constexpr, stride_dod: tl.constexpr,
    DQ, stride_dqb, stride_dqh, stride_dqm: tl.constexpr, stride_dqd: tl.constexpr,
    LSE, DELTA,
    LO, HI, KEY_PADDING,
    DENSE_MASK, stride_mb, stride_mh, stride_mm,
    TILE_KINDS, stride_tb, stride_th, stride_tm,
    SLOPES, Q_POS, K_POS,
    BIAS, stride_bb, stride_bh, stride_bm, stride_bn,
    H_q, T_q, T_k, D_K: tl.constexpr, D_V: tl.constexpr, GROUP, q_offset,
    scale, softcap, seed, seed_offset, drop_thr, drop_scale,
    HAS_KEY_PADDING: tl.constexpr, HOST_INTERVALS: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_DENSE_MASK: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr,
    NUM_DK: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_DV: tl.constexpr,
    BLOCK_C: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_M query rows × BLOCK_C columns of dQ for one (b, h)."""
    pid_m, pid_c, b, h = _program(H_q)
    offs_m, row_valid, lo, hi, row_live, n_lo, n_hi, start, u1, u2, slope, rows_hash = _query_rows(
        LO, HI, SLOPES, Q_POS, pid_m, b, h, H_q, T_q, T_k, q_offset, seed, seed_offset,
        BLOCK_M, BLOCK_N, HAS_KEY_PADDING, HOST_INTERVALS, CAUSAL, HAS_DENSE_MASK, ALIBI, DROPOUT,
    )  # fmt: skip
    lse = _lse_log2(_head_rows(LSE, b, h, H_q, T_q), offs_m, row_valid)
    delta = tl.load(_head_rows(DELTA, b, h, H_q, T_q) + offs_m, mask=row_valid, other=0.0)
    q_head = _head(Q, b, h, stride_qb, stride_qh)
    q = _rows_in_registers(
        q_head, offs_m, row_valid, stride_qm, stride_qd, D_K, BLOCK_M, BLOCK_DK, NUM_DK
    )
    do_head = _head(DO, b, h, stride_dob, stride_doh)
    do = _rows_in_registers(
        do_head, offs_m, row_valid, stride_dom, stride_dod, D_V, BLOCK_M, BLOCK_DV, NUM_DV
    )
    k_head = _head(K, b, h // GROUP, stride_kb, stride_kh)
    v_head = _head(V, b, h // GROUP, stride_vb, stride_vh)
    key_padding = KEY_PADDING + b.to(tl.int64) * T_k
    mask_head = _head(DENSE_MASK, b, h, stride_mb, stride_mh)
    kinds_head = _head(TILE_KINDS, b, h, stride_tb, stride_th)
    bias_head = _head(BIAS, b, h, stride_bb, stride_bh)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_valid = offs_c < D_K
    acc = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    for run in tl.static_range(1 if HAS_DENSE_MASK else 3):
        first, last = _span(run, start, u1, u2, n_hi)
        for start_n in range(first, last, BLOCK_N):
            kind = _tile_kind(kinds_head, pid_m, start_n // BLOCK_N, stride_tm, HAS_DENSE_MASK)
            tile_mask = _tile_mask_head(mask_head, kind, pid_m * BLOCK_M, start_n, BLOCK_M, BLOCK_N)
            if kind != 0:
                acc = _dq_tile(
                    acc, q, do, start_n, kind,
                    q_head, stride_qm, stride_qd,
                    k_head, stride_kn, stride_kd,
                    v_head, stride_vn, stride_vd,
                    do_head, stride_dom, stride_dod,
                    offs_m, row_valid, lo, hi, lse, delta, rows_hash,
                    key_padding, n_lo, n_hi, K_POS, tile_mask, stride_mm,
                    bias_head, stride_bm, stride_bn, offs_c, c_valid,
                    q_offset, scale, softcap, slope, drop_thr, drop_scale,
                    D_K, D_V, run != 1, HAS_KEY_PADDING, HAS_DENSE_MASK, SOFTCAP, ALIBI, HAS_BIAS,
                    DROPOUT,
                    BLOCK_M, BLOCK_N, BLOCK_DK, NUM_DK, BLOCK_DV, NUM_DV, PREC,
                )  # fmt: skip
    dq = tl.where(row_live[:, None], acc * scale, 0.0)
    dq_head = _head(DQ, b, h, stride_dqb, stride_dqh)
    _store_tile(dq_head, dq, offs_m, offs_c, row_valid, c_valid, stride_dqm, stride_dqd)


@triton.jit
def bwd_preprocess(
    O, DO, LSE, DLSE, DELTA, N_ROWS,
    D_V: tl.constexpr, HAS_DLSE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_DV: tl.constexpr,
):  # fmt: skip
    """D = rowsum(dH ∘ H) in fp32 (minus the lse gradient; 0 on empty rows), for the
    rows of contiguous (B·H_q·T_q, d_v) views of H and dH, into DELTA."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = offs_m < N_ROWS
    rows = offs_m.to(tl.int64) * D_V
    acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    for c in range(NUM_DV):
        offs_d = c * BLOCK_DV + tl.arange(0, BLOCK_DV)
        d_valid = offs_d < D_V
        o = _load_tile(O, rows, offs_d, row_valid, d_valid, 1, 1).to(tl.float32)
        do = _load_tile(DO, rows, offs_d, row_valid, d_valid, 1, 1).to(tl.float32)
        acc += tl.sum(o * do, axis=1)
    if HAS_DLSE:  # d lse / d S = A, so a gradient on lse shifts D
        acc -= tl.load(DLSE + offs_m, mask=row_valid, other=0.0)
    lse = tl.load(LSE + offs_m, mask=row_valid, other=0.0)
    tl.store(DELTA + offs_m, tl.where(lse == float("-inf"), 0.0, acc), mask=row_valid)
