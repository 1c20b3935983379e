# causalattn learn exercise: mask (torch)
"""Reference solution of the mask exercise (the tests plant faults into it)."""

import torch


def mask(T, length):
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    readable = (j <= i) & (j < length) & (i < length)
    M = torch.full((T, T), float("-inf"))
    M[readable] = 0.0
    return M
