# causalattn learn exercise: attention (numpy)
"""Reference solution of the attention exercise (the tests plant faults into it)."""

import numpy as np


def attention(q, k, v):
    T, d_k = q.shape
    S = q @ k.T / np.sqrt(d_k)
    M = np.where(np.arange(T)[None, :] <= np.arange(T)[:, None], 0.0, -np.inf)
    Z = S + M
    E = np.exp(Z - Z.max(axis=-1, keepdims=True))
    A = E / E.sum(axis=-1, keepdims=True)
    return A @ v
