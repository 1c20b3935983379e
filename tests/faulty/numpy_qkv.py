"""NumPy attention fn(q, k, v, key_padding_mask=None): q, k T×d_k, v T×d_v (or (B, T, d)).

``key_padding_mask`` (B, T) is True where a key may be read. Each function below plants one
fault from the diagnose catalogue; ``correct`` has none. Names: the catalogue id.
"""

import numpy as np


def _allowed(T, key_padding_mask):
    allowed = np.tril(np.ones((T, T), dtype=bool))
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, :]
    return allowed


def _softmax_rows(z):
    m = z.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(z - m)
    den = e.sum(axis=-1, keepdims=True)
    return np.where(den > 0, e / np.where(den > 0, den, 1.0), 0.0)


def correct(q, k, v, key_padding_mask=None):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    z = np.where(_allowed(s.shape[-1], key_padding_mask), s, -np.inf)
    return _softmax_rows(z) @ v


def k_not_transposed(q, k, v, key_padding_mask=None):
    s = q @ k / np.sqrt(q.shape[-1])  # fault: K is not transposed
    z = np.where(_allowed(s.shape[-1], key_padding_mask), s, -np.inf)
    return _softmax_rows(z) @ v


def scale_by_dk(q, k, v, key_padding_mask=None):
    s = q @ np.swapaxes(k, -1, -2) / q.shape[-1]  # fault: / d_k
    z = np.where(_allowed(s.shape[-1], key_padding_mask), s, -np.inf)
    return _softmax_rows(z) @ v


def diagonal_blocked(q, k, v, key_padding_mask=None):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    T = s.shape[-1]
    allowed = np.tril(np.ones((T, T), dtype=bool), k=-1)  # fault: j < i
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, :]
    return _softmax_rows(np.where(allowed, s, -np.inf)) @ v


def anti_causal_mask(q, k, v, key_padding_mask=None):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    T = s.shape[-1]
    allowed = np.triu(np.ones((T, T), dtype=bool))  # fault: upper triangle
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, :]
    return _softmax_rows(np.where(allowed, s, -np.inf)) @ v


def padding_ignored(q, k, v, key_padding_mask=None):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    T = s.shape[-1]
    allowed = np.tril(np.ones((T, T), dtype=bool))  # fault: key_padding_mask never used
    return _softmax_rows(np.where(allowed, s, -np.inf)) @ v


def padding_queries_only(q, k, v, key_padding_mask=None):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    T = s.shape[-1]
    allowed = np.tril(np.ones((T, T), dtype=bool))
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, :, None]  # fault: rows, not columns
    return _softmax_rows(np.where(allowed, s, -np.inf)) @ v


def softmax_all_entries(q, k, v, key_padding_mask=None):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    z = np.where(_allowed(s.shape[-1], key_padding_mask), s, -np.inf)
    e = np.exp(z - z.max(axis=(-2, -1), keepdims=True))
    a = e / e.sum(axis=(-2, -1), keepdims=True)  # fault: one distribution over T×T
    return a @ v


def nan_on_empty_rows(q, k, v, key_padding_mask=None):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    z = np.where(_allowed(s.shape[-1], key_padding_mask), s, -np.inf)
    e = np.exp(z - z.max(axis=-1, keepdims=True))  # fault: a row of -inf gives 0/0
    return e / e.sum(axis=-1, keepdims=True) @ v


def missing_scale_and_query_axis(q, k, v, key_padding_mask=None):
    """Two faults: no 1/√d_k (stage S) and softmax over queries (stage A)."""
    s = q @ np.swapaxes(k, -1, -2)
    z = np.where(_allowed(s.shape[-1], key_padding_mask), s, -np.inf)
    e = np.exp(z - z.max(axis=-2, keepdims=True))
    return e / e.sum(axis=-2, keepdims=True) @ v


def hangs(q, k, v):
    while True:
        pass
