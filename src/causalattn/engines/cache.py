"""KVCache: keys and values kept across decoding steps, appended in place.

Storage is preallocated and grown by doubling, so one decoding step copies only the
new token's keys and values; attention over the cache then costs O(T·d) per new query.
New queries are the last positions of the sequence (bottom-right causal alignment).
"""

from __future__ import annotations

import torch

# Keys and values together may take at most this many bytes unless the cache is told
# otherwise (KVCache(max_bytes=...)): a capacity of 10**12 positions is refused, not tried.
MAX_BYTES = 16 * 2**30


class KVCache:
    """Keys ``(B, H_kv, T, d_k)`` and values ``(B, H_kv, T, d_v)`` grown along T."""

    def __init__(self, capacity: int = 256, *, max_bytes: int = MAX_BYTES):
        for name, value in (("capacity", capacity), ("max_bytes", max_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"KVCache: {name} must be a positive integer, got {value!r}")
        self._capacity = capacity
        self._max_bytes = max_bytes
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._len = 0
        self.owner: int | None = None  # the layer whose keys and values this holds (claim)

    def claim(self, owner: int, what: str = "layer") -> None:
        """Mark this cache as holding ``owner``'s keys and values; a second owner is refused.

        ``owner`` is a plain int (e.g. a layer's ``cache_id``), so that a compiled model
        checks it without tracing weak references.
        """
        if self.owner is not None and self.owner != owner:
            raise ValueError(
                f"kv_cache: this KVCache already holds keys and values of another {what}; "
                f"give every {what} its own KVCache"
            )
        self.owner = owner

    def __len__(self) -> int:
        return self._len

    @property
    def k(self) -> torch.Tensor:
        """The cached keys ``(B, H_kv, T, d_k)``, T the tokens appended so far (a view)."""
        if self._k is None:
            raise ValueError("KVCache: empty; append keys and values first")
        return self._k[:, :, : self._len]

    @property
    def v(self) -> torch.Tensor:
        """The cached values ``(B, H_kv, T, d_v)`` (a view)."""
        if self._v is None:
            raise ValueError("KVCache: empty; append keys and values first")
        return self._v[:, :, : self._len]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add ``k`` ``(B, H_kv, t, d_k)`` and ``v`` ``(B, H_kv, t, d_v)``; return the whole
        cache."""
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(
                    f"KVCache.append: {name} must be a torch.Tensor (B, H_kv, t, d), got "
                    f"{type(t).__name__} (torch.from_numpy(...) converts a NumPy array)"
                )
        if k.dtype != v.dtype or k.device != v.device:
            raise ValueError(
                f"KVCache.append: k is {k.dtype} on {k.device} but v is {v.dtype} on {v.device}; "
                "they must match"
            )
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
                    f"d_v = {want_v}; got k {tuple(k.shape)}, v {tuple(v.shape)} (another layer or "
                    "batch?)"
                )
            if k.dtype != self._k.dtype or k.device != self._k.device:
                raise ValueError(
                    f"KVCache.append: cache is {self._k.dtype} on {self._k.device}; got "
                    f"{k.dtype} on {k.device}"
                )
        t = k.shape[2]
        need = self._len + t
        if self._k is None or need > self._k.shape[2]:
            cap = max(self._capacity, need)  # the first append: capacity, or all it needs
            if self._k is not None:  # later ones: at least double the storage
                cap = max(cap, 2 * self._k.shape[2])
            B, H = k.shape[:2]
            nbytes = B * H * cap * (k.shape[3] + v.shape[3]) * k.element_size()
            if nbytes > self._max_bytes:
                raise ValueError(
                    f"KVCache: {cap} positions of k (B, H_kv, T, d_k) = ({B}, {H}, {cap}, "
                    f"{k.shape[3]}) and v (d_v = {v.shape[3]}) in {k.dtype} would take "
                    f"{nbytes / 2**30:.1f} GiB (max_bytes {self._max_bytes / 2**30:.1f} GiB); "
                    "give a smaller capacity or a larger max_bytes"
                )
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
