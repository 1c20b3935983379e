"""Implementation exercises: a scaffold file per stage of the seeds' equation, NumPy or torch.

    scaffold("attention", framework="numpy") -> str     # the file's text
    write("attention", "attention.py", framework="torch")

Each scaffold holds one function with a docstring saying what to compute, with shapes in
the seeds' notation, and a body that raises NotImplementedError. The grader
(:mod:`causalattn.learn.grade`) runs the learner's function inside the reference pipeline
(the stages it does not cover are the library's), so ``causalattn.diagnose`` can name the
first wrong stage. The first line marks the exercise, so ``--check`` knows what to grade.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["Exercise", "EXERCISES", "FRAMEWORKS", "scaffold", "write", "MARK"]

MARK = "# causalattn learn exercise:"
FRAMEWORKS = ("numpy", "torch")


@dataclass(frozen=True)
class Exercise:
    """One exercise: the function the learner writes and the stages it covers."""

    name: str
    function: str
    params: str
    stages: tuple[str, ...]  # the diagnose stages the learner's code computes
    doc: str  # the function's docstring; {arr} / {one} name the array type


EXERCISES: dict[str, Exercise] = {
    "scores": Exercise(
        "scores",
        "scores",
        "q, k",
        ("S",),
        """\
The scaled scores of one sequence: S = Q Kᵀ / √d_k.

    q, k: T×d_k {arr}. Return S, T×T: S[i, j] compares query i with key j.

    (The grader adds the causal mask, the softmax and A V itself.)""",
    ),
    "mask": Exercise(
        "mask",
        "mask",
        "T, length",
        ("M",),
        """\
The seed's additive mask M for one sequence of T positions: the first `length` are
    real tokens, the rest are <PAD>.

    T, length: ints, 0 <= length <= T. Return M, T×T, as {one}:
    M[i, j] = 0 where query i may read key j, and -inf where it may not.
    Query i may read key j when j is not in its future (j <= i) and both are real tokens
    (i < length and j < length). A padding query reads nothing: its whole row is -inf.

    (The grader computes S, adds your M, applies the softmax and A V itself.)""",
    ),
    "softmax": Exercise(
        "softmax",
        "softmax",
        "z",
        ("A",),
        """\
The attention weights of one sequence: A = softmax_last(Z), with Z = S + M.

    z: T×T {arr}, -inf where query i may not read key j. Return A, T×T: row i is
    query i's distribution over the keys it may read (it sums to 1; -inf entries get 0).
    Scores can be large: exp must not overflow. A row that is -inf everywhere (a padding
    query) reads nothing: it must come out as zeros, never NaN.

    (The grader computes S and M, calls your softmax on S + M, then forms A V itself.)""",
    ),
    "attention": Exercise(
        "attention",
        "attention",
        "q, k, v",
        ("S", "M", "A", "H"),
        """\
Causal self-attention for one sequence: H = softmax_last(Q Kᵀ / √d_k + M) V.

    q, k: T×d_k {arr}; v: T×d_v. Return H, T×d_v.

    S = Q Kᵀ / √d_k          T×T: S[i, j] compares query i with key j
    M                        T×T: 0 where j <= i, -inf where j > i (the future)
    A = softmax_last(S + M)  T×T: each row sums to 1 over the keys it may read
    H = A V                  T×d_v: row i is h_i""",
    ),
    "multihead": Exercise(
        "multihead",
        "multihead",
        "x, w_q, w_k, w_v, w_o, n_heads",
        ("S", "M", "A", "H", "O"),
        """\
Multi-head causal self-attention for one sequence: O = [H_0 … H_{{h-1}}] W_O.

    x: T×d_model {arr}; w_q, w_k: d_model×(h·d_k); w_v: d_model×(h·d_v);
    w_o: (h·d_v)×d_model; n_heads: h (an int). Return O, T×d_model.

    Q = X W_Q, K = X W_K, V = X W_V. Head n (n = 0 … h-1) uses columns n·d_k … (n+1)·d_k - 1
    of Q and K and n·d_v … (n+1)·d_v - 1 of V, and is causal self-attention with its own
    d_k: H_n = softmax_last(Q_n K_nᵀ / √d_k + M) V_n, T×d_v. The heads' outputs are put
    side by side in head order, [H_0 … H_{{h-1}}]: T×(h·d_v), then multiplied by W_O.""",
    ),
}

_IMPORT = {"numpy": "import numpy as np", "torch": "import torch"}
_ARR = {"numpy": "NumPy float arrays", "torch": "torch float tensors"}
_ONE = {"numpy": "a NumPy float array", "torch": "a torch float tensor"}


def _check(name: str, framework: str) -> Exercise:
    if name not in EXERCISES:
        raise ValueError(f"learn: unknown exercise {name!r}; choose one of {list(EXERCISES)}")
    if framework not in FRAMEWORKS:
        raise ValueError(f"learn: framework must be one of {FRAMEWORKS}, got {framework!r}")
    return EXERCISES[name]


def scaffold(name: str, framework: str = "numpy", filename: str | None = None) -> str:
    """The text of exercise ``name``'s scaffold file for ``framework`` ("numpy" | "torch");
    ``filename`` is the path its check command names (default ``NAME.py``)."""
    ex = _check(name, framework)
    doc = ex.doc.format(arr=_ARR[framework], one=_ONE[framework])
    return f'''{MARK} {name} ({framework})
"""Fill in `{ex.function}` below, then grade it:

    causalattn learn --check {filename or f"{name}.py"}

The grader runs your function on its own inputs, inside the rest of the attention
pipeline, and reports stage by stage what is right, the first stage that is wrong and a
hint. It never shows a solution. Positions are 0-based here, as in Python.
"""
{_IMPORT[framework]}


def {ex.function}({ex.params}):
    """{doc}
    """
    raise NotImplementedError("{ex.function}: not written yet")
'''


def write(
    name: str, path: str | Path | None = None, framework: str = "numpy", force: bool = False
) -> Path:
    """Write the scaffold to ``path`` (default ``NAME.py`` here); never over a file unless
    ``force``."""
    p = Path(path) if path is not None else Path(f"{name}.py")
    text = scaffold(name, framework, str(p))
    if p.exists() and not force:
        raise ValueError(f"learn: {p} exists already; choose another -o PATH (or --force)")
    p.write_text(text, encoding="utf-8")
    return p
