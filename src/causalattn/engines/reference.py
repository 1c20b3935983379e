"""Materialized attention in float64 torch: the truth the fast engines are tested against.

O(T_q·T_k) memory; differentiable by autograd, so it also gives reference gradients.
The result is returned in the input dtype.
"""

from __future__ import annotations

import torch

from .problem import Problem


def _weighted_values(A: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """H = A v without 0·NaN: a non-finite value at an unreadable key must not reach a row.

    Non-finite value rows are zeroed for the product; the query rows that really read one
    are recomputed over their readable keys only (the same rule as the NumPy reference).
    """
    finite = torch.isfinite(v).all(dim=-1)  # (B, H, T_k)
    H = A @ v.masked_fill(~finite[..., None], 0.0)
    if bool(finite.all()):
        return H
    reads_bad = (allowed & ~finite[..., None, :]).any(dim=-1)  # (B, H, T_q)
    H = H.clone()
    al = allowed.expand(A.shape)
    for b, h, i in reads_bad.nonzero().tolist():
        cols = al[b, h, i]
        H[b, h, i] = A[b, h, i, cols] @ v[b, h, cols]
    return H


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
    out = _weighted_values(A, v, allowed).to(p.q.dtype)
    if not return_lse:
        return out
    lse = (m + torch.log(denom)).squeeze(-1).masked_fill(~has_key.squeeze(-1), float("-inf"))
    return out, lse.to(torch.float32)
