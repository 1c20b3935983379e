"""Ring attention over torch.distributed: one causal sequence across many processes.

    ring_attention(q, k, v, *, group=None, layout="zigzag", lengths=None, scale=None)

gloo on CPUs, NCCL on GPUs. Each rank holds a shard (B, H, T/P, d) of the sequence;
:func:`shard` / :func:`unshard` move a full sequence into and out of the layout.
"""

from .layout import LAYOUTS, positions, shard, unshard
from .ring import RingError, RingStats, ring_attention

__all__ = ["ring_attention", "shard", "unshard", "positions", "RingError", "RingStats", "LAYOUTS"]
