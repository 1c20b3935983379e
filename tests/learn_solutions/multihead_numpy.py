# causalattn learn exercise: multihead (numpy)
"""Reference solution of the multihead exercise (the tests plant faults into it)."""

import numpy as np


def multihead(x, w_q, w_k, w_v, w_o, n_heads):
    T = x.shape[0]
    Q, K, V = x @ w_q, x @ w_k, x @ w_v
    d_k, d_v = Q.shape[1] // n_heads, V.shape[1] // n_heads
    M = np.where(np.arange(T)[None, :] <= np.arange(T)[:, None], 0.0, -np.inf)
    heads = []
    for n in range(n_heads):
        q, k = Q[:, n * d_k : (n + 1) * d_k], K[:, n * d_k : (n + 1) * d_k]
        v = V[:, n * d_v : (n + 1) * d_v]
        Z = q @ k.T / np.sqrt(d_k) + M
        E = np.exp(Z - Z.max(axis=-1, keepdims=True))
        heads.append(E / E.sum(axis=-1, keepdims=True) @ v)
    H = np.concatenate(heads, axis=1)
    return H @ w_o
