"""The check-yourself panel's data: questions (``causalattn.learn.questions``'s dicts) with
the matrix each answer is drawn on, computed here from the question's own trace or sentence.

    _learn_data(questions) -> [{"prompt", "choices", "answer", "hint", "explanation",
                                "highlight", "picture": {"matrix", "T", "tokens", "kinds",
                                "values"}}]
"""

from __future__ import annotations

import json

import numpy as np

from ..matrix_form import trace as _trace
from .kinds import sequences, tokens_of
from .sentences import batch_traces

__all__ = ["learn_data"]


def _learn_matrix(q: dict) -> dict | None:
    """The matrix a question's highlight points at, as the panel draws it (or None)."""
    hl = q.get("highlight")
    if not isinstance(hl, dict) or hl.get("matrix") not in ("M", "S", "A"):
        return None
    from .. import text

    data = q.get("data") or {}
    if all(k in data for k in ("X", "W_q", "W_k", "W_v")):
        tr = _trace(
            np.asarray(data["X"], float),
            np.asarray(data["W_q"], float),
            np.asarray(data["W_k"], float),
            np.asarray(data["W_v"], float),
            mask=np.asarray(data["mask"], bool) if "mask" in data else None,
            tokens=data.get("tokens"),
        )
        kinds = sequences(tr)[0].kinds
    elif isinstance(q.get("sentence"), int):
        batch = text.encode(text.SEED_SENTENCES)
        b = q["sentence"]
        if not 0 <= b < batch.B:
            return None
        tr = batch_traces(batch)[b].select(0)
        kinds = sequences(tr)[0].kinds
    else:
        return None
    T = kinds.shape[0]
    m = hl["matrix"]
    vals = None
    if m in ("S", "A"):
        v = np.where(kinds == 0, tr[m], np.nan)
        vals = [[None if not np.isfinite(x) else round(float(x), 4) for x in row] for row in v]
    return {
        "matrix": m,
        "T": int(T),
        "tokens": tokens_of(tr, T),
        "kinds": kinds.astype(int).tolist(),
        "values": vals,
    }


def learn_data(questions) -> list[dict]:
    """The questions as the panel needs them (prompt, choices, answer, hint, explanation,
    highlight) plus the highlighted matrix computed here."""
    if isinstance(questions, dict) or not hasattr(questions, "__iter__"):
        raise ValueError(
            "explorer: questions must be a list of question dicts "
            "(causalattn.learn.questions(seed, n))"
        )
    out = []
    for k, q in enumerate(questions):
        need = ("prompt", "choices", "answer")
        if not isinstance(q, dict) or any(n not in q for n in need):
            raise ValueError(f"explorer: question {k + 1} must be a dict with {need}")
        choices = [str(c) for c in q["choices"]]
        a = q["answer"]
        if isinstance(a, bool) or not isinstance(a, (int, np.integer)) or not 0 <= a < len(choices):
            raise ValueError(
                f"explorer: question {k + 1}: answer {a!r} is not an index of its "
                f"{len(choices)} choices"
            )
        hl = q.get("highlight") if isinstance(q.get("highlight"), dict) else None
        out.append(
            {
                "id": str(q.get("id", k + 1)),
                "prompt": str(q["prompt"]),
                "choices": choices,
                "answer": int(a),
                "hint": str(q.get("hint") or ""),
                "explanation": str(q.get("explanation") or ""),
                "highlight": json.loads(json.dumps(hl)) if hl else None,
                "picture": _learn_matrix(q),
            }
        )
    return out
