"""Check questions whose answers the library computes, seeded so a teacher can hand out one set.

    questions(seed=0, n=None) -> list[dict]

Each question is a JSON-serializable dict::

    {"id": "s0-q1-softmax-axis", "kind": "softmax-axis",
     "prompt": str, "choices": [str, ...], "answer": int (0-based index into choices),
     "hint": str, "explanation": str,
     "highlight": {"matrix": "A", "axis": "row", "row": 2}     # or None; see below
     "data": {...},                                           # what the answer was computed from
     "sentence": 3}                                           # only for seed-sentence questions

Positions in prompts, choices and explanations are 1-based, as in the chapter (h_1 … h_T);
indices in ``highlight`` and ``data`` are 0-based, as in the Python API. ``highlight`` says
where the answer lives in a picture: ``matrix`` is a stage symbol ("S", "M", "A"), with
``axis`` ("row" | "column" | "all") and ``row``, or ``cells`` ([[i, j], ...]). When the
question is about a seed sentence, ``sentence`` (0-based, in the question and its highlight)
names it; otherwise ``data`` holds a small trace (X, W_q, W_k, W_v, tokens) to draw: the one
the question was generated from, or, for a window question, one under that ``mask`` (T×T
booleans from ``masks.Pattern(window=w)``).

No answer is typed in: each one comes from the library (the reference trace, the masks,
:func:`causalattn.shapes.shape_table`), and every wrong choice is computed too, from the
mistake it stands for (the mask forgotten, the wrong softmax axis, a raw score, ...).
"""

from __future__ import annotations

import numpy as np

from .. import masks, text
from ..check.words import spans
from ..matrix_form import softmax_last
from ..matrix_form import trace as run_trace
from ..shapes import shape_table

__all__ = ["questions", "KINDS"]


def _f(x: float) -> str:
    return f"{float(x):.3f}"


def _vec(v) -> str:
    return "[" + ", ".join(_f(x) for x in np.asarray(v).ravel()) + "]"


def _span(idx) -> str:
    """0-based indices -> '3–5' style 1-based ranges ('none' when empty)."""
    return ", ".join(spans(sorted(int(i) + 1 for i in idx), "–")) or "none"


def _keys(idx, verb: str = "") -> str:
    """'key 4' / 'keys 4–6' (1-based), with 'is' / 'are' when a verb is wanted."""
    idx = list(idx)
    word = "key" if len(idx) == 1 else "keys"
    tail = "" if not verb else (" is" if len(idx) == 1 else " are")
    return f"{word} {_span(idx)}{tail}"


class _Retry(Exception):
    """The draw gave coinciding choices (or no clear answer): draw again."""


def _pack(rng, kind, prompt, correct, wrong, hint, explanation, highlight=None, data=None):
    """Shuffle the computed choices; the answer index follows the correct one."""
    choices = [correct, *wrong]
    if len(set(choices)) != len(choices):
        raise _Retry
    order = rng.permutation(len(choices))
    shuffled = [choices[k] for k in order]
    out = {
        "kind": kind,
        "prompt": prompt,
        "choices": shuffled,
        "answer": int(np.flatnonzero(order == 0)[0]),
        "hint": hint,
        "explanation": explanation,
        "highlight": highlight,
        "data": data or {},
    }
    if highlight and "sentence" in highlight:  # the seed sentence the picture shows
        out["sentence"] = highlight["sentence"]
    return out


# -- small seeded traces ------------------------------------------------------------------------
def _small_trace(rng, T: int, d_model: int = 2):
    """A T-token trace over one seed sentence's words, with 1-decimal X and weights."""
    long = [b for b, s in enumerate(text.SEED_SENTENCES) if len(text.tokenize(s)) >= T]
    sent = int(rng.choice(long))
    tokens = text.tokenize(text.SEED_SENTENCES[sent])[:T]
    X = np.round(rng.normal(size=(T, d_model)), 1)
    W = [np.round(rng.normal(size=(d_model, d_model)), 1) for _ in range(3)]
    tr = run_trace(X, *W, tokens=tokens)
    data = {
        "X": X.tolist(),
        "W_q": W[0].tolist(),
        "W_k": W[1].tolist(),
        "W_v": W[2].tolist(),
        "tokens": tokens,
    }
    return tr, data


def _q(i: int, tokens) -> str:
    return f"query {i + 1} ('{tokens[i]}')"


# -- the chapter's Q1 ---------------------------------------------------------------------------
def _softmax_axis(rng):
    tr, data = _small_trace(rng, 5)
    allowed = _dense(masks.Pattern(), 5)
    Z = np.where(allowed, tr.S, -np.inf)
    with np.errstate(invalid="ignore"):
        by = {
            "across the 5 columns within each query row (the last, key axis)": softmax_last(
                Z, allowed
            ),
            "down the 5 query rows within each key column": softmax_last(Z.T, allowed.T).T,
            "across all 25 scores of the matrix at once": softmax_last(
                Z.reshape(1, -1), allowed.reshape(1, -1)
            ).reshape(5, 5),
        }
    right = [c for c, A in by.items() if np.allclose(A, tr.A)]
    if len(right) != 1:
        raise _Retry
    wrong = [c for c in by if c != right[0]]
    sums = {c: A[2].sum() for c, A in by.items()}
    return _pack(
        rng,
        "softmax-axis",
        "One sequence's score matrix S + M has shape (5, 5). Row 3 belongs to one query; its 5 "
        "columns are the key positions. Along which axis must the softmax normalize?",
        right[0],
        wrong,
        "Each query row must become a distribution over the positions it may read.",
        f"Softmax runs along the last axis, across the keys of each query row: row 3 of A then "
        f"sums to {_f(sums[right[0]])} over keys 1–3, and its future keys get weight 0. Down "
        f"the columns, row 3 would sum to {_f(sums[wrong[0]])}; over all 25 scores, to "
        f"{_f(sums[wrong[1]])}.",
        {"matrix": "A", "axis": "row", "row": 2},
        data,
    )


# -- the seed corpus' masks ---------------------------------------------------------------------
def _dense(pattern: masks.Pattern, T: int) -> np.ndarray:
    """One sequence's T×T boolean mask (True = may read) from the one M."""
    return np.asarray(pattern.allowed(1, 1, T, T))[0, 0]


def _seed_masks(b: int):
    """Sentence b's (0-based) causal, padding-only and combined masks, N×N, and its tokens."""
    batch = text.encode(list(text.SEED_SENTENCES))
    L, N = int(batch.lengths[b]), batch.N
    causal = _dense(masks.Pattern(), N)
    padding = _dense(masks.Pattern(causal=False, lengths=[L]), N)
    combined = _dense(masks.Pattern(lengths=[L]), N)
    assert np.array_equal(combined, batch.mask[b])  # the batch's mask is the same M
    return batch.tokens[b], L, N, causal, padding, combined


_CELL = {
    "readable": "it may read it: the weight A_ij can be non-zero",
    "future": "blocked because key j is in query i's future (the causal part of M)",
    "padding": "blocked because of padding (a padding key, or a padding query that reads nothing)",
    "both": "blocked twice over: key j is in the future and padding is involved",
}


def _mask_cell(rng):
    b = 3  # the seed's sentence 4, "Cheese and burgers go well together", padded to N = 10
    tokens, L, N, causal, padding, combined = _seed_masks(b)
    kind = np.select(
        [combined, ~causal & padding, causal & ~padding], ["readable", "future", "padding"], "both"
    )
    want = str(rng.choice(list(_CELL)))
    cells = np.argwhere(kind == want)
    i, j = (int(x) for x in cells[rng.integers(len(cells))])
    got = str(kind[i, j])
    return _pack(
        rng,
        "mask-cell",
        f"Sentence 4 of the seed corpus ({' '.join(tokens[:L])}) is padded to N = {N} tokens. "
        f"In its combined mask M (causal AND padding), may query {i + 1} ('{tokens[i]}') read "
        f"key {j + 1} ('{tokens[j]}')?",
        _CELL[got],
        [v for k, v in _CELL.items() if k != got],
        "Ask two questions separately: is j > i (the future)? Is key j, or query i, a <PAD>?",
        f"Query {i + 1} and key {j + 1}: the causal mask {'allows' if causal[i, j] else 'blocks'} "
        f"the cell (j {'≤' if j <= i else '>'} i), and the padding mask "
        f"{'allows' if padding[i, j] else 'blocks'} it (sentence 4 has L = {L} real tokens). "
        f"M is 0 only where both allow: here M = {'0' if combined[i, j] else '-∞'}.",
        {"matrix": "M", "cells": [[i, j]], "sentence": b},
        {"sentence": b, "i": i, "j": j},
    )


def _mask_count(rng):
    b = int(rng.integers(1, 4))  # sentences 2–4: the ones with padding
    tokens, L, N, causal, padding, combined = _seed_masks(b)
    n = {
        k: int(m.sum())
        for k, m in (
            ("combined", combined),
            ("causal", causal),
            ("padding", padding),
            ("none", np.ones((N, N), bool)),
        )
    }
    return _pack(
        rng,
        "mask-count",
        f"Sentence {b + 1} of the seed corpus has L = {L} tokens, padded to N = {N}. How many of "
        f"the {N}×{N} entries of its combined mask M (causal AND padding) are readable (M = 0)?",
        str(n["combined"]),
        [str(n["causal"]), str(n["padding"]), str(n["none"])],
        "Padding leaves an L×L corner; causality keeps its lower triangle, diagonal included.",
        f"{n['combined']} = {L}·{L + 1}/2: the lower triangle of the {L}×{L} real corner. The "
        f"causal mask alone allows {n['causal']}, padding alone {n['padding']}.",
        {"matrix": "M", "cells": np.argwhere(combined).tolist(), "sentence": b},
        {"sentence": b},
    )


def _padding_rows(rng):
    b = int(rng.integers(1, 4))
    tokens, L, N, causal, padding, combined = _seed_masks(b)
    empty = np.flatnonzero(~combined.any(-1))
    alive = np.flatnonzero(combined.any(-1))
    return _pack(
        rng,
        "padding-rows",
        f"Sentence {b + 1} of the seed corpus has L = {L} tokens, padded to N = {N}. Which query "
        "rows of its combined mask M have no readable key at all (their output rows are zero)?",
        f"rows {_span(empty)}",
        ["none: every query can read at least itself", f"rows {_span(alive)}", f"row {N} only"],
        "A <PAD> query is not a real token: it reads nothing, not even itself.",
        f"Rows {_span(empty)} are the padding queries: every entry of them is -∞, so their "
        f"weights and outputs are exactly 0 (never NaN). Rows {_span(alive)} read keys "
        f"1…i of the real tokens.",
        {"matrix": "M", "cells": [[int(i), j] for i in empty for j in range(N)], "sentence": b},
        {"sentence": b},
    )


# -- the four quantities of one pair ----------------------------------------------------------
def _weight(rng):
    T = int(rng.integers(4, 7))
    tr, data = _small_trace(rng, T)
    i = int(rng.integers(1, T - 1))
    j = int(rng.integers(0, i + 1))
    S_i = tr.S[i]
    no_mask = softmax_last(S_i, np.ones(T, bool))[j]
    wrong = [_f(S_i[j]), _f(no_mask), _f(1 / (i + 1))]
    if min(abs(float(w) - tr.A[i, j]) for w in wrong) < 0.02:
        raise _Retry
    return _pack(
        rng,
        "weight",
        f"In this trace {_q(i, data['tokens'])} may read keys 1–{i + 1}; its scaled scores "
        f"S_{i + 1},j over them are {_vec(S_i[: i + 1])} ({_keys(range(i + 1, T), 'be')} its "
        f"future). "
        f"What is the weight A_{i + 1},{j + 1}?",
        _f(tr.A[i, j]),
        wrong,
        "Exponentiate the readable scores (subtract their maximum first) and divide by their "
        "sum; future keys take no part.",
        f"A_{i + 1},{j + 1} = exp(S_{i + 1},{j + 1}) / Σ_j≤{i + 1} exp(S_{i + 1},j) = "
        f"{_f(tr.A[i, j])}. The score itself is {_f(S_i[j])}; a softmax over all {T} keys "
        f"(mask forgotten) gives {_f(no_mask)}; {_f(1 / (i + 1))} would be equal weights.",
        {"matrix": "A", "cells": [[i, j]]},
        {**data, "i": i, "j": j},
    )


def _contribution(rng):
    T = int(rng.integers(4, 7))
    tr, data = _small_trace(rng, T)
    i = int(rng.integers(1, T))
    j = int(rng.integers(0, i + 1))
    ex = tr.explain(i)
    c, v = ex.contribution[j], tr.V[j]
    wrong = [_vec(v), _vec(tr.S[i, j] * v), _vec(ex.h)]
    if min(np.abs(np.array(w.strip("[]").split(", "), float) - c).max() for w in wrong) < 0.01:
        raise _Retry
    return _pack(
        rng,
        "contribution",
        f"In this trace {_q(i, data['tokens'])} has weights A_{i + 1},j = "
        f"{_vec(tr.A[i, : i + 1])} over keys 1–{i + 1}, and key {j + 1}'s value is "
        f"v_{j + 1} = {_vec(v)}. What vector does key {j + 1} contribute to h_{i + 1}?",
        _vec(c),
        wrong,
        "A contribution is the value scaled by the weight, not by the score.",
        f"A_{i + 1},{j + 1} v_{j + 1} = {_f(tr.A[i, j])} · {_vec(v)} = {_vec(c)}. Adding every "
        f"readable key's contribution gives h_{i + 1} = {_vec(ex.h)}.",
        {"matrix": "A", "cells": [[i, j]]},
        {**data, "i": i, "j": j},
    )


def _top_contributor(rng):
    T = int(rng.integers(4, 7))
    tr, data = _small_trace(rng, T)
    i = T - 1  # the last query reads every key
    ex = tr.explain(i)
    top_s = int(np.argmax(ex.rank_score == 1))
    top_n = int(np.argmax(ex.rank_norm == 1))
    clear = [np.sort(x)[-1] - np.sort(x)[-2] for x in (ex.score, ex.norm)]
    if top_s == top_n or clear[0] < 0.05 or clear[1] < 0.15 * ex.norm[top_n]:  # no near ties
        raise _Retry
    others = [int(k) for k in rng.permutation(T) if k not in (top_s, top_n)][:2]
    tok = data["tokens"]
    rows = "; ".join(
        f"key {k + 1} ('{tok[k]}'): S = {_f(ex.score[k])}, A = {_f(ex.weight[k])}, "
        f"v = {_vec(ex.value[k])}"
        for k in range(T)
    )
    key = lambda k: f"key {k + 1} ('{tok[k]}')"  # noqa: E731
    return _pack(
        rng,
        "top-contributor",
        f"In this trace {_q(i, tok)} reads every key: {rows}. Which key contributes the "
        f"largest vector A_{i + 1},j v_j (by length) to h_{i + 1}?",
        key(top_n),
        [key(top_s)] + [key(k) for k in others],
        "Weight is not contribution: compare A_ij · ‖v_j‖, not the scores alone.",
        f"Key {top_s + 1} has the highest score ({_f(ex.score[top_s])}) and so the highest "
        f"weight ({_f(ex.weight[top_s])}), but its value is short (‖v‖ = "
        f"{_f(np.linalg.norm(ex.value[top_s]))}): it contributes ‖A v‖ = "
        f"{_f(ex.norm[top_s])}. Key {top_n + 1} has weight {_f(ex.weight[top_n])} and ‖v‖ = "
        f"{_f(np.linalg.norm(ex.value[top_n]))}, so ‖A v‖ = {_f(ex.norm[top_n])}, the largest.",
        {"matrix": "A", "cells": [[i, top_n]]},
        {**data, "i": i},
    )


def _mask_after_softmax(rng):
    T = int(rng.integers(4, 7))
    tr, data = _small_trace(rng, T)
    i = int(rng.integers(0, T - 1))  # a query with future keys
    allowed = _dense(masks.Pattern(), T)[i]
    after = softmax_last(tr.S[i], np.ones(T, bool)) * allowed
    s = float(after.sum())
    wrong = [_f(1.0), _f(1 - s), _f((i + 1) / T)]
    if min(abs(float(w) - s) for w in wrong) < 0.01:
        raise _Retry
    return _pack(
        rng,
        "mask-after-softmax",
        f"In this trace {_q(i, data['tokens'])} has scaled scores {_vec(tr.S[i])} over all {T} "
        f"keys. Someone applies the mask AFTER the softmax: softmax over all {T} scores, then "
        f"the future {_keys(range(i + 1, T))} set to 0. What do query {i + 1}'s weights "
        "then sum to?",
        _f(s),
        wrong,
        "The softmax already spent part of the row's mass on the future keys.",
        f"They sum to {_f(s)}, not 1: the future keys took {_f(1 - s)} of the mass before being "
        f"zeroed, so the readable weights {_vec(after[: i + 1])} are no longer a distribution. "
        f"With M added before the softmax the row is {_vec(tr.A[i, : i + 1])}, summing to 1.",
        {"matrix": "A", "axis": "row", "row": i},
        {**data, "i": i},
    )


# -- shapes -------------------------------------------------------------------------------------
_SHAPE_CONFIGS = ((2048, 1000, 1), (2048, 1000, 1), (1024, 768, 12), (4096, 4096, 32))
_SHAPE_SYMBOLS = ("W_Q", "Q", "Kᵀ", "QKᵀ/√d_k + M", "A", "V", "H", "W_O")


def _shape(rng):
    T, D, h = _SHAPE_CONFIGS[rng.integers(len(_SHAPE_CONFIGS))]
    rows = {r.symbol: r for r in shape_table(T, D, h)}
    sym = str(rng.choice(_SHAPE_SYMBOLS))
    right = rows[sym]
    pool = {r.notation for r in rows.values()} | {"×".join(map(str, right.shape[::-1]))}
    pool.discard(right.notation)
    wrong = [str(x) for x in rng.permutation(sorted(pool))[:3]]
    heads = "one head" if h == 1 else f"h = {h} heads (d_k = d_v = {D // h})"
    return _pack(
        rng,
        "shape",
        f"Sequence length T = {T}, d_model = {D}, {heads}. What is the shape of {sym}"
        f" ({right.name.lower()}){'' if sym.startswith('W_') else ', per sequence'}?",
        right.notation,
        wrong,
        "Follow the products: (T×d_model)(d_model×d_k) -> T×d_k, (T×d_k)(d_k×T) -> T×T."
        + ("" if h == 1 else " Per-head stages carry a head axis first."),
        f"{sym} is {right.notation}: {right.explanation}.",
        None,
        {"seq_len": T, "d_model": D, "n_heads": h, "symbol": sym},
    )


# -- what a sliding window changes in M ------------------------------------------------------
def _picture(rng, T: int, w: int) -> dict:
    """A small trace's inputs under the window's mask, so a page can draw that M."""
    _, data = _small_trace(rng, T)
    return {**data, "T": T, "mask": _dense(masks.Pattern(window=w), T).tolist()}


def _window_row(rng):
    T, w = 8, int(rng.integers(2, 5))
    i = int(rng.integers(w + 1, T))  # far enough in that the window cuts something
    rows = {k: np.flatnonzero(_dense(masks.Pattern(window=k), T)[i]) for k in (w, w + 1, w - 1)}
    causal = np.flatnonzero(_dense(masks.Pattern(), T)[i])
    return _pack(
        rng,
        "window-row",
        f"A sliding window of w = {w} (masks.Pattern(window={w}), Hugging Face's "
        f"sliding_window) is added to the causal mask of T = {T} positions. Which keys may "
        f"query {i + 1} read?",
        f"keys {_span(rows[w])}",
        [f"keys {_span(rows[w + 1])}", f"keys {_span(rows[w - 1])}", f"keys {_span(causal)}"],
        "The window keeps the last w positions, the query's own included.",
        f"Query {i + 1} reads the last {w} positions, itself included: keys {_span(rows[w])}. "
        f"The causal mask alone would let it read keys {_span(causal)}; the window blocks "
        f"{len(causal) - len(rows[w])} of them, and every row's cost stops growing with T.",
        {"matrix": "M", "cells": [[i, int(j)] for j in rows[w]], "pattern": {"window": w}},
        {**_picture(rng, T, w), "window": w, "i": i},
    )


def _window_count(rng):
    T, w = int(rng.integers(6, 11)), int(rng.integers(2, 5))
    causal = int(_dense(masks.Pattern(), T).sum())
    blocked = {k: causal - int(_dense(masks.Pattern(window=k), T).sum()) for k in (w - 1, w, w + 1)}
    return _pack(
        rng,
        "window-count",
        f"Of the {T}×{T} causal mask's {causal} readable cells, how many does a sliding window "
        f"of w = {w} block (masks.Pattern(window={w}))?",
        str(blocked[w]),
        [str(blocked[w - 1]), str(blocked[w + 1]), str(causal - blocked[w])],
        "Row i keeps min(i + 1, w) keys; the rest of its causal keys are blocked.",
        f"{blocked[w]}: row i keeps min(i + 1, {w}) of its i + 1 causal keys, so "
        f"{causal - blocked[w]} cells stay readable out of {causal}.",
        {"matrix": "M", "axis": "all", "pattern": {"window": w}},
        {**_picture(rng, T, w), "window": w},
    )


KINDS = {
    "softmax-axis": _softmax_axis,
    "mask-cell": _mask_cell,
    "weight": _weight,
    "contribution": _contribution,
    "top-contributor": _top_contributor,
    "shape": _shape,
    "mask-after-softmax": _mask_after_softmax,
    "mask-count": _mask_count,
    "padding-rows": _padding_rows,
    "window-row": _window_row,
    "window-count": _window_count,
}


def questions(seed: int = 0, n: int | None = None, kinds=None) -> list[dict]:
    """``n`` questions (default: one of each kind, the chapter's Q1 first), seeded by ``seed``.

    ``kinds``: a subset of :data:`KINDS` (in that order); with ``n`` larger than the
    number of kinds they repeat with fresh draws.
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"learn: seed must be a non-negative integer, got {seed!r}")
    names = list(KINDS) if kinds is None else list(kinds)
    bad = [k for k in names if k not in KINDS]
    if bad or not names:
        raise ValueError(f"learn: unknown question kinds {bad}; known: {list(KINDS)}")
    if n is None:
        n = len(names)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= 1000:
        raise ValueError(f"learn: n must be an integer in 1..1000, got {n!r}")
    out = []
    for k in range(int(n)):
        kind = names[k % len(names)]
        rng = np.random.default_rng([int(seed), k])
        for _ in range(200):
            try:
                q = KINDS[kind](rng)
                break
            except _Retry:
                continue
        else:  # pragma: no cover - every kind finds a clear case within a few draws
            raise RuntimeError(f"learn: no clear {kind} question in 200 draws (seed {seed})")
        out.append({"id": f"s{seed}-q{k + 1}-{kind}", **q})
    return out
