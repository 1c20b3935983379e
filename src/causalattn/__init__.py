"""causalattn: causal self-attention in matrix form — understand it, check it, run it fast.

H = softmax_last( Q Kᵀ / √d_k + M ) V

The notation (X, W_Q, …, S, M, Z, A, H, C, O), "the seed", "the chapter's example", the
layers and the conventions are defined in docs/design.md.

Every public name loads on first use (PEP 562), so ``import causalattn`` and the commands
that compute nothing with torch (``causalattn --help``, ``shapes``, ``masks``, ``learn``'s
questions) start without importing it. ``causalattn.trace`` is the function
(:func:`causalattn.matrix_form.trace`); the Trace it returns lives in the private module
``_trace``, so no submodule's import rebinds that name.
"""

from __future__ import annotations

import importlib

# public name -> the module that defines it (relative to this package)
_LAZY = {
    "trace": ".matrix_form",
    "Trace": "._trace",
    "attention": ".engines",
    "KVCache": ".engines",
    "audit": ".check",
    "Report": ".check",
    "AuditInputError": ".check",
    "diagnose": ".check",
    "Diagnosis": ".check",
    "encode": ".text",
    "Vocabulary": ".text",
    "Batch": ".text",
    "shape_table": ".shapes",
    "CausalSelfAttention": ".layer",
}
# submodules reached as attributes (`causalattn.masks`, `causalattn.distributed`, ...)
_SUBMODULES = (
    "masks",
    "masks_mod",
    "text",
    "shapes",
    "viz",
    "check",
    "engines",
    "layer",
    "matrix_form",
    "dropout",
    "inspect",
    "memory",
    "integrations",
    "distributed",
    "learn",
    "bench",
)

__all__ = [
    "masks",
    "trace",
    "Trace",
    "attention",
    "KVCache",
    "audit",
    "Report",
    "AuditInputError",
    "diagnose",
    "Diagnosis",
]
__all__ += ["text", "encode", "Vocabulary", "Batch", "shapes", "shape_table"]
__all__ += ["viz"]
__all__ += ["CausalSelfAttention"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'causalattn' has no attribute {name!r}")
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_LAZY, *_SUBMODULES})
