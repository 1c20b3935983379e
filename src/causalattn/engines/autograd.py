"""The one autograd wiring of the engines with raw passes (tiled, cpp, triton).

An engine with raw passes (:class:`~causalattn.engines.contract.BlockKernels`: ``fwd``,
``bwd``, ``sinks_grad``) does not write an ``autograd.Function`` of its own: its eager
``forward(p, return_lse)`` is :func:`forward` here, which saves q, k, v, out and lse and
differentiates by the engine's ``bwd`` (and ``sinks_grad`` for learned sinks). Inside the
``causalattn::fwd`` operator (compile, export, torch.func) the operator's registered
backward calls the same passes (:mod:`causalattn.engines.ops`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .problem import Problem


class _RawAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, p, mod):
        p = replace(p, q=q, k=k, v=v)
        out, lse = mod.fwd(p)
        ctx.p, ctx.mod = replace(p, q=None, k=None, v=None), mod
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse.float()

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        p, mod = replace(ctx.p, q=q, k=k, v=v), ctx.mod
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = mod.bwd(p, out, lse, dout, dlse)
        ds = None
        if ctx.needs_input_grad[3]:
            sk = p.pattern.sinks
            ds = mod.sinks_grad(p, out, lse, dout, dlse).to(dtype=sk.dtype, device=sk.device)
        return dq, dk, dv, ds, None, None


def forward(mod, p: Problem, return_lse: bool = False):
    """``mod``'s eager entry: H (and the fp32 lse), differentiable in q, k, v and learned
    sinks through ``mod.bwd`` / ``mod.sinks_grad``; the raw forward alone when nothing
    needs a gradient."""
    sk = p.pattern.sinks
    sinks = sk if isinstance(sk, torch.Tensor) and sk.requires_grad else None
    needs_grad = torch.is_grad_enabled() and (
        sinks is not None or any(t.requires_grad for t in (p.q, p.k, p.v))
    )
    if needs_grad:
        out, lse = _RawAttention.apply(p.q, p.k, p.v, sinks, p, mod)
    else:
        out, lse = mod.fwd(p)
        lse = lse.float()
    return (out, lse) if return_lse else out
