"""fn(x, w_q, w_k, w_v, w_o) in the seeds' X W layout (NumPy), and nn.Modules taking x."""

import math

import numpy as np
import torch
from torch import nn


def _heads_out(x, w_q, w_k, w_v):
    q, k, v = x @ w_q, x @ w_k, x @ w_v
    s = q @ k.T / np.sqrt(q.shape[-1])
    s = np.where(np.tril(np.ones(s.shape, dtype=bool)), s, -np.inf)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)) @ v


def correct(x, w_q, w_k, w_v, w_o):
    return _heads_out(x, w_q, w_k, w_v) @ w_o


def output_projection_missing(x, w_q, w_k, w_v, w_o):
    return _heads_out(x, w_q, w_k, w_v)  # fault: w_o never applied


def output_projection_transposed(x, w_q, w_k, w_v, w_o):
    return _heads_out(x, w_q, w_k, w_v) @ w_o.T  # fault: transposed


class CausalSelfAttention(nn.Module):
    """nanoGPT-style: one c_attn Linear for Q, K, V, heads, c_proj."""

    def __init__(self, d_model=8, n_head=2, softmax_dim=-1):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.softmax_dim = softmax_dim

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        att = torch.softmax(att, dim=self.softmax_dim)
        y = (att.nan_to_num(0.0) @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class QueryAxisAttention(CausalSelfAttention):
    def __init__(self):
        super().__init__(softmax_dim=-2)  # fault: softmax over queries
