"""The Trace of one captured layer of a Hugging Face model: small to keep, exact to read.

A :class:`CapturedTrace` keeps what is O(T·d) — Q, K, V, H, O and W_O, in float32 — and
computes the T×T stages (S, [S_cap, E,] M, Z, A, and C while it stays under
``matrix_form.C_LIMIT_BYTES``) in float64 by :func:`causalattn.matrix_form.stages`, the one
float64 reference, from Q, K, V and the pattern the layer was handed; they are returned as
float32. The traces of one capture share a :class:`_StageCache` that holds the stages of the
one layer read last, so reading S, M, Z, A of a layer (as the audit does) computes them once
and at most one layer's are ever held. ``allowed`` and ``reasons`` (the declared pattern's
dense form) are built on each read.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache, partial

import numpy as np

from .. import masks, matrix_form
from .._trace import Trace
from ..matrix_form import C_LIMIT_BYTES

__all__ = ["CapturedTrace", "token_strings"]


@dataclass(frozen=True)
class _Record:
    """One recorded layer: what its attention was handed and gave, over all its calls."""

    layer: int
    Q: np.ndarray  # (B, H, T, d_k) float32
    K: np.ndarray  # (B, H_kv, T, d_k)
    V: np.ndarray  # (B, H_kv, T, d_v)
    H: np.ndarray  # (B, H, T, d_v): the engine's output
    received: masks.Pattern  # what the layer's attention was handed
    declared: masks.Pattern  # what the model's config says the layer should apply
    scale: float
    O: np.ndarray | None = None  # (B, T, d_model), bias taken off
    W_o: np.ndarray | None = None  # (H·d_v, d_model)
    ids: np.ndarray | None = None  # (B, T) token ids
    generated: int = 0  # the last `generated` positions were generated, one call each

    def expand(self, a: np.ndarray) -> np.ndarray:
        g = self.Q.shape[1] // a.shape[1]
        return a if g == 1 else np.repeat(a, g, axis=1)  # HF's repeat_kv: head h reads h // g


def _pattern_rows(p: masks.Pattern, b: slice) -> masks.Pattern:
    """The pattern restricted to batch rows b (per-row fields sliced, the rest kept)."""
    kw = {}
    for name in ("lengths", "prefix_lengths", "key_padding_mask"):
        v = getattr(p, name)
        if v is not None:
            kw[name] = v[b]
    if p.mask is not None and p.mask.shape[0] > 1:
        kw["mask"] = p.mask[b]
    if p.alibi_slopes is not None and p.alibi_slopes.ndim == 2:
        kw["alibi_slopes"] = p.alibi_slopes[b]
    if p.bias is not None and p.bias.ndim == 4 and p.bias.shape[0] > 1:
        kw["bias"] = p.bias[b]
    return replace(p, **kw) if kw else p


def _pattern_heads(p: masks.Pattern, h: slice) -> masks.Pattern:
    kw = {}
    if p.mask is not None and p.mask.ndim == 4 and p.mask.shape[1] > 1:
        kw["mask"] = p.mask[:, h]
    if p.sinks is not None:
        kw["sinks"] = p.sinks[h]
    if p.alibi_slopes is not None:
        kw["alibi_slopes"] = p.alibi_slopes[..., h]
    if p.rel_bias is not None:
        kw["rel_bias"] = p.rel_bias[h]
    if p.bias is not None and p.bias.ndim >= 3 and p.bias.shape[-3] > 1:  # (.., H, T_q, T_k)
        kw["bias"] = p.bias[..., h, :, :]
    return replace(p, **kw) if kw else p


class _StageCache:
    """The T×T stages (float32) of the one record read last; one per capture."""

    def __init__(self):
        self.rec: _Record | None = None
        self.stages: dict[str, np.ndarray] = {}

    def get(self, rec: _Record, compute) -> dict[str, np.ndarray]:
        if self.rec is not rec:
            self.rec, self.stages = None, {}  # drop the previous layer's before computing these
            self.stages = {k: v.astype(np.float32) for k, v in compute().items() if k != "H"}
            self.rec = rec
        return self.stages


class CapturedTrace(Trace):
    """A :class:`Trace` of one layer of a Hugging Face model (see the module docstring).

    Extra attributes: ``layer`` (its index), ``pattern`` (the pattern the config declares,
    whose dense form is ``allowed``), ``received`` (the pattern the layer was handed),
    ``batch_tokens`` (token strings per sequence), ``ids`` (the token ids, ``(T,)``, or
    ``(B, T)`` for a batch) and ``generated`` (how many of the last positions were generated
    by ``capture(..., generate=N)``; 0 otherwise).
    """

    def __init__(self, rec: _Record, tokens: list[list[str]] | None, cache: _StageCache):
        B, H, T, _ = rec.Q.shape
        self._rec, self._cache, self._squeeze = rec, cache, B == 1
        names = ["Q", "K", "V", "S"]
        names += ["S_cap"] * (rec.received.softcap is not None)
        names += ["E"] * rec.received.has_additive
        names += ["M", "Z", "A", "H"]
        if B * H * T * T * rec.V.shape[3] * 8 <= C_LIMIT_BYTES:
            names.append("C")
        if rec.O is not None:
            names += ["W_o", "O"]
        super().__init__(
            {n: partial(self._stage, n) for n in names},
            allowed=partial(self._dense, "allowed"),
            reasons=partial(self._dense, "reasons"),
            scale=rec.scale,
            n_heads=H,
            tokens=tokens[0] if tokens is not None and self._squeeze else None,
            pattern=rec.declared,
        )
        self.layer = rec.layer
        self.received = rec.received
        self.batch_tokens = tokens
        self.generated = rec.generated
        self.ids = None if rec.ids is None else (rec.ids[0] if self._squeeze else rec.ids)

    def _stage(self, name: str) -> np.ndarray:
        r = self._rec
        if name in ("Q", "H", "O", "W_o"):
            out = getattr(r, name)
        elif name in ("K", "V"):
            out = r.expand(getattr(r, name))
        else:
            st = self._cache.get(r, self._stages)
            if name == "C":
                out = st["A"][..., None] * r.expand(r.V)[..., None, :, :]
            else:
                out = st[name]
                if name in ("M", "E"):
                    out = np.broadcast_to(out, st["S"].shape)
        return out[0] if self._squeeze and name != "W_o" else out

    def _dense(self, kind: str) -> np.ndarray:
        """The declared pattern's ``allowed`` or ``reasons``, ``(1|H, T, T)`` (``(B|1, 1|H,
        T, T)`` for a batch)."""
        B, H, T, _ = self._rec.Q.shape
        a = getattr(self.pattern, kind)(B, H, T, T)
        return a[0] if self._squeeze else a

    def _stages(self) -> dict[str, np.ndarray]:
        """This layer's S, [S_cap, E,] M, Z, A, H in float64, computed afresh from Q, K, V and
        the received pattern by the reference (M as its compact ``(B|1, H|1, T, T)``)."""
        r = self._rec
        Q, K, V = (np.asarray(a, np.float64) for a in (r.Q, r.expand(r.K), r.expand(r.V)))
        st, allowed, _ = matrix_form.stages(Q, K, V, r.received, scale=r.scale, with_C=False)
        st["M"] = masks.additive(allowed)
        return st

    def __repr__(self) -> str:
        return f"CapturedTrace(layer {self.layer}, {super().__repr__()})"

    def select(self, *index: int):
        """``select(h)`` on one sequence, ``select(b)`` or ``select(b, h)`` on a batch: a plain
        :class:`Trace` of that slice, computed for that slice only."""
        B = self._rec.Q.shape[0]
        if B == 1:
            index = (0, *index)
        if not 1 <= len(index) <= 2:
            raise ValueError(
                f"select: give (b,) or (b, h) for a batch, (h,) for one sequence; got {index}"
            )
        b = index[0]
        r = self._rec
        bs, hs = slice(b, b + 1), slice(None)
        kw = {"Q": r.Q[bs], "K": r.K[bs], "V": r.V[bs], "H": r.H[bs]}
        kw["O"] = None if r.O is None else r.O[bs]
        kw["ids"] = None if r.ids is None else r.ids[bs]
        if len(index) == 2:
            h = index[1]
            g = r.Q.shape[1] // r.K.shape[1]
            hs, kvs = slice(h, h + 1), slice(h // g, h // g + 1)
            kw.update(
                Q=r.Q[bs, hs], K=r.K[bs, kvs], V=r.V[bs, kvs], H=r.H[bs, hs], O=None, W_o=None
            )
        sub = replace(
            r,
            **kw,
            received=_pattern_heads(_pattern_rows(r.received, bs), hs),
            declared=_pattern_heads(_pattern_rows(r.declared, bs), hs),
        )
        tokens = None if self.batch_tokens is None else [self.batch_tokens[b]]
        tr = CapturedTrace(sub, tokens, _StageCache())
        if len(index) == 2:  # one head: no head axis
            arrays = {n: tr[n][0] for n in tr.names}
            return Trace(
                arrays,
                allowed=tr.allowed[0],
                scale=tr.scale,
                tokens=tr.tokens,
                pattern=tr.pattern,
                reasons=tr.reasons[0],
            )
        return tr


# ---- readable tokens -------------------------------------------------------------------


@cache
def _byte_level():
    """tokenizers' own ByteLevel decoder (what a byte-level tokenizer's decoder is) and its
    256 printable stand-ins for the bytes (GPT-2's 'Ġ' for a space)."""
    from tokenizers import decoders, pre_tokenizers

    return decoders.ByteLevel(), frozenset(pre_tokenizers.ByteLevel.alphabet())


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(
        tokenizer, "_tokenizer", None
    )
    dec = getattr(backend, "decoder", None)
    return "ByteLevel" in repr(dec) if dec is not None else False


def token_strings(tokenizer, ids) -> list[str]:
    """Each id as readable text: byte-level pieces decoded ('Ġ' -> ' ', 'Ċ' -> '\\n'; a
    piece holding part of a UTF-8 character shows U+FFFD), SentencePiece's '▁' as a space.
    Without a tokenizer, the ids themselves."""
    ids = [int(i) for i in ids]
    if tokenizer is None:
        return [str(i) for i in ids]
    pieces = tokenizer.convert_ids_to_tokens(ids)
    decoder, alphabet = _byte_level() if _is_byte_level(tokenizer) else (None, frozenset())
    out = []
    for p, i in zip(pieces, ids):
        if p is None:
            out.append(f"<{i}>")
        elif decoder is not None and all(ch in alphabet for ch in p):
            out.append(decoder.decode([p]))  # its bytes as UTF-8, U+FFFD where cut
        else:
            out.append(p.replace("▁", " "))
    return out
