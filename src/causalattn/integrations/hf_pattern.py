"""What Hugging Face hands an attention function -> one :class:`causalattn.masks.Pattern`.

HF calls the attention function with q ``(B, H, T_q, d)``, k ``(B, H_kv, T_k, d)`` and the
mask from the registered mask function: None for a plain causal problem (or one whose
window does not bite yet), else a boolean ``(B, 1, T_q, T_k)`` mask, True = may read
(HF's ``sdpa_mask``: causal, sliding window, chunks, packed documents and padding all
folded in), plus keywords: ``sliding_window``, ``softcap`` (Gemma 2), ``s_aux`` (gpt-oss's
sinks), ``is_causal``. The dense mask is the truth (HF's eager path reads only it), so we
look for the structured pattern that reproduces it exactly — causal, the layer's window or
chunk, packed documents, key padding — because the engines skip whole blocks of a
structured pattern; where none does, the dense mask itself becomes the pattern's ``mask``.
Nothing is guessed: every structured candidate is checked against the mask, bit for bit.
Additive score biases come in as the pattern's ``bias``: a ``position_bias`` keyword (T5's
relative bias) and the finite non-zero entries of an additive float mask (blocked where it
is -inf or below finfo.min / 2, read elsewhere with that bias added).
"""

from __future__ import annotations

import weakref

import torch

from .. import masks
from .._internals.torch import version as _version
from ..masks import shape_str as _shape_str

__all__ = ["pattern_from_hf", "SUPPORTED_KWARGS"]

# keywords of HF's attention-function call that carry part of the pattern
SUPPORTED_KWARGS = ("sliding_window", "softcap", "s_aux", "is_causal", "position_bias")
BIAS_KWARGS = ("position_bias",)  # additive score biases: the pattern's bias
REFUSED_KWARGS = {  # score terms whose layout causalattn does not read: refused by name
    "alibi": "a model's own ALiBi tensor; causalattn takes the slopes",
    "attn_bias": "an additive score bias of a layout causalattn does not read",
}


def _boolean(mask: torch.Tensor, B: int, H: int, T_q: int, T_k: int):
    """HF's mask as (booleans ``(B|1, 1|H, T_q, T_k)``, True = may read; the additive bias
    of a float mask at its readable cells, or None); checks shape and kind."""
    if (
        mask.dim() != 4
        or mask.shape[0] not in (1, B)
        or mask.shape[1] not in (1, H)
        or tuple(mask.shape[2:]) != (T_q, T_k)
    ):
        raise ValueError(
            f"causalattn attention: attention_mask must be (B, 1, T_q, T_k) = ({B}, 1, {T_q}, "
            f"{T_k}), got {_shape_str(mask)}"
        )
    if mask.dtype == torch.bool:
        return mask, None
    if not mask.dtype.is_floating_point:
        raise ValueError(
            f"causalattn attention: attention_mask has dtype {mask.dtype}; expected bool or float"
        )
    # HF's eager masks: 0 where allowed, finfo.min (or -inf) where blocked; anything else
    # finite at a readable cell is an additive bias
    allowed = mask > torch.finfo(mask.dtype).min / 2
    if bool(torch.isnan(mask).any()):
        raise ValueError("causalattn attention: attention_mask holds NaN")
    extra = mask.masked_fill(~allowed, 0.0)
    return allowed, (extra if bool((extra != 0).any()) else None)


def _documents(allowed: torch.Tensor) -> list[int] | None:
    """cu_seqlens of packed documents read off a (1, 1, T, T) mask: a row that cannot read
    the key just before it while it reads itself starts a new document."""
    T = allowed.shape[-1]
    if T < 2:
        return None
    a = allowed[0, 0]
    idx = torch.arange(1, T, device=a.device)
    starts = (a[idx, idx] & ~a[idx, idx - 1]).nonzero().flatten() + 1
    if starts.numel() == 0:
        return None
    return [0, *starts.tolist(), T]


def _fits(pat: masks.Pattern, allowed: torch.Tensor, B: int, H: int, T_q: int, n: int) -> bool:
    """Whether ``pat`` over the first n keys gives ``allowed`` exactly (and no later key is
    read)."""
    try:
        got = pat.allowed(B, H, T_q, n, like=allowed)
    except ValueError:
        return False
    a = allowed[..., :n]
    if got.shape[0] != a.shape[0] and a.shape[0] == 1:
        a = a.expand(got.shape[0], *a.shape[1:])
    return bool(torch.equal(got.expand_as(a), a)) and not bool(allowed[..., n:].any())


def _structure(allowed, B, H, T_q, T_k, causal, window, chunk) -> tuple[dict, int]:
    """The mask fields of the pattern (as keywords) and the number of keys n to keep."""
    if allowed.shape[1] == 1:
        read = allowed.any(dim=2)[:, 0]  # (B|1, T_k): keys some query reads
        last = int(read.any(0).nonzero().max()) + 1 if bool(read.any()) else 0
        for n in dict.fromkeys((T_k, last)):  # all keys, or a StaticCache's filled ones
            if n < T_q:
                continue
            key_padding = read[:, :n].expand(B, n)
            kw = {"causal": causal, "window": window, "chunk": chunk}
            if not bool(key_padding.all()):
                kw["key_padding_mask"] = key_padding.contiguous()
            if _fits(masks.Pattern(**kw), allowed, B, H, T_q, n):
                return kw, n
        if B == 1 and T_q == T_k and bool(read.all()):
            cu = _documents(allowed)
            if cu is not None:
                kw = {"causal": causal, "window": window, "chunk": chunk, "cu_seqlens": cu}
                if _fits(masks.Pattern(**kw), allowed, B, H, T_q, T_k):
                    return kw, T_k
    return {"causal": False, "mask": allowed}, T_k  # the general fallback: the mask itself


class _Memo:
    """The last few masks' structures: every layer of a kind gets the same mask tensor."""

    def __init__(self, size: int = 4):
        self.size = size
        self.items: list[tuple[tuple, weakref.ref, tuple[dict, int]]] = []

    def get(self, mask: torch.Tensor, key: tuple):
        for k, ref, value in self.items:
            if k == key and ref() is mask:
                return value
        return None

    def put(self, mask: torch.Tensor, key: tuple, value) -> None:
        self.items = [(key, weakref.ref(mask), value), *self.items[: self.size - 1]]


_MEMO = _Memo()


def _chunk_of(module) -> int | None:
    """Llama 4's chunked layers: the config's ``attention_chunk_size`` where the layer's type
    is "chunked_attention" (verified on the mask all the same)."""
    cfg = getattr(module, "config", None)
    c = getattr(cfg, "attention_chunk_size", None)
    types, layer = getattr(cfg, "layer_types", None), getattr(module, "layer_idx", None)
    if types is not None and layer is not None and layer < len(types):
        if types[layer] != "chunked_attention":
            return None
    return int(c) if isinstance(c, int) and c > 0 else None


def pattern_from_hf(
    module: torch.nn.Module | None,
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[masks.Pattern, int]:
    """(pattern, n): the pattern of this attention call, over the first n keys.

    query ``(B, H, T_q, d)``, key ``(B, H_kv, T_k, d)``, attention_mask None or
    ``(B|1, 1|H, T_q, T_k)`` (bool, or HF's additive 0 / finfo.min). Keys after the first
    n are read by no query (a StaticCache's empty slots) and are dropped by the caller.
    """
    for name, what in REFUSED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise ValueError(
                f"causalattn attention: {name!r} ({what}) is not supported; "
                "use attn_implementation='eager'"
            )
    B, H, T_q, _ = query.shape
    T_k = key.shape[2]
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    window = kwargs.get("sliding_window")
    window = int(window) if window is not None else None
    if window is not None and window < 1:
        raise ValueError(f"causalattn attention: sliding_window must be >= 1, got {window}")
    chunk = _chunk_of(module)
    modifiers = {"softcap": kwargs.get("softcap") or None, "sinks": kwargs.get("s_aux")}
    if modifiers["sinks"] is not None and tuple(modifiers["sinks"].shape) != (H,):
        raise ValueError(
            f"causalattn attention: s_aux (sinks) must be one logit per head, "
            f"(H,) = ({H},); got {_shape_str(modifiers['sinks'])}"
        )
    bias = _bias_of(kwargs, B, H, T_q, T_k)
    if attention_mask is None:
        n = T_k
        if causal and 1 < T_q < T_k:
            # HF leaves the mask out here only for a prefill into an empty StaticCache: the
            # queries are the first T_q positions, and the slots after them hold nothing yet.
            n = T_q
        # a window HF did not fold into a mask does not bite yet (T_k < window); keep it
        # declared all the same, so the trace names the layer's real pattern
        modifiers["bias"] = _keys(bias, n)
        return masks.Pattern(causal=causal, window=window if causal else None, **modifiers), n
    allowed, extra = _boolean(attention_mask.to(query.device), B, H, T_q, T_k)
    if extra is not None:
        bias = extra.to(query.dtype) if bias is None else bias + extra
    key_ = (id(allowed), _version(allowed), tuple(allowed.shape), B, H, T_q, causal, window, chunk)
    found = _MEMO.get(allowed, key_)
    if found is None:
        found = None
        for w, c in dict.fromkeys(((window, chunk), (window, None), (None, chunk), (None, None))):
            kw, n = _structure(allowed, B, H, T_q, T_k, causal, w, c)
            if "mask" not in kw:
                found = (kw, n)
                break
        if found is None:
            found = ({"causal": False, "mask": allowed}, T_k)
        _MEMO.put(allowed, key_, found)
    kw, n = found
    return masks.Pattern(**kw, **modifiers, bias=_keys(bias, n)), n


def _bias_of(kwargs, B: int, H: int, T_q: int, T_k: int):
    """The additive bias keywords (position_bias), summed; None without one."""
    total = None
    for name in BIAS_KWARGS:
        b = kwargs.get(name)
        if b is None:
            continue
        if not isinstance(b, torch.Tensor) or not b.dtype.is_floating_point or b.dim() > 4:
            raise ValueError(
                f"causalattn attention: {name} must be a float tensor broadcastable to (B, H, "
                f"T_q, T_k) = ({B}, {H}, {T_q}, {T_k}), got {getattr(b, 'shape', type(b))}"
            )
        total = b if total is None else total + b
    return total


def _keys(bias, n: int):
    """A bias over the first n keys (a StaticCache's unfilled slots dropped; a key axis of
    1 or n is kept as it is)."""
    return None if bias is None else bias[..., :n]
