"""The explorer's first step: what was given (a Trace, a list of them, a Batch), read as
sequences × layers, each layer one sequence's Trace with the kinds of its blocked cells.

A list of Traces that share their tokens is one model's layers (what ``capture()``
returns); any other list is one sequence per Trace. Each stage is read once
(:func:`_plain`): a captured Hugging Face layer computes its T×T stages on every read.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .._trace import Trace
from .kinds import sequences
from .sentences import batch_traces, sentence_names

__all__ = ["Layer", "Seq", "named_sequences", "stacked"]


class Layer(NamedTuple):
    name: str
    trace: Trace  # one sequence, heads (if any) on the leading axis
    kinds: np.ndarray  # T×T uint8


class Seq(NamedTuple):
    name: str
    layers: list[Layer]


def stacked(tr: Trace, name: str) -> np.ndarray:
    """A per-head stage of a one-sequence trace as ``(h, T, ·)`` (h = 1 without heads)."""
    a = np.asarray(tr[name])
    return a if tr.n_heads is not None else a[None]


# -- reading what was given --------------------------------------------------
def _is_model(traces: list[Trace]) -> bool:
    """A list of Traces is one model's layers when they share tokens and shapes."""
    if len(traces) < 2 or traces[0].tokens is None or "A" not in traces[0]:
        return False
    t0, s0 = traces[0].tokens, traces[0]["A"].shape
    return all(t.tokens == t0 and "A" in t and t["A"].shape == s0 for t in traces[1:])


def _plain(tr: Trace) -> Trace:
    """The stages the explorer reads, each read once: a Trace may compute its T×T stages on
    every read (a captured Hugging Face layer does), and the explorer looks at them often."""
    arrays = {
        n: np.asarray(tr[n])
        for n in ("X", "W_q", "W_k", "W_v", "Q", "K", "V", "S", "A", "H")
        if n in tr
    }
    out = Trace(
        arrays,
        allowed=tr.allowed,
        scale=tr.scale,
        n_heads=tr.n_heads,
        tokens=tr.tokens,
        pattern=getattr(tr, "pattern", None),
        reasons=getattr(tr, "reasons", None),
    )
    return out


def _layer_name(tr: Trace, k: int) -> str:
    """ "layer N", 1-based: the model's own index when the trace knows it (``tr.layer``)."""
    idx = getattr(tr, "layer", None)
    return f"layer {int(idx) + 1}" if isinstance(idx, (int, np.integer)) else f"layer {k + 1}"


def named_sequences(obj, names, layers) -> list[Seq]:
    """Accept a Trace, a list of Traces (layers or sequences), or a text.Batch."""
    from ..text import Batch

    if isinstance(obj, Batch):
        names = sentence_names(obj) if names is None else names
        obj = batch_traces(obj)
    traces = [obj] if isinstance(obj, Trace) else list(obj)
    if not traces:
        raise ValueError("explorer: nothing to show; give at least one Trace")
    for k, tr in enumerate(traces):
        if not isinstance(tr, Trace):
            raise ValueError(f"explorer: item {k + 1} is a {type(tr).__name__}, not a Trace")
    as_model = _is_model(traces) if layers is None else bool(layers)
    if as_model:
        per_layer = [sequences(_plain(tr)) for tr in traces]
        n = len(per_layer[0])
        shapes = {(len(p), p[0].kinds.shape) for p in per_layer}
        if len(shapes) != 1:
            raise ValueError(
                f"explorer: layers=True needs layers of the same sequences and "
                f"length; got (sequences, T×T) {sorted(shapes)}"
            )
        batch_tokens = getattr(traces[0], "batch_tokens", None)  # a capture's, per sequence
        ids = getattr(traces[0], "ids", None)
        ids = None if ids is None else np.asarray(ids).reshape(n, -1)
        for b in range(n):
            for p in per_layer:
                if batch_tokens is not None and len(batch_tokens) == n:
                    p[b].trace.tokens = [str(t) for t in batch_tokens[b]]
                p[b].trace.ids = None if ids is None else ids[b]
                p[b].trace.generated = getattr(traces[0], "generated", 0)
        out = [
            Seq(
                per_layer[0][b].name if n > 1 else "sequence 1",
                [
                    Layer(_layer_name(tr, k), p[b].trace, p[b].kinds)
                    for k, (tr, p) in enumerate(zip(traces, per_layer))
                ],
            )
            for b in range(n)
        ]
    else:
        out = []
        for k, tr in enumerate(traces):
            parts = sequences(_plain(tr))
            for part in parts:
                label = (
                    part.name
                    if len(traces) == 1
                    else (f"trace {k + 1}" + (f" {part.name}" if len(parts) > 1 else ""))
                )
                out.append(Seq(label, [Layer("layer 1", part.trace, part.kinds)]))
    if names is not None:
        names = [str(n) for n in names]
        if len(names) != len(out):
            raise ValueError(f"explorer: {len(names)} names for {len(out)} sequences")
        out = [Seq(n, s.layers) for n, s in zip(names, out)]
    return out
