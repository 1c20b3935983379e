"""The one catalogue of faults: what the audit hints at, what diagnose names, what the CLI
prints and what the docs' table lists (tests/check/test_check_measure.py's
``test_docs_fault_table_is_the_catalogue`` keeps that table true).

Each fault has an ``id``, the ``stage`` of the seed's dependency order where it shows
(S, M, A, H, O; ``heads`` for a fault that only some heads carry: its stage is theirs),
a one-line ``description`` of the bug, a ``hint``: what to change (the audit and diagnose
give it), and a ``lesson``: where to look, never what to write (``causalattn learn``'s
grade gives it to a learner).
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
    lesson: str


# In dependency order (the docs' table lists them so); diagnose names every one it measures.
CATALOGUE: tuple[Fault, ...] = (
    Fault(
        "k-not-transposed",
        "S",
        "S = Q K instead of Q Kᵀ (only runs when T = d_k)",
        "transpose K: S = Q Kᵀ (k.transpose(-2, -1))",
        "S[i, j] must compare query row i with key row j over their d_k entries. With T = "
        "d_k your product runs but pairs the wrong axes; try T ≠ d_k and watch the "
        "shapes.",
    ),
    Fault(
        "missing-scale",
        "S",
        "S = Q Kᵀ without the 1/√d_k factor",
        "divide the scores by √d_k",
        "Your scores are too large by a constant factor that depends on d_k. In the "
        "chapter (d_k = 2) the last query's scores are [-0.707, 0.707, 0, 1.414].",
    ),
    Fault(
        "scale-by-dk",
        "S",
        "S = Q Kᵀ / d_k instead of / √d_k",
        "divide by √d_k, not d_k",
        "Your scores are too small. With d_k = 4, should the scores be halved or quartered?",
    ),
    Fault(
        "scale-by-sqrt-dv",
        "S",
        "S = Q Kᵀ / √d_v: scaled by the value width",
        "the scale is 1/√d_k, the query/key width, not the value width d_v",
        "Your scores are scaled by the width of the values. The factor belongs to the "
        "axis that Q Kᵀ contracts.",
    ),
    Fault(
        "scale-by-sqrt-dmodel",
        "S",
        "S = Q Kᵀ / √d_model: scaled by the model width",
        "with heads the scale is 1/√d_k of one head (d_model / h), not 1/√d_model",
        "Your scores are scaled by the model's width. Each head compares vectors of its own width.",
    ),
    Fault(
        "diagonal-blocked",
        "M",
        "the diagonal is blocked (j < i allowed): a token cannot read itself",
        "allow j <= i: each token must be able to read itself",
        "Look at the diagonal of M: may a token read itself?",
    ),
    Fault(
        "no-mask",
        "M",
        "no causal mask: queries read future keys",
        "add the causal mask M before the softmax",
        "Your queries read keys in their future: nothing blocks j > i.",
    ),
    Fault(
        "anti-causal-mask",
        "M",
        "mask transposed: queries read j >= i",
        "queries read j <= i: the lower triangle, not the upper",
        "Your mask lets query i read the keys after it and blocks the ones before. Which "
        "side of the diagonal is the past?",
    ),
    Fault(
        "causal-top-left",
        "M",
        "causal mask aligned top-left when T_q < T_k: the queries "
        "are taken for the first positions, not the last (SDPA's is_causal trap)",
        "with a KV cache the queries are the last T_q positions: query i reads j <= i + "
        "T_k - T_q (bottom-right)",
        "With fewer queries than keys the queries are the last positions: where does query 0 sit?",
    ),
    Fault(
        "window-off-by-one",
        "M",
        "sliding window one key too wide or too narrow",
        "window w reads the last w keys, itself included: pos(i) - w < j <= pos(i)",
        "Count the window: w positions, the query's own included.",
    ),
    Fault(
        "padding-ignored",
        "M",
        "the padding mask is not applied",
        "block padding keys in M (key_padding_mask / lengths)",
        "Positions at or after `length` are <PAD>: a real query must not read them, and a "
        "padding query reads nothing.",
    ),
    Fault(
        "padding-queries-only",
        "M",
        "padding blocks query rows, not key columns",
        "a padding mask (B, T) blocks key columns: mask[:, None, :], not mask[:, :, None]",
        "Padding must block key columns too, not only query rows.",
    ),
    Fault(
        "finite-min-added-twice",
        "M",
        "causal and padding masks added as finite minimums: "
        "they overflow to -inf and rows with no readable key weight forbidden keys",
        "combine masks as booleans (AND), then fill once",
        "Two finite minimums added together overflow to -inf, and a row with no readable "
        "key then spreads its weight over forbidden keys. Build each blocked entry once.",
    ),
    Fault(
        "finite-fill-too-weak",
        "M",
        "a finite fill (such as -1e4) that large scores overcome: forbidden keys get weight",
        "fill with -inf (or the dtype's minimum) and zero blocked weights, or combine booleans",
        "Your blocked entries are not blocked enough: large scores overcome a finite fill "
        "such as -1e4.",
    ),
    Fault(
        "softmax-query-axis",
        "A",
        "softmax over the query axis (columns sum to 1)",
        "softmax over the last (key) axis: dim=-1",
        "Your weights sum to 1 down each column. A row is one query: along which axis are "
        "its keys?",
    ),
    Fault(
        "softmax-all-entries",
        "A",
        "softmax over all T×T entries at once",
        "normalize each row separately (dim=-1)",
        "Your weights sum to 1 over the whole matrix. Each query needs a distribution of its own.",
    ),
    Fault(
        "mask-after-softmax",
        "A",
        "mask applied after the softmax without renormalizing",
        "apply M to the scores before the softmax",
        "Your rows of A sum to less than 1: the future keys took part in the softmax "
        "before being zeroed. Where must M enter?",
    ),
    Fault(
        "unstable-softmax",
        "A",
        "no max subtraction: exp overflows at large scores (NaN)",
        "subtract each row's maximum before exp (stable softmax)",
        "With large scores exp overflows (inf / inf is NaN). A softmax does not change "
        "when one number is subtracted from a whole row: which number keeps every exp at "
        "most 1?",
    ),
    Fault(
        "softmax-fp16-accumulation",
        "A",
        "softmax in fp16 without fp32 accumulation: long rows lose their sums",
        "accumulate the softmax (and A V) in fp32",
        "Long rows in half precision lose their sums: in which precision is the row accumulated?",
    ),
    Fault(
        "nan-on-empty-rows",
        "A",
        "-inf on every entry of a row with no readable key gives NaN",
        "give rows with no readable key zero weights (0/0 is NaN)",
        "A padding query's row is -∞ everywhere, and 0 / 0 is NaN. Such a row reads "
        "nothing: its weights must be 0.",
    ),
    Fault(
        "some-heads-only",
        "heads",
        "a fault in some heads only: the other heads are right",
        "look at what differs between heads (per-head slicing, a head-indexed branch)",
        "Some heads are right and others not: what differs between the heads in your code?",
    ),
    Fault(
        "output-projection-missing",
        "O",
        "O = H: W_O is never applied",
        "apply the output projection: O = H W_O",
        "Your O is the heads' output itself: W_O never enters.",
    ),
    Fault(
        "output-projection-transposed",
        "O",
        "O = H W_Oᵀ instead of H W_O",
        "O = H W_O with W_O of shape (h·d_v)×d_model",
        "W_O is (h·d_v)×d_model and is used as X W is: which of its axes meets the "
        "columns of [H_0 … H_{h-1}]?",
    ),
)
BY_ID = {f.id: f for f in CATALOGUE}


def get(fault_id: str) -> Fault:
    return BY_ID[fault_id]


def table_markdown() -> str:
    """The table of faults in docs/guides/audit-diagnose.md."""
    rows = ["| id | stage | the bug |", "|---|---|---|"]
    rows += [f"| `{f.id}` | {f.stage} | {f.description} |" for f in CATALOGUE]
    return "\n".join(rows)
