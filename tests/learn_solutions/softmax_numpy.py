# causalattn learn exercise: softmax (numpy)
"""Reference solution of the softmax exercise (the tests plant faults into it)."""

import numpy as np


def softmax(z):
    m = z.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)  # a row of -inf reads nothing
    e = np.exp(z - m)
    total = e.sum(axis=-1, keepdims=True)
    return np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)
