# causalattn learn exercise: attention (torch)
"""Reference solution of the attention exercise (the tests plant faults into it)."""

import math

import torch


def attention(q, k, v):
    T, d_k = q.shape
    S = q @ k.transpose(0, 1) / math.sqrt(d_k)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    Z = S.masked_fill(future, float("-inf"))
    A = torch.softmax(Z, dim=-1)
    return A @ v
