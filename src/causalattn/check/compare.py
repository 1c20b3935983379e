"""Is someone's mask the one meant? :func:`compare_masks`, block by block in bounded memory.

``theirs`` is a dense mask — boolean (True = may read), additive (0 where read, -inf or a
large negative fill where blocked) or 1/0, read by the one reader (:mod:`.conventions`;
an ambiguous one is refused, never judged) — a FlexAttention ``BlockMask`` or a
``mask_mod(b, h, q_idx, kv_idx)``; ``expected`` a :class:`causalattn.masks.Pattern`. Both
are evaluated one block of cells at a time (``block`` × ``block``), so T = 32768 costs
O(block² + B·H·T) memory, never T×T. Each differing cell is named by the expected
pattern's first reason for blocking it (a future key read, a read across documents,
padding read, a chunk boundary crossed, the window, the mask), or as a readable cell they
block; a sliding window whose edge is off by k is named with k; a BlockMask built for
another length, or whose tables do not fit its block size, is named before any cell.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from .. import constants as _kinds
from .. import masks as _masks
from .. import masks_mod as _mod
from . import conventions
from .inputs import ALIASES
from .report import AuditInputError

__all__ = [
    "compare_masks",
    "MaskComparison",
    "MaskDifference",
    "KINDS",
    "lone_mask",
    "compare_lone_mask",
]
# a lone mask, by its name: the audit's names of a mask (inputs.ALIASES)
MASK_NAMES = tuple(a for a, stage in ALIASES.items() if stage == "allowed")

# what a difference is called, by the expected pattern's reason for blocking the cell
KINDS = {
    _masks.FUTURE: "future key read",
    _masks.DOCUMENT: "read across documents",
    _masks.PADDING: "padding read",
    _masks.CHUNK: "chunk boundary crossed",
    _masks.WINDOW: "window",
    _masks.MASK: "mask",
    _masks.MASK_MOD: "mask_mod",
}
BLOCKED = "readable key blocked"  # they block a cell the pattern lets through
LENGTH = "length"  # a BlockMask for another sequence length
BLOCK_SIZE = "block size"  # a BlockMask whose tables do not fit its block size


@dataclass(frozen=True)
class MaskDifference:
    """One kind of difference: how many cells, the first few (b, h, i, j) in row order
    (0-based), and a sentence (:meth:`describe` with 1-based positions for the CLI)."""

    kind: str
    count: int
    cells: tuple[tuple[int, int, int, int], ...]
    detail: str
    window: int | None = None  # the pattern's window, for "window off by k"
    offset: int | None = None

    def describe(self, base: int = 0) -> str:
        if not self.cells:
            return self.detail
        return _detail(self.kind, self.count, self.cells, self.window, self.offset, base)

    def to_dict(self, base: int = 0) -> dict:
        return {
            "kind": self.kind,
            "count": self.count,
            "cells": [[b, h, i + base, j + base] for b, h, i, j in self.cells],
            "detail": self.describe(base),
        }


@dataclass(frozen=True)
class MaskComparison:
    """The answer: ``ok`` when every cell agrees; ``message`` one line per kind; the
    differences as data; ``shape`` (B, H, T_q, T_k) compared; ``window_offset``: by how many
    keys their window's start differs (positive: they read further back), when it does."""

    ok: bool
    message: str
    differences: tuple[MaskDifference, ...]
    shape: tuple[int, int, int, int]
    expected: str
    window_offset: int | None = None
    kinds: dict = field(default_factory=dict)  # kind -> count
    convention: str | None = None  # how their dense mask was read (bool, additive, 1/0)

    def __bool__(self) -> bool:
        return self.ok

    def format(self, base: int = 0) -> str:
        """The message with query and key positions counted from ``base`` (1 on the CLI)."""
        if self.ok:
            return self.message
        head = self.message.splitlines()[0]
        return "\n".join([head, *("  " + d.describe(base) for d in self.differences)])

    def to_dict(self, base: int = 0) -> dict:
        return {
            "ok": self.ok,
            "message": self.format(base),
            "shape": list(self.shape),
            "expected": self.expected,
            "window_offset": self.window_offset,
            "convention": self.convention,
            "differences": [d.to_dict(base) for d in self.differences],
        }


class _Theirs:
    """Their mask as a tile function, with its (B, H, T_q, T_k) and what it says about its
    own size (a BlockMask's length and tables)."""

    def __init__(self, theirs, T_q, T_k, B, H):
        import torch

        self.problems: list[MaskDifference] = []
        self.convention = None  # how a dense mask was read (conventions), else None
        self.kinds = None  # a BlockMask's kinds per block, torch int8 (B|1, H|1, nQ, nK)
        if _is_block_mask(theirs):
            mod = _mod.BlockMaskMod(theirs)
            self.fn, self.block = mod, mod.block_size
            sq, sk = mod.seq_lengths
            T_q, T_k = T_q or sq, T_k or sk
            self.kinds = mod.kinds
            self._block_problems(theirs, mod, T_q, T_k)
            B = B or int(mod.kinds.shape[0])
            H = H or int(mod.kinds.shape[1])
            self.dense = None
        elif callable(theirs):
            if T_q is None:
                raise ValueError(
                    "compare_masks: a mask_mod has no size of its own; give T (or T_q and T_k)"
                )
            self.fn, self.dense = theirs, None
        else:
            a = theirs if isinstance(theirs, torch.Tensor) else torch.as_tensor(np.asarray(theirs))
            if a.dim() < 2 or a.dim() > 4:
                raise ValueError(
                    f"compare_masks: a dense mask needs 2 to 4 axes (B|1, H|1, T_q, T_k), got "
                    f"shape {tuple(a.shape)}"
                )
            reading = conventions.decide(a, "their mask")
            a, self.convention = reading.allowed, reading.convention
            a = a.reshape((1,) * (4 - a.dim()) + tuple(a.shape))
            self.fn, self.dense = None, a
            dq, dk = a.shape[2:]
            if T_q is not None and (T_q, T_k) != (dq, dk):
                self.problems.append(
                    MaskDifference(
                        LENGTH,
                        0,
                        (),
                        f"length: their mask is {dq}×{dk} but the sequence is T_q×T_k = "
                        f"{T_q}×{T_k}",
                    )
                )
            T_q, T_k = T_q or dq, T_k or dk
            B, H = B or int(a.shape[0]), H or int(a.shape[1])
        self.T_q, self.T_k, self.B, self.H = T_q, T_k, B or 1, H or 1

    def _block_problems(self, bm, mod, T_q, T_k) -> None:
        sq, sk = mod.seq_lengths
        if (sq, sk) != (T_q, T_k):
            self.problems.append(
                MaskDifference(
                    LENGTH,
                    0,
                    (),
                    f"length: the BlockMask was built for (T_q, T_k) = ({sq}, {sk}) but the "
                    f"sequence is ({T_q}, {T_k}); it would mask the wrong cells or be cut",
                )
            )
        bq, bk = mod.block_size
        want = (-(-sq // bq), -(-sk // bk))
        have = tuple(int(x) for x in bm.kv_indices.shape[-2:])
        if have[0] < want[0] or have[1] < want[1]:
            self.problems.append(
                MaskDifference(
                    BLOCK_SIZE,
                    0,
                    (),
                    f"block size: BLOCK_SIZE {mod.block_size} needs {want[0]}×{want[1]} blocks "
                    f"for ({sq}, {sk}), but its tables hold {have[0]}×{have[1]}",
                )
            )

    def tile(self, b, H, qs, q0, q1, ks, k0, k1):
        """Their booleans (1, H'|1, rows, cols) for batch row b (torch)."""
        import torch

        if self.dense is not None:
            d = self.dense
            bb = b if d.shape[0] > 1 else 0
            out = torch.zeros((1, d.shape[1], q1 - q0, k1 - k0), dtype=torch.bool)
            rq, rk = min(q1, d.shape[2]), min(k1, d.shape[3])
            if rq > q0 and rk > k0:
                out[:, :, : rq - q0, : rk - k0] = d[bb : bb + 1, :, q0:rq, k0:rk]
            return out
        if self.kinds is not None and ks == 0:  # a BlockMask: its kinds where no block is partial
            got = self._from_kinds(b, qs, q0, q1, k0, k1)
            if got is not None:
                return got
        pos = torch.arange(q0, q1) + qs
        j = torch.arange(k0, k1) + ks
        return _mod.evaluate_mask(self.fn, torch, [b], H, pos, j)

    def _from_kinds(self, b, qs, q0, q1, k0, k1):
        """A BlockMask's cells from its block kinds alone (1, H'|1, rows, cols), or None
        where a block in the region is partial (its mask_mod must be asked)."""

        T_q, T_k = self.fn.seq_lengths
        bq, bk = self.block
        i0, i1 = q0 + qs - (T_k - T_q), q1 + qs - (T_k - T_q)  # FlexAttention's query indices
        if i0 < 0 or i1 > T_q or k1 > T_k:
            return None
        t = self.kinds[b if self.kinds.shape[0] > 1 else 0][None]
        qa, qb, ka, kb = i0 // bq, -(-i1 // bq), k0 // bk, -(-k1 // bk)
        sub = t[:, :, qa:qb, ka:kb]
        if bool((sub == _kinds.PARTIAL_DENSE).any()):
            return None
        full = (sub == _kinds.FULL).repeat_interleave(bq, 2).repeat_interleave(bk, 3)
        r0, c0 = i0 - qa * bq, k0 - ka * bk
        return full[:, :, r0 : r0 + (q1 - q0), c0 : c0 + (k1 - k0)].contiguous()

    def block_absent(self, b, q0, q1, k0, k1) -> bool:
        """Whether a BlockMask reads nothing in these cells (its blocks there are absent)."""
        if self.kinds is None:
            return False
        bq, bk = self.block
        t = self.kinds[b if self.kinds.shape[0] > 1 else 0]
        qa, qb = q0 // bq, -(-q1 // bq)
        ka, kb = k0 // bk, -(-k1 // bk)
        if qb > t.shape[1] or kb > t.shape[2]:
            return False
        return not bool(t[:, qa:qb, ka:kb].any())


def _is_block_mask(x) -> bool:
    return type(x).__name__ == "BlockMask" and hasattr(x, "kv_num_blocks")


def compare_masks(
    theirs,
    expected: _masks.Pattern | None = None,
    *,
    T: int | None = None,
    T_q: int | None = None,
    T_k: int | None = None,
    B: int | None = None,
    H: int | None = None,
    block: int = 1024,
    limit: int = 5,
) -> MaskComparison:
    """Compare ``theirs`` (a dense bool, additive or 1/0 mask, a BlockMask or a mask_mod) with
    ``expected`` (a :class:`~causalattn.masks.Pattern`; default plain causal) cell for cell,
    ``block`` × ``block`` cells at a time. T (or T_q, T_k), B, H default to what ``theirs``
    says (a mask_mod needs T). ``limit``: cells kept per kind of difference."""
    import torch

    expected = _masks.Pattern() if expected is None else expected
    if not isinstance(expected, _masks.Pattern):
        raise ValueError(
            f"compare_masks: expected must be a causalattn.masks.Pattern, got "
            f"{type(expected).__name__}"
        )
    if T is not None:
        T_q = T_k = T
    if (T_q is None) != (T_k is None):
        T_q, T_k = T_q or T_k, T_k or T_q
    th = _Theirs(theirs, T_q, T_k, B, H)
    T_q, T_k = th.T_q, th.T_k
    B = max(th.B, expected.batch_size())
    H = th.H
    try:
        expected.check(B, H, T_q, T_k)
    except ValueError as exc:
        raise ValueError(f"compare_masks: expected: {exc}") from None
    qs, ks = expected.query_start(T_q, T_k), expected.k_start
    counts: dict[str, int] = {}
    cells: dict[str, list] = {}
    rows = B if (expected.per_batch or th.B > 1) else 1
    if any(d.kind == BLOCK_SIZE for d in th.problems):  # its tables cannot be read
        rows = 0
    first = torch.full((rows, H, T_q), T_k, dtype=torch.int64)  # their first read key per row
    lo, hi = expected.row_ranges(T_q, T_k)
    cpu = torch.zeros(())
    for b in range(rows):
        for q0 in range(0, T_q, block):
            q1 = min(T_q, q0 + block)
            e_lo, e_hi = expected.key_range(b, q0, q1, T_q, T_k)
            for k0 in range(0, T_k, block):
                k1 = min(T_k, k0 + block)
                exp_empty = e_hi <= k0 or e_lo >= k1 or e_lo == e_hi
                if exp_empty and th.block_absent(b, q0, q1, k0, k1):
                    continue
                mine = th.tile(b, H, qs, q0, q1, ks, k0, k1).expand(1, H, q1 - q0, k1 - k0)
                j = torch.arange(k0, k1)
                reads = mine.any(-1)
                if bool(reads.any()):
                    at = torch.where(mine, j, T_k).amin(-1)[0]
                    first[b, :, q0:q1] = torch.minimum(first[b, :, q0:q1], at)
                if exp_empty:
                    want = torch.zeros_like(mine)
                else:
                    want = expected.tile(B, H, T_q, T_k, q0, q1, k0, k1, like=cpu, batch=[b])
                    want = want.expand(1, H, q1 - q0, k1 - k0)
                differ = mine ^ want
                if not bool(differ.any()):
                    continue
                _classify(
                    expected, b, H, T_q, T_k, q0, q1, k0, k1, mine, want, counts, cells, limit
                )
    window_offset = _window_offset(expected, first, lo, T_k)
    diffs = list(th.problems)
    for kind, n in counts.items():
        w = expected.window
        detail = _detail(kind, n, cells[kind], w, window_offset, 0)
        diffs.append(MaskDifference(kind, n, tuple(cells[kind]), detail, w, window_offset))
    diffs.sort(key=lambda d: (d.count != 0, min(d.cells) if d.cells else ()))
    ok = not diffs
    what = expected.describe()
    conv = th.convention
    read_as = "" if conv is None else f"; theirs read as {conventions.MEANING[conv]}"
    if ok:
        message = f"the masks agree on all {B}×{H}×{T_q}×{T_k} cells ({what}{read_as})"
    else:
        message = f"the masks differ ({what} expected{read_as}):\n" + "\n".join(
            "  " + d.detail for d in diffs
        )
    return MaskComparison(
        ok,
        message,
        tuple(diffs),
        (B, H, T_q, T_k),
        what,
        window_offset,
        dict(counts),
        th.convention,
    )


def _classify(pat, b, H, T_q, T_k, q0, q1, k0, k1, mine, want, counts, cells, limit):
    """Count one block's differing cells by kind, keeping the first ``limit`` of each."""
    import torch

    rules = pat._rules(torch, [b], q0, q1, k0, k1, T_q, T_k, torch.device("cpu"), H)
    shape = mine.shape
    code = torch.zeros(shape, dtype=torch.uint8)
    for c in sorted(rules, reverse=True):  # the first reason is written last
        code[~rules[c].expand(shape)] = c
    extra = mine & ~want
    for c in torch.unique(code[extra]).tolist():
        _add(KINDS.get(int(c), "mask"), extra & (code == c), b, q0, k0, counts, cells, limit)
    missed = want & ~mine
    if bool(missed.any()):
        _add(BLOCKED, missed, b, q0, k0, counts, cells, limit)


def _add(kind, sel, b, q0, k0, counts, cells, limit) -> None:
    n = int(sel.sum())
    counts[kind] = counts.get(kind, 0) + n
    have = cells.setdefault(kind, [])
    if len(have) < limit:
        idx = sel[0].nonzero()[: limit - len(have)].tolist()  # (h, i, j) in row order
        have.extend((b, h, q0 + i, k0 + j) for h, i, j in idx)


def _window_offset(pat, first, lo, T_k) -> int | None:
    """How many keys further back than the window's start their rows read (negative:
    fewer), the most common offset over rows the window bites; None without a window, when
    it agrees, or when no offset holds on three quarters of those rows (their mask has no
    window of its own: the rows read back by differing amounts)."""
    if pat.window is None:
        return None
    import torch

    lo_t = torch.as_tensor(np.asarray(lo)).expand(first.shape[0], -1)[:, None, :]
    read = first < T_k
    bites = (lo_t > 0) & read  # rows whose window starts after the first key
    if not bool(bites.any()):
        return None
    off = (lo_t - first)[bites]
    values, n = torch.unique(off, return_counts=True)
    best = int(values[n.argmax()])
    if int(n.max()) * 4 < 3 * off.numel():  # no one offset: not a window off by k (no window)
        return None
    return best or None


def _detail(kind, n, cells, w, window_offset, base) -> str:
    b, h, i, j = cells[0]
    where = f"first at b={b}, h={h}, query {i + base}, key {j + base}"
    # their window wider (they read further back) or narrower (they block what it reads)
    if (kind == "window" and window_offset) or (kind == BLOCKED and (window_offset or 0) < 0):
        if window_offset:
            return (
                f"window off by {window_offset}: their rows read the last "
                f"{w + window_offset} positions, the pattern's window is {w} ({n} cells; {where})"
            )
    sentences = {
        "future key read": f"future key read: {n} cells read a key after the query ({where})",
        "read across documents": (
            f"read across documents: {n} cells read another document ({where})"
        ),
        "padding read": (
            f"padding read: {n} cells read a padding key or come from a padding query ({where})"
        ),
        "chunk boundary crossed": f"chunk boundary crossed: {n} cells read another chunk ({where})",
        "window": f"window: {n} cells read before the window's start ({where})",
        "mask": f"mask: {n} cells read what the mask blocks ({where})",
        "mask_mod": f"mask_mod: {n} cells read what the mask_mod blocks ({where})",
        BLOCKED: f"readable key blocked: {n} cells the pattern reads are blocked ({where})",
    }
    return sentences.get(kind, f"{kind}: {n} cells ({where})")


def _is_lone_mask(name: str, shape, dtype) -> bool:
    """One array of 2 to 4 axes, boolean or named like a mask (MASK_NAMES)."""
    return 2 <= len(shape) <= 4 and (dtype == np.bool_ or name.lower() in MASK_NAMES)


def lone_mask(obj, max_bytes: int):
    """The mask ``obj`` holds when it holds only a mask — a file (headers checked before
    anything is read) or a mapping of one array, boolean or named like a mask
    (MASK_NAMES), 2 to 4 axes — else None (stages for :func:`audit`). The one test of
    "only a mask", for ``audit()`` and the CLI's audit alike."""
    if isinstance(obj, Mapping):
        if len(obj) != 1:
            return None
        ((name, m),) = obj.items()
        if not hasattr(m, "shape") or not hasattr(m, "dtype"):
            m = np.asarray(m)
        dtype = np.bool_ if str(m.dtype) in ("bool", "torch.bool") else np.dtype("float64")
        return m if _is_lone_mask(str(name), tuple(m.shape), dtype) else None
    from ..io.files import open_arrays

    f = open_arrays(obj, max_bytes)
    if len(f.headers) != 1:
        return None
    ((name, (shape, dtype)),) = f.headers.items()
    if not _is_lone_mask(name, shape, dtype):
        return None
    return next(iter(f.read().values()))


def compare_lone_mask(obj, max_bytes: int, declared: dict) -> MaskComparison | None:
    """What ``obj`` (a file or mapping) holding only a mask is, against the pattern the
    keywords ``declared`` make (:func:`compare_masks`); None when it holds something else.
    The one door for a lone mask: ``audit()`` and the CLI's audit both come here, and both
    refuse with the same :class:`~.report.AuditInputError` (an ambiguous mask included)."""
    try:
        mask = lone_mask(obj, max_bytes)
        return None if mask is None else compare_masks(mask, _masks.Pattern(**declared))
    except AuditInputError:
        raise
    except ValueError as exc:
        raise AuditInputError(f"audit: {exc}") from None
