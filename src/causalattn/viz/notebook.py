"""Notebook display: Jupyter shows a Trace or a Batch as the offline explorer, inline.

Registered from here (viz) onto the core classes, so that core modules never import viz
(the layers of docs/design.md); importing :mod:`causalattn` registers it.
"""

from __future__ import annotations

from .._trace import Trace
from ..text import Batch
from .explorer import explorer_fragment


def _trace_html(tr: Trace) -> str | None:
    try:
        return explorer_fragment(tr)
    except ValueError:  # a partial trace (no S, A or V): the plain repr
        return None


def _batch_html(batch: Batch) -> str:
    return explorer_fragment(batch, title="causalattn explorer: seeded random weights")


def register() -> None:
    """Give Trace and Batch their ``_repr_html_`` (idempotent)."""
    Trace._repr_html_ = _trace_html
    Batch._repr_html_ = _batch_html
