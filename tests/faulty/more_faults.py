"""One planted fault each for the catalogue entries that measurement separates.

fn(q, k, v) with q, k: (..., T_q|T_k, d_k), v: (..., T_k, d_v); NumPy unless torch is named.
"""

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def _softmax_rows(z):
    m = z.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(z - m)
    den = e.sum(axis=-1, keepdims=True)
    return np.where(den > 0, e / np.where(den > 0, den, 1.0), 0.0)


def _tril(T):
    return np.tril(np.ones((T, T), dtype=bool))


def causal_top_left(q, k, v):
    """SDPA's is_causal aligns the mask top-left: wrong when T_q < T_k (decoding)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # fault: top-left


def window_off_by_one(q, k, v):
    """Declared window=3; reads the last 4 keys (i - j <= 3 instead of < 3)."""
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    T = s.shape[-1]
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    allowed = (j <= i) & (i - j <= 3)  # fault: one key too many
    return _softmax_rows(np.where(allowed, s, -np.inf)) @ v


def window_one_too_narrow(q, k, v):
    """Declared window=3; reads the last 2 keys (i - j < 2: one key too few)."""
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    T = s.shape[-1]
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    allowed = (j <= i) & (i - j < 2)  # fault: one key too few
    return _softmax_rows(np.where(allowed, s, -np.inf)) @ v


def finite_fill_too_weak(q, k, v):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    T = scores.shape[-1]
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    scores = scores.masked_fill(~allowed, -1e4)  # fault: large scores overcome -1e4
    return torch.softmax(scores, dim=-1) @ v


def some_heads_only(q, k, v):
    """(B, H, T, d) code whose head 2 forgets the mask; 2-D input is one head, right."""
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    allowed = np.broadcast_to(_tril(s.shape[-1]), s.shape).copy()
    if s.ndim == 4 and s.shape[1] > 1:
        allowed[:, 1] = True  # fault: head 2 is not masked
    return _softmax_rows(np.where(allowed, s, -np.inf)) @ v


def scale_by_sqrt_dv(q, k, v):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(v.shape[-1])  # fault: √d_v
    return _softmax_rows(np.where(_tril(s.shape[-1]), s, -np.inf)) @ v


class ScaleByModelWidth(nn.Module):
    """nanoGPT-style heads, scaled by 1/√d_model instead of one head's 1/√d_k."""

    def __init__(self, d_model=8, n_head=2):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = q @ k.transpose(-2, -1) / math.sqrt(C)  # fault: C = d_model, not d_k
        att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        y = torch.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


def softmax_fp16_accumulation(q, k, v):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1]).astype(q.dtype)
    T_q, T_k = s.shape[-2:]
    allowed = np.tril(np.ones((T_q, T_k), dtype=bool), T_k - T_q)
    z = np.where(allowed, s, -np.inf)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    den = np.cumsum(e, axis=-1, dtype=e.dtype)[..., -1:]  # fault: summed in the input dtype
    return (e / den) @ v
