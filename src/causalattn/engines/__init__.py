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

import importlib

from .cache import KVCache
from .problem import Problem, make_problem

__all__ = ["attention", "KVCache", "Problem", "make_problem", "ENGINES", "pick_engine"]

# engine name -> module with forward(problem, return_lse)
ENGINES = {
    "reference": "causalattn.engines.exact",  # the engine named "reference"
    "sdpa": "causalattn.engines.sdpa",
    "tiled": "causalattn.engines.tiled",
    "triton": "causalattn.engines.triton",
}


def _supports(mod, p: Problem, return_lse: bool) -> bool:
    """An engine module's own ``supports(p, return_lse)``; without one, the legacy patterns."""
    fn = getattr(mod, "supports", None)
    return fn(p, return_lse) if fn is not None else p.is_legacy


def pick_engine(p: Problem, return_lse: bool = False) -> str:
    """The engine "auto" runs for this problem."""
    if p.q.device.type == "cuda":
        from . import sdpa

        try:
            from . import triton as tr
        except ImportError:
            tr = None
        if tr is not None and tr.available() and _supports(tr, p, return_lse):
            return "triton" if tr.prefers(p) or return_lse else "sdpa"
        return "sdpa" if sdpa.supports(p, return_lse) else "reference"
    from . import tiled

    return "tiled" if tiled.supports(p, return_lse) else "reference"


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
    the engines. ``sinks`` may be a learned Parameter (gradients flow to it)."""
    p = make_problem(
        q, k, v, causal=causal, window=window, lengths=lengths,
        key_padding_mask=key_padding_mask, cu_seqlens=cu_seqlens,
        prefix_lengths=prefix_lengths, chunk=chunk, mask=mask, alibi_slopes=alibi_slopes,
        softcap=softcap, sinks=sinks, scale=scale, dropout_p=dropout_p, generator=generator,
    )
    return run(p, engine, return_lse)


def run(p: Problem, engine: str = "auto", return_lse: bool = False):
    """Run a built :class:`Problem` on an engine (what :func:`attention` does after checking)."""
    if not isinstance(return_lse, bool):
        raise ValueError(f"attention: return_lse must be True or False, got {return_lse!r}")
    name = pick_engine(p, return_lse) if engine == "auto" else engine
    if name not in ENGINES:
        raise ValueError(f"attention: unknown engine {engine!r}; choose from {['auto', *ENGINES]}")
    try:
        mod = importlib.import_module(ENGINES[name])
    except ImportError as exc:
        raise ValueError(f"attention: engine {name!r} is not available here ({exc})") from exc
    if name == "triton" and not hasattr(mod, "supports") and not p.is_legacy:
        raise ValueError(
            f"attention: engine 'triton' does not support {p.pattern.describe()}"
            + (f" with dropout_p={p.dropout_p}" if p.dropout_p else "")
            + " yet; use engine='tiled' or 'reference'"
        )
    return mod.forward(p, return_lse)
