"""Materialized attention in float64 torch: the truth the fast engines are tested against.

O(T_q·T_k) memory; differentiable by autograd, so it also gives reference gradients.
The result is returned in the input dtype.
"""

from __future__ import annotations

import torch

from .problem import Problem


def forward(p: Problem, return_lse: bool = False):
    q, k, v = (t.to(torch.float64) for t in (p.q, p.k, p.v))
    if p.group > 1:  # grouped-query: query head h reads key/value head h // group
        k = k.repeat_interleave(p.group, dim=1)
        v = v.repeat_interleave(p.group, dim=1)
    allowed = p.allowed()  # (B, 1, T_q, T_k)
    S = (q @ k.transpose(-1, -2)) * p.scale
    Z = S.masked_fill(~allowed, float("-inf"))
    has_key = allowed.any(dim=-1, keepdim=True)
    m = Z.amax(dim=-1, keepdim=True).masked_fill(~has_key, 0.0).detach()
    E = torch.exp(Z - m)  # exactly 0 where blocked
    denom = E.sum(dim=-1, keepdim=True)
    A = E / torch.where(has_key, denom, torch.ones_like(denom))
    out = (A @ v).to(p.q.dtype)
    if not return_lse:
        return out
    lse = (m + torch.log(denom)).squeeze(-1).masked_fill(~has_key.squeeze(-1), float("-inf"))
    return out, lse.to(torch.float32)
