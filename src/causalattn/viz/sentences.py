"""Sentences as Traces for the pictures: seeded random weights over a text.Batch.

traces = batch_traces(text.encode(["I love pizza", "you love cheese"]))
names = sentence_names(batch)
"""

from __future__ import annotations

import numpy as np

from .._trace import Trace
from ..matrix_form import trace as _trace

__all__ = ["batch_traces", "sentence_traces", "sentence_names"]


def batch_traces(
    batch, *, d_model: int = 16, n_heads: int = 2, seed: int = 0, chunk: int = 512
) -> list[Trace]:
    """One Trace per sentence of a :class:`causalattn.text.Batch`, from seeded random weights.

    The embedding (vocabulary×d_model) and W_Q, W_K, W_V, W_O are drawn from
    ``numpy.random.default_rng(seed)``: the weights are made up, the pattern (causal, and
    the padding after each sentence: ``lengths``) and the arithmetic are real. Sentences are
    traced ``chunk`` at a time (one batched trace each); each returned Trace is one
    sentence with its own tokens; C is left out (A and V give it).
    """
    if isinstance(n_heads, bool) or not isinstance(n_heads, (int, np.integer)) or n_heads < 1:
        raise ValueError(f"explorer: n_heads must be a positive integer, got {n_heads!r}")
    if isinstance(d_model, bool) or not isinstance(d_model, (int, np.integer)) or d_model < 1:
        raise ValueError(f"explorer: d_model must be a positive integer, got {d_model!r}")
    if d_model % n_heads:
        raise ValueError(f"explorer: d_model={d_model} is not divisible by n_heads={n_heads}")
    rng = np.random.default_rng(seed)
    E = rng.normal(size=(len(batch.vocab), d_model))
    W_q, W_k, W_v, W_o = (rng.normal(size=(d_model, d_model)) / np.sqrt(d_model) for _ in range(4))
    out = []
    for b0 in range(0, batch.ids.shape[0], chunk):
        ids = batch.ids[b0 : b0 + chunk]
        tr = _trace(
            E[ids],
            W_q,
            W_k,
            W_v,
            W_o,
            lengths=np.asarray(batch.lengths[b0 : b0 + chunk]),
            n_heads=n_heads,
        )
        # C (T×T×d_v per head) is most of a sentence's memory and A, V give it (explain()
        # needs only those): 10,000 sentences keep a few hundred MiB, not a GiB.
        tr = Trace(
            {n: tr[n] for n in tr.names if n != "C"},
            allowed=tr.allowed,
            scale=tr.scale,
            n_heads=tr.n_heads,
            pattern=tr.pattern,
            reasons=tr.reasons,
        )
        for b in range(ids.shape[0]):
            one = tr.select(b)
            one.tokens = list(batch.tokens[b0 + b])
            out.append(one)
    return out


def sentence_traces(sentences, *, max_len: int | None = None, **kw) -> list[Trace]:
    """:func:`batch_traces` of ``text.encode(sentences, max_len)``."""
    from .. import text

    return batch_traces(text.encode(sentences, max_len=max_len), **kw)


def sentence_names(batch) -> list[str]:
    """Short names for a batch's sentences: their real tokens, cut at 60 characters."""
    names = []
    for b, toks in enumerate(batch.tokens):
        s = " ".join(toks[: int(batch.lengths[b])])
        names.append(f"{b + 1}: " + (s if len(s) <= 60 else s[:59] + "…"))
    return names
