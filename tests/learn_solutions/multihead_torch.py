# causalattn learn exercise: multihead (torch)
"""Reference solution of the multihead exercise (the tests plant faults into it)."""

import math

import torch


def multihead(x, w_q, w_k, w_v, w_o, n_heads):
    T = x.shape[0]
    Q, K, V = x @ w_q, x @ w_k, x @ w_v
    d_k, d_v = Q.shape[1] // n_heads, V.shape[1] // n_heads
    q = Q.view(T, n_heads, d_k).transpose(0, 1)  # (h, T, d_k)
    k = K.view(T, n_heads, d_k).transpose(0, 1)
    v = V.view(T, n_heads, d_v).transpose(0, 1)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    Z = (q @ k.transpose(-2, -1) / math.sqrt(d_k)).masked_fill(future, float("-inf"))
    H = torch.softmax(Z, dim=-1) @ v  # (h, T, d_v)
    return H.transpose(0, 1).reshape(T, n_heads * d_v) @ w_o
