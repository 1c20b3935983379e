"""Which global positions each rank holds, and moving a sequence in and out of that layout.

The sequence of length T is cut into 2P equal chunks (P = ranks in the group).

- ``"zigzag"``: rank r holds chunks r and 2P−1−r. Under the causal mask early chunks read
  few keys and late chunks many, so pairing them gives every rank the same work.
- ``"contiguous"``: rank r holds chunks 2r and 2r+1, i.e. positions [r·T/P, (r+1)·T/P).
  The last rank does about 2P−1 times the work of the first (kept for comparison).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {list(LAYOUTS)}, got {layout!r}")


def rank_and_size(group=None) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "ring attention needs torch.distributed: call torch.distributed.init_process_group "
            "first (gloo on CPU, nccl on GPU), e.g. under torchrun"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def multiple(P: int, layout: str) -> int:
    """T must be a multiple of this for equal shards."""
    check_layout(layout)
    return 2 * P if layout == "zigzag" else P


def segments(rank: int, P: int, T_local: int, layout: str) -> list[tuple[int, int]]:
    """The runs of global positions ``[(start, length), ...]`` rank holds, in local order.

    ``T_local`` is the shard length T/P. Zigzag needs it even (two chunks of T/(2P)).
    """
    check_layout(layout)
    if layout == "contiguous":
        return [(rank * T_local, T_local)]
    if T_local % 2:
        raise ValueError(
            f"ring_attention: layout 'zigzag' cuts T = {T_local * P} into 2P = {2 * P} chunks, "
            f"but each rank holds T/P = {T_local} positions (odd); use shard(), which pads T "
            f"to a multiple of 2P, or layout='contiguous'"
        )
    c = T_local // 2
    return [(rank * c, c), ((2 * P - 1 - rank) * c, c)]


def positions(T_local: int, group=None, layout: str = "zigzag", device=None) -> torch.Tensor:
    """Global positions ``(T/P,)`` of this rank's local rows (e.g. for rotary embeddings)."""
    r, P = rank_and_size(group)
    return _positions(segments(r, P, T_local, layout), device)


def _positions(segs, device=None) -> torch.Tensor:
    return torch.cat([torch.arange(s, s + n, device=device) for s, n in segs])


def shard(x: torch.Tensor, group=None, layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """This rank's part of the full sequence ``x`` (every rank passes the same x).

    x: ``(B, H, T, d)`` (sequence along ``dim``) -> ``(B, H, T'/P, d)``. When T is not a
    multiple of 2P (zigzag) or P (contiguous), x is padded with zeros at the end to the next
    multiple T'. Causality keeps real positions from ever reading that tail; drop it again
    with ``unshard(..., length=T)``, and when you train on the local shards pass
    ``lengths`` to :func:`ring_attention` so the tail rows are padding (zero output and
    gradient). Differentiable (slicing only, no communication).
    """
    r, P = rank_and_size(group)
    dim = dim % x.dim()
    T = x.shape[dim]
    m = multiple(P, layout)
    T_pad = -(-T // m) * m
    if T_pad != T:
        pad = [0, 0] * (x.dim() - 1 - dim) + [0, T_pad - T]
        x = F.pad(x, pad)
    segs = segments(r, P, T_pad // P, layout)
    parts = [x.narrow(dim, s, n) for s, n in segs]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def unshard(
    x_local: torch.Tensor,
    group=None,
    layout: str = "zigzag",
    dim: int = 2,
    length: int | None = None,
) -> torch.Tensor:
    """Gather every rank's shard back into the full sequence (inverse of :func:`shard`).

    ``length`` drops the zero tail :func:`shard` added. Collective: every rank of the group
    must call it. Not differentiable (for results and checks; train on local shards).
    """
    r, P = rank_and_size(group)
    dim = dim % x_local.dim()
    T_local = x_local.shape[dim]
    x_local = x_local.detach().contiguous()
    parts = [torch.empty_like(x_local) for _ in range(P)]
    dist.all_gather(parts, x_local, group=group)
    pieces = []  # (global start, tensor)
    for rank, part in enumerate(parts):
        off = 0
        for s, n in segments(rank, P, T_local, layout):
            pieces.append((s, part.narrow(dim, off, n)))
            off += n
    full = torch.cat([t for _, t in sorted(pieces, key=lambda st: st[0])], dim=dim)
    if length is not None:
        if not 0 <= length <= full.shape[dim]:
            raise ValueError(f"unshard: length={length} must lie in [0, T={full.shape[dim]}]")
        full = full.narrow(dim, 0, length)
    return full
