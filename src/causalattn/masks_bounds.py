"""Which tiles of a mask_mod are surely all True or all False, by interval arithmetic.

A row form (:mod:`causalattn.masks_rows`) needs the mask_mod's cells only where a tile is
partly readable. :func:`tile_verdicts` calls the mask_mod ONCE on stand-ins for its index
tensors: ``q_idx`` is, per row block, the interval of its positions, ``kv_idx`` per key
tile likewise, ``b`` and ``h`` exact. The stand-ins carry [lo, hi] bounds through integer
arithmetic (+, -, unary -, * by an int, // and % by a positive int, abs), indexing a 1-D
integer or bool tensor (its min and max over the interval, from a sparse table), and
comparisons, which give (surely True, maybe True) per tile; &, |, ~ combine those. Every
step is sound: "surely" holds for every cell of the tile. Anything else (floats, other
torch functions, Python control flow on a value, indices out of range) raises
:class:`Unsupported`, and the caller evaluates every cell as before: never a wrong answer,
at worst no saving.
"""

from __future__ import annotations

import torch

__all__ = ["Unsupported", "tile_verdicts", "SKIP", "FULL", "UNKNOWN"]

SKIP, FULL, UNKNOWN = 0, 1, 2  # a tile's verdict: surely none, surely all, evaluate it


class Unsupported(Exception):
    """The mask_mod did something the bounds do not follow (the caller evaluates cells)."""


def _int(x) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        if isinstance(x, torch.Tensor) and x.dim() == 0 and not x.dtype.is_floating_point:
            return int(x)
        raise Unsupported(f"operand {type(x).__name__}")
    return x


def _span(x) -> Span:
    return x if isinstance(x, Span) else Span.exact(_int(x))


class Span:
    """Integer values within [lo, hi] (int64 tensors broadcastable to (B, H, nQ, nK))."""

    __slots__ = ("lo", "hi")

    def __init__(self, lo: torch.Tensor, hi: torch.Tensor):
        self.lo, self.hi = lo, hi

    @staticmethod
    def exact(c: int) -> Span:
        t = torch.tensor(c, dtype=torch.int64)
        return Span(t, t)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__ and isinstance(args[0], torch.Tensor):
            return _gather(args[0], args[1])
        if func in (torch.abs, torch.Tensor.abs) and isinstance(args[0], Span):
            return abs(args[0])
        raise Unsupported(getattr(func, "__name__", str(func)))

    def __add__(self, o):
        o = _span(o)
        return Span(self.lo + o.lo, self.hi + o.hi)

    __radd__ = __add__

    def __sub__(self, o):
        o = _span(o)
        return Span(self.lo - o.hi, self.hi - o.lo)

    def __rsub__(self, o):
        return _span(o) - self

    def __neg__(self):
        return Span(-self.hi, -self.lo)

    def __mul__(self, o):
        c = _int(o)
        return Span(self.lo * c, self.hi * c) if c >= 0 else Span(self.hi * c, self.lo * c)

    __rmul__ = __mul__

    def __floordiv__(self, o):
        c = _int(o)
        if c <= 0:
            raise Unsupported("// by a non-positive int")
        return Span(self.lo.div(c, rounding_mode="floor"), self.hi.div(c, rounding_mode="floor"))

    def __mod__(self, o):
        c = _int(o)
        if c <= 0:
            raise Unsupported("% by a non-positive int")
        same = self.lo.div(c, rounding_mode="floor") == self.hi.div(c, rounding_mode="floor")
        return Span(
            torch.where(same, self.lo.remainder(c), 0),
            torch.where(same, self.hi.remainder(c), c - 1),
        )

    def abs(self):
        return abs(self)

    def __abs__(self):
        lo = torch.where(self.lo >= 0, self.lo, torch.where(self.hi <= 0, -self.hi, 0))
        return Span(lo, torch.maximum(self.hi.abs(), self.lo.abs()))

    # comparisons: (surely, maybe) per tile
    def __le__(self, o):
        o = _span(o)
        return Verdict(self.hi <= o.lo, self.lo <= o.hi)

    def __lt__(self, o):
        o = _span(o)
        return Verdict(self.hi < o.lo, self.lo < o.hi)

    def __ge__(self, o):
        return _span(o) <= self

    def __gt__(self, o):
        return _span(o) < self

    def __eq__(self, o):  # type: ignore[override]
        o = _span(o)
        overlap = (self.lo <= o.hi) & (o.lo <= self.hi)
        single = (self.lo == self.hi) & (o.lo == o.hi) & (self.lo == o.lo)
        return Verdict(single, overlap)

    def __ne__(self, o):  # type: ignore[override]
        return ~(self == o)

    def __bool__(self):
        raise Unsupported("a value used in Python control flow")

    __hash__ = None  # type: ignore[assignment]


class Verdict:
    """Booleans per tile: ``sure`` (every cell True) and ``may`` (some cell may be True)."""

    __slots__ = ("sure", "may")

    def __init__(self, sure: torch.Tensor, may: torch.Tensor):
        self.sure, self.may = sure, may

    @staticmethod
    def _of(o) -> Verdict:
        if isinstance(o, Verdict):
            return o
        if isinstance(o, bool) or (
            isinstance(o, torch.Tensor) and o.dim() == 0 and o.dtype == torch.bool
        ):
            t = torch.tensor(bool(o))
            return Verdict(t, t)
        raise Unsupported(f"operand {type(o).__name__}")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise Unsupported(getattr(func, "__name__", str(func)))

    def __and__(self, o):
        o = Verdict._of(o)
        return Verdict(self.sure & o.sure, self.may & o.may)

    __rand__ = __and__

    def __or__(self, o):
        o = Verdict._of(o)
        return Verdict(self.sure | o.sure, self.may | o.may)

    __ror__ = __or__

    def __invert__(self):
        return Verdict(~self.may, ~self.sure)

    def __bool__(self):
        raise Unsupported("a verdict used in Python control flow")


def _gather(t: torch.Tensor, idx) -> Span | Verdict:
    """t[idx] for a 1-D integer or bool tensor and a Span index: t's min and max over each
    interval (a sparse table of t: log2(len) levels of len values)."""
    if not isinstance(idx, Span) or t.dim() != 1 or t.dtype.is_floating_point or t.is_complex():
        raise Unsupported("indexing other than a 1-D integer tensor by one index")
    n = t.shape[0]
    if n == 0 or bool((idx.lo < 0).any()) or bool((idx.hi >= n).any()):
        raise Unsupported("an index out of range")  # torch would raise or wrap around
    x = t.detach().to("cpu", torch.int64)
    mins, maxs = [x], [x]
    while 2 ** len(mins) <= n:
        w = 2 ** (len(mins) - 1)
        mins.append(torch.minimum(mins[-1][:-w], mins[-1][w:]))
        maxs.append(torch.maximum(maxs[-1][:-w], maxs[-1][w:]))
    length = idx.hi - idx.lo + 1
    k = torch.zeros_like(length)
    for level in range(1, len(mins)):  # floor(log2(length)), exactly
        k = torch.where(length >= 2**level, level, k)
    lo = torch.full(torch.broadcast_shapes(idx.lo.shape, idx.hi.shape), 0, dtype=torch.int64)
    hi = lo.clone()
    lo_i, hi_i = idx.lo.expand_as(lo), idx.hi.expand_as(lo)
    kk = k.expand_as(lo)
    for level in range(len(mins)):
        at = kk == level
        if not bool(at.any()):
            continue
        a, b = lo_i[at], hi_i[at] - 2**level + 1
        lo[at] = torch.minimum(mins[level][a], mins[level][b])
        hi[at] = torch.maximum(maxs[level][a], maxs[level][b])
    if t.dtype == torch.bool:
        return Verdict(lo == 1, hi == 1)
    return Span(lo, hi)


def tile_verdicts(fn, B: int, H: int, qs: int, ks: int, T_q: int, T_k: int, bq: int, bk: int):
    """int8 (B'|1, H'|1, ceil(T_q/bq), ceil(T_k/bk)): per tile of the local (bq, bk) grid
    (query i at position qs + i, key j at ks + j) :data:`FULL` when the rule surely reads
    every cell, :data:`SKIP` when surely none, else :data:`UNKNOWN`; or None when the
    rule does something the bounds do not follow (:class:`Unsupported`)."""
    nq, nk = -(-T_q // bq), -(-T_k // bk)
    q0 = qs + torch.arange(nq, dtype=torch.int64) * bq
    k0 = ks + torch.arange(nk, dtype=torch.int64) * bk
    q = Span(q0.view(1, 1, -1, 1), torch.clamp(q0 + bq, max=qs + T_q).view(1, 1, -1, 1) - 1)
    kv = Span(k0.view(1, 1, 1, -1), torch.clamp(k0 + bk, max=ks + T_k).view(1, 1, 1, -1) - 1)
    b = torch.arange(B, dtype=torch.int64).view(-1, 1, 1, 1)
    h = torch.arange(H, dtype=torch.int64).view(1, -1, 1, 1)
    try:
        out = fn(Span(b, b), Span(h, h), q, kv)
    except Unsupported:
        return None
    except Exception:  # noqa: BLE001 - the cells' evaluation names the user's error
        return None
    if not isinstance(out, Verdict):
        return None
    sure, may = torch.broadcast_tensors(out.sure, out.may)
    if sure.dim() > 4 or any(s not in (1, t) for s, t in zip(sure.shape[::-1], (nk, nq, H, B))):
        return None
    v = torch.where(sure, FULL, torch.where(may, UNKNOWN, SKIP)).to(torch.int8)
    v = v.reshape((1,) * (4 - v.dim()) + tuple(v.shape))
    return v.expand(v.shape[0], v.shape[1], nq, nk)
