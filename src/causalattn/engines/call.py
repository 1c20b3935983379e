"""One call of :func:`causalattn.attention`, as one frozen description.

:meth:`Call.of` checks what can be checked without reading data (so traced code builds it
too): q, k, v, the scalar keywords, dropout, the generator and the scale; it turns list
and array pattern arguments into tensors and derives what the engines are chosen by — the
user's functions by number (:func:`causalattn.engines.ops.mods_id`), the tensors a
score_mod reads that need a gradient, and the call's
:func:`~causalattn.engines.registry.feature_values`. What needs the data (lengths,
cu_seqlens, finiteness) is checked inside the operator, by :func:`make_problem`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import dropout as _dropout
from .._internals.torch import constant_result
from ..masks import CALLABLES, default_scale
from ..masks_mod import check_callable
from . import auto as _auto
from . import ops as _ops
from .problem import Problem, _check_tensors, check_generator, make_problem
from .registry import LEARNED, TENSORS, captured_of, feature_values

_default_scale = constant_result(default_scale)


def _tensor(name: str, x, device):
    """A list or array argument as a tensor (tensors pass through; the operator checks them)."""
    if x is None or isinstance(x, torch.Tensor):
        return x
    try:
        return torch.as_tensor(x, device=device)
    except (TypeError, ValueError, RuntimeError) as exc:  # a string, ragged lists, ...
        raise ValueError(f"{name}: expected an array or tensor, got {x!r:.60} ({exc})") from exc


class Call(NamedTuple):
    """q ``(B, H_q, T_q, d_k)``, k ``(B, H_kv, T_k, d_k)``, v ``(B, H_kv, T_k, d_v)``, every
    pattern keyword (tensors as tensors), the scale, dropout and what the engine is chosen
    by (``values``: :func:`~causalattn.engines.registry.feature_values`)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    keywords: dict  # every name of PATTERN_KEYWORDS
    scale: float
    dropout_p: float
    generator: torch.Generator | None
    return_lse: bool
    mods: int  # (mask_mod, score_mod) by number; 0 for neither
    captured: tuple  # a score_mod's tensors that need a gradient
    values: tuple  # the Features fields

    @classmethod
    def of(cls, q, k, v, keywords: dict, scale, dropout_p, generator, return_lse) -> Call:
        """The checked description (ValueError naming the argument otherwise)."""
        _check_tensors(q, k, v)
        if not isinstance(return_lse, bool):
            raise ValueError(f"attention: return_lse must be True or False, got {return_lse!r}")
        kw = keywords
        why = _auto.scalar_refusal(kw["causal"], kw["window"], kw["chunk"], kw["softcap"])
        if why:
            raise ValueError(why)
        dropout_p = _dropout.check_p(dropout_p)
        check_generator(generator)
        scale = _default_scale(int(q.shape[-1])) if scale is None else scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise ValueError(f"attention: scale must be a number, got {scale!r}")
        kw = {**kw, **{n: _tensor(n, kw[n], q.device) for n in TENSORS}}
        for name in CALLABLES:
            check_callable(name, kw[name])
        # a score_mod's captured tensors need a gradient even when q, k, v and the pattern
        # tensors need none (a learned bias over frozen projections); looked up on the
        # function held by number: one made inside a compiled region is Dynamo's, which
        # does not show its globals, the held one is the real function
        mods = _ops.mods_id(kw["mask_mod"], kw["score_mod"])
        captured = captured_of(_ops.mods_of(mods)[1]) if torch.is_grad_enabled() else []
        grad = bool(captured) or (
            torch.is_grad_enabled()
            and any(
                isinstance(t, torch.Tensor) and t.requires_grad
                for t in (q, k, v, *(kw[n] for n in LEARNED))
            )
        )
        values = feature_values(
            q,
            k,
            v,
            tensors={n: kw[n] for n in TENSORS},
            causal=kw["causal"],
            window=kw["window"],
            chunk=kw["chunk"],
            softcap=kw["softcap"],
            dropout_p=dropout_p,
            lse=return_lse,
            grad=grad,
            mask_mod=kw["mask_mod"],
            score_mod=kw["score_mod"],
            captured=captured,
        )
        return cls(q, k, v, kw, scale, dropout_p, generator, return_lse, mods, captured, values)

    def problem(self) -> Problem:
        """The checked :class:`Problem` (reads the data: eager engines only)."""
        return make_problem(
            self.q,
            self.k,
            self.v,
            scale=self.scale,
            dropout_p=self.dropout_p,
            generator=self.generator,
            **self.keywords,
        )

    def op_args(self, engine: str) -> _ops.OpArgs:
        """The forward operator's arguments for ``engine`` (the dropout seed drawn now, as a
        tensor: a compiled graph draws it anew on every call)."""
        kw = self.keywords
        seed = _dropout.seed_tensor(self.generator) if self.dropout_p else None
        return _ops.OpArgs(
            self.q,
            self.k,
            self.v,
            *(kw[n] for n in TENSORS),
            captured=list(self.captured),
            dropout_seed=seed,
            causal=kw["causal"],
            window=kw["window"],
            chunk=kw["chunk"],
            softcap=None if kw["softcap"] is None else float(kw["softcap"]),
            scale=float(self.scale),
            dropout_p=float(self.dropout_p),
            mods=self.mods,
            engine=engine,
            return_lse=self.return_lse,
        )
