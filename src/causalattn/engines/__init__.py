"""Fast engines behind one signature, and the dispatch between them.

    attention(q, k, v, *, causal=True, key_padding_mask=None, lengths=None,
              cu_seqlens=None, scale=None, engine="auto", return_lse=False)

q: ``(B, H_q, T_q, d_k)``, k: ``(B, H_kv, T_k, d_k)``, v: ``(B, H_kv, T_k, d_v)`` as in
SDPA; H_q a multiple of H_kv (grouped-query). Returns H ``(B, H_q, T_q, d_v)`` in q's
dtype, and with ``return_lse`` also the fp32 log-sum-exp ``(B, H_q, T_q)``.
See :mod:`causalattn.engines.problem` for what each mask argument means.
"""

from __future__ import annotations

import importlib

from .cache import KVCache
from .problem import Problem, make_problem

__all__ = ["attention", "KVCache", "Problem", "make_problem", "ENGINES", "pick_engine"]

# engine name -> module with forward(problem, return_lse)
ENGINES = {
    "reference": "causalattn.engines.reference",
    "sdpa": "causalattn.engines.sdpa",
    "tiled": "causalattn.engines.tiled",
    "triton": "causalattn.engines.triton",
}


def pick_engine(p: Problem, return_lse: bool = False) -> str:
    """The engine "auto" runs for this problem."""
    if p.q.device.type == "cuda":
        try:
            from .triton import available, prefers
        except ImportError:
            available = None
        if available is None or not available():  # triton (the `.[gpu]` extra) missing
            return "sdpa" if not return_lse else "reference"
        return "triton" if prefers(p) or return_lse else "sdpa"
    return "tiled"


def attention(
    q,
    k,
    v,
    *,
    causal: bool = True,
    key_padding_mask=None,
    lengths=None,
    cu_seqlens=None,
    scale: float | None = None,
    engine: str = "auto",
    return_lse: bool = False,
):
    """Causal self-attention ``softmax_last(q kᵀ·scale + M) v`` on one of the engines."""
    p = make_problem(
        q, k, v, causal=causal, key_padding_mask=key_padding_mask, lengths=lengths,
        cu_seqlens=cu_seqlens, scale=scale,
    )
    name = pick_engine(p, return_lse) if engine == "auto" else engine
    if name not in ENGINES:
        raise ValueError(f"attention: unknown engine {engine!r}; choose from {['auto', *ENGINES]}")
    try:
        mod = importlib.import_module(ENGINES[name])
    except ImportError as exc:
        raise ValueError(f"attention: engine {name!r} is not available here ({exc})") from exc
    return mod.forward(p, return_lse)
