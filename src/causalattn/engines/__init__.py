"""Fast engines behind one signature, and the dispatch between them.

    attention(q, k, v, *, pattern=None, <the pattern keywords>, scale=None, dropout_p=0.0,
              generator=None, engine="auto", return_lse=False)

q: ``(B, H_q, T_q, d_k)``, k: ``(B, H_kv, T_k, d_k)``, v: ``(B, H_kv, T_k, d_v)`` as in
SDPA; H_q a multiple of H_kv (grouped-query). Returns H ``(B, H_q, T_q, d_v)`` in q's
dtype, and with ``return_lse`` also the fp32 log-sum-exp ``(B, H_q, T_q)``.
The pattern keywords are :class:`causalattn.masks.Pattern`'s fields
(:data:`causalattn.masks.PATTERN_KEYWORDS`, given to the signature by
:func:`causalattn.masks.takes_pattern`); dropout is :mod:`causalattn.dropout`'s. A call
becomes one :class:`~causalattn.engines.call.Call`; the engines and what each runs are the
registry's data (:mod:`causalattn.engines.registry`); "auto" is :mod:`causalattn.engines.auto`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .._internals.torch import is_fake, transforms_active
from ..masks import Pattern, default_scale, keywords_of, takes_pattern
from . import auto as _auto
from . import cpp as _cpp
from . import ops as _ops
from .cache import KVCache
from .call import Call
from .problem import Problem, _check_tensors, make_problem
from .registry import ENGINES, Features, engine, feature_values, of_problem, refusal, refusal_of

if TYPE_CHECKING:
    from ..arrays import Tensor

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
    user = any(values[i] for i in USER) or (values[LSE] and not e.lse)
    why = refusal_of(name, values) if torch.compiler.is_compiling() or user else ""
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


# ---- the plain call, in microseconds --------------------------------------------------------
# q, k, v and at most causal, window, chunk, scale, engine: its checks and its choice are
# made once per (dtypes, devices, shapes, keywords) and remembered, so a repeated call costs
# a dictionary look-up and the kernel's own call (the bar: twice SDPA's time at (1,1,8,16)).
_PLAIN: dict = {}
_PLAIN_MAX = 4096
_SCALE: dict = {}  # d_k -> 1/√d_k
_PLAIN_KEYWORDS = frozenset(("causal", "window", "chunk"))


def _plain(q, k, v, keywords, scale, dropout_p, generator, name, return_lse):
    """The shortcut's result, or None for the usual way (which also names what is wrong)."""
    if generator is not None or return_lse is not False:
        return None
    if not (dropout_p == 0 and type(dropout_p) in (float, int)):
        return None
    if not (type(q) is type(k) is type(v) is torch.Tensor):  # Parameters, fakes: the usual way
        return None
    if torch.compiler.is_compiling() or transforms_active():
        return None
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    causal, window = keywords.get("causal", True), keywords.get("window")
    chunk = keywords.get("chunk")
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


@takes_pattern
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    pattern: Pattern | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    engine: str = "auto",
    return_lse: bool = False,
    **keywords,
) -> Tensor | tuple[Tensor, Tensor]:
    """Causal self-attention ``dropout(softmax_last(modify(q kᵀ·scale) + M)) v`` on one of
    the engines. The pattern is ``pattern`` (a :class:`~causalattn.masks.Pattern`) or its
    keywords (not both). ``sinks`` may be a learned Parameter (gradients flow to it).

    One call of the ``causalattn::fwd`` operator (:mod:`causalattn.engines.ops`): it
    compiles with ``torch.compile(fullgraph=True)``, exports, runs on meta tensors and
    under torch.func. Shapes are checked here (at trace time, :class:`Call`); what needs
    the data (lengths, cu_seqlens, finiteness) inside the operator. A plain eager call (no
    pattern tensors, modifiers or dropout) takes a remembered shortcut to the same kernels.

    ``mask_mod(b, h, q_idx, kv_idx) -> bool`` and ``score_mod(score, b, h, q_idx, kv_idx)``
    are FlexAttention's (see :mod:`causalattn.masks_mod`); ``bias`` an additive float tensor
    broadcastable to (B, H_q, T_q, T_k), ``rel_bias`` (H_q, 2T−1) a relative-position bias.
    Gradients flow to ``bias``, ``rel_bias``, ``alibi_slopes``, ``sinks`` and the tensors a
    score_mod reads, where they require one.
    """
    if pattern is None and keywords.keys() <= _PLAIN_KEYWORDS:
        out = _plain(q, k, v, keywords, scale, dropout_p, generator, engine, return_lse)
        if out is not None:
            return out
    kw = keywords_of(pattern, keywords, "attention")
    call = Call.of(q, k, v, kw, scale, dropout_p, generator, return_lse)
    name = _choose(engine, call.values, k.shape[2])
    # eagerly, SDPA keeps PyTorch's own autograd: through the operator its backward would
    # recompute the forward (fwd+bwd 1.4x slower at GPT-2 small in one bench run).
    # Under a torch.func transform, a tensor that a score_mod captures is wrapped at the
    # transform's level, which no operator can differentiate through: the reference's
    # differentiable torch math runs at the user's level instead, so the transform sees it.
    direct = "sdpa" if name == "sdpa" and _eager(q) else None
    direct = "reference" if call.captured and transforms_active() else direct
    if direct:
        with _ops.naming(direct):
            return _ops.engine_module(direct).forward(call.problem(), return_lse)
    args = call.op_args(name)
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
