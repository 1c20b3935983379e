"""The Triton engine's host side: what the kernels read besides Q, K, V, made once per call
from the :class:`~causalattn.masks.Pattern` and the dropout settings (:class:`Plan`), in the
kernels' argument order. Pure torch and NumPy: it imports without triton.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import dropout as _dropout
from .problem import Problem

__all__ = ["Plan"]


def _device_tensor(x, dev, dtype) -> torch.Tensor:
    """A pattern array (NumPy, list or torch) as a contiguous tensor on the kernels' device."""
    t = x.detach() if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
    return t.to(device=dev, dtype=dtype).contiguous()


def _broadcast_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """Batch, head and row strides of a (B', H', rows, cols) tensor, 0 along a broadcast
    axis of size 1 (the kernels then read the one slice for every b or h)."""
    st = t.stride()
    return (st[0] if t.shape[0] > 1 else 0, st[1] if t.shape[1] > 1 else 0, st[2])


class Plan:
    """Everything the kernels read besides Q, K, V, derived once from ``p.pattern`` and the
    dropout settings, named as in the kernels (see ``_triton_kernels``' words): per-row key
    intervals ``LO <= j < HI`` ((B, T_q) int32, from
    :meth:`causalattn.masks.Pattern.row_ranges`; plain causal and full attention compute
    them in the kernels), the key padding, the dense mask with its tile kinds per tile
    size, ALiBi slopes (B, H_q), sinks (H_q,) and the dropout hash's inputs."""

    def __init__(self, p: Problem):
        pat = self.pattern = p.pattern
        B, H_q, T_q, d_k = p.q.shape
        T_k = p.k.shape[2]
        dev = p.q.device
        self.dims = (B, H_q, T_q, T_k)
        self.d_k, self.d_v, self.group = d_k, p.v.shape[-1], p.group
        # query i sits at key index i + offset (bottom-right, or as the pattern places it)
        self.offset = pat.query_start(T_q, T_k) - pat.k_start
        self.T_k, self.causal = T_k, pat.causal
        none8 = torch.zeros(1, dtype=torch.int8, device=dev)
        self.none32 = torch.zeros(1, dtype=torch.int32, device=dev)
        nonef = torch.zeros(1, dtype=torch.float32, device=dev)

        self.has_key_padding = pat.key_padding_mask is not None
        self.key_padding = none8
        if self.has_key_padding:
            self.key_padding = _device_tensor(pat.key_padding_mask, dev, torch.int8)
        # plain causal / full attention: the kernels compute the intervals themselves
        self.host_intervals = any(
            x is not None
            for x in (pat.lengths, pat.cu_seqlens, pat.window, pat.chunk, pat.prefix_lengths)
        )
        if self.host_intervals:
            lo, hi = pat.row_ranges(T_q, T_k)
            self.lo64, self.hi64 = (
                torch.from_numpy(np.array(np.broadcast_to(x, (B, T_q)), order="C")).to(dev)
                for x in (lo, hi)
            )
            self.lo, self.hi = self.lo64.to(torch.int32), self.hi64.to(torch.int32)
        else:
            self.lo = self.hi = self.none32

        self.has_mask_mod = pat.mask_mod is not None
        self.has_dense_mask = pat.mask is not None or self.has_mask_mod
        self.dense_mask, self.dense_mask_strides, self._tile_kinds = none8, (0, 0, 0), {}
        if pat.mask is not None and not self.has_mask_mod:
            m = pat.mask if isinstance(pat.mask, torch.Tensor) else torch.as_tensor(pat.mask)
            m = m.reshape((1,) * (4 - m.dim()) + tuple(m.shape)).to(dev).contiguous()
            self.dense_mask_bool = m
            self.dense_mask = m.view(torch.int8)
            self.dense_mask_strides = _broadcast_strides(m)

        self.has_bias = pat.bias is not None
        self.bias, self.bias_strides = nonef, (0, 0, 0, 0)
        if self.has_bias:
            bb = (
                pat.bias.detach()
                if isinstance(pat.bias, torch.Tensor)
                else torch.as_tensor(pat.bias)
            )
            bb = bb.reshape((1,) * (4 - bb.dim()) + tuple(bb.shape)).to(dev)
            self.bias = bb.expand(B, H_q, T_q, T_k)  # stride 0 along the broadcast axes
            self.bias_strides = tuple(self.bias.stride())

        self.has_alibi = pat.alibi_slopes is not None
        self.slopes = nonef
        if self.has_alibi:
            a = _device_tensor(pat.alibi_slopes, dev, torch.float32)
            self.slopes = (a[None] if a.dim() == 1 else a).expand(B, H_q).contiguous()
        self.softcap = pat.softcap
        self.has_sinks = pat.sinks is not None
        self.sinks = _device_tensor(pat.sinks, dev, torch.float32) if self.has_sinks else nonef

        self.dropout = p.dropout_p > 0
        self.seed = self.seed_offset = self.drop_thr = 0
        self.drop_scale = 1.0
        self.q_pos = self.k_pos = self.none32
        if self.dropout:
            self.seed, self.seed_offset = p.dropout_seed
            self.drop_thr = _dropout.threshold(p.dropout_p)
            self.drop_scale = 0.0 if p.dropout_p >= 1 else 1.0 / (1.0 - p.dropout_p)
            self.q_pos = p.dropout_rows().to(dev, torch.int32).contiguous()
            self.k_pos = p.dropout_cols().to(dev, torch.int32).contiguous()

    def flags(self) -> dict:
        return dict(
            HAS_KEY_PADDING=self.has_key_padding,
            HOST_INTERVALS=self.host_intervals,
            CAUSAL=self.causal,
            HAS_DENSE_MASK=self.has_dense_mask,
            SOFTCAP=self.softcap is not None,
            ALIBI=self.has_alibi,
            HAS_BIAS=self.has_bias,
            DROPOUT=self.dropout,
        )

    def arrays(self, block_m: int, block_n: int) -> tuple:
        """The kernels' pattern arguments, in their order: LO, HI, KEY_PADDING, DENSE_MASK
        (or this tile size's tile masks) and its strides, TILE_KINDS (for this tile size) and
        its strides, SLOPES, Q_POS, K_POS, BIAS and its strides."""
        kinds, kinds_strides, mask, mask_strides = self.tile_kinds(block_m, block_n)
        return (
            self.lo,
            self.hi,
            self.key_padding,
            mask,
            *mask_strides,
            kinds,
            *kinds_strides,
            self.slopes,
            self.q_pos,
            self.k_pos,
            self.bias,
            *self.bias_strides,
        )

    def scalars(self, scale: float) -> tuple:
        """The kernels' sizes and scalars, in their order: H_q, T_q, T_k, D_K, D_V, GROUP,
        q_offset, scale, softcap, seed, seed_offset, drop_thr, drop_scale."""
        _, H_q, T_q, T_k = self.dims
        sizes = (H_q, T_q, T_k, self.d_k, self.d_v, self.group, self.offset)
        drop = (self.seed, self.seed_offset, self.drop_thr, self.drop_scale)
        return (*sizes, scale, self.softcap or 1.0, *drop)

    def tile_kinds(self, block_m: int, block_n: int):
        """(kinds, their (batch, head, row-block) strides, the mask the kernels read, its
        strides) for (BLOCK_M × BLOCK_N) tiles: the dense mask's kinds, int8 (B', H', n_m,
        n_n) (:meth:`causalattn.masks.Pattern.mask_tile_kinds`) with the mask itself; with a
        mask_mod, the int32 kinds of its kept table (:func:`causalattn.masks_table.kept_tiles`)
        with its tile masks (n, BLOCK_M, BLOCK_N), made on the host block by block."""
        if not self.has_dense_mask:
            return self.dense_mask, (0, 0, 0), self.dense_mask, (0, 0, 0)
        key = (block_m, block_n)
        if key in self._tile_kinds:
            return self._tile_kinds[key]
        dev = self.dense_mask.device
        if self.has_mask_mod:
            from ..masks_table import kept_tiles

            B, H_q, T_q, T_k = self.dims
            lo, hi = self.pattern.row_ranges(T_q, T_k)
            kinds, tiles = kept_tiles(self.pattern, B, H_q, T_q, T_k, block_m, block_n, lo, hi)
            kinds = kinds.to(dev).contiguous()
            mask = tiles.to(dev).view(torch.int8).contiguous()
            entry = (kinds, _broadcast_strides(kinds), mask, (0, 0, block_n))
        else:
            kinds = self.pattern.mask_tile_kinds(block_m, block_n, like=self.dense_mask_bool)
            entry = (kinds, _broadcast_strides(kinds), self.dense_mask, self.dense_mask_strides)
        self._tile_kinds[key] = entry
        return entry

    def key_tile_rows(self, block_n: int) -> torch.Tensor:
        """For each key tile: the rows that may read it [q_lo, q_hi) and the rows that read
        all of it [r1, r2) (empty when the tile is partial or keys are padded) -> (B, n, 4)."""
        T_k = self.T_k
        if not self.host_intervals:  # computed in the kernel
            return torch.zeros(1, 1, 4, dtype=torch.int32, device=self.key_padding.device)
        B = self.lo64.shape[0]
        s = torch.arange(0, T_k, block_n, device=self.lo64.device, dtype=torch.int64)
        e = torch.clamp(s + block_n, max=T_k)
        S, E, F = (x.expand(B, -1).contiguous() for x in (s, e, s + block_n))
        q_lo = torch.searchsorted(self.hi64, S, right=True)  # first row with HI > s
        q_hi = torch.searchsorted(self.lo64, E, right=False)  # first row with LO >= e
        r1 = torch.searchsorted(self.hi64, F, right=False)  # first row with HI >= s + n
        r2 = torch.searchsorted(self.lo64, S, right=True)  # first row with LO > s
        if self.has_key_padding:
            r1 = r2 = torch.zeros_like(r1)
        return torch.stack([q_lo, q_hi, r1, r2], dim=-1).to(torch.int32).contiguous()
