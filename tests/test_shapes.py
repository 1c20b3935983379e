"""shapes: the seed's dimension table (2048 tokens, d_model 1000, one head) and beyond."""

from __future__ import annotations

import numpy as np
import pytest

import causalattn as ca
from causalattn.matrix_form import trace
from causalattn.shapes import BACKWARD_FACTOR, Row, attention_flops, score_flops, shape_table

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


@pytest.mark.parametrize(
    "kwargs,name,value",
    [
        ({"seq_len": 0}, "seq_len", "0"),
        ({"d_head": -2}, "d_head", "-2"),
        ({"n_heads": 0}, "n_heads", "0"),
        ({"batch": 1.5}, "batch", "1.5"),
        ({"keys": 0}, "keys", "0"),
        ({"seq_len": True}, "seq_len", "True"),
        ({"d_head": "8"}, "d_head", "'8'"),
    ],
)
def test_attention_flops_refuses_sizes_by_name(kwargs, name, value):
    args = {"seq_len": 4, "d_head": 8, **kwargs}
    with pytest.raises(ValueError) as e:
        attention_flops(**args)
    assert str(e.value) == f"shapes: {name} must be a positive integer, got {value}"


def test_attention_flops_are_integers_of_the_convention():
    """4·B·H·T²·d, causal halved; backward 2.5×; NumPy integers are sizes too."""
    cases = [((3, 5), 4 * 9 * 5 // 2), ((3, 5, 2, 7), 4 * 7 * 2 * 9 * 5 // 2)]
    for args, want in cases:
        got = attention_flops(*args)
        assert type(got) is int and got == want
        back = attention_flops(*args, backward=True)
        assert type(back) is int and back == int(want * BACKWARD_FACTOR)
    assert attention_flops(np.int64(3), np.int32(5)) == 90
    assert attention_flops(3, 5, causal=False) == 180 and BACKWARD_FACTOR == 2.5
    assert type(attention_flops(3, 5, keys=4, causal=False)) is int
    assert score_flops(10, 3) == 2 * 10 * 6 and score_flops(10, 3, 5) == 2 * 10 * 8
    assert score_flops(2.5, 2, 0) == 10.0


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"seq_len": 0}, "shapes: seq_len must be a positive integer, got 0"),
        ({"d_model": -1}, "shapes: d_model must be a positive integer, got -1"),
        ({"n_heads": 0}, "shapes: n_heads must be a positive integer, got 0"),
        ({"d_k": 0}, "shapes: d_k must be a positive integer, got 0"),
        ({"d_v": 2.5}, "shapes: d_v must be a positive integer, got 2.5"),
        (
            {"d_model": 10, "n_heads": 3},
            "shapes: d_model = 10 is not divisible by n_heads = 3; give d_k (and d_v) explicitly",
        ),
    ],
)
def test_shape_table_messages_name_the_size(kwargs, message):
    args = {"seq_len": 8, "d_model": 8, **kwargs}
    with pytest.raises(ValueError) as e:
        shape_table(**args)
    assert str(e.value) == message


def test_every_row_of_one_head_and_of_three_heads():
    """Names, shapes, parameters, bytes, FLOPs and explanations, row by row."""
    one = {r.symbol: r for r in shape_table(4, 6, d_k=2, d_v=3)}
    three = {r.symbol: r for r in shape_table(4, 6, n_heads=3)}  # d_k = d_v = 2
    want = {  # symbol: (name, one head's shape and FLOPs, three heads' shape and FLOPs)
        "Q": ("Query", (4, 2), 2 * 4 * 6 * 2, (3, 4, 2), 2 * 4 * 6 * 3 * 2),
        "K": ("Key", (4, 2), 2 * 4 * 6 * 2, (3, 4, 2), 2 * 4 * 6 * 3 * 2),
        "Kᵀ": ("Key transpose", (2, 4), 0, (3, 2, 4), 0),
        "QKᵀ": ("Product QKᵀ", (4, 4), 2 * 16 * 2, (3, 4, 4), 2 * 3 * 16 * 2),
        "M": ("Attention mask", (4, 4), 0, (4, 4), 0),
        "QKᵀ/√d_k + M": ("Scaled score + mask", (4, 4), 2 * 16, (3, 4, 4), 2 * 3 * 16),
        "A": ("Attention weights", (4, 4), 4 * 16, (3, 4, 4), 4 * 3 * 16),
        "V": ("Value", (4, 3), 2 * 4 * 6 * 3, (3, 4, 2), 2 * 4 * 6 * 3 * 2),
        "H": ("Output", (4, 3), 2 * 16 * 3, (3, 4, 2), 2 * 3 * 16 * 2),
        "W_Q": ("Query weights", (6, 2), 0, (6, 6), 0),
        "W_K": ("Key weights", (6, 2), 0, (6, 6), 0),
        "W_V": ("Value weights", (6, 3), 0, (6, 6), 0),
        "W_O": ("Output weights", (3, 6), 2 * 4 * 3 * 6, (6, 6), 2 * 4 * 6 * 6),
    }
    assert list(one) == list(want) == list(three)
    for sym, (name, s1, f1, s3, f3) in want.items():
        for rows, shape, flops in ((one, s1, f1), (three, s3, f3)):
            r = rows[sym]
            n = int(np.prod(shape))
            assert (r.name, r.shape, r.flops) == (name, shape, flops), sym
            assert (r.bytes_fp32, r.bytes_bf16) == (4 * n, 2 * n), sym
            assert r.params == (n if sym.startswith("W_") else 0), sym
            assert type(r.flops) is int and type(r.params) is int
    assert one["Q"].explanation == "Q = X W_Q: sequence length × d_k"
    assert three["Q"].explanation == "Q = X W_Q: sequence length × d_k in each of the 3 heads"
    assert three["QKᵀ"].explanation == (
        "(T×d_k)(d_k×T) -> T×T in each of the 3 heads: one raw score per query-key pair"
    )
    assert one["H"].explanation == "H = A V: (T×T)(T×d_v) -> T×d_v"
    assert one["W_Q"].explanation == "d_model×d_k: projects the input embedding to Query space"
    assert three["W_V"].explanation == "d_model×3·d_v: projects the input embedding to Value space"
    assert three["W_K"].explanation.startswith("d_model×3·d_k: ")
    assert one["W_O"].explanation.startswith("d_v×d_model: projects the attention output")
    assert three["W_O"].explanation.startswith("3·d_v×d_model: ")
    assert "O = H W_O" in three["W_O"].explanation
    assert one["M"].explanation.startswith("causal mask, 0 on and below the diagonal")


def test_row_to_dict_has_every_field():
    r = shape_table(5, 4, n_heads=2)[0]
    assert r.to_dict() == {
        "name": "Query",
        "symbol": "Q",
        "shape": [2, 5, 2],
        "notation": "2×5×2",
        "params": 0,
        "bytes_fp32": 80,
        "bytes_bf16": 40,
        "flops": 2 * 5 * 4 * 2 * 2,
        "explanation": "Q = X W_Q: sequence length × d_k in each of the 2 heads",
    }
    assert type(r.to_dict()["shape"]) is list


EXPLAINED = {  # what `causalattn shapes` prints beside each row ({each}: per head, {h}: heads)
    "Q": "Q = X W_Q: sequence length × d_k{each}",
    "K": "K = X W_K: sequence length × d_k",
    "Kᵀ": "transposed from K so the inner d_k axes contract (a view, no copy)",
    "QKᵀ": "(T×d_k)(d_k×T) -> T×T{each}: one raw score per query-key pair",
    "M": "causal mask, 0 on and below the diagonal, -∞ above; T×T, shared by every head",
    "QKᵀ/√d_k + M": "scale by 1/√d_k and add M element-wise: the shape is preserved",
    "A": "A = softmax_last(…), row-wise over the key axis: the shape is preserved",
    "V": "V = X W_V: sequence length × d_v",
    "H": "H = A V: (T×T)(T×d_v) -> T×d_v{each}",
    "W_Q": "d_model×{h}d_k: projects the input embedding to Query space",
    "W_K": "d_model×{h}d_k: projects the input embedding to Key space",
    "W_V": "d_model×{h}d_v: projects the input embedding to Value space",
    "W_O": "{h}d_v×d_model: projects the attention output back to the model dimension; "
    "FLOPs are those of O = H W_O",
}


@pytest.mark.parametrize("h", [1, 2, 3])
def test_every_rows_explanation(h):
    each = "" if h == 1 else f" in each of the {h} heads"
    heads = "" if h == 1 else f"{h}·"
    got = {r.symbol: r.explanation for r in shape_table(4, 6, n_heads=h)}
    assert got == {s: e.format(each=each, h=heads) for s, e in EXPLAINED.items()}
