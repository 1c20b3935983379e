"""shapes: the seed's dimension table (2048 tokens, d_model 1000, one head) and beyond."""

from __future__ import annotations

import numpy as np
import pytest

import causalattn as ca
from causalattn.reference import trace
from causalattn.shapes import Row, attention_flops, shape_table

# The seed's tables, verbatim: (symbol, shape).
SEED_TABLE = [
    ("Q", "2048×1000"),
    ("K", "2048×1000"),
    ("Kᵀ", "1000×2048"),
    ("QKᵀ", "2048×2048"),
    ("M", "2048×2048"),
    ("QKᵀ/√d_k + M", "2048×2048"),
    ("A", "2048×2048"),
    ("V", "2048×1000"),
    ("H", "2048×1000"),
    ("W_Q", "1000×1000"),
    ("W_K", "1000×1000"),
    ("W_V", "1000×1000"),
    ("W_O", "1000×1000"),
]


def test_seed_table_2048_by_1000():
    rows = shape_table(2048, 1000)
    assert [(r.symbol, r.notation) for r in rows] == SEED_TABLE
    by = {r.symbol: r for r in rows}
    for r in rows:
        n = int(np.prod(r.shape))
        assert (r.bytes_fp32, r.bytes_bf16) == (4 * n, 2 * n)
        assert r.params == (1000 * 1000 if r.symbol.startswith("W_") else 0)
        assert r.explanation
    assert by["Q"].flops == 2 * 2048 * 1000 * 1000
    assert by["QKᵀ"].flops == 2 * 2048 * 2048 * 1000
    assert by["H"].flops == 2 * 2048 * 2048 * 1000
    assert by["Kᵀ"].flops == 0 and by["M"].flops == 0
    assert by["A"].bytes_fp32 == 2048 * 2048 * 4  # 16 MiB per T×T matrix in fp32
    # docs/design.md's convention: QKᵀ + A V = 4·T²·d dense; causal halves it
    dense = by["QKᵀ"].flops + by["H"].flops
    assert dense == attention_flops(2048, 1000, causal=False) == 4 * 2048**2 * 1000
    assert attention_flops(2048, 1000) == dense // 2


def test_multi_head_shapes():
    rows = {r.symbol: r for r in shape_table(16, 64, n_heads=4)}
    assert rows["Q"].shape == (4, 16, 16) and rows["Kᵀ"].shape == (4, 16, 16)
    assert rows["QKᵀ"].shape == (4, 16, 16) and rows["M"].shape == (16, 16)
    assert rows["W_Q"].shape == (64, 64) and rows["W_O"].shape == (64, 64)
    rows = {r.symbol: r for r in shape_table(10, 12, n_heads=3, d_k=5, d_v=7)}
    assert rows["Q"].notation == "3×10×5" and rows["V"].notation == "3×10×7"
    assert rows["W_Q"].shape == (12, 15) and rows["W_V"].shape == (12, 21)
    assert rows["W_O"].shape == (21, 12) and rows["W_O"].params == 21 * 12
    assert rows["QKᵀ"].flops + rows["H"].flops == 2 * 3 * 10 * 10 * (5 + 7)


def test_table_agrees_with_a_real_trace():
    T, D, h = 5, 6, 2
    rng = np.random.default_rng(0)
    W = [rng.normal(size=(D, D)) for _ in range(4)]
    tr = trace(rng.normal(size=(T, D)), *W, n_heads=h)
    rows = {r.symbol: r for r in shape_table(T, D, n_heads=h)}
    for sym, stage in (
        ("Q", "Q"),
        ("K", "K"),
        ("V", "V"),
        ("A", "A"),
        ("H", "H"),
        ("W_Q", "W_q"),
        ("W_O", "W_o"),
    ):
        assert rows[sym].shape == tr[stage].shape, sym
    assert rows["QKᵀ/√d_k + M"].shape == tr.Z.shape
    assert rows["M"].shape == tr.allowed.shape


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((0, 8), {}, "shapes: seq_len must be a positive integer"),
        ((8, -1), {}, "shapes: d_model"),
        ((8, 8), {"n_heads": 0}, "shapes: n_heads"),
        ((8, 10), {"n_heads": 3}, "d_model = 10 is not divisible by n_heads = 3"),
        ((8, 10), {"n_heads": 3, "d_k": 0}, "shapes: d_k"),
        ((8, 8), {"d_v": 2.5}, "shapes: d_v"),
        ((True, 8), {}, "shapes: seq_len"),
    ],
)
def test_bad_sizes(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        shape_table(*args, **kwargs)


def test_row_and_exports():
    r = shape_table(3, 3, n_heads=3, d_k=1)[0]
    assert isinstance(r, Row) and r.shape == (3, 3, 1)
    assert r.to_dict()["notation"] == "3×3×1"
    with pytest.raises(AttributeError):
        r.flops = 0
    assert ca.shape_table is shape_table


def test_attention_flops_causal_halves_only_a_square():
    """keys= T_k: a rectangle (decoding, a ring's block pair) counts every T_q·T_k entry,
    causal or not; causal halves only T_k = T (keys=T is the default)."""
    for T, T_k, d, H, B in ((1, 1000, 64, 12, 4), (7, 3, 5, 2, 1), (16, 48, 8, 1, 2)):
        full = 4 * B * H * T * T_k * d
        for causal in (True, False):
            assert attention_flops(T, d, H, B, causal, keys=T_k) == full
            assert attention_flops(T, d, H, B, causal, keys=T_k, backward=True) == int(full * 2.5)
        square = 4 * B * H * T * T * d
        assert attention_flops(T, d, H, B, keys=T) == attention_flops(T, d, H, B) == square // 2
        assert attention_flops(T, d, H, B, False, keys=T) == square
    with pytest.raises(ValueError, match="keys must be a positive integer"):
        attention_flops(4, 8, keys=0)
