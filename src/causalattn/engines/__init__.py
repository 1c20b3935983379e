"""Fast engines behind one signature, and the dispatch between them.

    attention(q, k, v, *, causal=True, window=None, lengths=None, key_padding_mask=None,
              cu_seqlens=None, prefix_lengths=None, chunk=None, mask=None,
              alibi_slopes=None, softcap=None, sinks=None, scale=None, dropout_p=0.0,
              generator=None, engine="auto", return_lse=False, mask_mod=None,
              score_mod=None, bias=None, rel_bias=None)

q: ``(B, H_q, T_q, d_k)``, k: ``(B, H_kv, T_k, d_k)``, v: ``(B, H_kv, T_k, d_v)`` as in
SDPA; H_q a multiple of H_kv (grouped-query). Returns H ``(B, H_q, T_q, d_v)`` in q's
dtype, and with ``return_lse`` also the fp32 log-sum-exp ``(B, H_q, T_q)``.
The mask keywords and modifiers are :class:`causalattn.masks.Pattern`'s; dropout is
:mod:`causalattn.dropout`'s (see :mod:`causalattn.engines.problem`). The engines are the
registry's (:mod:`causalattn.engines.registry`); "auto" is :mod:`causalattn.engines.auto`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .. import dropout as _dropout
from .._internals.torch import constant_result, is_fake, transforms_active
from ..masks import default_scale
from ..masks_mod import check_callable
from . import auto as _auto
from . import cpp as _cpp
from . import ops as _ops
from .cache import KVCache
from .problem import Problem, _check_tensors, check_generator, make_problem
from .registry import (
    ENGINES,
    LEARNED,
    TENSORS,
    Features,
    captured_of,
    engine,
    feature_values,
    of_problem,
    refusal,
    refusal_of,
)

if TYPE_CHECKING:
    from ..arrays import MaskMod, ScoreMod, Tensor

_default_scale = constant_result(default_scale)

__all__ = ["attention", "KVCache", "Problem", "make_problem", "ENGINES", "pick_engine", "run"]


def _choose(name: str, values: tuple, k_len) -> str:
    """The engine to run: ``name`` itself (checked), or what "auto" picks, from the call's
    :func:`~causalattn.engines.registry.feature_values`; plain values only, so it runs at
    trace time."""
    if name == "auto":
        T_k = k_len  # symbolic while tracing: each bound below becomes a guard
        return next(n for bound, n in _auto.ladder_of(values) if T_k <= bound)
    e = engine(name)  # unknown names raise here
    # what the engine does not support: named now while tracing; in eager mode by the
    # operator, after the data checks (which name the bad argument first)
    # (the user's functions and learned tensors are named now: nothing in the data decides)
    user = any(values[i] for i in USER)
    why = refusal_of(name, values) if torch.compiler.is_compiling() or user else ""
    if values[LSE] and not e.lse:
        why = (
            f"engine {name!r}: return_lse: PyTorch's SDPA does not return the log-sum-exp; "
            "use 'cpp' or 'tiled'"
        )
    if why:
        raise ValueError(why)
    return name


LSE = list(Features.__dataclass_fields__).index("lse")  # its place in feature_values
USER = tuple(
    list(Features.__dataclass_fields__).index(n) for n in ("mask_mod", "score_mod", "learned")
)


def pick_engine(p: Problem, return_lse: bool = False) -> str:
    """The engine "auto" runs for this problem (see :mod:`causalattn.engines.auto`)."""
    return _auto.pick(of_problem(p, return_lse))


def _tensor(name: str, x, device):
    """A list or array argument as a tensor (tensors pass through; the operator checks them)."""
    if x is None or isinstance(x, torch.Tensor):
        return x
    try:
        return torch.as_tensor(x, device=device)
    except (TypeError, ValueError, RuntimeError) as exc:  # a string, ragged lists, ...
        raise ValueError(f"{name}: expected an array or tensor, got {x!r:.60} ({exc})") from exc


# ---- the plain call, in microseconds --------------------------------------------------------
# q, k, v and at most causal, window, chunk, scale, engine: its checks and its choice are
# made once per (dtypes, devices, shapes, keywords) and remembered, so a repeated call costs
# a dictionary look-up and the kernel's own call (the bar: twice SDPA's time at (1,1,8,16)).
_PLAIN: dict = {}
_PLAIN_MAX = 4096
_SCALE: dict = {}  # d_k -> 1/√d_k


def _plain(q, k, v, causal, window, chunk, scale, name):
    if not (type(q) is type(k) is type(v) is torch.Tensor):  # Parameters, fakes: the usual way
        return None
    if torch.compiler.is_compiling() or transforms_active():
        return None
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    # k, v's devices as indices: the shortcut only ever runs with q on the CPU, where any
    # other device of k or v has an index >= 0
    key = (
        q.shape,
        k.shape,
        v.shape,
        q.dtype,
        k.dtype,
        v.dtype,
        q.device,
        k.get_device(),
        v.get_device(),
        causal,
        window,
        chunk,
        name,
        grad,
    )
    try:
        run_as = _PLAIN[key]
    except KeyError:
        run_as = _plain_engine(q, k, v, causal, window, chunk, name, grad)
        if len(_PLAIN) >= _PLAIN_MAX:
            _PLAIN.clear()
        _PLAIN[key] = run_as
    except TypeError:  # an unhashable keyword: the usual way names it
        return None
    if run_as is None:
        return None
    if scale is None:
        d_k = q.shape[-1]
        scale = _SCALE.get(d_k) or _SCALE.setdefault(d_k, default_scale(d_k))
    elif type(scale) not in (float, int) or not math.isfinite(scale):
        return None  # the usual way refuses it by name
    if run_as == "sdpa":
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    return _cpp.plain(q, k, v, run_as, float(scale))


def _plain_engine(q, k, v, causal, window, chunk, name, grad):
    """How a plain call runs on the shortcut — "sdpa", the native engine's prepared call
    (:func:`causalattn.engines.cpp.prepare`), or None for the usual way (which also names
    whatever is wrong): checks everything the usual way checks before the kernels."""
    _check_tensors(q, k, v)
    if _auto.scalar_refusal(causal, window, chunk, None) or q.shape[2] > k.shape[2]:
        return None
    if q.device.type != "cpu":
        return None
    values = feature_values(
        q, k, v, tensors={}, causal=causal, window=window, chunk=chunk, grad=grad
    )
    run_as = _choose(name, values, k.shape[2])
    if run_as not in ENGINES or refusal(run_as, Features(*values)):
        return None
    if run_as == "cpp":
        return _cpp.prepare(q, k, causal, window, chunk, grad)
    plain_sdpa = window is None and chunk is None and (not causal or q.shape[2] == k.shape[2])
    return "sdpa" if run_as == "sdpa" and plain_sdpa and not grad else None


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    window: int | None = None,
    lengths: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    prefix_lengths: Tensor | None = None,
    chunk: int | None = None,
    mask: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    engine: str = "auto",
    return_lse: bool = False,
    mask_mod: MaskMod | None = None,
    score_mod: ScoreMod | None = None,
    bias: Tensor | None = None,
    rel_bias: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Causal self-attention ``dropout(softmax_last(modify(q kᵀ·scale) + M)) v`` on one of
    the engines. ``sinks`` may be a learned Parameter (gradients flow to it).

    One call of the ``causalattn::fwd`` operator (:mod:`causalattn.engines.ops`): it
    compiles with ``torch.compile(fullgraph=True)``, exports, runs on meta tensors and
    under torch.func. Shapes are checked here (at trace time); what needs the data
    (lengths, cu_seqlens, finiteness) inside the operator. A plain eager call (no pattern
    tensors, modifiers or dropout) takes a remembered shortcut to the same kernels.

    ``mask_mod(b, h, q_idx, kv_idx) -> bool`` and ``score_mod(score, b, h, q_idx, kv_idx)``
    are FlexAttention's (see :mod:`causalattn.masks_mod`); ``bias`` an additive float tensor
    broadcastable to (B, H_q, T_q, T_k), ``rel_bias`` (H_q, 2T−1) a relative-position bias.
    Gradients flow to ``bias``, ``rel_bias``, ``alibi_slopes``, ``sinks`` and the tensors a
    score_mod reads, where they require one.
    """
    if (
        lengths is None
        and key_padding_mask is None
        and cu_seqlens is None
        and prefix_lengths is None
        and mask is None
        and alibi_slopes is None
        and softcap is None
        and sinks is None
        and mask_mod is None
        and score_mod is None
        and bias is None
        and rel_bias is None
        and generator is None
        and return_lse is False
        and (dropout_p == 0 and type(dropout_p) in (float, int))
    ):
        out = _plain(q, k, v, causal, window, chunk, scale, engine)
        if out is not None:
            return out
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
        bias=bias,
        rel_bias=rel_bias,
    )
    tensors = {n: _tensor(n, x, q.device) for n, x in given.items()}
    for name, fn in (("mask_mod", mask_mod), ("score_mod", score_mod)):
        check_callable(name, fn)
    # a score_mod's captured tensors need a gradient even when q, k, v and the pattern
    # tensors need none (a learned bias over frozen projections)
    # (looked up on the function held by number: a function made inside a compiled region
    # is Dynamo's, which does not show its globals; the held one is the real function)
    mods = _ops.mods_id(mask_mod, score_mod)
    captured = captured_of(_ops.mods_of(mods)[1]) if torch.is_grad_enabled() else []
    grad = bool(captured) or (
        torch.is_grad_enabled()
        and any(
            isinstance(t, torch.Tensor) and t.requires_grad
            for t in (q, k, v, *(tensors[n] for n in LEARNED))
        )
    )
    values = feature_values(
        q,
        k,
        v,
        tensors=tensors,
        causal=causal,
        window=window,
        chunk=chunk,
        softcap=softcap,
        dropout_p=dropout_p,
        lse=return_lse,
        grad=grad,
        mask_mod=mask_mod,
        score_mod=score_mod,
        captured=captured,
    )
    name = _choose(engine, values, k.shape[2])
    # eagerly, SDPA keeps PyTorch's own autograd: through the operator its backward would
    # recompute the forward (fwd+bwd 1.4x slower at GPT-2 small in one bench run).
    # Under a torch.func transform, a tensor that a score_mod captures is wrapped at the
    # transform's level, which no operator can differentiate through: the reference's
    # differentiable torch math runs at the user's level instead, so the transform sees it.
    direct = (
        "sdpa"
        if name == "sdpa" and _eager(q)
        else "reference"
        if captured and transforms_active()
        else None
    )
    if direct:
        with _ops.naming(direct):
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
                mask_mod=mask_mod,
                score_mod=score_mod,
                **given,
            )
            return _ops.engine_module(direct).forward(p, return_lse)
    # the dropout seed stays a tensor: a compiled graph draws it anew on every call
    seed = _dropout.seed_tensor(generator) if dropout_p else None
    args = _ops.OpArgs(
        q,
        k,
        v,
        *(tensors[n] for n in TENSORS),
        captured=list(captured),
        dropout_seed=seed,
        causal=causal,
        window=window,
        chunk=chunk,
        softcap=None if softcap is None else float(softcap),
        scale=float(scale),
        dropout_p=float(dropout_p),
        mods=mods,
        engine=name,
        return_lse=return_lse,
    )
    if transforms_active():  # torch.func.grad, vmap, ...
        out, lse = _ops.FuncAttention.apply(*_ops.FuncAttention.flat(args))
    else:
        out, lse = torch.ops.causalattn.fwd(*args)
    return (out, lse.float()) if return_lse else out


def _eager(q: torch.Tensor) -> bool:
    """Plain eager mode: not traced by Dynamo or export, no torch.func transform, real data."""
    return not (
        torch.compiler.is_compiling()
        or torch.compiler.is_exporting()
        or transforms_active()
        or is_fake(q)
        or q.device.type == "meta"
    )


def run(p: Problem, engine: str = "auto", return_lse: bool = False):
    """Run a built :class:`Problem` on an engine, eagerly (its pattern may be placed, its
    dropout seed drawn already); :func:`attention` is the traceable entry."""
    if not isinstance(return_lse, bool):
        raise ValueError(f"attention: return_lse must be True or False, got {return_lse!r}")
    name = pick_engine(p, return_lse) if engine == "auto" else engine
    why = _ops.refusal(name, p, return_lse)
    if why:
        raise ValueError(why)
    with _ops.naming(name):
        return _ops.engine_module(name).forward(p, return_lse)
