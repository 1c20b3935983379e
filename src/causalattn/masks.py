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

import inspect
from dataclasses import dataclass, fields, replace
from typing import Literal

import numpy as np

from . import masks_mod as _mod

# causalattn.masks is the one public face: Pattern takes its checks (masks_checks) and its
# dense forms (masks_dense) from the modules below, and their names are importable here
from .masks_checks import PatternChecks, _check_len, _numpy, check_lengths, default_scale, shape_str
from .masks_checks import _float_array as _float_array
from .masks_checks import _int_vector as _int_vector
from .masks_checks import _is_torch as _is_torch
from .masks_checks import _positive_int as _positive_int
from .masks_dense import CHUNK as CHUNK
from .masks_dense import DOCUMENT as DOCUMENT
from .masks_dense import FUTURE as FUTURE
from .masks_dense import MASK as MASK
from .masks_dense import MASK_MOD, READABLE, REASONS, PatternDense
from .masks_dense import PADDING as PADDING
from .masks_dense import WINDOW as WINDOW

# FlexAttention's combinators of mask_mods, by their names
from .masks_mod import and_masks as and_masks
from .masks_mod import or_masks as or_masks

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
    "takes_pattern",
    "create_block_mask",
    "and_masks",
    "or_masks",
]

# the keywords that are functions (never operator arguments: see causalattn.engines.ops)
CALLABLES = ("mask_mod", "score_mod")


@dataclass(frozen=True, eq=False)
class Pattern(PatternChecks, PatternDense):
    """Who may read whom, and with what bias: the seed's M, in general. See the module doc.

    Its methods live in three modules: here the summaries (``describe``, ``per_batch``,
    ...), the score modifiers (``modify_scores``) and FlexAttention both ways; in
    :mod:`causalattn.masks_checks` the checks (``__post_init__``, ``check``); in
    :mod:`causalattn.masks_dense` the dense forms and what the engines read (``tile``,
    ``allowed``, ``reasons``, ``key_range``, ``row_ranges``, ``mask_tile_kinds``,
    ``block_kind``)."""

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

    @classmethod
    def from_kwargs(cls, pattern: Pattern | None = None, *, where: str = "attention", **keywords):
        """The one place keywords become a Pattern: ``pattern`` itself, or a Pattern of the
        pattern keywords (:data:`PATTERN_KEYWORDS`; placement too). ``where`` names the
        caller in the errors: TypeError for an unknown keyword, ValueError for a keyword
        given together with ``pattern``."""
        kw = keywords_of(pattern, keywords, where, placement=True)
        return pattern if pattern is not None else cls(**kw)

    def query_start(self, T_q: int, T_k: int) -> int:
        """Global position of query 0."""
        return self.k_start + T_k - T_q if self.q_start is None else self.q_start

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
                sl = torch.as_tensor(a).to(device=S.device, dtype=S.dtype)
            else:
                pos = np.arange(q0, q0 + rows) + self.query_start(T_q, T_k)
                j = np.arange(k0, k0 + cols) + self.k_start
                dist = np.abs(pos[:, None] - j[None, :]).astype(S.dtype)
                sl = _numpy(a).astype(S.dtype)
            if sl.ndim == 2 and batch is not None:
                sl = sl[batch]
            S = S - sl[..., None, None] * dist  # slopes (H,) or (B, H)
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

    def block_table(self, T_q: int, T_k: int, *, B: int = 1, H: int = 1, block_size=128):
        """The kept block table of this M's mask_mod (ANDed with the dense mask) for a
        (B, H, T_q, T_k) problem on (block_size × block_size) tiles, as the kernels read it:
        a dict with ``kinds`` int32 (B'|1, H'|1, ceil(T_q/bq), ceil(T_k/bk)) — 0 skipped,
        1 fully readable, 3 + n partly readable through ``tile_masks[n]`` — ``tile_masks``
        bool (n, bq, bk), ``block_size``, ``seq_lengths`` and ``nbytes``. The keyword rules
        are the kernels' row intervals: a tile no row's interval reaches is 0, unevaluated.
        Made once and kept (:mod:`causalattn.masks_table`): a second call, another Pattern
        of the same mask_mod, or a longer T_k reuses it."""
        from . import masks_table

        return masks_table.problem_table(self, T_q, T_k, B, H, block_size)

    @staticmethod
    def from_block_mask(bm) -> Pattern:
        """The Pattern of a FlexAttention ``BlockMask`` (for its own (T_q, T_k) only)."""
        return Pattern(causal=False, mask_mod=_mod.block_mask_mod(bm))


# The keywords that say who reads whom and with what bias: Pattern's fields in their order,
# less the placement (q_start, k_start). The one list: every entry point's signature
# (takes_pattern), the operators' tensor arguments and the CLI's options derive from it.
PLACEMENT = ("q_start", "k_start")
_FIELDS = {f.name: f for f in fields(Pattern)}
PATTERN_KEYWORDS = tuple(n for n in _FIELDS if n not in PLACEMENT)
DEFAULTS = {n: _FIELDS[n].default for n in PATTERN_KEYWORDS}


def keywords_of(pattern, keywords: dict, where: str, placement: bool = False) -> dict:
    """Every pattern keyword's value for a call: ``pattern``'s fields, or the given
    ``keywords`` over the defaults (placement only with ``placement``). Nothing is checked
    against the data here (traced code calls it; :class:`Pattern` checks the values).
    TypeError for an unknown keyword (as Python's own), ValueError naming both when a
    keyword that is not its default comes with ``pattern``."""
    names = _FIELDS if placement else DEFAULTS
    unknown = [n for n in keywords if n not in names]
    if unknown:
        raise TypeError(f"{where}() got an unexpected keyword argument {unknown[0]!r}")
    if pattern is None:
        return {**DEFAULTS, **keywords}
    if not isinstance(pattern, Pattern):
        raise ValueError(
            f"{where}: pattern must be a causalattn.masks.Pattern, got {type(pattern).__name__}"
        )
    given = [n for n, v in keywords.items() if v is not _FIELDS[n].default]
    if given:
        raise ValueError(
            f"{where}: give either pattern= or the pattern keywords, not both (got "
            f"{', '.join(given)})"
        )
    if not placement and (pattern.q_start is not None or pattern.k_start):
        raise ValueError(
            f"{where}: pattern is placed (q_start={pattern.q_start}, k_start="
            f"{pattern.k_start}); {where} takes an unplaced one (placed problems run through "
            "causalattn.engines.run)"
        )
    return {n: getattr(pattern, n) for n in names}


def takes_pattern(fn):
    """Give ``fn`` the pattern keywords in its signature: ``fn`` declares ``pattern=None``
    and ``**keywords`` (where the calls' pattern keywords arrive; it reads them with
    :meth:`Pattern.from_kwargs` or :func:`keywords_of`); its ``inspect.signature`` then shows
    ``pattern`` followed by :data:`PATTERN_KEYWORDS` with Pattern's defaults, in place of
    ``**keywords`` (and in its annotations); a function that takes other keywords too
    declares ``**kwargs`` instead, which stays last. Only the signature is set: a call
    costs nothing more."""
    sig = inspect.signature(fn)
    # **keywords holds only the pattern keywords; a **kwargs of other keywords too (kept)
    params = [p for p in sig.parameters.values() if p.name != "keywords"]
    if len(params) == len(sig.parameters) and "kwargs" not in sig.parameters:
        raise TypeError(f"takes_pattern: {fn.__name__} needs pattern=None and **keywords")
    if "pattern" not in sig.parameters:
        raise TypeError(f"takes_pattern: {fn.__name__} needs pattern=None and **keywords")
    at = [p.name for p in params].index("pattern") + 1
    kw = [
        inspect.Parameter(
            n, inspect.Parameter.KEYWORD_ONLY, default=DEFAULTS[n], annotation=_FIELDS[n].type
        )
        for n in PATTERN_KEYWORDS
    ]
    fn.__signature__ = sig.replace(parameters=params[:at] + kw + params[at:])
    ann = {n: a for n, a in fn.__annotations__.items() if n != "keywords"}
    fn.__annotations__ = {**ann, **{p.name: p.annotation for p in kw}}
    return fn


def create_block_mask(
    mask_mod, B, H, Q_LEN: int, KV_LEN: int, device=None, BLOCK_SIZE=128, _compile=False
):
    """FlexAttention's ``create_block_mask``, same signature and indices, made from the kept
    block table of ``mask_mod`` (:func:`causalattn.masks_table.create_block_mask`): a
    ``BlockMask`` for ``flex_attention``, and for causalattn as
    ``pattern=Pattern.from_block_mask(bm)``."""
    from . import masks_table

    return masks_table.create_block_mask(
        mask_mod, B, H, Q_LEN, KV_LEN, device=device, BLOCK_SIZE=BLOCK_SIZE, _compile=_compile
    )


def alibi_slopes(n_heads: int) -> np.ndarray:
    """ALiBi's fixed slopes (H,): for H a power of two the geometric sequence 2^(-8h/H),
    h = 1..H; otherwise those of the next lower power of two, then every other slope of the
    next higher one (as the ALiBi paper and BLOOM do)."""
    n = _positive_int("n_heads", n_heads)

    def powers(m):
        return [2.0 ** (-8.0 * (h + 1) / m) for h in range(m)]

    low = 1 << (n.bit_length() - 1)
    slopes = powers(low) + powers(2 * low)[0::2][: n - low]
    return np.asarray(slopes)  # Python floats: float64


# ---- the seeds' building blocks, on the one definition ----------------------------------


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
    (see :mod:`causalattn.matrix_form`), so a finite fill changes no weight.
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
    if window is None and chunk is None:  # closed form, O(B)
        readable = L * (L + 1) // 2
        return {"readable": readable, "future": L * L - readable, "padding": T * T - L * L}
    # the rules' intervals; real rows' own (i < L) never pass L, and padding rows count 0
    lo, hi = Pattern(window=window, chunk=chunk).row_ranges(T, T)
    real = np.arange(T)[None, :] < L[:, None]  # query rows of real tokens
    width = np.where(real, hi - lo, 0)
    readable = width.sum(axis=1)
    i = np.arange(T)[None, :]
    future = np.where(real, L[:, None] - 1 - i, 0).sum(axis=1)  # keys j > i, j < L
    out = {"readable": readable, "future": future}
    out["window" if window is not None else "chunk"] = L * L - readable - future
    out["padding"] = T * T - L * L
    return out
