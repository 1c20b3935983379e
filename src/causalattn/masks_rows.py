"""A mask_mod as the native kernel's keyword inputs: per-row key intervals, plus tile bits.

The cpp kernel already reads who may read whom as per-row intervals ``lo <= j < hi``
(the keywords' :meth:`~causalattn.masks.Pattern.row_ranges`) and, beyond them, per-tile
kinds with bits only for partial tiles. :func:`row_form` turns a mask_mod into exactly
those inputs, once per problem (kept on the rule's :class:`~causalattn.masks_table.BlockTable`,
so it is invalidated with it):

- each row's interval is the hull of the keys the rule lets it read (over the heads);
- when, on every row and head, the rule reads its whole hull (a window, documents, causal,
  prefix LM, and their intersections), there are no kinds at all: the kernel runs the
  keyword path itself, bit for bit what the same rule written as keywords computes;
- otherwise the kinds say, relative to the intervals, which tiles are full (the intervals
  alone), skipped, or partial (bits): only tiles with holes inside the intervals are read
  bit by bit.

Made a chunk of rows at a time (at most ``ROW_CELLS`` cells per call of the mask_mod:
whole rows, every key the keyword intervals reach), never T_q×T_k at once; the first row
block is evaluated twice (an impure rule is refused).

Bytes: 16 per (b', query row) for the intervals; with kinds, 4 per (b', h', tile) plus
bq·bk per distinct partial tile.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from . import masks_bounds as _bounds
from . import masks_mod as _mod
from . import masks_table as _table

__all__ = ["row_form", "ROW_CELLS", "FORMS"]

ROW_CELLS = _mod.TILE_CELLS  # cells per call of the rule: the tables' bound
FORMS = 8  # forms kept per table (problem shapes: a decoding loop makes one per step)
_CPU = torch.device("cpu")


def row_form(pattern, B: int, H: int, T_q: int, T_k: int, bq: int, bk: int, lo, hi) -> tuple:
    """``(lo, hi, kinds, tile_masks, nbytes)`` of ``pattern.mask_mod`` AND the keyword
    intervals ``lo, hi`` (NumPy (B|1, T_q), local key indices) on the local (bq, bk) grid:
    lo, hi torch int64 (B'|1, T_q); kinds int32 (B'|1, H'|1, ceil(T_q/bq), ceil(T_k/bk))
    relative to those intervals (1 full, 0 skip, 3 + n partial through tile_masks[n]) and
    tile_masks bool (n, bq, bk), or both None when the intervals say everything. Kept per
    problem on the rule's kept table (made once; remade with it when the rule changes)."""
    lo, hi = np.ascontiguousarray(lo, dtype=np.int64), np.ascontiguousarray(hi, dtype=np.int64)
    qs, ks = pattern.query_start(T_q, T_k), pattern.k_start
    table = _table.kept(pattern.mask_mod, B, H, bq, bk, qs, ks)
    digest = hashlib.blake2b(lo.tobytes() + hi.tobytes(), digest_size=16).digest()
    key = (qs, ks, T_q, T_k, lo.shape, digest)
    form = table.forms.get(key)
    if form is None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # small ops: a parallel region costs more than it saves
        try:
            form = table.forms[key] = _make(table, qs, ks, T_q, T_k, lo, hi)
        finally:
            torch.set_num_threads(threads)
        while len(table.forms) > FORMS:
            table.forms.popitem(last=False)
    else:
        table.forms.move_to_end(key)
    return form


def _make(table, qs: int, ks: int, T_q: int, T_k: int, lo: np.ndarray, hi: np.ndarray):
    bq, bk = table.bq, table.bk
    nq, nk = -(-T_q // bq), -(-T_k // bk)
    los, his, kind_parts = [], [], []  # per chunk: (B'|1, R) and (qb0, kinds or None)
    masks: list = []
    index: dict[bytes, int] = {}
    per_cell = 1  # B'·H' of the rule's answers (known after the first chunk)
    verdicts = _bounds.tile_verdicts(table.fn, table.B, table.H, qs, ks, T_q, T_k, bq, bk)
    r0 = 0
    while r0 < T_q:
        r1 = min(T_q, r0 + bq)
        while (
            r0 and r1 < T_q and verdicts is None
        ):  # more row blocks while their cells fit (not the first)
            n1 = min(T_q, r1 + bq)
            if per_cell * (n1 - r0) * (_width(lo[:, r0:n1], hi[:, r0:n1]) + bk) > ROW_CELLS:
                break
            r1 = n1
        cl, ch = lo[:, r0:r1], hi[:, r0:r1]
        if not (ch > cl).any():  # nothing readable: empty intervals, no tiles
            los.append(cl)
            his.append(cl)
            r0 = r1
            continue
        v = None if verdicts is None else _verdicts_of(verdicts, r0 // bq, cl, ch, bk)
        pieces, kA, rlo, rhi, exact, full = _evaluate(table, qs, ks, r0, r1, cl, ch, T_k, v)
        per_cell = max([per_cell] + [t.shape[0] * t.shape[1] for _, _, t in pieces])
        los.append((rlo + kA).numpy())
        his.append((rhi + kA).numpy())
        if not exact:
            W = min(T_k, -(-int(ch.max()) // bk) * bk) - kA
            c_lo, c_hi = torch.from_numpy(cl)[..., None], torch.from_numpy(ch)[..., None]
            t = _cells(pieces, full, kA, W, bk, c_lo, c_hi)
            kind_parts.append((r0 // bq, _classify(t, rlo, rhi, kA, bq, bk, nk, masks, index)))
        del pieces
        r0 = r1
    lo_t = _stack(los, T_q)
    hi_t = _stack(his, T_q)
    kinds = tile_masks = None
    nbytes = int(lo_t.numel() + hi_t.numel()) * 8
    if kind_parts:
        Bx = max(k.shape[0] for _, k in kind_parts)
        Hx = max(k.shape[1] for _, k in kind_parts)
        kinds = torch.full((Bx, Hx, nq, nk), _mod.FULL, dtype=torch.int32)
        for qb, k in kind_parts:
            kinds[:, :, qb : qb + k.shape[2]] = k
        tile_masks = torch.stack(masks) if masks else torch.zeros((1, bq, bk), dtype=torch.bool)
        nbytes += int(kinds.numel() * 4 + len(masks) * bq * bk)
    return lo_t, hi_t, kinds, tile_masks, nbytes


def _width(cl: np.ndarray, ch: np.ndarray) -> int:
    """The keys the rows' intervals reach, first to last (0 when none)."""
    some = ch > cl
    return int(ch[some].max() - cl[some].min()) if some.any() else 0


def _evaluate(table, qs, ks, r0, r1, cl, ch, T_k, v=None):
    """The rule AND the keyword intervals on rows r0:r1 over the keys kA:kB the intervals
    reach (on whole tiles), reduced per row: ``(pieces, kA, rlo, rhi, exact, full)``.
    ``v``: the row block's tile verdicts (:func:`causalattn.masks_bounds.tile_verdicts`,
    (B'|1, H'|1, tiles from kA's)) or None: then only the runs of tiles with an UNKNOWN
    verdict are evaluated, the FULL ones (``full``, bool (B'|1, H'|1, tiles)) counted from
    the intervals alone. Evaluated in pieces (a, b, bool (B'|1, H'|1, R, b - a)) of at most
    ``ROW_CELLS`` cells, each reduced as it comes; :func:`_hull`'s per-row hull."""
    bk = table.bk
    kA = int(cl[ch > cl].min()) // bk * bk
    kB = min(T_k, -(-int(ch.max()) // bk) * bk)
    R, W = r1 - r0, kB - kA
    n_t = -(-W // bk)
    c_lo, c_hi = torch.from_numpy(cl)[..., None], torch.from_numpy(ch)[..., None]
    first, last, cnt, full = torch.tensor(W), torch.tensor(-1), torch.tensor(0), None
    if v is None:
        runs = [(kA, kB)]
    else:
        unknown = (v == _bounds.UNKNOWN).flatten(0, 1).any(0).tolist()
        full = (v == _bounds.FULL) & ~torch.tensor(unknown)
        runs, i = [], 0
        while i < n_t:
            if unknown[i]:
                e = i
                while e < n_t and unknown[e]:
                    e += 1
                runs.append((kA + i * bk, min(kB, kA + e * bk)))
                i = e
            else:
                i += 1
        first, last, cnt = _counted(full, kA, kB, bk, c_lo, c_hi)
    step = max(bk, ROW_CELLS // max(1, R) // bk * bk)  # keys per call of the rule
    pieces = []
    for a0, b0 in runs:
        for a in range(a0, b0, step):
            b = min(b0, a + step)
            t = _piece(table, qs, ks, r0, r1, a, b, c_lo, c_hi)
            n = t.sum(-1)
            u = t.view(torch.uint8)
            f = torch.where(n > 0, u.argmax(-1) + (a - kA), W)
            g = torch.where(n > 0, (b - kA - 1) - u.flip(-1).argmax(-1), -1)
            first, last, cnt = torch.minimum(first, f), torch.maximum(last, g), cnt + n
            pieces.append((a, b, t))
    rlo, rhi, exact = _hull(first, last, cnt)
    return pieces, kA, rlo, rhi, exact, full


def _counted(full, kA: int, kB: int, bk: int, c_lo, c_hi):
    """Per (b', h', row): the first and last key (chunk offsets; W and -1 where none) and
    the count of keys in the tiles the rule surely reads all of, within the intervals."""
    k0 = kA + torch.arange(full.shape[-1]) * bk
    start = torch.maximum(k0, c_lo)  # (B|1, R, tiles)
    end = torch.minimum(torch.clamp(k0 + bk, max=kB), c_hi)
    n = torch.clamp(end - start, min=0)[:, None]
    ok = full[:, :, None, :] & (n > 0)
    W = kB - kA
    first = torch.where(ok, start[:, None] - kA, W).amin(-1)
    last = torch.where(ok, end[:, None] - 1 - kA, -1).amax(-1)
    return first, last, (n * ok).sum(-1)


def _piece(table, qs, ks, r0, r1, a, b, c_lo, c_hi):
    """The rule AND the keyword intervals on rows r0:r1, keys a:b: bool (B'|1, H'|1, R, b-a)
    (the table's first one evaluated twice: a pure rule answers the same)."""
    pos, j, rows = np.arange(qs + r0, qs + r1), np.arange(ks + a, ks + b), np.arange(table.B)
    t = _mod.evaluate_mask(table.fn, torch, rows, table.H, pos, j, _CPU, torch.int32)
    if not table.checked:
        table.checked = True
        again = _mod.evaluate_mask(table.fn, torch, rows, table.H, pos, j, _CPU, torch.int32)
        if tuple(again.shape) != tuple(t.shape) or not bool((again == t).all()):
            raise ValueError(
                f"mask_mod: {_mod.name_of(table.fn)} answered differently on a second "
                f"evaluation of the same cells (q_idx {pos[0]}..{pos[-1]}, kv_idx "
                f"{j[0]}..{j[-1]}); it must be a pure function of b, h, q_idx, kv_idx "
                "and the tensors it reads"
            )
    table.evaluated += (r1 - r0) * (b - a)
    jj = torch.arange(a, b)
    return t & ((jj >= c_lo) & (jj < c_hi))[:, None]  # its own tensor


def _cells(pieces, full, kA: int, W: int, bk: int, c_lo, c_hi) -> torch.Tensor:
    """The chunk's cells, bool (B'|1, H'|1, R, W): the evaluated pieces, and the tiles the
    rule surely reads all of within the intervals (for :func:`_classify`)."""
    Bx = max(
        [p.shape[0] for _, _, p in pieces]
        + ([full.shape[0], c_lo.shape[0]] if full is not None else [])
    )
    Hx = max([p.shape[1] for _, _, p in pieces] + ([full.shape[1]] if full is not None else []))
    R = c_lo.shape[1]
    t = torch.zeros((Bx, Hx, R, W), dtype=torch.bool)
    if full is not None:
        jj = kA + torch.arange(W)
        inside = ((jj >= c_lo) & (jj < c_hi))[:, None]
        t |= inside & full.repeat_interleave(bk, -1)[:, :, None, :W]
    for a, b, p in pieces:
        t[:, :, :, a - kA : b - kA] = p
    return t


def _hull(first, last, cnt):
    """(lo, hi) int64 (B'|1, R) per row: the hull over the heads of its readable keys (in
    the chunk's key offsets; lo = hi = 0 where none), from each (b', h', row)'s first and
    last readable key and their count; and whether every head reads all of its row's hull
    (then the intervals say everything)."""
    rlo, rhi = first.amin(1), (last + 1).amax(1)
    rlo = torch.where(rhi > rlo, rlo, 0)
    rhi = torch.maximum(rhi, rlo)
    exact = bool((cnt == (rhi - rlo)[:, None]).all())
    return rlo, rhi, exact


def _verdicts_of(verdicts, qb: int, cl, ch, bk: int) -> torch.Tensor:
    """Row block qb's tile verdicts from the tile of key kA on (B'|1, H'|1, tiles)."""
    kA = int(cl[ch > cl].min()) // bk
    return verdicts[:, :, qb, kA:]


def _classify(t, rlo, rhi, kA: int, bq: int, bk: int, nk: int, masks: list, index: dict):
    """The chunk's tile kinds (B'|1, H'|1, ceil(R/bq), nk) relative to the intervals
    [rlo, rhi): full where the rule reads every cell the intervals let in, skip where none,
    else partial (its bits stored once in ``masks``)."""
    Bx, Hx, R, W = t.shape
    nqc, nkc = -(-R // bq), -(-W // bk)
    pad = (0, nkc * bk - W, 0, nqc * bq - R)
    jj = torch.arange(W)
    inside = (jj >= rlo[..., None]) & (jj < rhi[..., None])  # (B'|1, R, W)
    tt = torch.nn.functional.pad(t, pad).view(Bx, Hx, nqc, bq, nkc, bk)
    ii = torch.nn.functional.pad(inside, pad).view(inside.shape[0], 1, nqc, bq, nkc, bk)
    n_t = tt.sum((3, 5), dtype=torch.int64)
    n_in = ii.sum((3, 5), dtype=torch.int64).expand_as(n_t)
    kinds = torch.full((Bx, Hx, nqc, nk), _mod.FULL, dtype=torch.int32)
    part = kinds[:, :, :, kA // bk : kA // bk + nkc]
    part[(n_t == 0) & (n_in > 0)] = _mod.SKIP
    for b, h, qi, ki in ((n_t > 0) & (n_t < n_in)).nonzero().tolist():
        m = tt[b, h, qi, :, ki, :].contiguous()
        key = m.numpy().tobytes()
        n = index.get(key)
        if n is None:
            n = index[key] = len(masks)
            masks.append(m)
        part[b, h, qi, ki] = _mod.PARTIAL_TILE + n
    return kinds


def _stack(parts: list, T_q: int) -> torch.Tensor:
    """The chunks' (B'|1, R) arrays side by side as one contiguous int64 (B'|1, T_q)."""
    Bx = max(p.shape[0] for p in parts)
    out = np.concatenate([np.broadcast_to(p, (Bx, p.shape[1])) for p in parts], axis=1)
    assert out.shape[1] == T_q
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.int64))
