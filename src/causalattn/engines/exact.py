"""The engine named "reference": materialized attention in float64 torch, the truth the fast
engines are tested against (``causalattn.matrix_form`` is the NumPy trace of every stage).

O(T_q·T_k) memory; differentiable by autograd (in q, k, v and learned sinks), so it also
gives reference gradients (to q, k, v and every learned pattern tensor: sinks, ALiBi slopes,
``bias``, ``rel_bias``, a score_mod's captured tensors). The result is returned in the input
dtype. Everything the pattern can say is supported: every rule of M and mask_mod, softcap,
ALiBi, the biases, score_mod, sinks, and dropout, whose
keep pattern is regenerated from the problem's seed (:func:`dropout_mask`) or given
explicitly (:func:`attend`'s ``keep``), so tests can hand the same pattern to every engine.
"""

from __future__ import annotations

import torch

from .. import dropout as _dropout
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
    al = allowed.expand(A.shape)
    reads_bad = (al & ~finite[..., None, :]).any(dim=-1)  # (B, H, T_q)
    H = H.clone()
    for b, h, i in reads_bad.nonzero().tolist():
        cols = al[b, h, i]
        H[b, h, i] = A[b, h, i, cols] @ v[b, h, cols]
    return H


def dropout_mask(p: Problem) -> torch.Tensor | None:
    """The keep pattern ``(B, H_q, T_q, T_k)`` bool (CPU) that the engines draw for ``p``,
    regenerated from its seed (True = kept); None without dropout. For inspection: O(T²)."""
    if p.dropout_p == 0:
        return None
    B, H, _, _ = p.dims
    return p.keep(torch.arange(B)[:, None], torch.arange(H)[None, :])


def _sinks(p: Problem):
    s = p.pattern.sinks
    if s is None:
        return None
    s = s if isinstance(s, torch.Tensor) else torch.as_tensor(s)
    return s.to(device=p.q.device, dtype=torch.float64)[None, :, None, None]  # (1, H, 1, 1)


def attend(p: Problem, keep: torch.Tensor | None = None, return_lse: bool = False):
    """The reference forward. ``keep``: an explicit dropout keep pattern, bool broadcastable
    to (B, H_q, T_q, T_k), used instead of the one regenerated from p's seed (p.dropout_p
    still sets the 1/(1-p) scale)."""
    q, k, v = (t.to(torch.float64) for t in (p.q, p.k, p.v))
    if p.group > 1:  # grouped-query: query head h reads key/value head h // group
        k = k.repeat_interleave(p.group, dim=1)
        v = v.repeat_interleave(p.group, dim=1)
    allowed = p.allowed()  # (B', H', T_q, T_k)
    # softcap, ALiBi, rel_bias, bias, score_mod
    S = p.pattern.modify_scores((q @ k.transpose(-1, -2)) * p.scale)
    Z = S.masked_fill(~allowed, float("-inf"))
    has_key = allowed.any(dim=-1, keepdim=True).expand(*Z.shape[:-1], 1)
    if p.pattern.bias is not None or p.pattern.score_mod is not None:
        # a bias or score_mod of -inf on every readable key leaves the row nothing to read
        has_key = has_key & ~(Z == float("-inf")).all(dim=-1, keepdim=True)
    m = Z.amax(dim=-1, keepdim=True)
    sink = _sinks(p)
    if sink is not None:
        m = torch.maximum(m, sink)
    m = m.masked_fill(~has_key, 0.0).detach()
    E = torch.exp(Z - m)  # exactly 0 where blocked
    denom = E.sum(dim=-1, keepdim=True)
    if sink is not None:  # the sink joins the denominator and takes no value
        denom = denom + torch.exp(sink - m).masked_fill(~has_key, 0.0)
    A = E / torch.where(has_key, denom, torch.ones_like(denom))
    if p.dropout_p >= 1:  # everything dropped; masked_fill keeps the graph (zero gradients)
        A = A.masked_fill(torch.ones((), dtype=torch.bool, device=A.device), 0.0)
    elif p.dropout_p > 0:
        if keep is None:
            keep = dropout_mask(p)
        A = _dropout.apply(A, keep.to(A.device), p.dropout_p)
    out = _weighted_values(A, v, allowed).to(p.q.dtype)
    if not return_lse:
        return out
    lse = (m + torch.log(denom)).squeeze(-1).masked_fill(~has_key.squeeze(-1), float("-inf"))
    return out, lse.to(torch.float32)


def forward(p: Problem, return_lse: bool = False):
    return attend(p, return_lse=return_lse)
