"""Write examples/dump.npz: the named arrays of an attention whose softmax ran over the
wrong axis (the query axis), for `causalattn audit examples/dump.npz` to find.

    .venv/bin/python examples/make_dump.py
"""

from pathlib import Path

import numpy as np

import causalattn as ca

rng = np.random.default_rng(0)
T, d = 6, 4
X = rng.normal(size=(T, 8))
W_q, W_k, W_v = (rng.normal(size=(8, d)) for _ in range(3))
Q, K, V = X @ W_q, X @ W_k, X @ W_v
S = Q @ K.T / np.sqrt(d)
M = ca.masks.additive(ca.masks.causal(T))
Z = S + M
E = np.exp(Z - Z.max(axis=0, keepdims=True))
A = E / E.sum(axis=0, keepdims=True)  # the bug: normalized down the columns (axis 0)
H = A @ V
np.savez(
    Path(__file__).with_name("dump.npz"),
    X=X,
    W_q=W_q,
    W_k=W_k,
    W_v=W_v,
    Q=Q,
    K=K,
    V=V,
    S=S,
    A=A,
    H=H,
)
