"""The attention function Hugging Face calls: ``attn_implementation="causalattn"``.

A leaf of the integration: capture, ablate and patch (:mod:`.hf_taps`) call into it, and
:mod:`causalattn.integrations.transformers` is the public face of all of them.

    from causalattn.integrations.transformers import register
    register()                       # once per process; engine="auto" by default
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="causalattn")
    model.set_attn_implementation("causalattn")   # or switch an existing model

HF calls the attention function with q ``(B, H, T_q, d)`` and k, v ``(B, H_kv, T_k, d)``
(its KV cache already applied), the mask from the registered mask function (None for a
plain causal problem, else HF's boolean ``sdpa_mask``, True = may read) and keywords
(``sliding_window``, ``softcap``, ``s_aux`` sinks, ``dropout``). :mod:`.hf_pattern` turns
them into one :class:`causalattn.masks.Pattern` — causal, window, chunk, packed documents,
key padding, or HF's dense mask itself where nothing structured reproduces it exactly —
and the engines run it. Additive score biases (the finite entries of a float mask,
``position_bias``) run as the pattern's ``bias``; a model's ``alibi`` tensor and an
``attn_bias`` keyword are refused with a ValueError. A query row with no readable key
(left padding) gives zeros, never NaN.
"""

from __future__ import annotations

import inspect

import torch

from .. import masks
from ..engines import attention
from .hf_pattern import pattern_from_hf

__all__ = ["register", "attention_forward", "mask_function", "engine_kwargs", "NAME"]

NAME = "causalattn"


def mask_function(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    allow_is_causal_skip: bool = True,
    **kwargs,
):
    """HF's boolean ``sdpa_mask`` (same signature): None when plain causal, else ``(B, 1, T_q,
    T_k)``."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function or causal_mask_function,
        attention_mask=attention_mask,
        allow_is_causal_skip=allow_is_causal_skip,
        **kwargs,
    )


def engine_kwargs(pat: masks.Pattern) -> dict:
    """The pattern as :func:`causalattn.attention` keywords (only the fields that are set)."""
    kw = {"causal": pat.causal}
    for name in masks.PATTERN_KEYWORDS[1:]:  # causal first, always given
        v = getattr(pat, name)
        if v is not None:
            kw[name] = v
    return kw


def _accepted() -> set[str]:
    return set(inspect.signature(attention).parameters)


@masks.takes_pattern
def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    pattern: masks.Pattern | None = None,
    engine: str = "auto",
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF's attention-function signature on :func:`causalattn.attention`.

    query ``(B, H, T_q, d_k)``, key ``(B, H_kv, T_k, d_k)``, value ``(B, H_kv, T_k, d_v)``
    -> (``(B, T_q, H, d_v)``, None): attention weights are never materialized.
    ``dropout`` (HF passes the config's attention dropout in ``train()`` mode, 0 in
    ``eval()``) is causalattn's ``dropout_p``, drawn from torch's global RNG. ``pattern``
    or the pattern keywords add to what HF's arguments say (``softcap`` is HF's own
    keyword too); one that both set is refused by name. The other keywords are HF's.
    """
    own = {n: kwargs.pop(n) for n in masks.PATTERN_KEYWORDS if n in kwargs and n != "softcap"}
    extra = masks.keywords_of(pattern, own, "causalattn attention")
    if torch.compiler.is_compiling():  # no look at the mask's data while tracing
        kw, n = _traced_kwargs(module, query, key, attention_mask, **kwargs)
    else:
        pat, n = pattern_from_hf(module, query, key, attention_mask, **kwargs)
        kw = engine_kwargs(pat)
        missing = sorted(set(kw) - _accepted())
        if missing:
            raise ValueError(
                f"causalattn attention: this causalattn.attention does not take {missing} yet "
                f"(the layer's pattern: {pat.describe()}); use attn_implementation='eager'"
            )
    kw = _joined(kw, extra)
    if dropout:
        kw["dropout_p"] = float(dropout)
    H_out = attention(query, key[:, :, :n], value[:, :, :n], scale=scaling, engine=engine, **kw)
    return H_out.transpose(1, 2).contiguous(), None


def _joined(kw: dict, extra: dict) -> dict:
    """HF's pattern keywords with the call's own (``extra``: every keyword) added."""
    both = [
        n for n, v in extra.items() if n != "causal" and v is not None and kw.get(n) is not None
    ]
    if both:
        raise ValueError(
            f"causalattn attention: {', '.join(both)} given by the call and by HF's arguments "
            "(the model's own pattern); give it once"
        )
    out = {**kw, **{n: v for n, v in extra.items() if v is not None and n != "causal"}}
    if extra["causal"] is False:
        out["causal"] = False
    return out


def _traced_kwargs(module, query, key, attention_mask, **kwargs) -> tuple[dict, int]:
    """The attention keywords while torch.compile / torch.export trace: HF's boolean mask
    goes in whole as ``mask`` (the operator reads it; no structure is searched, which would
    read data), else the plain causal problem :func:`pattern_from_hf` gives for no mask."""
    if attention_mask is None:
        pat, n = pattern_from_hf(module, query, key, None, **kwargs)
        return engine_kwargs(pat), n
    if attention_mask.dtype != torch.bool:
        raise ValueError(
            "causalattn attention: under torch.compile/torch.export the attention_mask must be "
            f"boolean (the 'causalattn' mask function gives one), got {attention_mask.dtype}"
        )
    pat, n = pattern_from_hf(module, query, key, None, **kwargs)  # keywords and modifiers
    kw = {"causal": False, "mask": attention_mask}
    kw.update({k: v for k, v in engine_kwargs(pat).items() if k in ("softcap", "sinks", "bias")})
    return kw, key.shape[2]


def register(engine: str = "auto", name: str = NAME) -> str:
    """Register ``name`` with transformers' AttentionInterface and AttentionMaskInterface.

    ``engine`` is the causalattn engine the function runs ("auto", "tiled", "sdpa", ...).
    Returns the name to pass as ``attn_implementation``.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as exc:  # the optional extra
        raise ImportError(
            "causalattn.integrations.transformers needs `pip install causalattn[hf]`"
        ) from exc

    @masks.takes_pattern
    def forward(
        module,
        query,
        key,
        value,
        attention_mask,
        scaling=None,
        dropout=0.0,
        *,
        pattern=None,
        **kwargs,
    ):
        return attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            scaling,
            dropout,
            pattern=pattern,
            engine=engine,
            **kwargs,
        )

    forward.__name__ = f"{name}_attention_forward"
    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, mask_function)
    return name
