"""The one autograd wiring of the engines with raw passes (tiled, cpp, triton).

An engine with raw passes (:class:`~causalattn.engines.contract.BlockKernels`: ``fwd``,
``bwd``, ``sinks_grad``) does not write an ``autograd.Function`` of its own: its eager
``forward(p, return_lse)`` is :func:`forward` here, which saves q, k, v, out and lse and
differentiates by the engine's ``bwd`` (and ``sinks_grad`` for learned sinks). Learned
pattern tensors beyond the sinks — ALiBi slopes, ``bias``, ``rel_bias`` and the tensors a
``score_mod`` reads ("captured") — get theirs from the engine's
``bwd_grads(p, out, lse, dout, dlse, want) -> (dq, dk, dv, {name: grad})``, computed in the
same tiles as dQ, dK, dV. Inside the ``causalattn::fwd`` operator (compile, export,
torch.func) the operator's registered backward calls the same passes
(:mod:`causalattn.engines.ops`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .problem import Problem
from .registry import LEARNED, captured_of


def learned(p: Problem) -> tuple[list[str], list[torch.Tensor]]:
    """(names, tensors) of what needs a gradient besides q, k, v: the LEARNED pattern
    tensors that require one, then each tensor the score_mod reads ("captured")."""
    if not torch.is_grad_enabled():
        return [], []
    pt = p.pattern
    names, tensors = [], []
    for n in LEARNED:
        t = getattr(pt, n)
        if isinstance(t, torch.Tensor) and t.requires_grad:
            names.append(n)
            tensors.append(t)
    for t in captured_of(pt.score_mod):
        names.append("captured")
        tensors.append(t)
    return names, tensors


def backward(mod, p: Problem, out, lse, dout, dlse, names) -> tuple:
    """(dq, dk, dv, grads) of the engine ``mod``: grads one per entry of ``names``
    (LEARNED names; "captured" once per captured tensor, in order)."""
    extra = [n for n in dict.fromkeys(names) if n != "sinks"]
    if extra:
        dq, dk, dv, got = mod.bwd_grads(p, out, lse, dout, dlse, tuple(extra))
    else:
        (dq, dk, dv), got = mod.bwd(p, out, lse, dout, dlse), {}
    grads, caps = [], iter(got.get("captured", ()))
    for n in names:
        if n == "sinks":
            grads.append(mod.sinks_grad(p, out, lse, dout, dlse))
        elif n == "captured":
            grads.append(next(caps))
        else:
            grads.append(got[n])
    return dq, dk, dv, grads


class _RawAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p, mod, names, q, k, v, *tensors):
        p = replace(p, q=q, k=k, v=v)
        out, lse = mod.fwd(p)
        ctx.p, ctx.mod, ctx.names = replace(p, q=None, k=None, v=None), mod, names
        ctx.tensors = tensors
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse.float()

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        p, mod = replace(ctx.p, q=q, k=k, v=v), ctx.mod
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv, grads = backward(mod, p, out, lse, dout, dlse, ctx.names)
        grads = [g.to(dtype=t.dtype, device=t.device) for g, t in zip(grads, ctx.tensors)]
        return None, None, None, dq, dk, dv, *grads


def forward(mod, p: Problem, return_lse: bool = False):
    """``mod``'s eager entry: H (and the fp32 lse), differentiable in q, k, v and the learned
    pattern tensors (sinks, slopes, biases, a score_mod's captured tensors); the raw forward
    alone when nothing needs a gradient."""
    names, tensors = learned(p)
    needs_grad = torch.is_grad_enabled() and (
        bool(tensors) or any(t.requires_grad for t in (p.q, p.k, p.v))
    )
    if needs_grad:
        out, lse = _RawAttention.apply(p, mod, tuple(names), p.q, p.k, p.v, *tensors)
    else:
        out, lse = mod.fwd(p)
        lse = lse.float()
    return (out, lse) if return_lse else out
