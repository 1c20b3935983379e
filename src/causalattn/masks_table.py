"""Block tables that outlive the call: a mask_mod's tile kinds and partial tiles, made once.

A kernel visits (bq × bk) tiles; for a ``mask_mod`` it needs each tile's kind (0 skip,
1 full, 3 + n partial through ``tile_masks[n]``, see :func:`causalattn.masks_mod.tile_table`).
:class:`BlockTable` holds them on a grid of global positions, for one rule and one
(B, H, bq, bk): query position p is in row block ``(p - q0) // bq`` and key position j in
column block ``(j - k0) // bk``, with (q0, k0) the grid's origin (the problem's first query
and key positions modulo the block, so a problem's tiles are the table's tiles).

- Made lazily, tile by tile: a call asks for the tiles its row intervals reach; those not
  yet evaluated are evaluated a run of tiles at a time (at most ``TILE_CELLS`` cells per
  call of the mask_mod), never T_q×T_k at once. The first run, and a sample of the rest
  (:func:`causalattn.masks_mod.evaluate_mask`), is evaluated twice: a rule that answers
  differently is refused (an impure mask_mod).
- Kept: :func:`kept` holds the tables per rule (weakly, keyed on the function: a table dies
  with its function) and per (B, H, bq, bk, origin), so the keyword form
  ``attention(q, k, v, mask_mod=fn)``, which makes a new Pattern per call, finds the table
  of its previous call; forward and backward, the layers of a model and the steps of a
  decoding loop share it. A longer T_k (or T_q) evaluates only the new tiles (and the edge
  tiles the earlier call evaluated in part).
- Invalidated: the key holds the rule's state (:func:`rule_state`): the identity and
  version counter (``_internals.torch.version``) of every tensor it reaches, the bytes of
  small NumPy arrays, and its scalars, wherever :func:`causalattn.masks_mod.reach` finds
  them; an in-place write to a captured tensor, a new tensor in its closure, a changed
  closure int or a changed field of an object it reads makes a new table.

Bytes: 4 per (b', h', tile) for the kinds (int32) plus bq·bk (one bool per cell) per
distinct partial tile; identical partial tiles are stored once.
"""

from __future__ import annotations

import functools
import hashlib
import types
import weakref
from collections import OrderedDict

import numpy as np
import torch

from . import constants as _kinds
from . import masks_mod as _mod
from ._internals.torch import version as _version

__all__ = ["BlockTable", "kept", "kept_tiles", "rule_state", "clear", "UNKNOWN"]

UNKNOWN = -1  # a tile not yet evaluated
_CPU = torch.device("cpu")
PER_RULE = 16  # tables kept per rule (grids, shapes, origins), least recently used dropped
SMALL_ARRAY = 1 << 16  # NumPy arrays a rule reads are hashed up to this many bytes


class BlockTable:
    """The kinds and partial tiles of one rule on one grid (see the module doc).

    ``kinds`` int32 (B', H', nQ, nK) with :data:`UNKNOWN` where not evaluated; ``masks``
    bool (capacity, bq, bk), the first ``n`` used; ``evaluated`` counts the cells the
    mask_mod was asked about (what tests read to see a table kept)."""

    def __init__(self, fn, B: int, H: int, bq: int, bk: int, q0: int, k0: int):
        self.fn, self.B, self.H, self.bq, self.bk = fn, B, H, bq, bk
        self.q0, self.k0 = q0, k0
        self.kinds = torch.full((B, H, 0, 0), UNKNOWN, dtype=torch.int32)
        self.masks = torch.zeros((1, bq, bk), dtype=torch.bool)
        self.n = 0
        self.index: dict[bytes, int] = {}
        self.part: dict[tuple[int, int], tuple[int, int, int, int]] = {}  # edge tiles' cells
        self.part_rows: set[int] = set()  # row blocks holding such a tile
        self.seen_b = self.seen_h = 1
        self.evaluated = 0
        self.forms: OrderedDict = OrderedDict()  # per problem: causalattn.masks_rows

    # ---- geometry -------------------------------------------------------------------------
    def _grow(self, nq: int, nk: int) -> None:
        B, H, q, k = self.kinds.shape
        if nq <= q and nk <= k:
            return
        new = torch.full((B, H, max(q, nq), max(k, nk)), UNKNOWN, dtype=torch.int32)
        new[:, :, :q, :k] = self.kinds
        self.kinds = new

    @property
    def nbytes(self) -> int:
        """The table's bytes: 4 per kind, bq·bk per distinct partial tile."""
        return int(
            self.kinds[: self.seen_b, : self.seen_h].numel() * 4 + self.n * self.bq * self.bk
        )

    # ---- evaluation -----------------------------------------------------------------------
    def ensure(self, qb: int, kb0: int, kb1: int, r0: int, r1: int, c0: int, c1: int) -> None:
        """Evaluate row block ``qb``'s key blocks kb0:kb1 where not yet done over global
        query positions r0:r1 and key positions c0:c1 (the problem's, within these tiles)."""
        self._grow(qb + 1, kb1)
        bq, bk = self.bq, self.bk
        a0 = max(r0, self.q0 + qb * bq)
        a1 = min(r1, self.q0 + qb * bq + bq)
        if a1 <= a0:
            return
        if qb not in self.part_rows and bool((self.kinds[0, 0, qb, kb0:kb1] != UNKNOWN).all()):
            return  # all evaluated, whole (the steady state: one check per row block)
        todo = []
        for kb in range(kb0, kb1):
            b0 = max(c0, self.k0 + kb * bk)
            b1 = min(c1, self.k0 + kb * bk + bk)
            if b1 <= b0:
                continue
            if int(self.kinds[0, 0, qb, kb]) != UNKNOWN:
                have = self.part.get((qb, kb))
                if have is None or (
                    have[0] <= a0 and have[1] >= a1 and have[2] <= b0 and have[3] >= b1
                ):
                    continue
                a0b, a1b = min(a0, have[0]), max(a1, have[1])  # the hull: both were valid
                todo.append((kb, min(b0, have[2]), max(b1, have[3]), a0b, a1b))
            else:
                todo.append((kb, b0, b1, a0, a1))
        step = max(1, _mod.TILE_CELLS // (bq * bk))
        i = 0
        while i < len(todo):  # runs of adjacent tiles sharing their rows, at most `step`
            run = [todo[i]]
            while (
                i + len(run) < len(todo)
                and len(run) < step
                and todo[i + len(run)][0] == run[-1][0] + 1
                and todo[i + len(run)][3:] == run[0][3:]
                and run[-1][2] == self.k0 + run[-1][0] * bk + bk
                and todo[i + len(run)][1] == self.k0 + todo[i + len(run)][0] * bk
            ):
                run.append(todo[i + len(run)])
            self._evaluate(qb, run)
            i += len(run)

    def _evaluate(self, qb: int, run: list) -> None:
        bq, bk = self.bq, self.bk
        a0, a1 = run[0][3], run[0][4]
        j0, j1 = run[0][1], run[-1][2]
        pos, j = np.arange(a0, a1), np.arange(j0, j1)
        rows = np.arange(self.B)
        first = self.evaluated == 0  # a new table's first run is evaluated twice (pure?)
        t = _mod.evaluate_mask(self.fn, torch, rows, self.H, pos, j, _CPU, torch.int32, first)
        # a rule that ignores q_idx or kv_idx answers with a broadcast axis: make it whole,
        # or a slice of its columns below would be empty (read as "every cell readable")
        t = t.expand(t.shape[0], t.shape[1], a1 - a0, j1 - j0)
        self.evaluated += int(t.numel())
        tr0 = a0 - (self.q0 + qb * bq)  # rows within the tile
        for kb, b0, b1, _, _ in run:
            cell = t[:, :, :, b0 - j0 : b1 - j0]
            some, every = cell.any(-1).any(-1), cell.all(-1).all(-1)
            kt = every.to(torch.int32)
            tc0 = b0 - (self.k0 + kb * bk)
            for b, h in (some & ~every).nonzero().tolist():
                m = torch.zeros((bq, bk), dtype=torch.bool)
                m[tr0 : tr0 + (a1 - a0), tc0 : tc0 + (b1 - b0)] = cell[b, h]
                kt[b, h] = _kinds.PARTIAL_TILE + self._store(m)
            self.kinds[:, :, qb, kb] = kt
            self.seen_b, self.seen_h = max(self.seen_b, kt.shape[0]), max(self.seen_h, kt.shape[1])
            whole = (a1 - a0, b1 - b0) == (bq, bk)
            if whole:
                self.part.pop((qb, kb), None)
            else:
                self.part[(qb, kb)] = (a0, a1, b0, b1)
                self.part_rows.add(qb)

    def _store(self, m: torch.Tensor) -> int:
        key = m.numpy().tobytes()
        n = self.index.get(key)
        if n is None:
            if self.n == self.masks.shape[0]:  # grow by doubling: a contiguous prefix
                more = torch.zeros((max(1, self.n) * 2, self.bq, self.bk), dtype=torch.bool)
                more[: self.n] = self.masks[: self.n]
                self.masks = more
            n = self.index[key] = self.n
            self.masks[n] = m
            self.n += 1
        return n

    # ---- what the kernels read -------------------------------------------------------------
    def tiles(self, qs: int, ks: int, T_q: int, T_k: int, lo, hi):
        """(kinds int32 (B', H', ceil(T_q/bq), ceil(T_k/bk)), tile_masks bool (n, bq, bk)) of
        a problem whose query i sits at qs + i and key j at ks + j, on this grid (qs, ks on
        the origin's residues), for a kernel that applies the row intervals lo, hi (NumPy
        (B|1, T_q), local key indices) itself: the tiles no row reaches are skipped."""
        bq, bk = self.bq, self.bk
        nq, nk = -(-T_q // bq), -(-T_k // bk)
        Q, K = (qs - self.q0) // bq, (ks - self.k0) // bk
        lo, hi = np.asarray(lo), np.asarray(hi)
        self._grow(Q + nq, K + nk)
        reach = []
        for qi in range(nq):
            r_lo = int(lo[:, qi * bq : qi * bq + bq].min())
            r_hi = int(hi[:, qi * bq : qi * bq + bq].max())
            if r_hi > r_lo:
                kb0, kb1 = r_lo // bk, -(-r_hi // bk)
                self.ensure(Q + qi, K + kb0, K + kb1, qs, qs + T_q, ks, ks + T_k)
                reach.append((qi, kb0, kb1))
        out = torch.zeros((self.seen_b, self.seen_h, nq, nk), dtype=torch.int32)
        for qi, kb0, kb1 in reach:  # only what was asked for (UNKNOWN elsewhere: skipped)
            out[:, :, qi, kb0:kb1] = self.kinds[
                : self.seen_b, : self.seen_h, Q + qi, K + kb0 : K + kb1
            ]
        return out.contiguous(), self.masks[: max(1, self.n)]

    def cells(self, b: int, p0: int, p1: int, j0: int, j1: int) -> torch.Tensor:
        """The rule's booleans (H'|1, p1-p0, j1-j0) for batch row b, global query positions
        p0:p1 and key positions j0:j1 (any rectangle: the tiled engine's), from the table's
        tiles (evaluated where missing)."""
        bq, bk = self.bq, self.bk
        qb0, qb1 = (p0 - self.q0) // bq, -(-(p1 - self.q0) // bq)
        kb0, kb1 = (j0 - self.k0) // bk, -(-(j1 - self.k0) // bk)
        for qb in range(qb0, qb1):
            self.ensure(qb, kb0, kb1, p0, p1, j0, j1)
        bb = b if self.seen_b > 1 else 0
        out = torch.zeros((self.seen_h, p1 - p0, j1 - j0), dtype=torch.bool)
        for qb in range(qb0, qb1):
            t0 = self.q0 + qb * bq
            r0, r1 = max(p0, t0), min(p1, t0 + bq)
            for kb in range(kb0, kb1):
                u0 = self.k0 + kb * bk
                c0, c1 = max(j0, u0), min(j1, u0 + bk)
                kind = self.kinds[bb, : self.seen_h, qb, kb]
                dst = out[:, r0 - p0 : r1 - p0, c0 - j0 : c1 - j0]
                for h in range(self.seen_h):
                    k_ = int(kind[h])
                    if k_ == _kinds.FULL:
                        dst[h] = True
                    elif k_ >= _kinds.PARTIAL_TILE:
                        dst[h] = self.masks[
                            k_ - _kinds.PARTIAL_TILE, r0 - t0 : r1 - t0, c0 - u0 : c1 - u0
                        ]
        return out


# ---- the rule's state: what invalidates its tables ------------------------------------------
def rule_state(fn, limit: int = 64) -> tuple:
    """A hashable summary of what ``fn`` reads (:func:`causalattn.masks_mod.reach`, at most
    ``limit`` entries): per tensor its identity, version counter, shape and dtype; per small
    NumPy array its bytes' digest; its scalars; per function its code; per list, tuple or
    dict its length; the identity of other objects."""
    return _state(fn, limit)[0]


def _state(fn, limit: int = 64) -> tuple[tuple, list]:
    """(:func:`rule_state`, the tensors in it, to check at a key's hit that they are still
    the same objects: an id is reused once its tensor is gone)."""
    out: list = []
    tensors: list = []
    for obj in _mod.reach(fn, limit):
        if len(out) >= limit:
            break
        if isinstance(obj, torch.Tensor):
            out.append(("t", id(obj), _version(obj), tuple(obj.shape), str(obj.dtype)))
            tensors.append(obj)
        elif isinstance(obj, np.ndarray):
            if obj.nbytes <= SMALL_ARRAY:
                digest = hashlib.blake2b(np.ascontiguousarray(obj).tobytes(), digest_size=16)
                out.append(("a", obj.shape, str(obj.dtype), digest.hexdigest()))
            else:
                out.append(("A", id(obj), obj.shape, obj.ctypes.data))
        elif obj is _mod.EMPTY_CELL:
            out.append(("s", None))
        elif isinstance(obj, _mod.SCALARS):
            out.append(("s", obj))
        elif isinstance(obj, types.FunctionType):
            out.append(("f", id(obj.__code__)))
        elif isinstance(obj, (list, tuple)):
            out.append(("l", len(obj)))
        elif isinstance(obj, dict):
            out.append(("d", len(obj)))
        elif not isinstance(obj, (torch.nn.Module, functools.partial, types.MethodType)):
            out.append(("o", id(obj)))  # (what those three hold is recorded instead)
    return tuple(out), tensors


# ---- the tables kept, per rule ----------------------------------------------------------------
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_UNKEPT: OrderedDict = OrderedDict()  # rules that take no weak reference: the last few


def _anchor(fn):
    """(the object the tables live as long as, what else names the rule): a bound method's
    object (a new bound method is made at every attribute read), else the function."""
    if isinstance(fn, types.MethodType):
        return fn.__self__, id(fn.__func__)
    return fn, None


def kept(fn, B: int, H: int, bq: int, bk: int, qs: int, ks: int) -> BlockTable:
    """The kept :class:`BlockTable` of rule ``fn`` for (B, H) on the (bq, bk) grid whose
    origin fits a problem starting at query position qs and key position ks: the same table
    across calls while the rule's state (:func:`rule_state`) is unchanged, else a new one."""
    anchor, extra = _anchor(fn)
    q0, k0 = qs % bq, ks % bk
    state, tensors = _state(fn)
    key = (extra, state, int(B), int(H), int(bq), int(bk), q0, k0)
    try:
        per = _KEPT.get(anchor)
        if per is None:
            per = _KEPT[anchor] = OrderedDict()
    except TypeError:  # no weak reference to it: keep the last few by key only
        per = _UNKEPT.setdefault(id(anchor), OrderedDict())
        while len(_UNKEPT) > PER_RULE:
            _UNKEPT.popitem(last=False)
    hit = per.get(key)
    if hit is not None:
        table, refs = hit
        if len(refs) == len(tensors) and all(r() is t for r, t in zip(refs, tensors)):
            per.move_to_end(key)
            return table
    table = BlockTable(fn, B, H, bq, bk, q0, k0)
    per[key] = (table, [weakref.ref(t) for t in tensors])
    while len(per) > PER_RULE:
        per.popitem(last=False)
    return table


def kept_tiles(pattern, B: int, H: int, T_q: int, T_k: int, bq: int, bk: int, lo, hi):
    """:func:`causalattn.masks_mod.tile_table`'s ``(kinds, tile_masks)`` for a kernel on the
    (bq, bk) grid: of the kept table of the pattern's mask_mod (:func:`kept`) when it has no
    dense mask (a dense mask is this call's data: then made for this call)."""
    if pattern.mask_mod is None or pattern.mask is not None:
        return _mod.tile_table(pattern, B, H, T_q, T_k, bq, bk, lo, hi)
    qs, ks = pattern.query_start(T_q, T_k), pattern.k_start
    table = kept(pattern.mask_mod, B, H, bq, bk, qs, ks)
    return table.tiles(qs, ks, T_q, T_k, lo, hi)


def clear() -> None:
    """Drop every kept table (they are remade on the next call)."""
    _KEPT.clear()
    _UNKEPT.clear()


# ---- the public face: a problem's table, and FlexAttention's create_block_mask ----------------
def problem_table(pattern, T_q: int, T_k: int, B: int, H: int, block_size) -> dict:
    """What :meth:`causalattn.masks.Pattern.block_table` returns (see there)."""
    bq, bk = _block_size(block_size, "block_table")
    if pattern.mask_mod is None and pattern.mask is None:
        raise ValueError(
            "block_table: the pattern has no mask_mod and no mask; its keyword rules need no "
            "table (the kernels read them as row intervals)"
        )
    pattern.check(B, H, T_q, T_k)
    lo, hi = pattern.row_ranges(T_q, T_k)
    kinds, tile_masks = kept_tiles(pattern, B, H, T_q, T_k, bq, bk, lo, hi)
    return {
        "kinds": kinds,
        "tile_masks": tile_masks,
        "block_size": (bq, bk),
        "seq_lengths": (T_q, T_k),
        "nbytes": int(kinds.numel() * 4 + tile_masks.numel()),
    }


def _block_size(bs, what: str) -> tuple[int, int]:
    pair = (bs, bs) if isinstance(bs, (int, np.integer)) else tuple(bs)
    if (
        len(pair) != 2
        or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in pair)
        or min(pair) < 1
    ):
        raise ValueError(f"{what}: BLOCK_SIZE must be an int >= 1 or a pair of them, got {bs!r}")
    return int(pair[0]), int(pair[1])


def create_block_mask(
    mask_mod, B, H, Q_LEN: int, KV_LEN: int, device=None, BLOCK_SIZE=128, _compile=False
):
    """FlexAttention's ``create_block_mask`` (same signature and indices: q_idx 0..Q_LEN-1,
    kv_idx 0..KV_LEN-1): a ``torch.nn.attention.flex_attention.BlockMask`` made from the
    kept table of ``mask_mod`` (evaluated a few tiles at a time, kept across calls), which
    ``flex_attention`` takes and causalattn takes as ``pattern=Pattern.from_block_mask(bm)``.
    ``_compile`` is accepted and has no effect (nothing is traced)."""
    from torch.nn.attention.flex_attention import BlockMask

    _mod.check_callable("mask_mod", mask_mod)
    if mask_mod is None:
        raise ValueError("create_block_mask: mask_mod is required (mask_mod(b, h, q_idx, kv_idx))")
    bq, bk = _block_size(BLOCK_SIZE, "create_block_mask")
    for name, x in (("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN)):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1:
            raise ValueError(f"create_block_mask: {name} must be an int >= 1, got {x!r}")
    for name, x in (("B", B), ("H", H)):
        if x is not None and (isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1):
            raise ValueError(f"create_block_mask: {name} must be None or an int >= 1, got {x!r}")
    Bn, Hn = int(B or 1), int(H or 1)
    nq, nk = -(-int(Q_LEN) // bq), -(-int(KV_LEN) // bk)
    lo = np.zeros((1, int(Q_LEN)), dtype=np.int64)
    hi = np.full((1, int(Q_LEN)), int(KV_LEN), dtype=np.int64)
    table = kept(mask_mod, Bn, Hn, bq, bk, 0, 0)
    kinds, _ = table.tiles(0, 0, int(Q_LEN), int(KV_LEN), lo, hi)
    kinds = kinds.expand(Bn, Hn, nq, nk).numpy()
    flex_kinds = np.where(kinds >= _kinds.PARTIAL_TILE, _kinds.PARTIAL_DENSE, kinds)
    num, idx, full_num, full_idx = _mod._kv_blocks(flex_kinds, device or "cpu")
    return BlockMask.from_kv_blocks(
        num,
        idx,
        full_num,
        full_idx,
        BLOCK_SIZE=(bq, bk),
        mask_mod=mask_mod,
        seq_lengths=(int(Q_LEN), int(KV_LEN)),
    )
