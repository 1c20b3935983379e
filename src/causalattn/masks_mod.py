"""Rules a user writes, on the one M: ``mask_mod`` and ``score_mod`` (FlexAttention's
signatures), the additive biases, and FlexAttention's ``BlockMask`` both ways.

:class:`causalattn.masks.Pattern` holds them; this module evaluates them.

- ``mask_mod(b, h, q_idx, kv_idx) -> bool``: b, h, q_idx, kv_idx are broadcastable integer
  index tensors (torch; NumPy arrays in the NumPy reference), shaped (nb, 1, 1, 1),
  (1, H, 1, 1), (1, 1, rows, 1) and (1, 1, 1, cols); the answer must broadcast to
  (nb, H, rows, cols). q_idx and kv_idx are positions in the whole sequence, as the keyword
  rules read them: query i at ``pos(i)`` (bottom-right by default, ``q_start + i`` when
  placed), key j at ``k_start + j``; for T_q = T_k, unplaced, they are FlexAttention's
  indices. It is ANDed with the keyword rules and ``mask``. It is only ever evaluated on
  one block of cells at a time (:func:`evaluate_mask`), never on the whole T×T; some blocks
  twice, so an impure rule is refused. :func:`and_masks` / :func:`or_masks` combine rules.
- ``score_mod(score, b, h, q_idx, kv_idx) -> score``: the same indices, the scores (after
  the scale, softcap, ALiBi, ``rel_bias`` and ``bias``, before M) in natural units; it
  must return the scores' shape and dtype (none is cast back).
- ``bias``: an additive float tensor broadcastable to (B, H, T_q, T_k), indexed by this
  problem's query and key indices (like ``mask``). ``rel_bias`` (H, 2·T−1): the bias of a
  relative position, ``rel_bias[h, c + (j − pos(i))]`` with c = (R−1)/2 the centre of its
  R columns (T5; global positions, so a placed block pair reads the same entries).

Tile tables (:func:`tile_table`): the kind of every (bq × bk) tile a kernel may visit —
0 skipped, 1 fully readable, 3 + n partly readable through ``tile_masks[n]`` (bq, bk) —
found by evaluating the rules tile by tile (O(bq·bk) at a time; identical partial tiles
stored once), for the native engine and the Triton kernels.
"""

from __future__ import annotations

import functools
import types
import weakref

import numpy as np

from .constants import FULL, PARTIAL_DENSE, PARTIAL_TILE, SKIP  # the kernels' tile kinds

__all__ = [
    "name_of",
    "evaluate_mask",
    "apply_score_mod",
    "captured_tensors",
    "reach",
    "tile_table",
    "tile_kinds",
    "block_kind",
    "to_mask_mod",
    "to_block_mask",
    "block_mask_mod",
    "BlockMaskMod",
    "and_masks",
    "or_masks",
]

TILE_CELLS = 1 << 18  # cells evaluated at once when a table is made (a few tiles)


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def name_of(fn) -> str:
    """A callable's name for messages and the blocked reason: ``fn.__name__`` ("lambda" for
    a lambda), a partial's function's, or the class name."""
    base = getattr(fn, "func", fn)  # functools.partial
    name = getattr(base, "__name__", None) or type(base).__name__
    return "lambda" if name == "<lambda>" else str(name)


_SIGNATURES = {  # FlexAttention's
    "mask_mod": "mask_mod(b, h, q_idx, kv_idx) -> bool",
    "score_mod": "score_mod(score, b, h, q_idx, kv_idx) -> score",
}


def check_callable(what: str, fn) -> None:
    if fn is not None and not callable(fn):
        raise ValueError(
            f"mask: {what} must be a function ({_SIGNATURES[what]}), got {type(fn).__name__}"
        )


def _shape(x) -> str:
    return str(tuple(int(s) for s in np.shape(x)))


def _fits(shape: tuple, target: tuple) -> bool:
    """Whether ``shape`` broadcasts to ``target`` (every axis 1 or the target's)."""
    if len(shape) > len(target):
        return False
    return all(s in (1, t) for s, t in zip(shape[::-1], target[::-1]))


def indices(xp, b_rows, H: int, pos, j, dev=None, dtype=None):
    """(b, h, q_idx, kv_idx) index tensors shaped (nb,1,1,1), (1,H,1,1), (1,1,rows,1),
    (1,1,1,cols), int64 (or torch ``dtype``: int32, FlexAttention's, for the block tables),
    in ``xp`` (NumPy or torch on ``dev``)."""
    if dtype is not None:
        return tuple(t.to(dtype) for t in indices(xp, b_rows, H, pos, j, dev))
    if xp is np:
        return (
            np.asarray(b_rows, dtype=np.int64).reshape(-1, 1, 1, 1),
            np.arange(H, dtype=np.int64).reshape(1, -1, 1, 1),
            np.asarray(pos, dtype=np.int64).reshape(1, 1, -1, 1),
            np.asarray(j, dtype=np.int64).reshape(1, 1, 1, -1),
        )

    def t(x):
        return xp.as_tensor(np.asarray(x, dtype=np.int64), device=dev)

    return (
        t(b_rows).reshape(-1, 1, 1, 1),
        xp.arange(H, device=dev).reshape(1, -1, 1, 1),
        (t(pos) if not _is_torch(pos) else pos.to(dev)).reshape(1, 1, -1, 1),
        (t(j) if not _is_torch(j) else j.to(dev)).reshape(1, 1, 1, -1),
    )


def _call(fn, what: str, args, xp):
    """fn(*args); in NumPy, a function written for torch is called again on torch tensors."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - any error of the user's function is named
        first = exc
    if xp is np:
        try:
            import torch

            return fn(*[torch.from_numpy(np.ascontiguousarray(a)) for a in args])
        except Exception:  # noqa: BLE001 - the first error is the one to report
            pass
    shapes = ", ".join(f"{n} {_shape(a)}" for n, a in zip(_ARG_NAMES[what], args))
    raise ValueError(
        f"{what}: {name_of(fn)} raised {type(first).__name__}: {first} (called on {shapes}); "
        f"it must compute from broadcastable index tensors, elementwise"
    ) from first


_ARG_NAMES = {
    "mask_mod": ("b", "h", "q_idx", "kv_idx"),
    "score_mod": ("score", "b", "h", "q_idx", "kv_idx"),
}


def evaluate_mask(fn, xp, b_rows, H: int, pos, j, dev=None, dtype=None, twice=False):
    """``fn``'s booleans for batch rows ``b_rows``, heads 0..H-1, query positions ``pos`` and
    key positions ``j`` (index tensors of ``dtype``, see :func:`indices`): a 4-D bool array
    (nb|1, H|1, rows|1, cols|1) in ``xp`` (on ``dev``). A ValueError names what came back
    when it is not booleans of a broadcastable shape, or when a second evaluation answers
    otherwise (made when ``twice``, else on a sample of the evaluations: :func:`_recheck`)."""
    args = indices(xp, b_rows, H, pos, j, dev, dtype)
    target = (len(np.atleast_1d(b_rows)), H, args[2].shape[2], args[3].shape[3])
    out = _answer(fn, args, target, xp, dev)
    if twice or _recheck(fn, int(np.prod(target))):  # a pure rule answers the same twice
        again = _answer(fn, args, target, xp, dev)
        if tuple(again.shape) != tuple(out.shape) or not bool((again == out).all()):
            raise ValueError(
                f"mask_mod: {name_of(fn)} answered differently on a second evaluation of the "
                f"same cells (index tensors {_index_shapes(args)}: b {_span(b_rows)}, q_idx "
                f"{_span(pos)}, kv_idx {_span(j)}); it must be a pure function of b, h, q_idx, "
                "kv_idx and the tensors it reads"
            )
    return out


def _index_shapes(args) -> str:
    return ", ".join(f"{n} {_shape(a)}" for n, a in zip(_ARG_NAMES["mask_mod"], args))


def _span(x) -> str:
    a = np.atleast_1d(np.asarray(x.cpu() if _is_torch(x) else x)).reshape(-1)
    return f"{int(a[0])}..{int(a[-1])}" if a.size else "none"


# How often each mask_mod has been evaluated, and its largest block: its 1st, 2nd, 4th, 8th,
# ... evaluation, and any block at least twice as large as all before, is made twice. So an
# impure rule is caught on the first block an engine asks for (the Pattern's own small check
# block is evaluated twice always), at a cost logarithmic in the calls (a kept block table
# stops them altogether).
# Keyed weakly on the function (a bound method on its function: one is made per read).
_EVALS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _recheck(fn, cells: int) -> bool:
    key = getattr(fn, "__func__", fn)
    try:
        n, most = _EVALS.get(key, (0, 0))
        _EVALS[key] = (n + 1, max(most, cells))
    except TypeError:  # takes no weak reference: every evaluation is checked
        return True
    return (n + 1) & n == 0 or cells >= 2 * most


def _answer(fn, args, target, xp, dev):
    """fn(*args) checked: booleans that broadcast to ``target``, 4-D, in ``xp`` on ``dev``."""
    out = _call(fn, "mask_mod", args, xp)
    if xp is np and str(getattr(out, "dtype", "")) not in ("bool", "torch.bool"):
        try:  # a rule written for torch that mixes NumPy in: ask it in torch
            import torch

            out = fn(*[torch.from_numpy(np.ascontiguousarray(a)) for a in args])
        except Exception:  # noqa: BLE001 - the NumPy answer is the one named below
            pass
    what = _shape(out) if hasattr(out, "shape") else ""
    dtype = str(getattr(out, "dtype", type(out).__name__))
    if dtype not in ("bool", "torch.bool") or not hasattr(out, "shape"):  # a Python bool too
        raise ValueError(
            f"mask_mod: {name_of(fn)} returned {type(out).__name__}{' ' + what if what else ''}"
            f" of dtype {dtype} for index tensors {_index_shapes(args)}; it must return "
            "booleans (True = may read) of the indices' shape, e.g. q_idx >= kv_idx"
        )
    if not _fits(tuple(out.shape), target):
        raise ValueError(
            f"mask_mod: {name_of(fn)} returned shape {what} for index tensors "
            f"{_index_shapes(args)}; it must broadcast to (nb, H, rows, cols) = {target}: "
            "combine the index tensors elementwise"
        )
    if xp is np:
        out = out.detach().cpu().numpy() if _is_torch(out) else np.asarray(out)
    elif not _is_torch(out):
        out = xp.as_tensor(np.asarray(out), device=dev)
    elif out.device != dev and dev is not None:
        out = out.to(dev)
    return out.reshape((1,) * (4 - out.ndim) + tuple(out.shape))


def apply_score_mod(fn, S, b, h, q_idx, kv_idx):
    """``fn(S, b, h, q_idx, kv_idx)`` checked: an array of the scores' shape and dtype (the
    engine's compute dtype: nothing is cast back; a captured tensor of a wider dtype must be
    cast by the function, ``buf.to(score.dtype)``)."""
    out = _call(fn, "score_mod", (S, b, h, q_idx, kv_idx), np if not _is_torch(S) else None)
    if not hasattr(out, "shape") or not hasattr(out, "dtype"):
        raise ValueError(
            f"score_mod: {name_of(fn)} returned {type(out).__name__}, not an array, for scores "
            f"of shape {_shape(S)}; it must return the scores changed elementwise, e.g. "
            "score + bias[h, q_idx - kv_idx]"
        )
    if tuple(out.shape) != tuple(S.shape):
        raise ValueError(
            f"score_mod: {name_of(fn)} returned shape {_shape(out)} for scores of shape "
            f"{_shape(S)}; it must return the scores' shape (change each score elementwise, "
            "e.g. score + bias[h, q_idx - kv_idx])"
        )
    if str(out.dtype).replace("torch.", "") != str(S.dtype).replace("torch.", ""):
        raise ValueError(
            f"score_mod: {name_of(fn)} returned dtype {out.dtype} for scores of shape "
            f"{_shape(S)} and dtype {S.dtype}; it must keep the scores' dtype (cast what it "
            "reads: buf.to(score.dtype))"
        )
    if _is_torch(out) != _is_torch(S):  # back in the scores' kind, dtype kept
        if _is_torch(out):
            return out.detach().cpu().numpy()
        import torch

        return torch.as_tensor(out, device=S.device)
    return out


EMPTY_CELL = object()  # what :func:`reach` yields for a closure cell not yet filled
SCALARS = (type(None), bool, int, float, complex, str, np.generic)  # read by value
_LEAVES = (*SCALARS, bytes, np.ndarray)  # nothing further to walk


def reach(fn, limit: int = 64):
    """Each object ``fn`` can read, depth first, ``fn`` first. One step each: a function's
    closure cells, defaults and the globals it names; a partial's function and arguments; a
    bound method's object and function; a torch module's ``state_dict`` tensors and its
    ``forward``; the first ``limit`` items of a list or tuple, values of a dict; any other
    object's ``__call__`` and fields (classes, modules, tensors, arrays and scalars: nothing
    further). Followed to depth 4, over at most 64·``limit`` objects; an object reached
    again is walked again only when nearer ``fn`` (a deeper path reached it first). The one
    walk of a rule's state: what its gradient flows to (:func:`captured_tensors`) and what
    invalidates its kept tables (:func:`causalattn.masks_table.rule_state`); leave the loop
    to stop."""
    import torch

    seen: dict[int, int] = {}  # id -> the least depth it was walked at

    def steps(obj):
        if isinstance(obj, (torch.Tensor, type, types.ModuleType, *_LEAVES)):
            return ()
        if isinstance(obj, torch.nn.Module):
            return (*obj.state_dict(keep_vars=True).values(), type(obj).forward)
        if isinstance(obj, functools.partial):
            return (obj.func, *obj.args, *obj.keywords.values())
        if isinstance(obj, types.MethodType):
            return (obj.__self__, obj.__func__)
        if isinstance(obj, types.FunctionType):
            g = obj.__globals__
            return (
                *(_cell(c) for c in obj.__closure__ or ()),
                *(obj.__defaults__ or ()),
                *(obj.__kwdefaults__ or {}).values(),
                *(g[n] for n in obj.__code__.co_names if n in g),
            )
        if isinstance(obj, (list, tuple)):
            return obj[:limit]
        if isinstance(obj, dict):
            return list(obj.values())[:limit]
        own = (getattr(type(obj), "__call__", None),) if callable(obj) else ()  # noqa: B004
        return (*own, getattr(obj, "__dict__", None))

    def walk(obj, depth: int):
        if depth > 4 or len(seen) >= 64 * limit or seen.get(id(obj), depth + 1) <= depth:
            return
        seen[id(obj)] = depth
        yield obj
        for x in steps(obj):
            yield from walk(x, depth + 1)

    yield from walk(fn, 0)


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return EMPTY_CELL


def captured_tensors(fn, limit: int = 64) -> list:
    """The tensors that require a gradient among what ``fn`` can read (:func:`reach`), at
    most ``limit``, each once: what a score_mod's gradient flows to."""
    import torch

    found: dict[int, torch.Tensor] = {}
    for obj in reach(fn, limit):
        if isinstance(obj, torch.Tensor) and obj.requires_grad:
            found.setdefault(id(obj), obj)
            if len(found) >= limit:
                break
    return list(found.values())


# ---- tile tables: the kinds of a kernel's tiles -------------------------------------------
def _classify(t: np.ndarray) -> np.ndarray:
    """The kind per (b', h') of a 4-D bool NumPy tile (B', H', r, c): 0 none, 1 all, 2 some."""
    return np.where(t.all((-2, -1)), FULL, np.where(t.any((-2, -1)), PARTIAL_DENSE, SKIP))


def tile_kinds(pattern, B: int, H: int, T_q: int, T_k: int, bq: int, bk: int):
    """The whole pattern's kind per (bq × bk) tile, NumPy int8 (B', H', ceil(T_q/bq),
    ceil(T_k/bk)): 0 nothing readable, 1 all readable, 2 partly; evaluated tile by tile
    (tiles outside :meth:`~causalattn.masks.Pattern.key_range` are not evaluated)."""
    pattern.check(B, H, T_q, T_k)
    nq, nk = -(-T_q // bq), -(-T_k // bk)
    rows = B if pattern.per_batch else 1
    heads = H if pattern.per_head else 1
    out = np.zeros((rows, heads, nq, nk), dtype=np.int8)
    for b in range(rows):
        for qi in range(nq):
            q0, q1 = qi * bq, min(T_q, qi * bq + bq)
            lo, hi = pattern.key_range(b, q0, q1, T_q, T_k)
            for ki in range(lo // bk, -(-hi // bk)):
                k0, k1 = ki * bk, min(T_k, ki * bk + bk)
                t = pattern.tile(B, H, T_q, T_k, q0, q1, k0, k1, batch=[b])
                out[b, :, qi, ki] = np.broadcast_to(_classify(t)[0], (heads,))  # (1, H'|1)
    return out


def block_kind(pattern, B, H, T_q, T_k, q0, q1, k0, k1, batch) -> str:
    """ "skip", "full" or "partial" for queries q0:q1, keys k0:k1 of batch rows ``batch``,
    evaluating a few tiles at a time (stops at the first tile that shows both)."""
    some = every = None
    rows = max(1, min(q1 - q0, TILE_CELLS // max(1, k1 - k0)))
    cols = min(k1 - k0, TILE_CELLS // rows) or 1
    for a in range(q0, q1, rows):
        for c in range(k0, k1, cols):
            t = pattern.tile(
                B, H, T_q, T_k, a, min(q1, a + rows), c, min(k1, c + cols), batch=batch
            )
            some = bool(t.any()) or bool(some)
            every = bool(t.all()) and every is not False
            if some and not every:
                return "partial"
    return "full" if every else ("partial" if some else "skip")


def tile_table(pattern, B: int, H: int, T_q: int, T_k: int, bq: int, bk: int, lo, hi):
    """The tiles of ``mask`` AND ``mask_mod`` for a kernel that applies the row intervals
    [lo, hi) (NumPy (B|1, T_q), :meth:`~causalattn.masks.Pattern.row_ranges`) and the key
    padding itself: ``(kinds, tile_masks)`` torch (CPU), kinds int32 (B', H', nQB, nKB) —
    0 skip, 1 full, 3 + n partial through ``tile_masks[n]``, bool (n, bq, bk) — or
    (None, None) when the pattern has neither. Only tiles some row's interval reaches are
    evaluated, a few tiles at a time; identical partial tiles are stored once."""
    import torch

    if pattern.mask is None and pattern.mask_mod is None:
        return None, None
    nq, nk = -(-T_q // bq), -(-T_k // bk)
    # each tile's kinds over the heads its cells differ by: one for a rule that does not read
    # h (a mask_mod shows that only by what it returns), so the partial tiles are made once,
    # not once per head, and the kernels get kinds that say so
    Bp = B if pattern.per_batch or (pattern.mask is not None and _mask_rows(pattern) > 1) else 1
    Hp = H if pattern.per_head else 1
    kinds = torch.zeros((Bp, Hp, nq, nk), dtype=torch.int32)  # filled in place: no small
    seen_b = seen_h = 1  # tensors kept per tile (they would pin the allocator's heap)
    masks: list = []
    index: dict[bytes, int] = {}
    lo, hi = np.asarray(lo), np.asarray(hi)
    step = max(1, TILE_CELLS // (bq * bk))  # key tiles evaluated at once
    for qi in range(nq):
        q0, q1 = qi * bq, min(T_q, qi * bq + bq)
        lo_q, hi_q = lo[:, q0:q1], hi[:, q0:q1]
        live = lo_q < hi_q  # an empty interval (a padding row's [T_k, T_k)) reaches no key
        if not live.any():
            continue
        reach_lo, reach_hi = int(lo_q[live].min()), int(hi_q[live].max())
        k_first, k_last = reach_lo // bk, -(-reach_hi // bk)
        for kc in range(k_first, k_last, step):
            kc2 = min(k_last, kc + step)
            k0, k1 = kc * bk, min(T_k, kc2 * bk)
            t = pattern.extra_tile(B, H, T_q, T_k, q0, q1, k0, k1)  # (B'|1, H'|1, r, c)
            for ki in range(kc, kc2):
                c0, c1 = ki * bk - k0, min(k1, ki * bk + bk) - k0
                cell = t[:, :, :, c0:c1]
                some, every = cell.any(-1).any(-1), cell.all(-1).all(-1)
                kt = every.to(torch.int32)  # 1 full, 0 skip for now
                for b, h in (some & ~every).nonzero().tolist():
                    m = torch.zeros((bq, bk), dtype=torch.bool)
                    m[: q1 - q0, : c1 - c0] = cell[b, h]
                    key = m.numpy().tobytes()
                    n = index.get(key)
                    if n is None:
                        n = index[key] = len(masks)
                        masks.append(m)
                    kt[b, h] = PARTIAL_TILE + n
                kinds[:, :, qi, ki] = kt
                seen_b, seen_h = max(seen_b, kt.shape[0]), max(seen_h, kt.shape[1])
    kinds = kinds[:seen_b, :seen_h]  # the same for every row / head where nothing differed
    tile_masks = torch.stack(masks) if masks else torch.zeros((1, bq, bk), dtype=torch.bool)
    return kinds.contiguous(), tile_masks.contiguous()


def _mask_rows(pattern) -> int:
    m = pattern.mask
    return int(m.shape[0]) if m is not None and m.ndim >= 3 else 1


# ---- combining rules: FlexAttention's and_masks / or_masks ---------------------------------
def _combined(mods: tuple, what: str, op: str):
    for n, m in enumerate(mods):
        if not callable(m):
            raise ValueError(
                f"{what}: argument {n} must be a mask_mod ({_SIGNATURES['mask_mod']}), got "
                f"{type(m).__name__}"
            )

    def combined(b, h, q_idx, kv_idx):
        if not mods:  # no rule: and_masks reads everything, or_masks nothing (Flex's)
            return (b == b) if op == "and" else (b != b)
        out = mods[0](b, h, q_idx, kv_idx)
        for m in mods[1:]:
            nxt = m(b, h, q_idx, kv_idx)
            out = (out & nxt) if op == "and" else (out | nxt)
        return out

    combined.__name__ = f"{op}({', '.join(name_of(m) for m in mods)})"
    return combined


def and_masks(*mask_mods):
    """The mask_mod that reads a cell where every one of ``mask_mods`` does (none: every
    cell), FlexAttention's ``and_masks``; works on torch and NumPy index arrays."""
    return _combined(mask_mods, "and_masks", "and")


def or_masks(*mask_mods):
    """The mask_mod that reads a cell where any of ``mask_mods`` does (none: no cell),
    FlexAttention's ``or_masks``."""
    return _combined(mask_mods, "or_masks", "or")


# ---- FlexAttention both ways ----------------------------------------------------------------
def to_mask_mod(pattern, T_q: int | None = None, T_k: int | None = None):
    """The pattern's M as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx)``: pointwise torch
    ops on the indices and the pattern's data (traceable by ``flex_attention`` and
    ``create_block_mask``). With T_q and T_k, q_idx and kv_idx are FlexAttention's indices of
    such a problem (placed as the pattern places them); without, they are positions."""
    import torch

    qs = 0 if T_q is None else pattern.query_start(T_q, T_k)
    ks = 0 if T_q is None else pattern.k_start
    data = pattern.rule_data(torch)
    inner = pattern.mask_mod

    def mask_mod(b, h, q_idx, kv_idx):
        inside = None
        if T_q is not None:  # FlexAttention pads to whole blocks: those cells read nothing
            inside = (q_idx < T_q) & (kv_idx < T_k)
            q_idx, kv_idx = q_idx.clamp(max=T_q - 1), kv_idx.clamp(max=T_k - 1)
        pos, j = q_idx + qs, kv_idx + ks
        out = pattern.rules_at(torch, pos, j, b, h, q_idx, kv_idx, data)
        if inner is not None:
            out = out & inner(b, h, pos, j)
        return out if inside is None else out & inside

    mask_mod.__name__ = f"causalattn_{pattern.describe().replace(' + ', '_').replace(' ', '')}"
    return mask_mod


def to_block_mask(
    pattern, T_q: int, T_k: int, block_size: int = 128, *, B=None, H=None, device="cpu"
):
    """FlexAttention's ``BlockMask`` of the pattern for (T_q, T_k): its kind per
    block_size × block_size tile from :func:`tile_kinds` (tile by tile), and
    :func:`to_mask_mod` for the partial tiles."""
    from torch.nn.attention.flex_attention import BlockMask

    bs = int(block_size)
    if bs < 1:
        raise ValueError(f"to_block_mask: block_size must be >= 1, got {block_size!r}")
    B = B if B is not None else pattern.batch_size()
    H = 1 if H is None else int(H)
    kinds = tile_kinds(pattern, B, H, T_q, T_k, bs, bs)
    num, idx, full_num, full_idx = _kv_blocks(kinds, device)
    return BlockMask.from_kv_blocks(
        num,
        idx,
        full_num,
        full_idx,
        BLOCK_SIZE=(bs, bs),
        mask_mod=to_mask_mod(pattern, T_q, T_k),
        seq_lengths=(T_q, T_k),
    )


def _kv_blocks(kinds: np.ndarray, device):
    """BlockMask's (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices), int32."""
    import torch

    def lists(which):
        sel = kinds == which
        num = sel.sum(-1).astype(np.int32)
        order = np.argsort(~sel, axis=-1, kind="stable").astype(np.int32)  # chosen first
        return torch.as_tensor(num, device=device), torch.as_tensor(order, device=device)

    n, i = lists(PARTIAL_DENSE)
    fn, fi = lists(FULL)
    return n, i, fn, fi


class BlockMaskMod:
    """A FlexAttention ``BlockMask`` as a mask_mod: full blocks read, partial blocks read
    where the BlockMask's own mask_mod says so, absent blocks not. It fits only the
    (T_q, T_k) it was built for (:meth:`causalattn.masks.Pattern.check` says so, never
    truncates); q_idx, kv_idx are positions, the queries bottom-right as in the keyword
    rules."""

    def __init__(self, bm):
        self.seq_lengths = tuple(int(x) for x in bm.seq_lengths)
        self.block_size = tuple(int(x) for x in bm.BLOCK_SIZE)
        self.inner = bm.mask_mod
        self.kinds = _dense_kinds(bm)  # torch int8 (B|1, H|1, nQ, nK)
        self.__name__ = f"BlockMask[{name_of(self.inner)}]"

    def __call__(self, b, h, q_idx, kv_idx):
        import torch

        T_q, T_k = self.seq_lengths
        i = q_idx - (T_k - T_q)  # FlexAttention's query index
        t = self.kinds if not _is_torch(i) else self.kinds.to(i.device)
        if not _is_torch(i):
            b, h, i, kv_idx = (torch.as_tensor(x) for x in (b, h, i, kv_idx))
        bb = b if t.shape[0] > 1 else torch.zeros_like(b)
        hh = h if t.shape[1] > 1 else torch.zeros_like(h)
        # cells outside its own (T_q, T_k) read nothing (compare_masks names the length;
        # attention refuses it first: mismatch)
        inside = (i >= 0) & (i < T_q) & (kv_idx >= 0) & (kv_idx < T_k)
        i, kv_idx = i.clamp(0, max(T_q - 1, 0)), kv_idx.clamp(0, max(T_k - 1, 0))
        kind = t[bb, hh, i // self.block_size[0], kv_idx // self.block_size[1]]
        inner = self.inner(b, h, i, kv_idx)
        return inside & ((kind == FULL) | ((kind == PARTIAL_DENSE) & inner.to(torch.bool)))

    def mismatch(self, B: int, H: int, T_q: int, T_k: int) -> str:
        """Why it does not fit a problem ("" when it does)."""
        if self.seq_lengths != (T_q, T_k):
            return (
                f"mask_mod: a BlockMask built for (T_q, T_k) = {self.seq_lengths} cannot mask a "
                f"problem of ({T_q}, {T_k}); build it for this length "
                f"(create_block_mask(..., Q_LEN={T_q}, KV_LEN={T_k}))"
            )
        Bb, Hb = self.kinds.shape[:2]
        if Bb not in (1, B) or Hb not in (1, H):
            return (
                f"mask_mod: a BlockMask for B={Bb}, H={Hb} cannot mask a problem of B={B}, "
                f"H={H}; build it with B=None/{B} and H=None/{H}"
            )
        return ""


def _dense_kinds(bm):
    """A BlockMask's kind per block as torch int8 (B, H, nQ, nK): 0 absent, 1 full, 2 partial."""
    import torch

    idx = bm.kv_indices.cpu().long()
    n_k = idx.shape[-1]

    def marks(num, ind):
        take = torch.arange(ind.shape[-1]) < num.cpu()[..., None].long()
        target = torch.where(take, ind.cpu().long().clamp(0, n_k - 1), n_k)  # n_k: unused slot
        out = torch.zeros((*ind.shape[:-1], n_k + 1), dtype=torch.bool)
        return out.scatter_(-1, target, True)[..., :n_k]

    partial = marks(bm.kv_num_blocks, idx)
    kinds = torch.where(partial, PARTIAL_DENSE, SKIP).to(torch.int8)
    if bm.full_kv_num_blocks is not None:
        kinds = torch.where(marks(bm.full_kv_num_blocks, bm.full_kv_indices), FULL, kinds)
    T_q, T_k = (int(x) for x in bm.seq_lengths)
    nq, nk = -(-T_q // bm.BLOCK_SIZE[0]), -(-T_k // bm.BLOCK_SIZE[1])
    return kinds[..., :nq, :nk].to(torch.int8).contiguous()


def block_mask_mod(bm) -> BlockMaskMod:
    """The mask_mod of a FlexAttention ``BlockMask`` (checked to be one), for
    :meth:`causalattn.masks.Pattern.from_block_mask`, which makes the Pattern (masks imports
    this module, never the other way)."""
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError as exc:  # pragma: no cover - old torch
        raise ValueError(f"from_block_mask: FlexAttention is not available ({exc})") from exc
    if not isinstance(bm, BlockMask):
        raise ValueError(
            f"from_block_mask: expected a torch.nn.attention.flex_attention.BlockMask, got "
            f"{type(bm).__name__}"
        )
    # one per BlockMask while it lives: its kept block tables are found again on each call
    try:
        mod = _BLOCK_MASK_MODS.get(bm)
    except TypeError:  # pragma: no cover - a BlockMask that takes no weak reference
        return BlockMaskMod(bm)
    if mod is None:
        mod = _BLOCK_MASK_MODS[bm] = BlockMaskMod(bm)
    return mod


_BLOCK_MASK_MODS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
