"""Fast engines behind one signature, and the dispatch between them.

    attention(q, k, v, *, causal=True, window=None, lengths=None, key_padding_mask=None,
              cu_seqlens=None, prefix_lengths=None, chunk=None, mask=None,
              alibi_slopes=None, softcap=None, sinks=None, scale=None, dropout_p=0.0,
              generator=None, engine="auto", return_lse=False)

q: ``(B, H_q, T_q, d_k)``, k: ``(B, H_kv, T_k, d_k)``, v: ``(B, H_kv, T_k, d_v)`` as in
SDPA; H_q a multiple of H_kv (grouped-query). Returns H ``(B, H_q, T_q, d_v)`` in q's
dtype, and with ``return_lse`` also the fp32 log-sum-exp ``(B, H_q, T_q)``.
The mask keywords and modifiers are :class:`causalattn.masks.Pattern`'s; dropout is
:mod:`causalattn.dropout`'s (see :mod:`causalattn.engines.problem`).
"""

from __future__ import annotations

import torch

from .. import dropout as _dropout
from ..masks import default_scale
from . import auto as _auto
from . import ops as _ops
from .cache import KVCache
from .ops import ENGINES, NO_LSE, engine_problem
from .problem import Problem, _check_tensors, check_generator, constant_result, make_problem

_default_scale = constant_result(default_scale)

__all__ = ["attention", "KVCache", "Problem", "make_problem", "ENGINES", "pick_engine", "run"]

_FALLBACK = {"cpu": ("tiled", "sdpa", "reference"), "cuda": ("triton", "sdpa", "reference")}


def _features(q, k, v, causal, window, chunk, softcap, dropout_p, tensors: dict, lse: bool):
    """What "auto" and the engines' supports() are asked about: plain values only."""
    present = tuple(n for n in _ops.TENSORS if tensors.get(n) is not None)
    masked = (
        bool(set(present) - {"lengths", "key_padding_mask", "cu_seqlens"})
        or any(x is not None for x in (window, chunk, softcap))
        or bool(dropout_p)
    )
    kind = _auto.kind(
        causal=causal,
        T_q=q.shape[2],
        T_k=k.shape[2],
        padded="lengths" in present or "key_padding_mask" in present,
        packed="cu_seqlens" in present,
        masked=masked,
    )
    ask = dict(
        dtype=str(q.dtype).replace("torch.", ""),
        d_k=int(q.shape[-1]),
        d_v=int(v.shape[-1]),
        H_q=int(q.shape[1]),
        H_kv=int(k.shape[1]),
        present=present,
        causal=causal,
        window=window,
        chunk=chunk,
        softcap=softcap,
        dropout_p=float(dropout_p),
        lse=lse,
    )
    return kind, ask


def _choose(q, k, v, engine: str, kind: str, ask: dict, grad: bool) -> str:
    """The engine to run: ``engine`` itself (checked), or what "auto" picks among those that
    support the problem. Shapes only, so it runs at trace time."""
    if engine != "auto":
        why = engine_problem(engine)
        # what the engine does not support: named now while tracing; in eager mode by the
        # operator, after the data checks (which name the bad argument first)
        if not why and torch.compiler.is_compiling():
            why = _auto.refusal(engine, str(q.device), **ask)
        if why:
            raise ValueError(why)
        return engine
    name = _auto.pick(q, k, v, kind_=kind, grad=grad, ask=ask, no_lse=NO_LSE)
    dev = str(q.device)
    if engine_problem(name) == "" and not _auto.refusal(name, dev, **ask):
        return name
    for alt in _FALLBACK.get(q.device.type, ("tiled", "reference")):
        if engine_problem(alt) == "" and not _auto.refusal(alt, dev, **ask):
            return alt
    return "reference"


def pick_engine(p: Problem, return_lse: bool = False) -> str:
    """The engine "auto" runs for this problem (see :mod:`causalattn.engines.auto`)."""
    pt = p.pattern
    tensors = {n: getattr(pt, n) for n in _ops.TENSORS}
    kind, ask = _features(
        p.q, p.k, p.v, pt.causal, pt.window, pt.chunk, pt.softcap, p.dropout_p, tensors, return_lse
    )
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (p.q, p.k, p.v))
    return _choose(p.q, p.k, p.v, "auto", kind, ask, grad)


def _tensor(name: str, x, device):
    """A list or array argument as a tensor (tensors pass through; the operator checks them)."""
    if x is None or isinstance(x, torch.Tensor):
        return x
    try:
        return torch.as_tensor(x, device=device)
    except (TypeError, ValueError, RuntimeError) as exc:  # a string, ragged lists, ...
        raise ValueError(f"{name}: expected an array or tensor, got {x!r:.60} ({exc})") from exc


def attention(
    q,
    k,
    v,
    *,
    causal: bool = True,
    window: int | None = None,
    lengths=None,
    key_padding_mask=None,
    cu_seqlens=None,
    prefix_lengths=None,
    chunk: int | None = None,
    mask=None,
    alibi_slopes=None,
    softcap: float | None = None,
    sinks=None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    generator=None,
    engine: str = "auto",
    return_lse: bool = False,
):
    """Causal self-attention ``dropout(softmax_last(modify(q kᵀ·scale) + M)) v`` on one of
    the engines. ``sinks`` may be a learned Parameter (gradients flow to it).

    One call of the ``causalattn::fwd`` operator (:mod:`causalattn.engines.ops`): it
    compiles with ``torch.compile(fullgraph=True)``, exports, runs on meta tensors and
    under torch.func. Shapes are checked here (at trace time); what needs the data
    (lengths, cu_seqlens, finiteness) inside the operator.
    """
    _check_tensors(q, k, v)
    if not isinstance(return_lse, bool):
        raise ValueError(f"attention: return_lse must be True or False, got {return_lse!r}")
    why = _auto.scalar_refusal(causal, window, chunk, softcap)
    if why:
        raise ValueError(why)
    dropout_p = _dropout.check_p(dropout_p)
    check_generator(generator)
    if scale is None:
        scale = _default_scale(int(q.shape[-1]))
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"attention: scale must be a number, got {scale!r}")
    given = dict(
        lengths=lengths,
        key_padding_mask=key_padding_mask,
        cu_seqlens=cu_seqlens,
        prefix_lengths=prefix_lengths,
        mask=mask,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
    )
    tensors = {n: _tensor(n, x, q.device) for n, x in given.items()}
    kind, ask = _features(q, k, v, causal, window, chunk, softcap, dropout_p, tensors, return_lse)
    grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v, tensors["sinks"])
    )
    name = _choose(q, k, v, engine, kind, ask, grad)
    if return_lse and name in NO_LSE:
        raise ValueError(
            f"engine {name!r}: return_lse: PyTorch's SDPA does not return the "
            "log-sum-exp; use 'tiled'"
        )
    if name == "sdpa" and _eager(q):
        # eagerly, SDPA keeps PyTorch's own autograd: through the operator its backward would
        # recompute the forward (fwd+bwd 1.4x slower at GPT-2 small in one bench run)
        p = make_problem(
            q,
            k,
            v,
            causal=causal,
            window=window,
            chunk=chunk,
            softcap=softcap,
            scale=scale,
            dropout_p=dropout_p,
            generator=generator,
            **given,
        )
        return _ops.engine_module(name).forward(p, False)
    # the dropout seed stays a tensor: a compiled graph draws it anew on every call
    seed = _dropout.seed_tensor(generator) if dropout_p else None
    args = (
        q,
        k,
        v,
        *(tensors[n] for n in _ops.TENSORS),
        seed,
        causal,
        window,
        chunk,
        None if softcap is None else float(softcap),
        float(scale),
        float(dropout_p),
        name,
        return_lse,
    )
    if torch._C._are_functorch_transforms_active():  # torch.func.grad, vmap, ...
        out, lse = _ops.FuncAttention.apply(*args)
    else:
        out, lse = torch.ops.causalattn.fwd(*args)
    return (out, lse.float()) if return_lse else out


def _eager(q: torch.Tensor) -> bool:
    """Plain eager mode: not traced by Dynamo or export, no torch.func transform, real data."""
    from torch._subclasses.fake_tensor import FakeTensor

    return not (
        torch.compiler.is_compiling()
        or torch.compiler.is_exporting()
        or torch._C._are_functorch_transforms_active()
        or isinstance(q, FakeTensor)
        or q.device.type == "meta"
    )


def run(p: Problem, engine: str = "auto", return_lse: bool = False):
    """Run a built :class:`Problem` on an engine, eagerly (its pattern may be placed, its
    dropout seed drawn already); :func:`attention` is the traceable entry."""
    if not isinstance(return_lse, bool):
        raise ValueError(f"attention: return_lse must be True or False, got {return_lse!r}")
    name = pick_engine(p, return_lse) if engine == "auto" else engine
    why = engine_problem(name) or _ops.refusal(name, p, return_lse)
    if why:
        raise ValueError(why)
    return _ops.engine_module(name).forward(p, return_lse)
