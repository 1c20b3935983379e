"""Hugging Face transformers on causalattn: the attention function, and what it can see.

    from causalattn.integrations.transformers import register, capture, ablate, patch
    register()                                   # attn_implementation="causalattn"
    traces = capture(model, ids)                 # the seed's stages, layer by layer
    traces = capture(model, ids, generate=8)     # ... and those of 8 greedy tokens
    with ablate(model, heads=[(1, 3)], how="zero"):   # 0-based (layer, head)
        loss = model(ids, labels=ids).loss
    with patch(model, source_ids, heads=[(1, 3)]):    # head 3 of layer 1 as on source_ids
        logits = model(ids).logits

One module per concern, none importing this one: :mod:`.hf_attention` (the registered
function and mask function), :mod:`.hf_pattern` (HF's mask -> a Pattern), :mod:`.hf_taps`
(the taps on the function that capture, ablate and patch are), :mod:`.hf_capture` and
:mod:`.hf_trace` (capture and its Traces), :mod:`.hf_edit` (ablate, patch).
"""

from __future__ import annotations

from .hf_attention import NAME, attention_forward, engine_kwargs, mask_function, register
from .hf_attention import _accepted as _accepted  # the tests ask which keywords it takes
from .hf_capture import CapturedTrace, capture
from .hf_edit import ablate, patch

__all__ = [
    "register",
    "attention_forward",
    "mask_function",
    "engine_kwargs",
    "capture",
    "CapturedTrace",
    "ablate",
    "patch",
    "NAME",
]
