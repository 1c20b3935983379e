# causalattn learn exercise: scores (numpy)
"""Reference solution of the scores exercise (the tests plant faults into it)."""

import numpy as np


def scores(q, k):
    d_k = q.shape[-1]
    return q @ k.T / np.sqrt(d_k)
