"""The one definition of M: who may read whom, and with what bias.

The seeds write the causal mask additively, M_ij = 0 for j <= i and -inf for j > i.
Real models use more rules (sliding windows, chunks, packed documents, prefixes, padding,
an explicit mask) and score modifiers (softcap, ALiBi, sinks). :class:`Pattern` holds
all of them; every engine, the reference, the trace, the audit, diagnose, the layer, ring
attention, the pictures and the Hugging Face function take their mask from it.

We build masks as booleans (True = may read) and derive the seeds' additive view only at
the end (:func:`additive`), because booleans combine safely with logical AND, while adding
two finite minimums overflows to -inf in fp16/fp32 and can hand weight to a forbidden key.

Positions: query i sits at key position ``pos(i) = i + T_k - T_q`` (bottom-right, the
decoding case). With that, for batch row b:

- ``causal``: j <= pos(i);
- ``window=w``: pos(i) - w < j (the last w positions, itself included; HF ``sliding_window``);
- ``chunk=c``: j and pos(i) in the same chunk of c positions (counted from the start of
  their document when ``cu_seqlens`` packs several);
- ``prefix_lengths`` (B,): inside sequence b's prefix (j < P_b and pos(i) < P_b) queries
  read the whole prefix, both ways — the rules above do not apply there;
- ``lengths`` (B,): keys j < L_b; query rows with pos(i) >= L_b are padding and read nothing;
- ``key_padding_mask`` (B, T_k) bool: blocks keys only;
- ``cu_seqlens`` (n+1,): packed documents (B == 1), a key is read only within its document;
- ``mask`` (B|1, H|1, T_q, T_k) bool (or (H|1, T_q, T_k), or (T_q, T_k)): the general
  fallback, ANDed with the rest;
- ``mask_mod(b, h, q_idx, kv_idx) -> bool``: any rule a user writes (FlexAttention's
  signature, evaluated block by block: :mod:`causalattn.masks_mod`), ANDed with the rest.

Score modifiers, in this order, on S = Q Kᵀ·scale before M (:meth:`Pattern.modify_scores`):
``softcap=c``: S -> c·tanh(S/c); ``alibi_slopes`` (H,) or (B, H): S_ij - slope_h·|pos(i) - j|.
Then ``rel_bias`` (H, 2T−1): + rel_bias[h, c + j − pos(i)]; ``bias`` (broadcastable to
(B, H, T_q, T_k)): + bias; ``score_mod(score, b, h, q_idx, kv_idx)``: any function of the
scores. ``sinks`` (H,): one logit per head that joins each row's softmax denominator and
takes no value. A row with no readable key gives zero weights whatever the sinks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from . import masks_mod as _mod

__all__ = [
    "Pattern",
    "REASONS",
    "READABLE",
    "alibi_slopes",
    "causal",
    "key_padding",
    "query_padding",
    "combine",
    "additive",
    "counts",
    "shape_str",
    "default_scale",
    "check_lengths",
    "PATTERN_KEYWORDS",
]

# The keywords that say who reads whom and with what bias, in Pattern's field order: those of
# causalattn.attention, make_problem, trace, audit and diagnose (not the placement q_start,
# k_start). The one list: the ops' tensor arguments, probes and the HF adapter derive theirs.
PATTERN_KEYWORDS = (
    "causal",
    "window",
    "chunk",
    "lengths",
    "key_padding_mask",
    "cu_seqlens",
    "prefix_lengths",
    "mask",
    "alibi_slopes",
    "softcap",
    "sinks",
    "mask_mod",
    "bias",
    "rel_bias",
    "score_mod",
)
# the keywords that are functions (never operator arguments: see causalattn.engines.ops)
CALLABLES = ("mask_mod", "score_mod")

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


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def default_scale(d_k: int) -> float:
    """The default scale of S = Q Kᵀ·scale, 1/√d_k (1.0 for an empty head, d_k = 0): the
    one place the engines, the trace, the audit, diagnose and the HF capture take it from."""
    return 1.0 / float(np.sqrt(d_k)) if d_k else 1.0


def shape_str(x) -> str:
    """An array's shape for messages, as Python writes a tuple: ``(2, 5)``, ``(3,)``. The
    one formatter (masks, problem, layer, hf_pattern)."""
    return str(tuple(int(s) for s in x.shape))


def _numpy(x) -> np.ndarray:
    """Host NumPy copy of a small array argument (lengths, offsets, slopes)."""
    if _is_torch(x):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"mask: {name} must be a positive integer, got {value!r}")
    if value < 1:
        raise ValueError(f"mask: {name} must be >= 1, got {value}")
    return int(value)


def _int_vector(name: str, value) -> np.ndarray:
    arr = _numpy(value) if not isinstance(value, (list, tuple)) else np.asarray(value)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_:
        raise ValueError(
            f"mask: {name} must be a 1-D integer array, got shape {arr.shape} and dtype {arr.dtype}"
        )
    return arr.astype(np.int64)


def _float_array(name: str, value, ndims: tuple[int, ...]):
    if _is_torch(value):
        ok = value.dtype.is_floating_point
        if ok and value.dim() in ndims and value.numel() and not value.device.type == "meta":
            if not bool(value.detach().isfinite().all()):
                raise ValueError(f"mask: {name} must be finite, got non-finite entries")
        arr = value
    else:
        arr = np.asarray(value)
        ok = np.issubdtype(arr.dtype, np.floating) or (
            np.issubdtype(arr.dtype, np.integer) and arr.dtype != np.bool_
        )
        if ok and arr.ndim in ndims and not np.isfinite(arr.astype(np.float64)).all():
            raise ValueError(f"mask: {name} must be finite, got non-finite entries")
        arr = arr.astype(np.float64) if ok else arr
    if not ok or arr.ndim not in ndims:
        raise ValueError(
            f"mask: {name} must be a real array with {' or '.join(map(str, ndims))} axes, "
            f"got shape {tuple(arr.shape)} and dtype {arr.dtype}"
        )
    return arr


@dataclass(frozen=True, eq=False)
class Pattern:
    """Who may read whom, and with what bias: the seed's M, in general. See the module doc."""

    causal: bool = True
    window: int | None = None
    chunk: int | None = None
    lengths: object = None  # (B,) int
    key_padding_mask: object = None  # (B, T_k) bool
    cu_seqlens: object = None  # (n+1,) int
    prefix_lengths: object = None  # (B,) int
    mask: object = None  # (B|1, H|1, T_q, T_k), (H|1, T_q, T_k) or (T_q, T_k) bool
    alibi_slopes: object = None  # (H,) or (B, H) float
    softcap: float | None = None
    sinks: object = None  # (H,) float, may be a learned torch Parameter
    # rules and modifiers a user writes (causalattn.masks_mod)
    mask_mod: object = None  # mask_mod(b, h, q_idx, kv_idx) -> bool, ANDed with the rules
    bias: object = None  # float, broadcastable to (B, H, T_q, T_k); may be learned
    rel_bias: object = None  # (H, 2T-1) float: bias of the relative position j - pos(i)
    score_mod: object = None  # score_mod(score, b, h, q_idx, kv_idx) -> score
    # Where this problem's queries and keys sit in the whole sequence (ring attention's block
    # pairs, a decoding step): query i at q_start + i, key j at k_start + j. q_start=None
    # means bottom-right: k_start + i + T_k - T_q. Every rule and the dropout pattern use
    # these global positions; lengths, prefix_lengths and cu_seqlens are global too.
    q_start: int | None = None
    k_start: int = 0

    def query_start(self, T_q: int, T_k: int) -> int:
        """Global position of query 0."""
        return self.k_start + T_k - T_q if self.q_start is None else self.q_start

    def __post_init__(self):
        set_ = object.__setattr__
        if not isinstance(self.causal, (bool, np.bool_)):
            raise ValueError(f"mask: causal must be True or False, got {self.causal!r}")
        set_(self, "causal", bool(self.causal))
        for name in ("q_start", "k_start"):
            v = getattr(self, name)
            if v is not None and (
                isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0
            ):
                raise ValueError(f"mask: {name} must be a non-negative integer, got {v!r}")
        if self.window is not None:
            set_(self, "window", _positive_int("window", self.window))
        if self.chunk is not None:
            set_(self, "chunk", _positive_int("chunk", self.chunk))
        for name in ("lengths", "prefix_lengths", "cu_seqlens"):
            v = getattr(self, name)
            if v is not None:
                arr = _int_vector(name, v)
                if arr.size and arr.min() < 0:
                    raise ValueError(f"mask: {name} must be >= 0, got {arr.tolist()[:8]}")
                set_(self, name, arr)
        if self.cu_seqlens is not None:
            cu = self.cu_seqlens
            if cu.size < 2 or cu[0] != 0 or (np.diff(cu) < 0).any():
                raise ValueError(
                    f"cu_seqlens: must have >= 2 entries, start at 0 and never decrease; "
                    f"got {cu.tolist()[:8]}"
                )
            if self.lengths is not None or self.key_padding_mask is not None:
                raise ValueError(
                    "cu_seqlens: give either packed sequences or lengths/key_padding_mask, not both"
                )
            if self.mask is not None:
                raise ValueError(
                    "cu_seqlens: a dense mask and packed sequences contradict; "
                    "give the document rule inside the mask, or cu_seqlens alone"
                )
            if self.prefix_lengths is not None:
                raise ValueError("cu_seqlens: prefix_lengths per packed document is not supported")
        for name, ndim in (("key_padding_mask", (2,)), ("mask", (2, 3, 4))):
            v = getattr(self, name)
            if v is None:
                continue
            if not _is_torch(v):
                v = np.asarray(v)
                set_(self, name, v)
            is_bool = str(v.dtype) in ("torch.bool", "bool")
            if not is_bool or v.ndim not in ndim:
                raise ValueError(
                    f"mask: {name} must be boolean (True = may read) with "
                    f"{' or '.join(map(str, ndim))} axes, got shape {tuple(v.shape)} "
                    f"and dtype {v.dtype}"
                )
        if self.alibi_slopes is not None:
            set_(self, "alibi_slopes", _float_array("alibi_slopes", self.alibi_slopes, (1, 2)))
        if self.sinks is not None:
            set_(self, "sinks", _float_array("sinks", self.sinks, (1,)))
        _mod.check_callable("mask_mod", self.mask_mod)
        _mod.check_callable("score_mod", self.score_mod)
        if self.rel_bias is not None:
            set_(self, "rel_bias", _float_array("rel_bias", self.rel_bias, (2,)))
        if self.bias is not None:
            b = self.bias if _is_torch(self.bias) else np.asarray(self.bias)
            ok = b.dtype.is_floating_point if _is_torch(b) else np.issubdtype(b.dtype, np.floating)
            if not ok or b.ndim > 4:
                raise ValueError(
                    f"bias: must be a float array broadcastable to (B, H, T_q, T_k) (at most 4 "
                    f"axes), got shape {tuple(b.shape)} and dtype {b.dtype}"
                )
            set_(self, "bias", b)
        if self.softcap is not None:
            c = self.softcap
            if isinstance(c, bool) or not isinstance(c, (int, float, np.floating, np.integer)):
                raise ValueError(f"mask: softcap must be a positive number, got {c!r}")
            if not (math.isfinite(float(c)) and c > 0):
                raise ValueError(f"mask: softcap must be finite and > 0, got {c}")
            set_(self, "softcap", float(c))

    # ---- summaries -------------------------------------------------------------------
    @property
    def is_plain_causal(self) -> bool:
        """Causal and nothing else (the seeds' M)."""
        return self.causal and self.describe() == "causal"

    @property
    def has_modifiers(self) -> bool:
        return any(
            getattr(self, n) is not None
            for n in ("softcap", "alibi_slopes", "sinks", "bias", "rel_bias", "score_mod")
        )

    @property
    def per_batch(self) -> bool:
        """Whether the readable set differs between batch rows (a dense mask has a batch axis
        only with 4 axes: a 3-D one is (H, T_q, T_k); a mask_mod may read b: taken as
        differing)."""
        return (
            any(
                getattr(self, n) is not None
                for n in ("lengths", "key_padding_mask", "prefix_lengths")
            )
            or (self.mask is not None and self.mask.ndim == 4 and self.mask.shape[0] > 1)
            or self.mask_mod is not None
        )

    @property
    def per_head(self) -> bool:
        """Whether the readable set differs between heads: the dense mask's head axis is the
        third from the end, (B|1, H|1, T_q, T_k) or (H|1, T_q, T_k); a mask_mod may read h."""
        return (
            self.mask is not None and self.mask.ndim >= 3 and self.mask.shape[-3] > 1
        ) or self.mask_mod is not None

    @property
    def has_additive(self) -> bool:
        """Whether additive score terms are set (ALiBi, rel_bias, bias): the trace's E."""
        return any(getattr(self, n) is not None for n in ("alibi_slopes", "rel_bias", "bias"))

    def only(self, *modifiers: str) -> Pattern:
        """This pattern with only the named score modifiers kept (of softcap, alibi_slopes,
        rel_bias, bias, score_mod): one stage of the modified scores at a time."""
        names = ("softcap", "alibi_slopes", "rel_bias", "bias", "score_mod")
        return replace(self, **{n: None for n in names if n not in modifiers})

    def batch_size(self) -> int:
        """B as the per-sequence data says it (lengths, prefixes, key padding), else 1."""
        for v in (self.lengths, self.prefix_lengths, self.key_padding_mask):
            if v is not None:
                return int(v.shape[0])
        return 1

    def reason_name(self, code: int) -> str:
        """The name of a blocked reason (:data:`REASONS`); the mask_mod's own name for it."""
        if code == MASK_MOD and self.mask_mod is not None:
            return _mod.name_of(self.mask_mod)
        return REASONS[int(code)]

    def describe(self) -> str:
        """A short human name, e.g. ``causal + window 3 + padding``."""
        parts = ["causal"] if self.causal else ["bidirectional"]
        if self.window is not None:
            parts.append(f"window {self.window}")
        if self.chunk is not None:
            parts.append(f"chunk {self.chunk}")
        if self.prefix_lengths is not None:
            parts.append("prefix")
        if self.lengths is not None or self.key_padding_mask is not None:
            parts.append("padding")
        if self.cu_seqlens is not None:
            parts.append("documents")
        if self.mask is not None:
            parts.append("mask")
        if self.mask_mod is not None:
            parts.append(f"mask_mod {_mod.name_of(self.mask_mod)}")
        if self.softcap is not None:
            parts.append(f"softcap {self.softcap:g}")
        if self.alibi_slopes is not None:
            parts.append("ALiBi")
        if self.sinks is not None:
            parts.append("sinks")
        if self.rel_bias is not None:
            parts.append("relative bias")
        if self.bias is not None:
            parts.append("bias")
        if self.score_mod is not None:
            parts.append(f"score_mod {_mod.name_of(self.score_mod)}")
        return " + ".join(parts)

    # ---- shapes ----------------------------------------------------------------------
    def check(self, B: int, H: int, T_q: int, T_k: int) -> None:
        """Raise ValueError, naming the argument and the shapes, where the pattern does not
        fit queries (B, H, T_q) against keys (B, ·, T_k)."""
        placed = self.q_start is not None or self.k_start != 0
        T_all = max(T_k + self.k_start, T_q + self.query_start(T_q, T_k))  # whole sequence
        if T_q > T_k and not placed:
            raise ValueError(
                f"mask: T_q={T_q} queries but only T_k={T_k} keys; queries are the last T_q "
                "positions, so T_q must be <= T_k"
            )
        for name in ("lengths", "prefix_lengths"):
            v = getattr(self, name)
            if v is None:
                continue
            if v.shape != (B,):
                raise ValueError(f"{name}: expected shape (B,) = ({B},), got {shape_str(v)}")
            if v.size and v.max() > T_all and not placed:
                raise ValueError(f"{name}: each must lie in [0, T_k={T_k}], got {v.tolist()[:8]}")
        if self.prefix_lengths is not None and self.lengths is not None:
            if (self.prefix_lengths > self.lengths).any():
                raise ValueError(
                    f"prefix_lengths: each must lie in [0, length]; got prefix "
                    f"{self.prefix_lengths.tolist()[:8]} for lengths {self.lengths.tolist()[:8]}"
                )
        key_padding = self.key_padding_mask
        if key_padding is not None and tuple(key_padding.shape) != (B, T_k):
            raise ValueError(
                f"key_padding_mask: expected a bool array (B, T_k) = ({B}, {T_k}), True = may "
                f"read; got shape {shape_str(key_padding)}"
            )
        cu = self.cu_seqlens
        if cu is not None:
            if (cu[-1] != T_k and not placed) or cu[-1] < T_all:
                raise ValueError(f"cu_seqlens: must end at T={T_k}; got {cu.tolist()[:8]}...")
            if B != 1 or (T_q != T_k and not placed):
                raise ValueError(
                    f"cu_seqlens: packed sequences need B = 1 and T_q = T_k; got B={B}, "
                    f"T_q={T_q}, T_k={T_k}"
                )
        m = self.mask
        if m is not None:
            full = (1,) * (4 - m.ndim) + tuple(m.shape)
            if full[2:] != (T_q, T_k) or full[0] not in (1, B) or full[1] not in (1, H):
                raise ValueError(
                    f"mask: expected a bool array (B|1, H|1, T_q, T_k) with B={B}, H={H}, "
                    f"T_q={T_q}, T_k={T_k}; got shape {shape_str(m)}"
                )
        a = self.alibi_slopes
        if a is not None and tuple(a.shape) not in ((H,), (B, H)):
            raise ValueError(
                f"alibi_slopes: expected shape (H,) = ({H},) or (B, H) = ({B}, {H}), "
                f"got {shape_str(a)}"
            )
        s = self.sinks
        if s is not None and tuple(s.shape) != (H,):
            raise ValueError(
                f"sinks: expected one logit per head, shape (H,) = ({H},), got {shape_str(s)}"
            )
        self._check_user(B, H, T_q, T_k)

    def _check_user(self, B: int, H: int, T_q: int, T_k: int) -> None:
        """bias, rel_bias, mask_mod and score_mod against the shapes: the mask_mod and
        score_mod are called on one small block (twice: a pure function answers the same)."""
        b = self.bias
        if b is not None and not _mod._fits(tuple(b.shape), (B, H, T_q, T_k)):
            raise ValueError(
                f"bias: shape {shape_str(b)} does not broadcast to (B, H, T_q, T_k) = "
                f"({B}, {H}, {T_q}, {T_k}); give (B|1, H|1, T_q|1, T_k|1)"
            )
        r = self.rel_bias
        if r is not None:
            qs, ks = self.query_start(T_q, T_k), self.k_start
            reach = max(qs + T_q - 1 - ks, ks + T_k - 1 - qs, 0)  # the largest |j - pos(i)|
            if r.shape[0] != H or r.shape[1] % 2 == 0 or (r.shape[1] - 1) // 2 < reach:
                raise ValueError(
                    f"rel_bias: expected (H, 2·T−1) = ({H}, {2 * reach + 1}) or wider (odd, "
                    f"centred on j = pos(i)), got {shape_str(r)}"
                )
        fn = self.mask_mod
        if fn is not None and hasattr(fn, "mismatch"):
            why = fn.mismatch(B, H, T_q, T_k)
            if why:
                raise ValueError(why)
        if T_q == 0 or T_k == 0 or (fn is None and self.score_mod is None):
            return
        qs, ks = self.query_start(T_q, T_k), self.k_start
        pos, j = np.arange(min(T_q, 16)) + qs, np.arange(min(T_k, 16)) + ks
        rows = np.arange(B)
        if fn is not None:
            import torch

            first = _mod.evaluate_mask(fn, torch, rows, H, pos, j)
            again = _mod.evaluate_mask(fn, torch, rows, H, pos, j)
            if tuple(first.shape) != tuple(again.shape) or not bool((first == again).all()):
                raise ValueError(
                    f"mask_mod: {_mod.name_of(fn)} is not a pure function of its indices: two "
                    f"calls on the same block (b 0..{B - 1}, q_idx {pos[0]}..{pos[-1]}, kv_idx "
                    f"{j[0]}..{j[-1]}) answered differently; compute the mask from b, h, "
                    "q_idx and kv_idx only"
                )
        if self.score_mod is not None:
            import torch

            b4, h4, q4, k4 = _mod.indices(torch, rows, H, pos, j)
            S = torch.zeros((B, H, len(pos), len(j)), dtype=torch.float64)
            with torch.no_grad():
                _mod.apply_score_mod(self.score_mod, S, b4, h4, q4, k4)

    # ---- the dense forms ---------------------------------------------------------------
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

        pt = Pattern(causal=False, mask=self.mask, mask_mod=self.mask_mod)
        pt = replace(pt, q_start=self.query_start(T_q, T_k), k_start=self.k_start)
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
        the dense mask differs by head, else 1. NumPy, or torch on ``like``'s device.
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
        if self.causal:
            hi = min(hi, max(p1 + 1, P if in_prefix else 0))
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

    def row_ranges(self, B: int, T_q: int, T_k: int) -> tuple[np.ndarray, np.ndarray]:
        """Per query row the keys [lo, hi) that causal, window, chunk, prefix, lengths and
        documents allow, as this problem's key indices: NumPy int64 (B', T_q) each, B' = B
        when lengths or prefixes differ by batch row, else 1. Row i reads exactly
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
        n = B if (self.lengths is not None or self.prefix_lengths is not None) else 1
        lo, hi = np.broadcast_to(lo, (n, T_q)), np.broadcast_to(hi, (n, T_q))
        if self.prefix_lengths is not None:
            # inside the prefix the row also reads all of it: [0, P) ∪ [lo, hi), and
            # lo <= pos < P there, so the union is one interval
            P = self.prefix_lengths[:, None]
            inside = pos < P
            lo = np.where(inside, ks, lo)
            hi = np.where(inside, np.minimum(np.maximum(hi, P), ks + T_k), hi)
        padding = np.zeros((1, 1), dtype=bool)
        if self.lengths is not None:
            L = self.lengths[:, None]
            hi = np.minimum(hi, L)
            padding = pos >= L  # padding query rows, the last ones
        lo, hi = np.clip(lo - ks, 0, T_k), np.clip(hi - ks, 0, T_k)  # this problem's keys
        hi = np.maximum(hi, lo)  # an empty row: lo = hi, still in order with its neighbours
        return np.where(padding, T_k, lo), np.where(padding, T_k, hi)

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

    def block_kind(
        self, b, q0, q1, k0, k1, T_q, T_k, H=1, B=None
    ) -> Literal["skip", "full", "partial"]:
        """Whether the tile (queries q0:q1, keys k0:k1) of batch row b is skipped, fully
        readable, or partly readable (and must be masked with :meth:`tile`)."""
        lo, hi = self.key_range(b, q0, q1, T_q, T_k)
        if hi <= k0 or lo >= k1 or lo == hi:
            return "skip"
        B = (
            (
                len(self.lengths)
                if self.lengths is not None
                else len(self.prefix_lengths)
                if self.prefix_lengths is not None
                else self.key_padding_mask.shape[0]
                if self.key_padding_mask is not None
                else b + 1
            )
            if B is None
            else B
        )
        if self.mask_mod is not None:  # a few tiles at a time, never the whole block
            return _mod.block_kind(self, max(B, b + 1), H, T_q, T_k, q0, q1, k0, k1, [b])
        t = self.tile(max(B, b + 1), H, T_q, T_k, q0, q1, k0, k1, batch=[b])
        if t.all():
            return "full"
        return "partial" if t.any() else "skip"

    # ---- score modifiers ---------------------------------------------------------------
    def modify_scores(self, S, q0: int = 0, k0: int = 0, T_q=None, T_k=None, batch=None):
        """softcap, then ALiBi, on scores S (B, H, rows, cols) (NumPy or torch); returns a new
        array. q0/k0 place a tile; T_q/T_k default to S's last two axes; ``batch`` picks the
        rows of (B, H) slopes."""
        if self.softcap is not None:
            c = self.softcap
            S = c * (S / c).tanh() if _is_torch(S) else c * np.tanh(S / c)
        a = self.alibi_slopes
        if a is not None:
            rows, cols = S.shape[-2:]
            T_q = rows if T_q is None else T_q
            T_k = cols if T_k is None else T_k
            if _is_torch(S):
                import torch

                pos = torch.arange(q0, q0 + rows, device=S.device) + self.query_start(T_q, T_k)
                j = torch.arange(k0, k0 + cols, device=S.device) + self.k_start
                dist = (pos[:, None] - j[None, :]).abs().to(S.dtype)
                sl = a if _is_torch(a) else torch.as_tensor(a)
                sl = sl.to(device=S.device, dtype=S.dtype)
            else:
                pos = np.arange(q0, q0 + rows) + self.query_start(T_q, T_k)
                j = np.arange(k0, k0 + cols) + self.k_start
                dist = np.abs(pos[:, None] - j[None, :]).astype(S.dtype)
                sl = _numpy(a).astype(S.dtype)
            if sl.ndim == 2 and batch is not None:
                sl = sl[batch]
            sl = sl[None] if sl.ndim == 1 else sl  # (1|B, H)
            S = S - sl[..., None, None] * dist
        if self.rel_bias is not None or self.bias is not None or self.score_mod is not None:
            S = self._modify_user(S, q0, k0, T_q, T_k, batch)
        return S

    def _modify_user(self, S, q0, k0, T_q, T_k, batch):
        """rel_bias, bias, then score_mod, on scores S (B'|1, H, rows, cols)."""
        rows, cols = S.shape[-2:]
        T_q = rows if T_q is None else T_q
        T_k = cols if T_k is None else T_k
        torch_ = _is_torch(S)
        if torch_:
            import torch as xp
        else:
            xp = np
        dev = S.device if torch_ else None
        pos = np.arange(q0, q0 + rows) + self.query_start(T_q, T_k)
        j = np.arange(k0, k0 + cols) + self.k_start

        def to_s(a):  # a bias array in S's kind and dtype (keeping its gradient in torch)
            if torch_:
                a = a if _is_torch(a) else xp.as_tensor(np.asarray(a))
                return a.to(device=dev, dtype=S.dtype)
            return _numpy(a).astype(S.dtype)

        r = self.rel_bias
        if r is not None:
            c = (r.shape[1] - 1) // 2
            idx = c + j[None, :] - pos[:, None]  # (rows, cols)
            S = S + to_s(r)[:, xp.as_tensor(idx, device=dev) if torch_ else idx]
        bias = self.bias
        if bias is not None:
            bias = to_s(bias)
            bias = bias.reshape((1,) * (4 - bias.ndim) + tuple(bias.shape))
            if bias.shape[0] > 1 and batch is not None:
                bias = bias[xp.as_tensor(np.asarray(batch), device=dev) if torch_ else batch]
            qs = slice(q0, q0 + rows) if bias.shape[2] > 1 else slice(None)
            ks = slice(k0, k0 + cols) if bias.shape[3] > 1 else slice(None)
            S = S + bias[:, :, qs, ks]
        if self.score_mod is not None:
            S4 = S.reshape((1,) * (4 - S.ndim) + tuple(S.shape))
            rows_b = np.arange(S4.shape[0]) if batch is None else np.asarray(batch)
            b, h, qi, kj = _mod.indices(xp, rows_b, S4.shape[1], pos, j, dev)
            S = _mod.apply_score_mod(self.score_mod, S4, b, h, qi, kj).reshape(S.shape)
        return S

    # ---- FlexAttention both ways (causalattn.masks_mod) ----------------------------------
    def to_mask_mod(self, T_q: int | None = None, T_k: int | None = None):
        """This M as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` (pointwise torch ops);
        with T_q, T_k its indices are FlexAttention's for such a problem."""
        return _mod.to_mask_mod(self, T_q, T_k)

    def to_block_mask(self, T_q: int, T_k: int, block_size: int = 128, **kw):
        """FlexAttention's ``BlockMask`` of this M for (T_q, T_k), made tile by tile
        (``B=``, ``H=``, ``device=`` as create_block_mask's)."""
        return _mod.to_block_mask(self, T_q, T_k, block_size, **kw)

    @staticmethod
    def from_block_mask(bm) -> Pattern:
        """The Pattern of a FlexAttention ``BlockMask`` (for its own (T_q, T_k) only)."""
        return Pattern(causal=False, mask_mod=_mod.block_mask_mod(bm))


def alibi_slopes(n_heads: int) -> np.ndarray:
    """ALiBi's fixed slopes (H,): for H a power of two the geometric sequence 2^(-8h/H),
    h = 1..H; otherwise those of the next lower power of two, then every other slope of the
    next higher one (as the ALiBi paper and BLOOM do)."""
    n = _positive_int("n_heads", n_heads)

    def powers(m):
        return [2.0 ** (-8.0 * (h + 1) / m) for h in range(m)]

    low = 1 << (n.bit_length() - 1)
    slopes = powers(low) + powers(2 * low)[0::2][: n - low]
    return np.asarray(slopes, dtype=np.float64)


# ---- the seeds' building blocks, on the one definition ----------------------------------


def _check_len(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"mask: {name} must be an integer, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"mask: {name} must be >= 0, got {value}")
    return int(value)


def causal(T_q: int, T_k: int | None = None) -> np.ndarray:
    """Causal mask, ``T_q×T_k`` booleans: query i may read key j when j <= i + (T_k - T_q).

    With T_q == T_k this is the lower triangle (diagonal included). With T_q < T_k
    (decoding against a KV cache) the queries are the *last* T_q positions, so the
    mask is aligned to the bottom-right corner.
    """
    T_q = _check_len("T_q", T_q)
    T_k = T_q if T_k is None else _check_len("T_k", T_k)
    if T_q > T_k:
        raise ValueError(
            f"causal mask: T_q={T_q} queries but only T_k={T_k} keys; with bottom-right "
            "alignment T_q must be <= T_k"
        )
    return Pattern().tile(1, 1, T_q, T_k)[0, 0]


def check_lengths(lengths, T: int, what: str, B: int | None = None, note: str = "") -> np.ndarray:
    """``lengths`` as int64 NumPy (B,), each in [0, T]; else a ValueError from ``what``
    naming the shape (B,) = (``B``,) when given. The one lengths check (masks, layer, ring)."""
    arr = _numpy(lengths) if not isinstance(lengths, (list, tuple)) else np.asarray(lengths)
    if (
        arr.ndim != 1
        or not np.issubdtype(arr.dtype, np.integer)
        or arr.dtype == np.bool_
        or (B is not None and arr.shape[0] != B)
    ):
        want = "(B,)" if B is None else f"(B,) = ({B},)"
        raise ValueError(
            f"{what}: lengths must be a 1-D integer array {want}, got shape "
            f"{tuple(arr.shape)} and dtype {arr.dtype}"
        )
    if arr.size and (arr.min() < 0 or arr.max() > T):
        raise ValueError(f"{what}: lengths must lie in [0, T={T}]{note}, got {arr.tolist()}")
    return arr.astype(np.int64)


def _padding(lengths, T: int, what: str) -> np.ndarray:
    T = _check_len("T", T)
    arr = check_lengths(lengths, T, what)
    # keys j < L_b: the padding rule of a bidirectional pattern, read along the key axis
    return Pattern(causal=False, lengths=arr).tile(len(arr), 1, T, T, 0, 1)[:, 0, 0, :]


def key_padding(lengths, T: int) -> np.ndarray:
    """Key-padding mask ``(B, T)``: key j of sequence b may be read when j < lengths[b]."""
    return _padding(lengths, T, "key padding mask")


def query_padding(lengths, T: int) -> np.ndarray:
    """Query-padding mask ``(B, T)``: query i of sequence b is real when i < lengths[b].

    Combined with a ``(B, T, T)`` mask it is broadcast over the key axis, so a padding
    query row has no readable key (its output row is zero, never NaN).
    """
    return _padding(lengths, T, "query padding mask")  # same positions, the query axis


def combine(*masks):
    """Logical AND of boolean masks, broadcast together (NumPy or torch, not mixed).

    Padding masks of shape ``(B, T)`` are read as key masks; to use one over queries,
    give it a trailing axis: ``q_mask[:, :, None]``.
    """
    if not masks:
        raise ValueError("combine: at least one mask is required")
    is_torch = [_is_torch(m) for m in masks]
    if any(is_torch) and not all(is_torch):
        raise ValueError("combine: masks must be all NumPy or all torch, not mixed")
    arrs = list(masks) if all(is_torch) else [np.asarray(m) for m in masks]
    for a in arrs:
        if str(a.dtype) not in ("bool", "torch.bool"):
            raise ValueError(f"combine: masks must be boolean (True = may read), got {a.dtype}")
    out = arrs[0]
    try:
        for a in arrs[1:]:
            out = out & a
    except (ValueError, RuntimeError) as exc:
        shapes = " and ".join(str(tuple(a.shape)) for a in arrs)
        raise ValueError(f"combine: masks of shapes {shapes} do not broadcast") from exc
    return out


def additive(allowed, fill: Literal["-inf", "finite"] = "-inf", dtype=np.float64) -> np.ndarray:
    """The seeds' additive mask M: 0 where allowed, -inf (or dtype's finite minimum) where blocked.

    A finite fill is written once per blocked entry, never summed from two masks, so it
    cannot overflow. Softmax in this package still forces blocked entries to exactly 0
    (see :mod:`causalattn.reference`), so a finite fill changes no weight.
    """
    a = np.asarray(allowed)
    if a.dtype != np.bool_:
        raise ValueError(f"additive: mask must be boolean (True = may read), got {a.dtype}")
    dt = np.dtype(dtype)
    if not np.issubdtype(dt, np.floating):
        raise ValueError(f"additive: dtype must be floating, got {dt}")
    if fill == "-inf":
        blocked = -np.inf
    elif fill == "finite":
        blocked = np.finfo(dt).min
    else:
        raise ValueError(f"additive: fill must be '-inf' or 'finite', got {fill!r}")
    return np.where(a, dt.type(0), dt.type(blocked)).astype(dt)


def counts(
    lengths, T: int, *, window: int | None = None, chunk: int | None = None
) -> dict[str, np.ndarray]:
    """How many of the T×T entries of causal (+ window, chunk) AND padding
    (``Pattern(window=..., chunk=..., lengths=lengths)``) are of each kind, per sequence.

    ``readable`` (may read), ``future`` (a later key of the sequence), ``window`` or
    ``chunk`` (an earlier key the rule hides; present only with that rule) and ``padding``
    (query or key is padding), each ``(B,)`` int64, summing to T². From the per-row key
    ranges (:meth:`Pattern.row_ranges`): O(B·T) however wide, where a dense count of a
    100,000-token sentence would walk 10^10 cells.
    """
    T = _check_len("T", T)
    L = check_lengths(lengths, T, "mask counts")
    B = len(L)
    if window is None and chunk is None:  # closed form, O(B)
        readable = L * (L + 1) // 2
        return {"readable": readable, "future": L * L - readable, "padding": T * T - L * L}
    lo, hi = Pattern(window=window, chunk=chunk, lengths=L).row_ranges(B, T, T)
    real = np.arange(T)[None, :] < L[:, None]  # query rows of real tokens
    width = np.where(real, hi - lo, 0)
    readable = width.sum(axis=1)
    i = np.arange(T)[None, :]
    future = np.where(real, L[:, None] - 1 - i, 0).sum(axis=1)  # keys j > i, j < L
    out = {"readable": readable, "future": future}
    out["window" if window is not None else "chunk"] = L * L - readable - future
    out["padding"] = T * T - L * L
    return out
