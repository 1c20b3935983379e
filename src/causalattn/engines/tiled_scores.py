"""The tiled engine's score modifiers per tile (softcap, ALiBi, rel_bias, bias, score_mod,
in base 2), the per-head constants they read, the dropout keep pattern of a tile, and the
gradients of the pattern's learned tensors. Part of :mod:`causalattn.engines.tiled`.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..constants import LN2, LOG2E
from ..masks_mod import apply_score_mod
from .problem import Problem
from .registry import captured_of


class _Heads:
    """Per head chunk of a job (N = batch rows · H_kv heads, g query heads each): the query
    head indices, the batch rows, and the per-head modifier constants in base 2."""

    def __init__(self, p: Problem, b0: int, b1: int, dt):
        B, Hq, _, _ = p.dims
        Hkv, g = p.k.shape[1], p.group
        n = torch.arange((b1 - b0) * Hkv)
        self.qhead = (n % Hkv)[:, None] * g + torch.arange(g)[None, :]  # (N, g)
        self.batch = (b0 + n // Hkv)[:, None].expand(-1, g)  # (N, g)
        pt = p.pattern
        self.slopes = None
        if pt.alibi_slopes is not None:
            sl = torch.as_tensor(_np(pt.alibi_slopes), dtype=torch.float64)
            sl = sl[None].expand(B, Hq) if sl.dim() == 1 else sl
            self.slopes = (sl[self.batch, self.qhead] * LOG2E).to(dt)  # (N, g)
            self.slope_list = self.slopes.tolist()
        self.sinks = None
        if pt.sinks is not None:
            s = torch.as_tensor(_np(pt.sinks), dtype=torch.float64)
            self.sinks = (s[self.qhead] * LOG2E).to(dt)  # (N, g)
        self.softcap = None if pt.softcap is None else pt.softcap * LOG2E  # in base-2 units
        self.rel = None  # rel_bias (H, R) in base 2, and its centre
        if pt.rel_bias is not None:
            r = torch.as_tensor(_np(pt.rel_bias), dtype=torch.float64)
            self.rel, self.rel_c = (r * LOG2E).to(dt), (r.shape[1] - 1) // 2
        self.bias = None  # bias as 4-D (B|1, H|1, T_q|1, T_k|1), its own dtype
        if pt.bias is not None:
            bb = torch.as_tensor(pt.bias).detach().cpu()
            self.bias = bb.reshape((1,) * (4 - bb.dim()) + tuple(bb.shape))
        self.score_mod = pt.score_mod
        # scores may be -inf (or NaN) where the pattern reads: masks are filled, never added
        self.user = pt.bias is not None or pt.score_mod is not None
        self.pos0, self.k0 = pt.query_start(*p.dims[2:]), pt.k_start

    def bias_tile(self, h, h2, a, a2, c, c2, dt) -> torch.Tensor:
        """bias for head chunk h:h2, rows a:a2, keys c:c2: (M, g, rows|1, cols|1) in dt."""
        b4 = self.bias
        t = b4[:, :, _span(b4, 2, a, a2), _span(b4, 3, c, c2)]
        zero = torch.zeros_like(self.batch[h:h2])
        bi = self.batch[h:h2] if b4.shape[0] > 1 else zero
        hi = self.qhead[h:h2] if b4.shape[1] > 1 else zero
        return t[bi, hi].to(dt)

    def rel_index(self, a, a2, c, c2) -> torch.Tensor:
        """rel_bias's column c + j - pos(i) for the tile (rows, cols), int64."""
        pos = torch.arange(a, a2) + self.pos0
        j = torch.arange(c, c2) + self.k0
        return self.rel_c + j[None, :] - pos[:, None]

    def mod_indices(self, h, h2, a, a2, c, c2):
        """score_mod's (b, h, q_idx, kv_idx) for the tile: (M, g, 1, 1) twice, positions."""
        pos = (torch.arange(a, a2) + self.pos0).view(1, 1, -1, 1)
        j = (torch.arange(c, c2) + self.k0).view(1, 1, 1, -1)
        return self.batch[h:h2, :, None, None], self.qhead[h:h2, :, None, None], pos, j


def _span(x: torch.Tensor, axis: int, lo: int, hi: int) -> slice:
    """lo:hi along an axis of x, or all of it where x broadcasts there (size 1)."""
    return slice(lo, hi) if x.shape[axis] > 1 else slice(None)


class _Grads:
    """Gradients of the pattern's learned tensors, summed over the tiles of one part of the
    backward (or, for the whole call, over the parts in order): ``bias`` in its 4-D form,
    ``rel_bias`` (H, R), ``alibi_slopes`` (1|B, H), and the tensors the score_mod reads."""

    def __init__(self, p: Problem, hd, want, dcache):
        self.p, self.hd, self.dcache = p, hd, dcache
        self.want = set(want)
        self.wanted = bool(self.want - {"captured"})  # read off dS in every tile
        self.caps = captured_of(p.pattern.score_mod) if "captured" in self.want else []
        self.sums: dict = {}
        if hd is not None:
            self.batch, self.qhead = hd.batch.tolist(), hd.qhead.tolist()

    def _acc(self, key, shape, dtype) -> torch.Tensor:
        if key not in self.sums:
            self.sums[key] = torch.zeros(shape, dtype=dtype)
        return self.sums[key]

    def tile(self, dS, tape, mask, heads, h, h2, a, a2, c, c2) -> None:
        """Add one tile's share. dS (M, g, rows, cols): the loss's gradient by the scores
        after every modifier (natural units); through the score_mod's tape it becomes the
        gradient by its input (in place), the one the biases and slopes take."""
        if tape is not None:
            x, y = tape
            with torch.enable_grad():
                g = torch.autograd.grad(y, [x, *self.caps], dS, allow_unused=True)
            dS.copy_(g[0])
            if mask is not None:  # nothing flows to a blocked cell, even 0·inf
                dS.masked_fill_(~mask.pick(mask.allowed, heads), 0.0)
            for i, gi in enumerate(g[1:]):
                if gi is not None:
                    self._acc(("captured", i), gi.shape, gi.dtype).add_(gi)
        if not self.wanted:
            return
        pt, hd = self.p.pattern, self.hd
        M, G = dS.shape[:2]
        cells = [
            (m, gi, self.batch[h + m][gi], self.qhead[h + m][gi])
            for m in range(M)
            for gi in range(G)
        ]
        if "bias" in self.want:
            b4 = hd.bias
            t = dS.sum(2, keepdim=True) if b4.shape[2] == 1 else dS
            t = t.sum(3, keepdim=True) if b4.shape[3] == 1 else t
            acc = self._acc("bias", b4.shape, dS.dtype)
            rs, cs = _span(b4, 2, a, a2), _span(b4, 3, c, c2)
            for m, gi, bi, qh in cells:
                acc[bi if b4.shape[0] > 1 else 0, qh if b4.shape[1] > 1 else 0, rs, cs] += t[m, gi]
        if "rel_bias" in self.want:
            acc = self._acc("rel_bias", tuple(pt.rel_bias.shape), dS.dtype)
            idx = hd.rel_index(a, a2, c, c2).flatten()
            for m, gi, _, qh in cells:
                acc[qh].index_add_(0, idx, dS[m, gi].flatten())
        if "alibi_slopes" in self.want:
            sl = pt.alibi_slopes
            acc = self._acc(
                "alibi_slopes", (sl.shape[0] if sl.ndim == 2 else 1, sl.shape[-1]), dS.dtype
            )
            dist = _dist(self.p, a, a2, c, c2, self.dcache, dS.dtype)
            for m, gi, bi, qh in cells:  # Z = ... - slope·|pos(i) - j|
                acc[bi if sl.ndim == 2 else 0, qh] -= (dS[m, gi] * dist).sum()

    def add(self, other: _Grads) -> None:
        for key, t in other.sums.items():
            if key in self.sums:
                self.sums[key] += t
            else:
                self.sums[key] = t.clone()

    def result(self) -> dict:
        """{name: gradient shaped as the pattern's tensor}; "captured": a list, in order."""
        pt, out = self.p.pattern, {}
        for name in ("bias", "rel_bias", "alibi_slopes"):
            if name in self.want:
                shape = tuple(getattr(pt, name).shape)
                t = self.sums.get(name)
                out[name] = (
                    torch.zeros(shape, dtype=torch.float64) if t is None else t.reshape(shape)
                )
        if "captured" in self.want:
            out["captured"] = [
                self.sums[("captured", i)] if ("captured", i) in self.sums else torch.zeros_like(c)
                for i, c in enumerate(self.caps)
            ]
        return out


def _np(x):
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x


def _dist(p: Problem, a: int, a2: int, c: int, c2: int, cache: dict, dt) -> torch.Tensor:
    """|pos(i) - j| for the tile (rows, cols) in dtype dt, from the pattern's ALiBi (unit
    slope): the same for every tile on one diagonal offset, so computed once per offset."""
    key = (a - c, a2 - a, c2 - c, dt)
    if key not in cache:
        # ALiBi alone (the other modifiers would leak into the distance)
        unit = replace(p.pattern.only("alibi_slopes"), sinks=None, alibi_slopes=[1.0])
        B, H, T_q, T_k = p.dims
        z = torch.zeros(1, 1, a2 - a, c2 - c, dtype=torch.float64)
        cache[key] = (-unit.modify_scores(z, a, c, T_q, T_k)[0, 0]).to(dt)
    return cache[key]


def _modify(
    S4: torch.Tensor, hd: _Heads, h: int, h2: int, a, a2, c, c2, p, cache, T=None, grad=False
):
    """softcap, ALiBi, rel_bias, bias, then the score_mod, in place on base-2 scores S4
    (M, g, rows, cols). With softcap and ``T`` (a buffer like S4), T receives tanh(S/c) for
    the backward; without T, S4 comes already divided by c (the forward folds 1/c into the
    query scale). With a score_mod and ``grad``: returns (its input, its output) in natural
    units, on autograd's tape, for the backward's vector-Jacobian product (else None)."""
    if hd.softcap is not None:
        cap = hd.softcap
        if T is not None:
            torch.div(S4, cap, out=T).tanh_()
            torch.mul(T, cap, out=S4)
        else:
            S4.tanh_().mul_(cap)
    if hd.slopes is not None:  # one fused pass per head: S -= slope·dist
        dist = _dist(p, a, a2, c, c2, cache, S4.dtype)
        for mi, row in enumerate(hd.slope_list[h:h2]):
            for gi, slope in enumerate(row):
                S4[mi, gi].sub_(dist, alpha=slope)
    if hd.rel is not None:
        S4.add_(hd.rel[hd.qhead[h:h2]][:, :, hd.rel_index(a, a2, c, c2)])
    if hd.bias is not None:
        S4.add_(hd.bias_tile(h, h2, a, a2, c, c2, S4.dtype), alpha=LOG2E)
    if hd.score_mod is None:
        return None
    idx = hd.mod_indices(h, h2, a, a2, c, c2)
    x = S4 * LN2
    if not grad:
        S4.copy_(apply_score_mod(hd.score_mod, x, *idx)).mul_(LOG2E)
        return None
    with torch.enable_grad():
        x.requires_grad_(True)
        y = apply_score_mod(hd.score_mod, x, *idx)
    S4.copy_(y.detach()).mul_(LOG2E)
    return x, y


def _keep(p: Problem, hd: _Heads, h, h2, a, a2, c, c2) -> torch.Tensor:
    """The dropout keep pattern of one tile, (M, g, rows, cols) bool, from global positions."""
    return p.keep(hd.batch[h:h2], hd.qhead[h:h2], a, a2, c, c2)
