"""KVCache: keys and values kept across decoding steps, appended in place.

Storage is preallocated and grown by doubling, so one decoding step copies only the
new token's keys and values; attention over the cache then costs O(T·d) per new query.
New queries are the last positions of the sequence (bottom-right causal alignment).
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys ``(B, H_kv, T, d_k)`` and values ``(B, H_kv, T, d_v)`` grown along T."""

    def __init__(self, capacity: int = 256):
        if capacity < 1:
            raise ValueError(f"KVCache: capacity must be >= 1, got {capacity}")
        self._capacity = int(capacity)
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._len = 0

    def __len__(self) -> int:
        return self._len

    @property
    def k(self) -> torch.Tensor:
        if self._k is None:
            raise ValueError("KVCache: empty; append keys and values first")
        return self._k[:, :, : self._len]

    @property
    def v(self) -> torch.Tensor:
        if self._v is None:
            raise ValueError("KVCache: empty; append keys and values first")
        return self._v[:, :, : self._len]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add ``k`` ``(B, H_kv, t, d_k)`` and ``v`` ``(B, H_kv, t, d_v)``; return the whole cache."""
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
            raise ValueError(
                f"KVCache.append: k and v must be (B, H_kv, t, d) with the same (B, H_kv, t); "
                f"got k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
        if self._k is not None:
            want_k = (self._k.shape[0], self._k.shape[1], self._k.shape[3])
            want_v = self._v.shape[3]
            if (k.shape[0], k.shape[1], k.shape[3]) != want_k or v.shape[3] != want_v:
                raise ValueError(
                    f"KVCache.append: cache holds (B, H_kv, T, d_k) = {tuple(self.k.shape)} and "
                    f"d_v = {want_v}; got k {tuple(k.shape)}, v {tuple(v.shape)} (another layer or batch?)"
                )
            if k.dtype != self._k.dtype or k.device != self._k.device:
                raise ValueError(
                    f"KVCache.append: cache is {self._k.dtype} on {self._k.device}; got "
                    f"{k.dtype} on {k.device}"
                )
        t = k.shape[2]
        need = self._len + t
        if self._k is None or need > self._k.shape[2]:
            cap = max(self._capacity, need)
            while cap < need:
                cap *= 2
            if self._k is not None:
                cap = max(cap, 2 * self._k.shape[2])
            B, H = k.shape[:2]
            nk = k.new_empty(B, H, cap, k.shape[3])
            nv = v.new_empty(B, H, cap, v.shape[3])
            if self._k is not None:
                nk[:, :, : self._len] = self.k
                nv[:, :, : self._len] = self.v
            self._k, self._v = nk, nv
        self._k[:, :, self._len : need] = k
        self._v[:, :, self._len : need] = v
        self._len = need
        return self.k, self.v
