"""The dimension table of causal self-attention for any T, d_model and heads.

One row per matrix of the seed's table (Q, K, Kᵀ, QKᵀ, M, QKᵀ/√d_k + M, A, V, H,
W_Q, W_K, W_V, W_O), with its shape, parameter count, bytes and FLOPs::

    for row in shape_table(2048, 1000):
        print(row.symbol, row.shape, row.flops)   # Q (2048, 1000) 4096000000 ...

Conventions:

* Shapes are per sequence (B = 1). With h > 1 heads a per-head stage is ``h×T×d_k``
  (shape ``(h, T, d_k)``) and a weight is ``d_model×h·d_k``; with one head the head
  axis is left out, as in the seed.
* Bytes are what the array takes when materialized densely in that dtype (Kᵀ is
  listed at K's size, though NumPy and PyTorch make it a view; M as an additive
  float mask).
* FLOPs: a matrix product of ``m×k`` by ``k×n`` counts ``2·m·n·k`` (one multiply and
  one add per term); element-wise work counts one FLOP per element per operation
  (scale and add M: 2, softmax: 4 = subtract max, exp, sum, divide); a transpose,
  the mask itself and the weights count 0. A row carries the FLOPs of computing it,
  except W_O, which carries O = H W_O (the seed's table has no O row).
* docs/design.md's attention convention (FlashAttention's benchmarks) counts only the two
  T×T matrix products: QKᵀ + A V = ``4·B·H·T²·d`` for d_k = d_v = d, halved for causal
  because half of the T×T entries are never needed. The rows here are the dense matrix
  form (every entry computed, then masked), so ``QKᵀ.flops + H.flops`` equals
  :func:`attention_flops` with ``causal=False``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Row", "shape_table", "attention_flops", "score_flops", "BACKWARD_FACTOR"]

# The backward recomputes S and A and makes five T×T products where the forward makes
# two (dV = Aᵀ dH, dA = dH Vᵀ, dQ = dS K, dK = dSᵀ Q, plus S again): 2.5× the forward.
BACKWARD_FACTOR = 2.5


def score_flops(cells: float, d_k: int, d_v: int | None = None) -> float:
    """The attention FLOP convention for ``cells`` computed score entries (B·H·T_q·T_k, or
    the needed half under a causal mask): QKᵀ costs 2·d_k and A V 2·d_v per entry.
    The one formula every benchmark and the ring's statistics count with."""
    return 2 * cells * (d_k + (d_k if d_v is None else d_v))


@dataclass(frozen=True)
class Row:
    """One matrix of the table: its name, symbol, shape, parameters, bytes and FLOPs."""

    name: str
    symbol: str
    shape: tuple[int, ...]
    params: int
    bytes_fp32: int
    bytes_bf16: int
    flops: int
    explanation: str

    @property
    def notation(self) -> str:
        """The shape in the seed's notation, e.g. ``2048×1000``."""
        return "×".join(str(s) for s in self.shape)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "symbol": self.symbol,
            "shape": list(self.shape),
            "notation": self.notation,
            "params": self.params,
            "bytes_fp32": self.bytes_fp32,
            "bytes_bf16": self.bytes_bf16,
            "flops": self.flops,
            "explanation": self.explanation,
        }


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"shapes: {name} must be a positive integer, got {value!r}")
    return int(value)


def attention_flops(
    seq_len: int,
    d_head: int,
    n_heads: int = 1,
    batch: int = 1,
    causal: bool = True,
    *,
    keys: int | None = None,
    backward: bool = False,
) -> int:
    """docs/design.md's forward attention FLOPs: ``4·B·H·T²·d``, halved when causal
    (:func:`score_flops` over the needed entries). ``keys``: T_k when it differs from
    T = T_q (causal halves only a square); ``backward``: the backward's FLOPs instead
    (:data:`BACKWARD_FACTOR` × the forward's)."""
    T = _positive("seq_len", seq_len)
    d = _positive("d_head", d_head)
    H = _positive("n_heads", n_heads)
    B = _positive("batch", batch)
    T_k = T if keys is None else _positive("keys", keys)
    cells = B * H * T * T_k
    f = int(score_flops(cells, d))
    f = f // 2 if causal and T_k == T else f
    return int(f * BACKWARD_FACTOR) if backward else f


def shape_table(
    seq_len: int,
    d_model: int,
    n_heads: int = 1,
    d_k: int | None = None,
    d_v: int | None = None,
) -> list[Row]:
    """The seed's table for sequence length T = ``seq_len``, as a list of :class:`Row`.

    ``d_k`` defaults to ``d_model / n_heads`` (which must then divide evenly) and
    ``d_v`` to ``d_k``. See the module docstring for the byte and FLOP conventions.
    """
    T = _positive("seq_len", seq_len)
    D = _positive("d_model", d_model)
    h = _positive("n_heads", n_heads)
    if d_k is None:
        if D % h:
            raise ValueError(
                f"shapes: d_model = {D} is not divisible by n_heads = {h}; "
                "give d_k (and d_v) explicitly"
            )
        d_k = D // h
    d_k = _positive("d_k", d_k)
    d_v = d_k if d_v is None else _positive("d_v", d_v)

    def per_head(*dims: int) -> tuple[int, ...]:
        return dims if h == 1 else (h, *dims)

    hd = "" if h == 1 else f"{h}×"  # head prefix in the notation
    each = "" if h == 1 else f" in each of the {h} heads"
    rows: list[Row] = []

    def add(name, symbol, shape, flops, explanation, params=0):
        n = int(np.prod(shape))
        rows.append(Row(name, symbol, tuple(shape), params, 4 * n, 2 * n, int(flops), explanation))

    proj_k = 2 * T * D * h * d_k  # X W_Q: (T×d_model)(d_model×h·d_k)
    add("Query", "Q", per_head(T, d_k), proj_k, f"Q = X W_Q: sequence length × d_k{each}")
    add("Key", "K", per_head(T, d_k), proj_k, "K = X W_K: sequence length × d_k")
    add(
        "Key transpose",
        "Kᵀ",
        per_head(d_k, T),
        0,
        "transposed from K so the inner d_k axes contract (a view, no copy)",
    )
    add(
        "Product QKᵀ",
        "QKᵀ",
        per_head(T, T),
        2 * h * T * T * d_k,
        f"(T×d_k)(d_k×T) -> T×T{each}: one raw score per query-key pair",
    )
    add(
        "Attention mask",
        "M",
        (T, T),
        0,
        "causal mask, 0 on and below the diagonal, -∞ above; T×T, shared by every head",
    )
    add(
        "Scaled score + mask",
        "QKᵀ/√d_k + M",
        per_head(T, T),
        2 * h * T * T,
        "scale by 1/√d_k and add M element-wise: the shape is preserved",
    )
    add(
        "Attention weights",
        "A",
        per_head(T, T),
        4 * h * T * T,
        "A = softmax_last(…), row-wise over the key axis: the shape is preserved",
    )
    add("Value", "V", per_head(T, d_v), 2 * T * D * h * d_v, "V = X W_V: sequence length × d_v")
    add(
        "Output",
        "H",
        per_head(T, d_v),
        2 * h * T * T * d_v,
        f"H = A V: (T×T)(T×d_v) -> T×d_v{each}",
    )
    for name, sym, cols, what in (
        ("Query weights", "W_Q", h * d_k, "Query"),
        ("Key weights", "W_K", h * d_k, "Key"),
        ("Value weights", "W_V", h * d_v, "Value"),
    ):
        add(
            name,
            sym,
            (D, cols),
            0,
            f"d_model×{hd.replace('×', '·')}d_{'v' if sym == 'W_V' else 'k'}: projects the "
            f"input embedding to {what} space",
            params=D * cols,
        )
    add(
        "Output weights",
        "W_O",
        (h * d_v, D),
        2 * T * h * d_v * D,
        f"{hd.replace('×', '·')}d_v×d_model: projects the attention output back to the model "
        "dimension; FLOPs are those of O = H W_O",
        params=h * d_v * D,
    )
    return rows
