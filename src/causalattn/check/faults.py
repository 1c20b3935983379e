"""The one catalogue of faults: what the audit hints at, what diagnose names, what the CLI
prints and what the README's table lists (tests/test_check_faults.py keeps that table true).

Each fault has an ``id``, the ``stage`` of the seed's dependency order where it shows
(S, M, A, H, O; ``heads`` for a fault that only some heads carry: its stage is theirs),
a one-line ``description`` of the bug and a ``hint``: what to change.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Fault", "CATALOGUE", "BY_ID", "get"]


@dataclass(frozen=True)
class Fault:
    id: str
    stage: str
    description: str
    hint: str


# In dependency order: with two faults at once, the one listed first is named.
CATALOGUE: tuple[Fault, ...] = (
    Fault(
        "k-not-transposed",
        "S",
        "S = Q K instead of Q Kᵀ (only runs when T = d_k)",
        "transpose K: S = Q Kᵀ (k.transpose(-2, -1))",
    ),
    Fault("missing-scale", "S", "S = Q Kᵀ without the 1/√d_k factor", "divide the scores by √d_k"),
    Fault("scale-by-dk", "S", "S = Q Kᵀ / d_k instead of / √d_k", "divide by √d_k, not d_k"),
    Fault(
        "scale-by-sqrt-dv",
        "S",
        "S = Q Kᵀ / √d_v: scaled by the value width",
        "the scale is 1/√d_k, the query/key width, not the value width d_v",
    ),
    Fault(
        "scale-by-sqrt-dmodel",
        "S",
        "S = Q Kᵀ / √d_model: scaled by the model width",
        "with heads the scale is 1/√d_k of one head (d_model / h), not 1/√d_model",
    ),
    Fault(
        "diagonal-blocked",
        "M",
        "the diagonal is blocked (j < i allowed): a token cannot read itself",
        "allow j <= i: each token must be able to read itself",
    ),
    Fault(
        "no-mask",
        "M",
        "no causal mask: queries read future keys",
        "add the causal mask M before the softmax",
    ),
    Fault(
        "anti-causal-mask",
        "M",
        "mask transposed: queries read j >= i",
        "queries read j <= i: the lower triangle, not the upper",
    ),
    Fault(
        "causal-top-left",
        "M",
        "causal mask aligned top-left when T_q < T_k: the queries "
        "are taken for the first positions, not the last (SDPA's is_causal trap)",
        "with a KV cache the queries are the last T_q positions: query i reads j <= i + "
        "T_k - T_q (bottom-right)",
    ),
    Fault(
        "window-off-by-one",
        "M",
        "sliding window one key too wide or too narrow",
        "window w reads the last w keys, itself included: pos(i) - w < j <= pos(i)",
    ),
    Fault(
        "padding-ignored",
        "M",
        "the padding mask is not applied",
        "block padding keys in M (key_padding_mask / lengths)",
    ),
    Fault(
        "padding-queries-only",
        "M",
        "padding blocks query rows, not key columns",
        "a padding mask (B, T) blocks key columns: mask[:, None, :], not mask[:, :, None]",
    ),
    Fault(
        "finite-min-added-twice",
        "M",
        "causal and padding masks added as finite minimums: "
        "they overflow to -inf and rows with no readable key weight forbidden keys",
        "combine masks as booleans (AND), then fill once",
    ),
    Fault(
        "finite-fill-too-weak",
        "M",
        "a finite fill (such as -1e4) that large scores overcome: forbidden keys get weight",
        "fill with -inf (or the dtype's minimum) and zero blocked weights, or combine booleans",
    ),
    Fault(
        "softmax-query-axis",
        "A",
        "softmax over the query axis (columns sum to 1)",
        "softmax over the last (key) axis: dim=-1",
    ),
    Fault(
        "softmax-all-entries",
        "A",
        "softmax over all T×T entries at once",
        "normalize each row separately (dim=-1)",
    ),
    Fault(
        "mask-after-softmax",
        "A",
        "mask applied after the softmax without renormalizing",
        "apply M to the scores before the softmax",
    ),
    Fault(
        "unstable-softmax",
        "A",
        "no max subtraction: exp overflows at large scores (NaN)",
        "subtract each row's maximum before exp (stable softmax)",
    ),
    Fault(
        "softmax-fp16-accumulation",
        "A",
        "softmax in fp16 without fp32 accumulation: long rows lose their sums",
        "accumulate the softmax (and A V) in fp32",
    ),
    Fault(
        "nan-on-empty-rows",
        "A",
        "-inf on every entry of a row with no readable key gives NaN",
        "give rows with no readable key zero weights (0/0 is NaN)",
    ),
    Fault(
        "some-heads-only",
        "heads",
        "a fault in some heads only: the other heads are right",
        "look at what differs between heads (per-head slicing, a head-indexed branch)",
    ),
    Fault(
        "output-projection-missing",
        "O",
        "O = H: W_O is never applied",
        "apply the output projection: O = H W_O",
    ),
    Fault(
        "output-projection-transposed",
        "O",
        "O = H W_Oᵀ instead of H W_O",
        "O = H W_O with W_O of shape (h·d_v)×d_model",
    ),
)
BY_ID = {f.id: f for f in CATALOGUE}


def get(fault_id: str) -> Fault:
    return BY_ID[fault_id]


def table_markdown() -> str:
    """The README's table of faults."""
    rows = ["| id | stage | the bug |", "|---|---|---|"]
    rows += [f"| `{f.id}` | {f.stage} | {f.description} |" for f in CATALOGUE]
    return "\n".join(rows)
