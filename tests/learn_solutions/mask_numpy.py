# causalattn learn exercise: mask (numpy)
"""Reference solution of the mask exercise (the tests plant faults into it)."""

import numpy as np


def mask(T, length):
    i = np.arange(T)[:, None]
    j = np.arange(T)[None, :]
    readable = (j <= i) & (j < length) & (i < length)
    return np.where(readable, 0.0, -np.inf)
