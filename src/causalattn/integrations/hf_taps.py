"""Taps on the attention function: what capture, ablate and patch do, for every family at once.

Every Hugging Face family that uses transformers' AttentionInterface calls one function for
attention, with the layer's module, q ``(B, H, T_q, d_k)``, k, v ``(B, H_kv, T_k, d)`` and HF's
mask, and hands the result ``(B, T_q, H, d_v)`` — the heads side by side — to the layer's
output projection. A :class:`Tap` sees each such call of the layers it sits on and may change
the result: record it (capture), set one head's part to zero or to its mean (ablate), or to
what a run on another input gave (patch). The heads are the third axis of that result in
every family, so no code is written per architecture.

While a tap is entered, the model runs ``attn_implementation="causalattn-tap"``: causalattn's
own function (:func:`.hf_attention.attention_forward`, in float32 at least) followed by the
taps, in the order they were entered. Each attention module carries, as the attribute
``_causalattn_site``, its layer index (read once, up front, from the module's ``layer_idx``)
and the taps on it. Leaving a tap — normally, by an exception, nested in another — puts the
model back as it was: its attention implementation, its modules' attributes, its hooks.

A family whose attention does not go through the AttentionInterface (transformers keeps its
own code for some, e.g. Falcon: ``is_backend_compatible()`` is False) is refused with a
ValueError: no function of ours would see its heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .hf_attention import attention_forward, mask_function

__all__ = ["TAP_NAME", "Tap", "Call", "attention_sites", "n_heads", "check_heads"]

TAP_NAME = "causalattn-tap"
_SITE = "_causalattn_site"  # the attribute an attention module carries while tapped
PROJECTIONS = ("o_proj", "c_proj", "out_proj", "dense", "wo")  # the output projection's names


@dataclass(frozen=True)
class Call:
    """One call of a layer's attention, as HF made it."""

    layer: int
    module: torch.nn.Module
    query: torch.Tensor  # (B, H, T_q, d_k), as handed (rotary applied)
    key: torch.Tensor  # (B, H_kv, T_k, d_k), the cache's keys included
    value: torch.Tensor  # (B, H_kv, T_k, d_v)
    attention_mask: torch.Tensor | None
    scaling: float | None
    kwargs: dict


class _Site:
    """What an attention module carries while tapped: its layer and the taps on it."""

    def __init__(self, layer: int):
        self.layer = layer
        self.taps: list[Tap] = []


def _tapped_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The registered ``causalattn-tap`` function: the engine's result through the taps."""
    site = module.__dict__.get(_SITE)
    if site is None or not site.taps:
        raise ValueError(
            f"attn_implementation={TAP_NAME!r} runs only inside capture(), ablate() or "
            "patch(); use 'causalattn' otherwise"
        )
    # float32 at least: a bf16/fp16 layer's result is the engine's before its rounding
    # (the engines accumulate in float32 anyway); it is rounded on its way back
    up = torch.promote_types(query.dtype, torch.float32)
    out, _ = attention_forward(
        module,
        query.to(up),
        key.to(up),
        value.to(up),
        attention_mask,
        scaling,
        dropout,
        engine=site.taps[-1].engine,
        **kwargs,
    )
    call = Call(site.layer, module, query, key, value, attention_mask, scaling, kwargs)
    for tap in list(site.taps):
        out = tap.attention(call, out)
    return out.to(query.dtype), None


def _register() -> None:
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as exc:
        raise ImportError("capture, ablate and patch need `pip install causalattn[hf]`") from exc
    AttentionInterface.register(TAP_NAME, _tapped_forward)
    AttentionMaskInterface.register(TAP_NAME, mask_function)


def _text_config(model):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _family(model) -> str:
    return f"{type(model).__name__} ({getattr(model.config, 'model_type', '?')})"


def _refuse_family(model, what: str) -> None:
    """A family HF runs with its own attention code cannot be tapped: say so, up front."""
    if not type(model).is_backend_compatible():
        raise ValueError(
            f"{what}: {_family(model)} keeps its own attention code; transformers does not "
            "route it through the AttentionInterface (is_backend_compatible() is False), so "
            "no registered function sees its heads; use a family that does (GPT-2, Llama, "
            "Mistral, Qwen2, Gemma 2, ...)"
        )


def attention_sites(model, what: str = "capture") -> dict[int, torch.nn.Module]:
    """The model's attention modules by layer index: the modules that carry an integer
    ``layer_idx`` and an output projection (HF's attention modules, in every family)."""
    _refuse_family(model, what)
    sites: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        layer = getattr(module, "layer_idx", None)
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            continue
        if projection(module) is None:  # a decoder layer that only holds its index
            continue
        if int(layer) in sites:
            raise ValueError(
                f"{what}: two attention modules of {_family(model)} claim layer {layer} "
                "(cross-attention?); causalattn taps decoder-only causal LMs"
            )
        sites[int(layer)] = module
    if not sites:
        raise ValueError(
            f"{what}: {_family(model)} has no attention module with a layer_idx; is it a "
            "transformers causal language model?"
        )
    return dict(sorted(sites.items()))


def projection(module) -> torch.nn.Module | None:
    """The attention module's output projection (o_proj, c_proj, ...), or None."""
    for name in PROJECTIONS:
        proj = getattr(module, name, None)
        if isinstance(proj, torch.nn.Module) and hasattr(proj, "weight"):
            return proj
    return None


def n_heads(model) -> int:
    """Query heads per layer, as the config states them."""
    n = getattr(_text_config(model), "num_attention_heads", None)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"{_family(model)}: its config names no num_attention_heads")
    return n


def check_heads(model, heads, what: str) -> dict[int, list[int]]:
    """``heads`` = [(layer, head), ...], 0-based -> {layer: [heads]}; out of range or not
    integer pairs: ValueError naming the entry and the model's ranges."""
    n_layers, H = len(attention_sites(model, what)), n_heads(model)
    if isinstance(heads, (str, bytes)) or not hasattr(heads, "__iter__"):
        raise ValueError(f"{what}: heads must be a list of (layer, head) pairs, got {heads!r}")
    out: dict[int, list[int]] = {}
    for entry in heads:
        pair = tuple(entry) if isinstance(entry, (tuple, list)) else None
        if pair is None or len(pair) != 2 or not all(_is_int(x) for x in pair):
            raise ValueError(
                f"{what}: heads must be (layer, head) pairs of integers (0-based), got {entry!r}"
            )
        layer, head = (int(x) for x in pair)
        if not 0 <= layer < n_layers:
            raise ValueError(
                f"{what}: heads: layer {layer} is out of range; the model has {n_layers} "
                f"layers (0..{n_layers - 1})"
            )
        if not 0 <= head < H:
            raise ValueError(
                f"{what}: heads: head {head} of layer {layer} is out of range; the model has "
                f"{H} heads a layer (0..{H - 1})"
            )
        out.setdefault(layer, []).append(head)
    if not out:
        raise ValueError(f"{what}: heads is empty; give at least one (layer, head) pair")
    return {layer: sorted(set(hs)) for layer, hs in out.items()}


def _is_int(x) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, np.integer))


class Tap:
    """A context that puts itself on the model's attention layers (see the module docstring).

    Subclasses override :meth:`attention` (``out`` ``(B, T_q, H, d_v)`` in, the result the
    layer hands on out) and may register hooks up front in :meth:`hooks`.
    """

    engine = "auto"
    what = "tap"

    def __init__(self, model):
        self.model = model
        self._entered = False

    def attention(self, call: Call, out: torch.Tensor) -> torch.Tensor:
        return out

    def hooks(self, sites: dict[int, torch.nn.Module]) -> list:
        return []

    def __enter__(self):
        if self._entered:
            raise ValueError(f"{self.what}: this context is already entered; make a new one")
        model = self.model
        sites = attention_sites(model, self.what)
        _register()
        old = model.config._attn_implementation
        model.set_attn_implementation(TAP_NAME)
        if model.config._attn_implementation != TAP_NAME:  # HF declined (own attention code)
            model.set_attn_implementation(old)
            raise ValueError(
                f"{self.what}: {_family(model)} does not let its attention implementation be "
                "set, so no registered function sees its heads"
            )
        self._old, self._sites, self._handles = old, sites, []
        for layer, module in sites.items():
            if _SITE not in module.__dict__:
                module.__dict__[_SITE] = _Site(layer)
            module.__dict__[_SITE].taps.append(self)
        self._entered = True
        try:
            self._handles = self.hooks(sites)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        if not self._entered:
            return
        for handle in self._handles:
            handle.remove()
        for module in self._sites.values():
            site = module.__dict__[_SITE]
            site.taps.remove(self)
            if not site.taps:
                del module.__dict__[_SITE]
        self.model.set_attn_implementation(self._old)
        self._entered = False
