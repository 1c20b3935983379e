# causalattn learn exercise: scores (torch)
"""Reference solution of the scores exercise (the tests plant faults into it)."""

import math

import torch


def scores(q, k):
    d_k = q.shape[-1]
    return torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d_k)
