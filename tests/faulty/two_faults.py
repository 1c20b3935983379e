"""Hand-written attention of the kind people write (NumPy, ``np.tril`` for the causal mask,
which is aligned top-left), each with two faults; the patched-row variants of catalogued
faults; faults on the value side and in precision.

``FINDINGS[name]``: the (stage, fault id) of every finding diagnose must give, in order;
``DECLARED[name]``: what the code is meant to compute (plain causal where not given).
"""

import numpy as np


def _scores(q, k, c=None):
    c = 1 / np.sqrt(q.shape[-1]) if c is None else c
    return q @ np.swapaxes(k, -1, -2) * c


def _tril(q, k):
    """np.tril of T_q×T_k: top-left aligned (wrong when T_q < T_k)."""
    return np.tril(np.ones((q.shape[-2], k.shape[-2]), bool))


def _causal(q, k):
    T_q, T_k = q.shape[-2], k.shape[-2]
    return np.tril(np.ones((T_q, T_k), bool), T_k - T_q)


def _softmax(z):
    m = z.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(z - m)
    den = e.sum(-1, keepdims=True)
    return np.where(den > 0, e / np.where(den > 0, den, 1.0), 0.0)


def _softmax_unstable(z):
    e = np.exp(z)  # no max subtraction
    return e / e.sum(-1, keepdims=True)


# -- the cases ---------------------------------------------------------------------------
def mask_after_softmax_tril(q, k, v):
    return (_softmax(_scores(q, k)) * _tril(q, k)) @ v  # mask after softmax; np.tril top-left


def unstable_tril(q, k, v):
    return _softmax_unstable(np.where(_tril(q, k), _scores(q, k), -np.inf)) @ v


def diagonal_blocked_row_one_patched(q, k, v):
    T_q, T_k = q.shape[-2], k.shape[-2]
    i, j = np.arange(T_q)[:, None] + T_k - T_q, np.arange(T_k)[None, :]
    allowed = (j < i) | ((i == 0) & (j == 0))  # the diagonal blocked, row 1 patched (no NaN)
    return _softmax(np.where(allowed, _scores(q, k), -np.inf)) @ v


def diagonal_blocked_row_one_uniform(q, k, v):
    T_q, T_k = q.shape[-2], k.shape[-2]
    i, j = np.arange(T_q)[:, None] + T_k - T_q, np.arange(T_k)[None, :]
    s = np.where(j < i, _scores(q, k), -np.inf)
    s[..., i[:, 0] == 0, :] = 0.0  # row 1 read nothing: patched to a uniform row
    return _softmax(s) @ v


def no_mask_padding_rows_zeroed(q, k, v, lengths=None):
    """No mask at all, but rows of padding queries (i >= length) patched to zero."""
    out = _softmax(_scores(q, k)) @ v
    if lengths is not None:
        pad = np.arange(q.shape[-2]) >= np.asarray(lengths).reshape(-1, 1)  # (B, T_q)
        out = np.where(pad.reshape(out.shape[:-1] + (1,)), 0.0, out)
    return out


def values_from_the_previous_row(q, k, v):
    A = _softmax(np.where(_causal(q, k), _scores(q, k), -np.inf))
    return A @ np.roll(v, 1, axis=-2)  # key j's weight multiplies v_{j-1}


def values_reversed(q, k, v):
    A = _softmax(np.where(_causal(q, k), _scores(q, k), -np.inf))
    return A @ v[..., ::-1, :]


def _bf16(x):
    """Round to bfloat16 (keep the top 16 bits of a float32), back in float64."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & np.uint32(0xFFFF0000)  # to nearest even
    return bits.view(np.float32).astype(np.float64)


def weights_rounded_to_bf16(q, k, v):
    A = _softmax(np.where(_causal(q, k), _scores(q, k), -np.inf))
    return _bf16(A) @ v  # float64 in, float64 out: the weights lost precision on the way


def weights_rounded_to_fp16(q, k, v):
    A = _softmax(np.where(_causal(q, k), _scores(q, k), -np.inf))
    return A.astype(np.float16).astype(np.float64) @ v


# -- more two-fault combinations -----------------------------------------------------------------
def missing_scale_no_mask(q, k, v):
    return _softmax(_scores(q, k, 1.0)) @ v


def scale_by_dk_unstable(q, k, v):
    z = np.where(_causal(q, k), _scores(q, k, 1 / q.shape[-1]), -np.inf)
    return _softmax_unstable(z) @ v


def all_entries_tril(q, k, v):
    z = np.where(_tril(q, k), _scores(q, k), -np.inf)
    e = np.exp(z - z.max((-2, -1), keepdims=True))
    return e / e.sum((-2, -1), keepdims=True) @ v  # one softmax over T_q×T_k; np.tril


def no_mask_unstable(q, k, v):
    return _softmax_unstable(_scores(q, k)) @ v


def weak_fill_missing_scale(q, k, v):
    return _softmax(np.where(_causal(q, k), _scores(q, k, 1.0), -1e4)) @ v


def mask_after_softmax_unstable(q, k, v):
    return (_softmax_unstable(_scores(q, k)) * _causal(q, k)) @ v


FINDINGS = {
    "mask_after_softmax_tril": [("A", "mask-after-softmax"), ("M", "causal-top-left")],
    "unstable_tril": [("M", "causal-top-left"), ("A", "unstable-softmax")],
    "diagonal_blocked_row_one_patched": [("M", "diagonal-blocked")],
    "diagonal_blocked_row_one_uniform": [("M", "diagonal-blocked")],
    "values_from_the_previous_row": [("H", None)],
    "values_reversed": [("H", None)],
    "weights_rounded_to_bf16": [("A", None)],
    "weights_rounded_to_fp16": [("A", None)],
    "missing_scale_no_mask": [("S", "missing-scale"), ("M", "no-mask")],
    "scale_by_dk_unstable": [("S", "scale-by-dk"), ("A", "unstable-softmax")],
    "all_entries_tril": [("A", "softmax-all-entries"), ("M", "causal-top-left")],
    "no_mask_unstable": [("M", "no-mask"), ("A", "unstable-softmax")],
    "weak_fill_missing_scale": [("S", "missing-scale"), ("M", "finite-fill-too-weak")],
    "mask_after_softmax_unstable": [("A", "mask-after-softmax"), ("A", "unstable-softmax")],
    "no_mask_padding_rows_zeroed": [("M", "no-mask")],
}
DECLARED = {"no_mask_padding_rows_zeroed": {"lengths": [4]}}  # else plain causal
