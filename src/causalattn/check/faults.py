"""The one catalogue of faults: id, stage, description (audit hints, diagnose, CLI, README)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fault:
    """One catalogued fault: the reference with ``knob`` set to ``value``."""

    id: str
    stage: str
    description: str
    knob: str
    value: str


# In dependency order: the earliest stage first (two faults at once -> the first listed).
CATALOGUE: tuple[Fault, ...] = (
    Fault("k-not-transposed", "S", "S = Q K instead of Q Kᵀ (only runs when T = d_k)", "kt", "no"),
    Fault("missing-scale", "S", "S = Q Kᵀ without the 1/√d_k factor", "scale", "none"),
    Fault("scale-by-dk", "S", "S = Q Kᵀ / d_k instead of / √d_k", "scale", "dk"),
    Fault("diagonal-blocked", "M", "mask blocks j = i (j < i allowed): a token cannot read itself",
          "mask", "diag"),
    Fault("no-mask", "M", "no causal mask: queries read future keys", "mask", "none"),
    Fault("anti-causal-mask", "M", "mask transposed: queries read j >= i", "mask", "anti"),
    Fault("padding-ignored", "M", "the padding mask is not applied", "pad", "ignored"),
    Fault("padding-queries-only", "M", "padding blocks query rows, not key columns", "pad",
          "queries"),
    Fault("finite-min-added-twice", "M", "causal and padding masks added as finite minimums: "
          "they overflow to -inf and rows with no readable key weight forbidden keys",
          "fill", "min-twice"),
    Fault("softmax-query-axis", "A", "softmax over the query axis (columns sum to 1)", "softmax",
          "query"),
    Fault("softmax-all-entries", "A", "softmax over all T×T entries at once", "softmax", "all"),
    Fault("mask-after-softmax", "A", "mask applied after the softmax without renormalizing",
          "softmax", "after"),
    Fault("unstable-softmax", "A", "no max subtraction: exp overflows at large scores (NaN)",
          "stable", "no"),
    Fault("nan-on-empty-rows", "A", "-inf on every entry of a row with no readable key gives NaN",
          "empty", "nan"),
    Fault("output-projection-missing", "O", "O = H: W_O is never applied", "out", "missing"),
    Fault("output-projection-transposed", "O", "O = H W_Oᵀ instead of H W_O", "out", "transposed"),
)
_BY_ID = {f.id: f for f in CATALOGUE}
# faults whose signature lives on rows with no readable key: compare every row for them
_EMPTY_ROW_FAULTS = {"padding-ignored", "padding-queries-only", "finite-min-added-twice",
                     "nan-on-empty-rows"}


