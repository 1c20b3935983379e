"""causalattn: causal self-attention in matrix form — understand it, check it, run it fast.

H = softmax_last( Q Kᵀ / √d_k + M ) V

The notation (X, W_Q, …, S, M, Z, A, H, C, O), "the seed", "the chapter's example", the
layers and the conventions are defined in docs/design.md.
"""

from . import masks, shapes, text, viz
from .check import AuditInputError, Diagnosis, Report, audit, diagnose
from .engines import KVCache, attention
from .layer import CausalSelfAttention
from .reference import trace
from .shapes import shape_table
from .text import Batch, Vocabulary, encode
from .trace import Trace

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


def __getattr__(name):  # `causalattn.distributed` (ring attention) and `.learn` load on first use
    if name in ("distributed", "learn"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'causalattn' has no attribute {name!r}")
