"""The dense forms of :class:`causalattn.masks.Pattern`, and what the engines read to
touch only readable blocks: the boolean tiles (``tile``, ``allowed``), why each cell is
blocked (``reasons``, :data:`REASONS`), the readable key range of a block of queries
(``key_range``), the per-row key intervals (``row_ranges``), the dense mask's tile kinds
(``mask_tile_kinds``) and a tile's kind (``block_kind``).

Part of :mod:`causalattn.masks` (its public face): ``Pattern`` takes these methods from
:class:`PatternDense`. Imports no torch at module level.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from . import masks_mod as _mod
from .masks_checks import _is_torch, _numpy

# Why a cell is blocked: the first reason in this order (0 = readable).
READABLE, PADDING, DOCUMENT, FUTURE, WINDOW, CHUNK, MASK, MASK_MOD = range(8)
REASONS = {
    READABLE: "readable",
    PADDING: "padding",
    DOCUMENT: "document",
    FUTURE: "future",
    WINDOW: "window",
    CHUNK: "chunk",
    MASK: "mask",
    MASK_MOD: "mask_mod",  # a user's rule: Pattern.reason_name gives the function's name
}


class PatternDense:
    """Pattern's dense forms: a mixin without fields (they are
    :class:`~causalattn.masks.Pattern`'s)."""

    def rule_data(self, xp, dev=None) -> dict:
        """The arrays the rules read, in ``xp`` (on ``dev``): the document of every position
        and the documents' starts (``cu_seqlens``), ``lengths``, ``prefix_lengths``, the key
        padding and the dense mask (4-D). O(T) beyond the mask itself; made once per
        pattern and device."""
        cache = self.__dict__.setdefault("_data_cache", {})
        key = "numpy" if xp is np else str(dev)
        if key not in cache:
            cache[key] = self._rule_data(xp, dev)
        return cache[key]

    def _rule_data(self, xp, dev) -> dict:

        def host(a):
            return a if xp is np else xp.as_tensor(a, device=dev)

        out = {}
        cu = self.cu_seqlens
        if cu is not None:
            out["doc"] = host(np.searchsorted(cu[1:-1], np.arange(int(cu[-1])), side="right"))
            out["cu"] = host(cu)
        for name in ("lengths", "prefix_lengths"):
            if getattr(self, name) is not None:
                out[name] = host(getattr(self, name))
        for name in ("key_padding_mask", "mask"):
            v = getattr(self, name)
            if v is None:
                continue
            if xp is np:
                v = _numpy(v)
            else:
                v = (v if _is_torch(v) else xp.as_tensor(np.asarray(v))).to(dev)
            out[name] = v.reshape((1,) * (4 - v.ndim) + tuple(v.shape)) if name == "mask" else v
        return out

    def _rule_sets(self, pos, j, b, data, key_padding=None, dense=None) -> dict:
        """Each keyword rule's readable set at query positions ``pos`` and key positions
        ``j`` (global, broadcastable) of batch rows ``b`` (an index array shaped (nb, 1, 1, 1)
        or a scalar): a dict reason -> bool array. ``key_padding`` and ``dense`` are the key
        padding and dense mask at these cells, already taken from ``data``."""
        out = {}
        if "doc" in data:  # packed documents: chunks count from the document's start
            doc, cu = data["doc"], data["cu"]
            dq, dk = doc[pos], doc[j]
            out[DOCUMENT] = dq == dk
            local_q, local_k = pos - cu[dq], j - cu[dk]
        else:
            local_q, local_k = pos, j
        if self.causal:
            out[FUTURE] = j <= pos
        if self.window is not None:
            out[WINDOW] = j > pos - self.window
        if self.chunk is not None:
            out[CHUNK] = (local_k // self.chunk) == (local_q // self.chunk)
        if "prefix_lengths" in data:
            P = data["prefix_lengths"][b]
            inside = (j < P) & (pos < P)
            for r in (FUTURE, WINDOW, CHUNK):
                if r in out:
                    out[r] = out[r] | inside
        pad = None
        if "lengths" in data:
            L = data["lengths"][b]
            pad = (j < L) & (pos < L)
        if key_padding is not None:
            pad = key_padding if pad is None else pad & key_padding
        if pad is not None:
            out[PADDING] = pad
        if dense is not None:
            out[MASK] = dense
        return out

    def rules_at(self, xp, pos, j, b, h, i, jl, data):
        """Every rule ANDed (keywords, mask, not mask_mod) at query positions ``pos``, key
        positions ``j`` (global), batch rows ``b``, heads ``h``, this problem's query and key
        indices ``i``, ``jl`` (broadcastable index tensors, or 0-d under FlexAttention's
        vmap); ``data`` from :meth:`rule_data`. Pointwise: what :meth:`to_mask_mod` runs."""
        kp = data.get("key_padding_mask")
        kp = None if kp is None else kp[b, jl]
        m = data.get("mask")
        if m is not None:
            zero = i * 0
            m = m[b if m.shape[0] > 1 else zero, h if m.shape[1] > 1 else zero, i, jl]
        out = pos == pos  # all True, of the indices' kind and shape
        for r in self._rule_sets(pos, j, b, data, kp, m).values():
            out = out & r
        return out

    def _rules(self, xp, b, q0, q1, k0, k1, T_q, T_k, dev, H=1):
        """Each rule's readable set for rows b (index array), queries q0:q1, keys k0:k1:
        a dict name -> bool array broadcastable to (len(b) or 1, 1 or H, rows, cols)."""

        def ar(lo, hi):
            return xp.arange(lo, hi, device=dev) if xp is not np else np.arange(lo, hi)

        pos = (ar(q0, q1) + self.query_start(T_q, T_k))[:, None]  # (rows, 1) global positions
        j = (ar(k0, k1) + self.k_start)[None, :]  # (1, cols)
        data = self.rule_data(xp, dev)
        b4 = np.asarray(b, dtype=np.int64).reshape(-1, 1, 1, 1)
        b4 = b4 if xp is np else xp.as_tensor(b4, device=dev)
        kp = data.get("key_padding_mask")
        kp = None if kp is None else kp[b4[:, :, 0, 0], k0:k1][:, :, None, :]  # (nb, 1, 1, cols)
        m = data.get("mask")
        if m is not None:
            m = m[b4[:, 0, 0, 0]] if m.shape[0] > 1 else m
            m = m[:, :, q0:q1, k0:k1]
        out = self._rule_sets(pos, j, b4, data, kp, m)
        if self.mask_mod is not None:
            out[MASK_MOD] = _mod.evaluate_mask(self.mask_mod, xp, b, H, pos[:, 0], j[0], dev)
        return out

    def extra_tile(self, B, H, T_q, T_k, q0, q1, k0, k1):
        """The dense mask AND the mask_mod (nothing else) for queries q0:q1, keys k0:k1 of
        every batch row: torch bool (B'|1, H'|1, rows, cols) on the CPU, for kernels that
        apply the row intervals and the key padding themselves."""
        import torch

        pt = type(self)(  # a Pattern: the same placement, no other rule
            causal=False,
            mask=self.mask,
            mask_mod=self.mask_mod,
            q_start=self.query_start(T_q, T_k),
            k_start=self.k_start,
        )
        return pt.tile(B, H, T_q, T_k, q0, q1, k0, k1, like=torch.zeros(()))

    def _frame(self, B, like):
        """(array module, device, batch rows as a NumPy index array)."""
        xp, dev = np, None
        if like is not None and _is_torch(like):
            import torch

            xp, dev = torch, like.device
        return xp, dev, np.arange(B) if self.per_batch else np.arange(min(B, 1))

    def tile(self, B, H, T_q, T_k, q0=0, q1=None, k0=0, k1=None, *, like=None, batch=None):
        """Dense bool (B', H', q1-q0, k1-k0) for queries q0:q1 and keys k0:k1; True = may read.

        B' is B (or len(batch)) when the pattern differs by batch row, else 1; H' is H when
        the dense mask differs by head or the mask_mod reads h (it is asked about heads
        0..H-1: H is its one use), else 1. NumPy, or torch on ``like``'s device.
        """
        q1 = T_q if q1 is None else q1
        k1 = T_k if k1 is None else k1
        xp, dev, b = self._frame(B, like)
        if batch is not None and self.per_batch:
            b = np.asarray(batch)
        shape = (len(b) if self.per_batch else 1, 1, q1 - q0, k1 - k0)
        if xp is np:
            out = np.ones(shape, dtype=bool)
        else:
            out = xp.ones(shape, dtype=xp.bool, device=dev)
        for r in self._rules(xp, b, q0, q1, k0, k1, T_q, T_k, dev, H).values():
            out = out & r
        return out

    def allowed(self, B, H, T_q, T_k, like=None):
        """The whole dense mask (B', H', T_q, T_k), True = may read (see :meth:`tile`)."""
        self.check(B, H, T_q, T_k)
        return self.tile(B, H, T_q, T_k, like=like)

    def reasons(self, B, H, T_q, T_k) -> np.ndarray:
        """NumPy uint8 (B', H', T_q, T_k): 0 where readable, else the first reason the cell is
        blocked, in the order of :data:`REASONS` (padding, document, future, window, chunk,
        mask)."""
        self.check(B, H, T_q, T_k)
        _, _, b = self._frame(B, None)
        rules = self._rules(np, b, 0, T_q, 0, T_k, T_q, T_k, None, H)
        shape = np.broadcast_shapes(
            (len(b) if self.per_batch else 1, 1, T_q, T_k), *(r.shape for r in rules.values())
        )
        out = np.zeros(shape, dtype=np.uint8)
        for code in sorted(rules, reverse=True):  # the first reason is written last
            out[~np.broadcast_to(rules[code], shape)] = code
        return out

    def key_range(self, b: int, q0: int, q1: int, T_q: int, T_k: int) -> tuple[int, int]:
        """Keys [lo, hi) that queries q0:q1 of batch row b may read at most; everything
        outside is unreadable for all of them (lo == hi: nothing to read). Cheap: no dense
        mask is formed except for an explicit ``mask``."""
        if q1 <= q0:
            return 0, 0
        qs, ks = self.query_start(T_q, T_k), self.k_start
        p0, p1 = q0 + qs, q1 - 1 + qs  # first and last query position (global)
        lo, hi = ks, ks + T_k  # global key positions from here on
        P = int(self.prefix_lengths[b]) if self.prefix_lengths is not None else 0
        in_prefix = p0 < P  # some query of the block reads the whole prefix
        if self.causal:  # a block reaching into the prefix reads all of it (else p1 >= P)
            hi = min(hi, max(p1 + 1, P))
        if self.window is not None and not in_prefix:
            lo = max(lo, p0 - self.window + 1)
        cu = self.cu_seqlens
        if cu is not None:
            d0 = int(np.searchsorted(cu[1:-1], p0, side="right"))
            d1 = int(np.searchsorted(cu[1:-1], p1, side="right"))
            lo, hi = max(lo, int(cu[d0])), min(hi, int(cu[d1 + 1]))
        if self.chunk is not None and not in_prefix:
            base = int(cu[d0]) if cu is not None else 0
            base1 = int(cu[d1]) if cu is not None else 0
            lo = max(lo, base + (p0 - base) // self.chunk * self.chunk)
            hi = min(hi, base1 + ((p1 - base1) // self.chunk + 1) * self.chunk)
        if self.lengths is not None:
            L = int(self.lengths[b])
            hi = min(hi, L)
            if p0 >= L:
                return 0, 0
        key_padding = self.key_padding_mask
        if key_padding is not None:
            idx = np.flatnonzero(_numpy(key_padding[b])) + ks
            if idx.size == 0:
                return 0, 0
            lo, hi = max(lo, int(idx[0])), min(hi, int(idx[-1]) + 1)
        if self.mask is not None:
            m = _numpy(self.mask)
            m = m.reshape((1,) * (4 - m.ndim) + m.shape)
            cols = np.flatnonzero(m[b if m.shape[0] > 1 else 0][:, q0:q1].any(axis=(0, 1)))
            if cols.size == 0:
                return 0, 0
            lo, hi = max(lo, int(cols[0]) + ks), min(hi, int(cols[-1]) + 1 + ks)
        lo, hi = max(lo - ks, 0), min(hi - ks, T_k)  # back to this problem's key indices
        return (lo, hi) if lo < hi else (0, 0)

    def row_ranges(self, T_q: int, T_k: int) -> tuple[np.ndarray, np.ndarray]:
        """Per query row the keys [lo, hi) that causal, window, chunk, prefix, lengths and
        documents allow, as this problem's key indices: NumPy int64 (B', T_q) each, B' = B
        (the rows of lengths and prefix_lengths) when either is given, else 1. Row i reads exactly
        lo <= j < hi AND key_padding_mask AND mask (every rule above leaves one interval
        per row). lo and hi never decrease along i; a row that reads nothing has lo = hi
        (T_k for padding query rows). O(B·T_q), for the kernels."""
        ks = self.k_start
        pos = np.arange(T_q, dtype=np.int64) + self.query_start(T_q, T_k)  # global positions
        lo = np.full(T_q, ks, dtype=np.int64)
        hi = np.full(T_q, ks + T_k, dtype=np.int64)
        base = np.zeros(T_q, dtype=np.int64)  # where chunks are counted from: the document's
        cu = self.cu_seqlens
        if cu is not None:
            d = np.searchsorted(cu[1:-1], pos, side="right")
            base, lo, hi = cu[d], np.maximum(lo, cu[d]), np.minimum(hi, cu[d + 1])
        if self.causal:
            hi = np.minimum(hi, pos + 1)
        if self.window is not None:
            lo = np.maximum(lo, pos - self.window + 1)
        if self.chunk is not None:
            c0 = base + (pos - base) // self.chunk * self.chunk
            lo, hi = np.maximum(lo, c0), np.minimum(hi, c0 + self.chunk)
        lo, hi = lo[None], hi[None]  # (1, T_q): lengths and prefixes broadcast it to (B, T_q)
        if self.prefix_lengths is not None:
            # inside the prefix the row also reads all of it: [0, P) ∪ [lo, hi), and
            # lo <= pos < P there, so the union is one interval
            P = self.prefix_lengths[:, None]
            inside = pos < P
            lo = np.where(inside, ks, lo)
            hi = np.where(inside, np.minimum(np.maximum(hi, P), ks + T_k), hi)
        if self.lengths is not None:
            hi = np.minimum(hi, self.lengths[:, None])
        # this problem's keys: lo >= ks and hi <= ks + T_k already, so one bound each; an
        # empty row gets lo = hi, still in order with its neighbours
        lo = np.minimum(lo - ks, T_k)
        hi = np.maximum(hi - ks, lo)
        if self.lengths is not None:  # padding query rows (the last ones): lo = hi = T_k
            padding = pos >= self.lengths[:, None]
            lo, hi = np.where(padding, T_k, lo), np.where(padding, T_k, hi)
        return lo, hi

    def mask_tile_kinds(self, block_q: int, block_k: int, like=None):
        """The dense ``mask``'s kind per (block_q × block_k) tile, int8 torch
        (B', H', ceil(T_q/block_q), ceil(T_k/block_k)) on ``like``'s device: 0 nothing allowed
        (skipped), 1 everything allowed (the mask need not be read), 2 partial; None without a
        mask. The kernels AND it with the intervals of :meth:`row_ranges` and the key padding,
        which they apply themselves. Cells past T_q, T_k neither allow nor block "full"."""
        import torch

        m = self.mask
        if m is None:
            return None
        m = m if _is_torch(m) else torch.as_tensor(np.asarray(m))
        if like is not None:
            m = m.to(like.device)
        m = m.reshape((1,) * (4 - m.ndim) + tuple(m.shape))
        T_q, T_k = m.shape[2:]
        n_q, n_k = -(-T_q // block_q), -(-T_k // block_k)
        pad = (0, n_k * block_k - T_k, 0, n_q * block_q - T_q)
        tiles = (*m.shape[:2], n_q, block_q, n_k, block_k)

        def padded(value):
            return torch.nn.functional.pad(m, pad, value=value) if any(pad) else m

        some = padded(False).reshape(tiles).any(5).any(3)
        every = padded(True).reshape(tiles).all(5).all(3)
        return torch.where(every, 1, torch.where(some, 2, 0)).to(torch.int8).contiguous()

    def block_kind(self, b, q0, q1, k0, k1, T_q, T_k, H=1) -> Literal["skip", "full", "partial"]:
        """Whether the tile (queries q0:q1, keys k0:k1) of batch row b, heads 0..H-1, is
        skipped, fully readable, or partly readable (and must be masked with :meth:`tile`).
        A tile outside :meth:`key_range` is skipped without forming any of its cells."""
        lo, hi = self.key_range(b, q0, q1, T_q, T_k)
        if hi <= k0 or lo >= k1 or lo == hi:
            return "skip"
        # row b only (batch=[b]): rows 0..b frame it, whatever the batch's size
        if self.mask_mod is not None:  # a few tiles at a time, never the whole block
            return _mod.block_kind(self, b + 1, H, T_q, T_k, q0, q1, k0, k1, [b])
        t = self.tile(b + 1, H, T_q, T_k, q0, q1, k0, k1, batch=[b])
        if t.all():
            return "full"
        return "partial" if t.any() else "skip"
