"""Ablate or patch attention heads, in every family the attention function serves.

    with ablate(model, heads=[(1, 0), (1, 2)], how="zero"):   # 0-based (layer, head)
        loss = model(ids, labels=ids).loss
    with patch(model, source_ids, heads=[(1, 0)]):
        logits = model(ids).logits

A head's output is its slice ``[:, :, h]`` of the attention function's result ``(B, T_q, H,
d_v)``: what the layer's output projection reads for that head (TransformerLens'
``hook_z``), the same axis in every family (:mod:`.hf_taps`). Inside the context it is

- ``how="zero"``: 0, so the head adds nothing to the layer's output (its share of H W_O is 0);
- ``how="mean"``: at every position, its mean over the batch and the query positions of the
  layer's first call inside the context (the prompt, under generation), so the head still
  adds its average but nothing about this input;
- patched: what the head gave on ``source_ids``, run once when the context is entered
  (through the contexts already entered). The runs inside must have the source's batch
  size (or a source of one sequence) and as many query positions in each call (a whole
  sequence, as the source: no KV cache).

On leaving — normally, by an exception, nested — the model is exactly as before.
"""

from __future__ import annotations

import torch

from .hf_capture import _as_ids
from .hf_taps import Call, Tap, check_heads

__all__ = ["ablate", "patch"]


class _HeadEdit(Tap):
    """A tap that replaces some heads' outputs; subclasses say with what."""

    def __init__(self, model, heads):
        super().__init__(model)
        self.heads = check_heads(model, heads, self.what)  # {layer: [heads]}

    def attention(self, call: Call, out: torch.Tensor) -> torch.Tensor:
        hs = self.heads.get(call.layer)
        if hs is None:
            return out
        if max(hs) >= out.shape[2]:
            raise ValueError(
                f"{self.what}: heads: layer {call.layer} has {out.shape[2]} heads, not "
                f"{max(hs) + 1}"
            )
        out = out.clone()
        out[:, :, hs] = self.replacement(call, out[:, :, hs])
        return out

    def replacement(self, call: Call, heads_out: torch.Tensor) -> torch.Tensor:
        """What the heads give instead of ``heads_out`` ``(B, T_q, k, d_v)``."""
        raise NotImplementedError


class _Ablation(_HeadEdit):
    what = "ablate"

    def __init__(self, model, heads, how: str):
        if how not in ("zero", "mean"):
            raise ValueError(f"ablate: how must be 'zero' or 'mean', got {how!r}")
        super().__init__(model, heads)
        self.how = how
        self.means: dict[int, torch.Tensor] = {}

    def __enter__(self):
        self.means = {}  # measured anew on the first call of each layer
        return super().__enter__()

    def replacement(self, call: Call, heads_out: torch.Tensor) -> torch.Tensor:
        if self.how == "zero":
            return torch.zeros_like(heads_out)
        if call.layer not in self.means:
            self.means[call.layer] = heads_out.mean(dim=(0, 1))  # (k, d_v)
        return self.means[call.layer].expand_as(heads_out)


class _Source(_HeadEdit):
    """Records the chosen heads' outputs of one run (the patch's source)."""

    what = "patch"

    def __init__(self, model, heads):
        super().__init__(model, heads)
        self.outputs: dict[int, torch.Tensor] = {}

    def replacement(self, call: Call, heads_out: torch.Tensor) -> torch.Tensor:
        self.outputs.setdefault(call.layer, heads_out.detach().clone())
        return heads_out


class _Patch(_HeadEdit):
    what = "patch"

    def __init__(self, model, source_ids, heads, attention_mask=None):
        super().__init__(model, heads)
        ids, am = _as_ids(source_ids, attention_mask, "patch: source_ids")
        self.source_ids, self.source_mask = ids, am
        self.outputs: dict[int, torch.Tensor] = {}

    def __enter__(self):
        source = _Source(self.model, [(l, h) for l, hs in self.heads.items() for h in hs])
        dev = next(self.model.parameters()).device
        kw = {} if self.source_mask is None else {"attention_mask": self.source_mask.long().to(dev)}
        with source, torch.no_grad():
            self.model(self.source_ids.to(dev), use_cache=False, **kw)
        self.outputs = {
            layer: out[:, :, [source.heads[layer].index(h) for h in hs]]
            for layer, hs in self.heads.items()
            for out in [source.outputs[layer]]
        }
        return super().__enter__()

    def replacement(self, call: Call, heads_out: torch.Tensor) -> torch.Tensor:
        src = self.outputs[call.layer]
        B, T_q = heads_out.shape[:2]
        if src.shape[1] != T_q or src.shape[0] not in (1, B):
            raise ValueError(
                f"patch: layer {call.layer} is called with (B, T_q) = ({B}, {T_q}) but "
                f"source_ids gave ({src.shape[0]}, {src.shape[1]}); patch runs of the source's "
                "length and batch (or a source of one sequence), whole (no KV cache)"
            )
        return src.to(heads_out.dtype).expand_as(heads_out)


def ablate(model, heads, how: str = "zero") -> _Ablation:
    """A context in which each (layer, head) of ``heads`` (0-based) is ablated: its output set
    to zero (``how="zero"``) or to its mean (``how="mean"``; see the module docstring)."""
    return _Ablation(model, heads, how)


def patch(model, source_ids, heads, attention_mask=None) -> _Patch:
    """A context in which each (layer, head) of ``heads`` (0-based) gives what it gave on
    ``source_ids`` ``(T,)`` or ``(B, T)`` (with its ``attention_mask``, if padded)."""
    return _Patch(model, source_ids, heads, attention_mask)
