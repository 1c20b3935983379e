"""The engine contract, written down: what every engine module promises.

Two protocols. An engine module is looked up by name in ``causalattn.engines.ENGINES``
and satisfies :class:`Engine`; an engine that can also run one block pair of a larger
problem (ring attention's building block) satisfies :class:`BlockKernels` too.
``tests/engines/test_engine_contract.py`` checks every engine against both, parametrized over
``ENGINES`` (a new engine is one line there).

The shared guarantees (the same for every engine, tested once):

* H ``(B, H_q, T_q, d_v)`` in q's dtype; a query row with no readable key is exactly 0,
  its lse is -inf and its gradients are 0 (sinks or not).
* Forbidden entries get exactly zero weight: NaN or inf in q, k or v at a position the
  pattern blocks never reaches a readable row, bit for bit (in H and in dQ).
* A NaN a row really reads propagates to that row.
* Accuracy rule (docs/design.md): ``max|H - H64| <= 2·max|plain - H64| + floor``, where H64
  is the float64 reference and ``plain`` the same formula in the inputs' dtype
  (``causalattn.engines.contract.plain``), for H and for dQ, dK, dV.

The log-sum-exp contract: ``lse[b, h, i] = log(Σ_j exp(Z[b, h, i, j]) + exp(s_h))`` over
the readable keys j of row i, Z the modified scores (``q kᵀ·scale``, then softcap and
ALiBi), ``s_h`` the sink of head h when there are sinks. Shape
``(B, H_q, T_q)``; float32 from :meth:`Engine.forward`; the raw :meth:`BlockKernels.fwd`
may keep float64 for float64 inputs. -inf where no key is readable. It is the
*pre-dropout* softmax's. Two block results over disjoint key sets merge exactly by
``L = logaddexp(l1, l2)``, ``out = o1·exp(l1 - L) + o2·exp(l2 - L)`` — and
:meth:`BlockKernels.bwd` takes that merged (global) ``out`` and ``lse`` and returns this
block's share of the gradients: summing dq over key blocks and concatenating dk, dv gives
the gradients of the whole problem.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .. import dropout as _dropout
from .problem import Problem


@runtime_checkable
class Engine(Protocol):
    """A module in ``ENGINES``."""

    def forward(self, p: Problem, return_lse: bool = False):
        """H ``(B, H_q, T_q, d_v)`` in q's dtype, or ``(H, lse)`` with ``return_lse``
        (lse float32 ``(B, H_q, T_q)``). Differentiable in q, k, v (and learned sinks)
        where the engine has a backward. An engine that cannot run ``p`` as asked raises
        ValueError naming what it cannot do; it may also define
        ``supports(p, return_lse) -> bool`` so that ``engine="auto"`` can pass it by."""
        ...


@runtime_checkable
class BlockKernels(Protocol):
    """Raw passes over one (placed) problem, no autograd: ring attention's block pairs."""

    def fwd(self, p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out (B, H_q, T_q, d_v) in q's dtype, lse (B, H_q, T_q))``, as the module
        docstring says."""
        ...

    def bwd(
        self,
        p: Problem,
        out: torch.Tensor,
        lse: torch.Tensor,
        dout: torch.Tensor,
        dlse: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` in the inputs' dtypes from the GIVEN ``out``, ``lse`` (possibly
        global, merged over key blocks) and ``dout`` ``(B, H_q, T_q, d_v)``; ``dlse``
        ``(B, H_q, T_q)`` is the gradient of the returned lse (it enters the row term as
        ``D = rowsum(dout ∘ out) - dlse``). dk, dv are summed over each query-head group;
        rows with lse = -inf get zero gradient; dropout is regenerated from the problem's
        seed."""
        ...

    def sinks_grad(
        self,
        p: Problem,
        out: torch.Tensor,
        lse: torch.Tensor,
        dout: torch.Tensor,
        dlse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """d sinks ``(H_q,)``: ``-Σ_{b,i} exp(s_h - lse_bhi)·D_bhi``."""
        ...


def plain(p: Problem, dtype: torch.dtype, keep: torch.Tensor | None = None) -> torch.Tensor:
    """The accuracy rule's yardstick: the plain formula in ``dtype`` with PyTorch ops
    (matmul, modifiers, masked softmax with the sinks' column, dropout by ``keep``,
    matmul), differentiable in ``p.q, p.k, p.v`` as given (cast to ``dtype``).
    Returns H ``(B, H_q, T_q, d_v)`` in ``dtype``; rows with no readable key are 0."""
    q, k, v = (t.to(dtype) for t in (p.q, p.k, p.v))
    kk, vv = k.repeat_interleave(p.group, 1), v.repeat_interleave(p.group, 1)
    allowed = p.allowed()
    has_key = allowed.any(-1, keepdim=True)
    S = p.pattern.modify_scores((q @ kk.transpose(-1, -2)) * p.scale)
    Z = S.masked_fill(~allowed, float("-inf"))
    Z = torch.where(has_key, Z, torch.zeros_like(Z)).float()  # empty rows: finite, zeroed below
    sinks = p.pattern.sinks
    if sinks is not None:
        s = torch.as_tensor(sinks).detach().to(Z.device, Z.dtype)
        Z = torch.cat([Z, s[None, :, None, None].expand(*Z.shape[:-1], 1)], -1)
    A = torch.softmax(Z, -1)[..., : S.shape[-1]].to(dtype)
    A = torch.where(has_key, A, torch.zeros_like(A))
    if p.dropout_p > 0 and keep is not None:
        A = _dropout.apply(A, keep.to(A.device), p.dropout_p)
    return A @ vv


__all__ = ["Engine", "BlockKernels", "plain"]
