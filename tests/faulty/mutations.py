"""Uncatalogued mutations of a correct NumPy fn(q, k, v): each changes one thing.

``TRUE_PATTERN[name](T)`` is the read pattern the mutation really has on a T×T probe, and
``STAGE[name]`` the first stage in dependency order where it differs from plain causal.
"""

import numpy as np


def _softmax_rows(z):
    m = z.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(z - m)
    den = e.sum(axis=-1, keepdims=True)
    return np.where(den > 0, e / np.where(den > 0, den, 1.0), 0.0)


def _scores(q, k, c=1.0):
    return q @ np.swapaxes(k, -1, -2) * (c / np.sqrt(q.shape[-1]))


def _ij(T):
    return np.arange(T)[:, None], np.arange(T)[None, :]


def _attend(q, k, v, allowed, c=1.0):
    return _softmax_rows(np.where(allowed, _scores(q, k, c), -np.inf)) @ v


def patched_first_row(q, k, v):
    """Diagonal blocked, but row 1 may read itself (so that it is not NaN)."""
    i, j = _ij(q.shape[-2])
    return _attend(q, k, v, (j < i) | ((i == 0) & (j == 0)))


def reads_next_token(q, k, v):
    i, j = _ij(q.shape[-2])
    return _attend(q, k, v, j <= i + 1)  # off by one: j <= i + 1


def first_key_blocked(q, k, v):
    i, j = _ij(q.shape[-2])
    return _attend(q, k, v, (j <= i) & (j >= 1))  # range starts at 1


def first_row_unmasked(q, k, v):
    i, j = _ij(q.shape[-2])
    return _attend(q, k, v, (j <= i) | (i == 0))


def window_two(q, k, v):
    i, j = _ij(q.shape[-2])
    return _attend(q, k, v, (j <= i) & (i - j < 2))  # a window nobody declared


def one_entry_dropped(q, k, v):
    i, j = _ij(q.shape[-2])
    return _attend(q, k, v, (j <= i) & ~((i == 3) & (j == 1)))


def sink_and_local(q, k, v):
    """Key 1 (a sink) and the last two keys, as a streaming cache keeps them."""
    i, j = _ij(q.shape[-2])
    return _attend(q, k, v, (j <= i) & ((j == 0) | (i - j < 2)))


def temperature(q, k, v):
    i, j = _ij(q.shape[-2])
    return _attend(q, k, v, j <= i, c=0.9)  # a stray 0.9


def epsilon_in_denominator(q, k, v):
    i, j = _ij(q.shape[-2])
    z = np.where(j <= i, _scores(q, k), -np.inf)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / (e.sum(axis=-1, keepdims=True) + 0.05) @ v  # a large "epsilon"


def wrong_axis_one_head(q, k, v):
    """(B, H, T, d): head 2 normalizes over queries; 2-D input is one head, right."""
    i, j = _ij(q.shape[-2])
    z = np.where(j <= i, _scores(q, k), -np.inf)
    A = _softmax_rows(z)
    if z.ndim == 4 and z.shape[1] > 1:
        e = np.exp(z[:, 1] - z[:, 1].max(axis=-2, keepdims=True))
        A[:, 1] = e / e.sum(axis=-2, keepdims=True)
    return A @ v


def scale_missing_one_head(q, k, v):
    i, j = _ij(q.shape[-2])
    s = _scores(q, k)
    if s.ndim == 4 and s.shape[1] > 1:
        s[:, 1] *= np.sqrt(q.shape[-1])  # head 2: no 1/√d_k
    return _softmax_rows(np.where(j <= i, s, -np.inf)) @ v


def sinks_ignored(q, k, v):
    """Declared sinks=[0.5]; computes plain causal attention without them."""
    i, j = _ij(q.shape[-2])
    return _attend(q, k, v, j <= i)


def _tp(fn):
    return fn


def _causal(T):
    i, j = _ij(T)
    return j <= i


TRUE_PATTERN = {
    "patched_first_row": lambda T: (_ij(T)[1] < _ij(T)[0]) | ((_ij(T)[0] == 0) & (_ij(T)[1] == 0)),
    "reads_next_token": lambda T: _ij(T)[1] <= _ij(T)[0] + 1,
    "first_key_blocked": lambda T: _causal(T) & (_ij(T)[1] >= 1),
    "first_row_unmasked": lambda T: _causal(T) | (_ij(T)[0] == 0),
    "window_two": lambda T: _causal(T) & (_ij(T)[0] - _ij(T)[1] < 2),
    "one_entry_dropped": lambda T: _causal(T) & ~((_ij(T)[0] == 3) & (_ij(T)[1] == 1)),
    "sink_and_local": lambda T: _causal(T) & ((_ij(T)[1] == 0) | (_ij(T)[0] - _ij(T)[1] < 2)),
    "temperature": _causal,
    "epsilon_in_denominator": _causal,
    "wrong_axis_one_head": _causal,
    "scale_missing_one_head": _causal,
    "sinks_ignored": _causal,
}
STAGE = {
    "patched_first_row": "M",
    "reads_next_token": "M",
    "first_key_blocked": "M",
    "first_row_unmasked": "M",
    "window_two": "M",
    "one_entry_dropped": "M",
    "sink_and_local": "M",
    "temperature": "S",
    "epsilon_in_denominator": "A",
    "wrong_axis_one_head": "A",
    "scale_missing_one_head": "S",
    "sinks_ignored": "A",
}
DECLARED = {"sinks_ignored": {"sinks": [0.5]}}
