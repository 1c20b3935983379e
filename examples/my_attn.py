"""An attention function with a classic bug, for `causalattn diagnose` to find.

causalattn diagnose examples/my_attn.py:attention --signature qkv
"""

import math

import torch


def attention(q, k, v):
    """q, k: T×d_k, v: T×d_v (torch); returns H = softmax_last(Q Kᵀ/√d_k + M) V -- almost."""
    T_q, T_k, d_k = q.shape[-2], k.shape[-2], q.shape[-1]
    S = q @ k.transpose(-2, -1) / math.sqrt(d_k)
    A = torch.softmax(S, dim=-1)
    future = torch.ones(T_q, T_k, dtype=torch.bool).triu(T_k - T_q + 1)  # queries: the last T_q
    A = A.masked_fill(future, 0.0)  # the bug: the mask comes after the softmax
    return A @ v
