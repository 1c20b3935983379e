"""One attention problem, checked once and handed to every engine in the same form.

Every engine takes a :class:`Problem` and returns ``H`` ``(B, H_q, T_q, d_v)`` and, when
asked, the fp32 log-sum-exp of each query row ``(B, H_q, T_q)`` (-inf for a row with
no readable key). What a query may read:

- ``causal``: query i (the last T_q positions when T_q < T_k) reads keys j <= i + T_k - T_q;
- ``lengths`` ``(B,)``: sequence b has lengths[b] real positions; keys past it are blocked
  and queries past it are padding rows (no readable key, zero output) — the seed's
  combined causal + padding mask;
- ``key_padding_mask`` ``(B, T_k)`` bool, True = may read: blocks keys only (as in SDPA
  and Hugging Face);
- ``cu_seqlens`` ``(n+1,)``: several sequences packed along T (B must be 1), each
  causal on its own, as in FlashAttention's varlen API.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


@dataclass
class Problem:
    q: torch.Tensor  # (B, H_q, T_q, d_k)
    k: torch.Tensor  # (B, H_kv, T_k, d_k)
    v: torch.Tensor  # (B, H_kv, T_k, d_v)
    causal: bool
    scale: float
    lengths: torch.Tensor | None = None  # (B,) int64
    key_padding_mask: torch.Tensor | None = None  # (B, T_k) bool
    cu_seqlens: torch.Tensor | None = None  # (n+1,) int64

    @property
    def group(self) -> int:
        """Query heads per key/value head (grouped-query attention)."""
        return self.q.shape[1] // self.k.shape[1]

    @property
    def offset(self) -> int:
        """Bottom-right causal alignment: query i sits at key position i + offset."""
        return self.k.shape[2] - self.q.shape[2]

    def allowed(self) -> torch.Tensor:
        """The dense boolean mask ``(B, 1, T_q, T_k)``, True = may read.

        Only the materializing engines (reference, sdpa) call this: it is O(T_q·T_k).
        """
        B, _, T_q, _ = self.q.shape
        T_k = self.k.shape[2]
        dev = self.q.device
        i = torch.arange(T_q, device=dev)[:, None] + self.offset  # query positions
        j = torch.arange(T_k, device=dev)[None, :]
        m = torch.ones(B, 1, T_q, T_k, dtype=torch.bool, device=dev)
        if self.causal:
            m = m & (j <= i)
        if self.lengths is not None:
            L = self.lengths.to(dev)[:, None, None, None]
            m = m & (j < L) & (i < L)
        if self.key_padding_mask is not None:
            m = m & self.key_padding_mask.to(dev)[:, None, None, :]
        if self.cu_seqlens is not None:
            seq = torch.bucketize(torch.arange(T_k, device=dev), self.cu_seqlens.to(dev)[1:], right=True)
            m = m & (seq[:, None] == seq[None, :])
        return m


def make_problem(
    q, k, v, *, causal=True, key_padding_mask=None, lengths=None, cu_seqlens=None, scale=None
) -> Problem:
    """Check inputs and build a :class:`Problem`; every error names the argument and shapes."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"attention: {name} must be a torch.Tensor (B, H, T, d), got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"attention: {name} must be 4-D (B, H, T, d), got shape {_shape(t)}")
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"attention: {name} {_shape(t)} has dtype {t.dtype}; expected one of fp64, fp32, bf16, fp16"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"attention: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"attention: q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    B, H_q, T_q, d_k = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(
            f"attention: batch sizes differ: q {_shape(q)}, k {_shape(k)}, v {_shape(v)}"
        )
    if k.shape[3] != d_k:
        raise ValueError(
            f"scores: q is (B, H, T_q, d_k) = {_shape(q)} but k is {_shape(k)}; "
            "the inner d_k axes must match"
        )
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(
            f"attention: k {_shape(k)} and v {_shape(v)} must agree on (B, H_kv, T_k)"
        )
    H_kv, T_k = k.shape[1], k.shape[2]
    if H_kv == 0 or H_q % H_kv:
        raise ValueError(
            f"attention: q has H_q={H_q} heads and k, v have H_kv={H_kv}; grouped-query "
            "attention needs H_q to be a multiple of H_kv"
        )
    if T_q > T_k:
        raise ValueError(
            f"attention: q has T_q={T_q} positions but k has T_k={T_k}; queries are the "
            "last T_q positions, so T_q must be <= T_k"
        )
    if scale is None:
        scale = 1.0 / math.sqrt(d_k) if d_k else 1.0
    scale = float(scale)

    if lengths is not None:
        lengths = torch.as_tensor(lengths, device=q.device)
        if lengths.dim() != 1 or lengths.shape[0] != B or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
            raise ValueError(
                f"lengths: expected an integer tensor of shape (B,) = ({B},), got shape "
                f"{_shape(lengths)} and dtype {lengths.dtype}"
            )
        lengths = lengths.to(torch.int64)
        if B and (int(lengths.min()) < 0 or int(lengths.max()) > T_k):
            raise ValueError(
                f"lengths: each length must lie in [0, T_k={T_k}], got {lengths.tolist()}"
            )
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor):
            key_padding_mask = torch.as_tensor(key_padding_mask)
        if key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != (B, T_k):
            raise ValueError(
                f"key_padding_mask: expected a bool tensor (B, T_k) = ({B}, {T_k}), True = may "
                f"read; got shape {_shape(key_padding_mask)} and dtype {key_padding_mask.dtype}"
            )
        key_padding_mask = key_padding_mask.to(q.device)
    if cu_seqlens is not None:
        cu_seqlens = torch.as_tensor(cu_seqlens, device=q.device)
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.numel() < 2:
            raise ValueError(
                f"cu_seqlens: expected a 1-D integer tensor (n+1,), got shape {_shape(cu_seqlens)} "
                f"and dtype {cu_seqlens.dtype}"
            )
        cu_seqlens = cu_seqlens.to(torch.int64)
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or cu[-1] != T_k or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(
                f"cu_seqlens: must start at 0, never decrease and end at T={T_k}; got {cu}"
            )
        if B != 1 or T_q != T_k:
            raise ValueError(
                f"cu_seqlens: packed sequences need q, k, v of shape (1, H, T, d) with one T; "
                f"got q {_shape(q)}, k {_shape(k)}"
            )
        if lengths is not None or key_padding_mask is not None:
            raise ValueError("cu_seqlens: give either packed sequences or lengths/key_padding_mask, not both")
    return Problem(q, k, v, bool(causal), scale, lengths, key_padding_mask, cu_seqlens)
