"""causalattn: causal self-attention in matrix form — understand it, check it, run it fast.

    H = softmax_last( Q Kᵀ / √d_k + M ) V
"""

from . import masks
from .engines import KVCache, attention
from .reference import trace
from .trace import Trace

__all__ = ["masks", "trace", "Trace", "attention", "KVCache"]
__version__ = "0.1.0"
