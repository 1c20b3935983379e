"""Hugging Face transformers on causalattn's engines: ``attn_implementation="causalattn"``.

    from causalattn.integrations.transformers import register
    register()                       # once per process; engine="auto" by default
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="causalattn")
    model.set_attn_implementation("causalattn")   # or switch an existing model

HF calls the attention function with q ``(B, H, T_q, d)`` and k, v ``(B, H_kv, T_k, d)``
(its KV cache already applied) and the mask from the registered mask function: None for
a plain causal problem, else a boolean ``(B, 1, T_q, T_k)`` mask, True = may read
(HF's ``sdpa_mask``). The function turns that mask back into the engines' arguments —
``causal`` plus a ``(B, T_k)`` key-padding mask, queries bottom-right aligned — checks
that this reproduces the mask exactly, and refuses masks it cannot express (sliding
windows, packed sequences, additive biases) with a ValueError rather than guess.
A query row with no readable key (a left-padding position) gives zeros, never NaN.
"""

from __future__ import annotations

import torch

from ..engines import attention

__all__ = ["register", "attention_forward", "mask_function", "NAME"]

NAME = "causalattn"


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


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
    """HF's boolean ``sdpa_mask`` (same signature): None when plain causal, else ``(B, 1, T_q, T_k)``."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    return sdpa_mask(
        batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
        kv_offset=kv_offset, mask_function=mask_function or causal_mask_function,
        attention_mask=attention_mask, allow_is_causal_skip=allow_is_causal_skip, **kwargs,
    )


def _allowed(mask: torch.Tensor, B: int, H: int, T_q: int, T_k: int) -> torch.Tensor:
    """HF's mask as booleans ``(B, T_q, T_k)``, True = may read; checks shape and kind."""
    if mask.dim() != 4 or mask.shape[0] not in (1, B) or mask.shape[1] not in (1, H) or tuple(mask.shape[2:]) != (T_q, T_k):
        raise ValueError(
            f"causalattn attention: attention_mask must be (B, 1, T_q, T_k) = ({B}, 1, {T_q}, {T_k}), "
            f"got {_shape(mask)}"
        )
    if mask.dtype != torch.bool:  # an additive mask: 0 where allowed, a huge negative where blocked
        if not mask.dtype.is_floating_point:
            raise ValueError(f"causalattn attention: attention_mask has dtype {mask.dtype}; expected bool or float")
        allowed = mask == 0
        blocked = mask <= torch.finfo(mask.dtype).min / 2
        if not bool((allowed | blocked).all()):
            raise ValueError(
                "causalattn attention: attention_mask carries an additive bias (values other than 0 "
                "and -inf/finfo.min); the engines take boolean masks only"
            )
        mask = allowed
    if mask.shape[1] > 1:
        if not bool((mask == mask[:, :1]).all()):
            raise ValueError("causalattn attention: per-head masks are not supported; heads must share one mask")
    return mask[:, 0].expand(B, T_q, T_k)


def _engine_masks(allowed: torch.Tensor, causal: bool, T_q: int):
    """Recover (T_k kept, key_padding_mask or None) with ``causal & kpm == allowed``, or None.

    First bottom-right alignment over all T_k keys (DynamicCache, any padding); then, for a
    StaticCache whose trailing slots no query reads yet, the same over the keys up to the
    last one any query reads.
    """
    T_k = allowed.shape[-1]
    read = allowed.any(dim=0).any(dim=0)  # (T_k,)
    last = int(read.nonzero().max()) + 1 if bool(read.any()) else 0
    for n in dict.fromkeys((T_k, last)):
        if n < T_q:
            continue
        a = allowed[..., :n]
        kpm = a[:, -1, :] if causal else a[:, 0, :]  # the last query row reads every real key
        want = kpm[:, None, :]
        if causal:
            i = torch.arange(T_q, device=a.device)[:, None] + (n - T_q)
            want = want & (torch.arange(n, device=a.device)[None, :] <= i)
        if torch.equal(want.expand_as(a), a) and not bool(allowed[..., n:].any()):
            return n, (None if bool(kpm.all()) else kpm.contiguous())
    return None


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    engine: str = "auto",
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF's attention-function signature on :func:`causalattn.attention`.

    query ``(B, H, T_q, d_k)``, key ``(B, H_kv, T_k, d_k)``, value ``(B, H_kv, T_k, d_v)``
    -> (``(B, T_q, H, d_v)``, None): attention weights are never materialized.
    """
    if dropout:
        raise ValueError(
            f"causalattn attention: attention dropout ({dropout}) is not implemented by the engines; "
            "set the model's attention dropout to 0 or call model.eval()"
        )
    for name in ("softcap", "s_aux", "sinks", "position_bias"):
        if kwargs.get(name) is not None:
            raise ValueError(f"causalattn attention: {name!r} is not supported; use attn_implementation='eager'")
    B, H, T_q, _ = query.shape
    T_k = key.shape[2]
    is_causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    kpm = None
    if attention_mask is None:
        if causal and 1 < T_q < T_k:
            # HF leaves the mask out here only for a prefill into an empty StaticCache: the
            # queries are the first T_q positions, and the slots after them hold nothing yet.
            key, value = key[:, :, :T_q], value[:, :, :T_q]
    else:
        allowed = _allowed(attention_mask.to(query.device), B, H, T_q, T_k)
        found = _engine_masks(allowed, causal, T_q)
        if found is None:
            raise ValueError(
                f"causalattn attention: the mask {_shape(attention_mask)} is not "
                f"{'causal (bottom-right) ' if causal else ''}plus key padding (a sliding window, "
                "packed sequences or a custom pattern?); use attn_implementation='sdpa' for it"
            )
        n, kpm = found
        key, value = key[:, :, :n], value[:, :, :n]
    H_out = attention(
        query, key, value, causal=causal, key_padding_mask=kpm, scale=scaling, engine=engine
    )
    return H_out.transpose(1, 2).contiguous(), None


def register(engine: str = "auto", name: str = NAME) -> str:
    """Register ``name`` with transformers' AttentionInterface and AttentionMaskInterface.

    ``engine`` is the causalattn engine the function runs ("auto", "tiled", "sdpa", ...).
    Returns the name to pass as ``attn_implementation``.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as exc:  # the optional extra
        raise ImportError("causalattn.integrations.transformers needs `pip install causalattn[hf]`") from exc

    def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        return attention_forward(
            module, query, key, value, attention_mask, scaling, dropout, engine=engine, **kwargs
        )

    forward.__name__ = f"{name}_attention_forward"
    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, mask_function)
    return name
