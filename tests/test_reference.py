"""The float64 reference and its Trace: the chapter's numbers, properties, bad input, files."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import causalattn as ca
from causalattn import masks
from causalattn.reference import softmax_last, trace
from causalattn.trace import STAGES, Trace

X4 = np.array([[1, 0], [0, 1], [1, 1], [-1, 1]], float)
I2 = np.eye(2)
WV4 = np.array([[1, 1], [1, -1]], float)

FAST = settings(max_examples=40, deadline=None)
finite = st.floats(-5, 5, allow_nan=False, allow_infinity=False, width=64)


def chapter():
    return trace(X4, I2, I2, WV4)


# -- the chapter's four-token trace ----------------------------------------------------


def test_chapter_numbers_to_three_decimals():
    tr = chapter()
    np.testing.assert_array_equal(tr.S[3].round(3), [-0.707, 0.707, 0.0, 1.414])
    np.testing.assert_array_equal(tr.A[3].round(3), [0.065, 0.266, 0.131, 0.539])
    np.testing.assert_array_equal(tr.H[3].round(3), [0.592, -1.279])
    assert tr.scale == pytest.approx(1 / np.sqrt(2))


def test_chapter_matrix_form_matches_per_row_loop():
    # H = A V for all four rows at once equals the chapter's one-query-at-a-time reading.
    tr = chapter()
    V = X4 @ WV4
    for i in range(4):
        s = np.array([X4[i] @ X4[j] / np.sqrt(2) for j in range(i + 1)])
        w = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
        np.testing.assert_allclose(tr.A[i, : i + 1], w, rtol=1e-14)
        np.testing.assert_allclose(tr.H[i], w @ V[: i + 1], rtol=1e-14, atol=1e-15)
    assert np.all(tr.A[np.triu_indices(4, 1)] == 0.0)


def test_stages_in_dependency_order_with_symbols_and_shapes():
    tr = chapter()
    assert tr.names == ["X", "W_q", "W_k", "W_v", "Q", "K", "V", "S", "M", "Z", "A", "H", "C"]
    assert [s.name for s in tr] == tr.names
    st_ = tr.stage("S")
    assert (st_.symbol, st_.notation, st_.shape) == ("S", "T×T", (4, 4))
    assert tr["A"] is tr.A
    assert np.isneginf(tr.M[0, 1]) and tr.M[1, 0] == 0
    # C[i, j] = A_ij v_j and sums to H over j
    np.testing.assert_allclose(tr.C.sum(axis=1), tr.H, atol=1e-15)
    with pytest.raises(KeyError):
        tr["O"]
    with pytest.raises(AttributeError):
        tr.O  # noqa: B018


def test_explain_the_four_quantities():
    tr = chapter()
    ex = tr.explain(3)
    np.testing.assert_array_equal(ex.weight, tr.A[3])
    np.testing.assert_allclose(ex.h, tr.H[3], atol=1e-15)
    np.testing.assert_allclose(ex.contribution, tr.A[3][:, None] * tr.V, atol=0)
    assert ex.rank_score.tolist() == [4, 2, 3, 1]
    assert ex.rank_weight.tolist() == [4, 2, 3, 1]
    np.testing.assert_allclose(ex.norm, np.linalg.norm(ex.contribution, axis=1))
    first = tr.explain(0)
    assert first.readable.tolist() == [True, False, False, False]
    assert first.rank_weight.tolist() == [1, 0, 0, 0]
    assert "blocked" in str(first)
    with pytest.raises(ValueError, match="explain"):
        tr.explain(4)


# -- properties ------------------------------------------------------------------------


@st.composite
def problems(draw, max_T=6, max_d=4):
    T = draw(st.integers(1, max_T))
    d = draw(st.integers(1, max_d))
    X = draw(hnp.arrays(np.float64, (T, d), elements=finite))
    Ws = [draw(hnp.arrays(np.float64, (d, d), elements=finite)) for _ in range(3)]
    return X, Ws


@FAST
@given(problems(), st.data())
def test_readable_rows_sum_to_one_forbidden_exactly_zero(prob, data):
    X, (Wq, Wk, Wv) = prob
    T = X.shape[0]
    allowed = data.draw(hnp.arrays(np.bool_, (T, T)))
    tr = trace(X, Wq, Wk, Wv, mask=allowed)
    has_key = allowed.any(axis=1)
    np.testing.assert_allclose(tr.A[has_key].sum(axis=1), 1.0, rtol=0, atol=1e-12)
    assert np.all(tr.A[~allowed] == 0.0)
    # rows with no readable key: zero weights and a zero output, never NaN
    assert np.all(tr.A[~has_key] == 0.0) and np.all(tr.H[~has_key] == 0.0)
    assert np.isfinite(tr.A).all() and np.isfinite(tr.H).all()


@FAST
@given(
    st.integers(1, 6).flatmap(
        lambda T: st.tuples(
            hnp.arrays(np.float64, (T, T), elements=finite),
            hnp.arrays(np.float64, (T,), elements=st.floats(-1e3, 1e3)),
        )
    )
)
def test_adding_a_constant_to_a_row_of_S_changes_nothing(zc):
    Z, c = zc
    allowed = masks.causal(Z.shape[0])
    np.testing.assert_allclose(
        softmax_last(Z + c[:, None], allowed), softmax_last(Z, allowed), rtol=1e-9, atol=1e-12
    )


@FAST
@given(problems(max_T=7), st.data(), st.sampled_from([np.nan, np.inf, -np.inf]))
def test_nonfinite_future_inputs_leave_earlier_outputs_bit_identical(prob, data, bad):
    X, (Wq, Wk, Wv) = prob
    T = X.shape[0]
    t = data.draw(st.integers(0, T - 1))  # positions t.. are poisoned
    Wo = np.eye(X.shape[1])
    clean = trace(X, Wq, Wk, Wv, Wo)
    Xbad = X.copy()
    Xbad[t:] = bad
    dirty = trace(Xbad, Wq, Wk, Wv, Wo)
    for name in ("A", "H", "O"):
        np.testing.assert_array_equal(dirty[name][:t], clean[name][:t])
    assert np.all(dirty.A[:t, t:] == 0.0)


@FAST
@given(st.integers(1, 3), st.integers(2, 6), st.data())
def test_nonfinite_padding_inputs_leave_real_outputs_bit_identical(B, T, data):
    d = 3
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    X = rng.normal(size=(B, T, d))
    Wq, Wk, Wv = (rng.normal(size=(d, d)) for _ in range(3))
    lengths = np.array(data.draw(st.lists(st.integers(0, T), min_size=B, max_size=B)))
    allowed = masks.combine(
        masks.causal(T)[None],
        masks.key_padding(lengths, T)[:, None, :],
        masks.query_padding(lengths, T)[:, :, None],
    )
    clean = trace(X, Wq, Wk, Wv, mask=allowed)
    Xbad = X.copy()
    for b, L in enumerate(lengths):
        Xbad[b, L:] = np.nan
    dirty = trace(Xbad, Wq, Wk, Wv, mask=allowed)
    for b, L in enumerate(lengths):
        np.testing.assert_array_equal(dirty.H[b, :L], clean.H[b, :L])
        np.testing.assert_array_equal(dirty.A[b, :L], clean.A[b, :L])
        # padding queries have no readable key: zero, not NaN
        assert np.all(dirty.H[b, L:] == 0.0) and np.all(dirty.A[b, L:] == 0.0)


@FAST
@given(problems(max_T=6, max_d=3))
def test_huge_scores_stay_finite(prob):
    X, (Wq, Wk, Wv) = prob
    X = np.where(X >= 0, 100.0, -100.0) + X  # |x| >= 100: S_ii = ‖x_i‖²/√d >= 1e4
    tr = trace(X, np.eye(X.shape[1]), np.eye(X.shape[1]), Wv)
    assert np.abs(tr.S).max() >= 1e4
    assert np.isfinite(tr.A).all() and np.isfinite(tr.H).all()
    np.testing.assert_allclose(tr.A.sum(axis=1), 1.0, atol=1e-12)


@FAST
@given(problems(), st.data())
def test_finite_fill_gives_the_same_weights_as_minus_inf(prob, data):
    X, (Wq, Wk, Wv) = prob
    T = X.shape[0]
    allowed = masks.combine(masks.causal(T), data.draw(hnp.arrays(np.bool_, (T, T))))
    a = trace(X, Wq, Wk, Wv, mask=allowed, fill="-inf")
    b = trace(X, Wq, Wk, Wv, mask=allowed, fill="finite")
    assert np.isfinite(b.M).all() and np.all(b.M[~allowed] == np.finfo(np.float64).min)
    np.testing.assert_array_equal(a.A, b.A)
    np.testing.assert_array_equal(a.H, b.H)


# -- bad input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((X4, np.eye(3), I2, WV4), {}, r"projections: X is T×d_model = 4×2 but W_q is 3×3"),
        ((X4, I2, np.ones((2, 3)), WV4), {}, r"scores: W_q gives d_k = 2 but W_k gives 3"),
        ((X4, np.ones(2), I2, WV4), {}, r"projections: W_q must be 2-D, got shape \(2,\)"),
        ((X4, np.ones((1, 2, 2)), I2, WV4), {}, r"projections: W_q must be 2-D"),
        ((np.ones(2), I2, I2, WV4), {}, r"projections: X must have at least 2 axes"),
        ((np.zeros((0, 2)), I2, I2, WV4), {}, r"projections: X is 0×2"),
        ((np.array([["a", "b"]]), I2, I2, WV4), {}, r"projections: X must be a real numeric"),
        ((X4, [[1, "x"], [0, 1]], I2, WV4), {}, r"projections: W_q must be a real numeric"),
        ((X4 + 0j, I2, I2, WV4), {}, r"projections: X must be a real numeric"),
        (
            (X4, I2, I2, WV4, np.eye(3)),
            {},
            r"output projection: H is T×\(h·d_v\) = 4×2 but W_o is 3×3",
        ),
        ((X4, I2, I2, WV4), {"mask": np.ones((4, 4))}, r"mask: must be boolean"),
        ((X4, I2, I2, WV4), {"mask": np.ones((3, 3), bool)}, r"mask: must end in T×T = 4×4"),
        ((X4, np.eye(2, 3), np.eye(2, 3), WV4), {"n_heads": 3}, r"not divisible by n_heads=3"),
        ((X4, I2, I2, WV4), {"n_heads": 0}, r"n_heads must be a positive integer"),
        ((X4, I2, I2, WV4), {"fill": "zero"}, r"fill must be"),
    ],
)
def test_bad_input_names_the_stage_and_shapes(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        trace(*args, **kwargs)


def test_ragged_input_is_a_value_error():
    with pytest.raises(ValueError, match="projections: X"):
        trace([[1, 2], [3]], I2, I2, WV4)


def test_single_token_works():
    tr = trace(np.array([[0.3, -2.0]]), I2, I2, WV4)
    assert tr.A.tolist() == [[1.0]]
    np.testing.assert_array_equal(tr.H, tr.V)


# -- files, heads, batches -------------------------------------------------------------


def test_save_load_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    X = rng.normal(size=(2, 5, 4))
    W = [rng.normal(size=(4, 4)) for _ in range(4)]
    tr = trace(X, *W, n_heads=2, tokens=list("abcde"))
    path = tmp_path / "t.npz"
    tr.save(path)
    back = Trace.load(path)
    assert back.names == tr.names
    for name in tr.names:
        np.testing.assert_array_equal(back[name], tr[name])
    np.testing.assert_array_equal(back.allowed, tr.allowed)
    assert (back.scale, back.n_heads, back.tokens) == (tr.scale, 2, list("abcde"))
    with np.load(path, allow_pickle=False) as f:  # plain named arrays, no pickles
        assert set(tr.names) <= set(f.files)


def test_load_rejects_non_npz(tmp_path):
    p = tmp_path / "x.npz"
    p.write_text("not a zip")
    with pytest.raises(ValueError, match="trace file"):
        Trace.load(p)
    with pytest.raises(ValueError, match="unknown stage"):
        Trace({"Y": np.zeros(2)})


def test_multi_head_equals_single_heads_on_sliced_weights():
    rng = np.random.default_rng(2)
    h, dk, dv, D, T = 3, 2, 4, 5, 6
    X = rng.normal(size=(T, D))
    Wq, Wk = rng.normal(size=(D, h * dk)), rng.normal(size=(D, h * dk))
    Wv, Wo = rng.normal(size=(D, h * dv)), rng.normal(size=(h * dv, D))
    tr = trace(X, Wq, Wk, Wv, Wo, n_heads=h)
    assert tr.Q.shape == (h, T, dk) and tr.A.shape == (h, T, T) and tr.O.shape == (T, D)
    singles = []
    for k in range(h):
        sq, sv = slice(k * dk, (k + 1) * dk), slice(k * dv, (k + 1) * dv)
        one = trace(X, Wq[:, sq], Wk[:, sq], Wv[:, sv])
        singles.append(one)
        for name in ("Q", "K", "V", "S", "A", "H", "C"):
            np.testing.assert_allclose(tr[name][k], one[name], rtol=1e-12, atol=1e-12)
        head = tr.heads[k]
        assert head.n_heads is None and "O" not in head
        np.testing.assert_array_equal(head.A, tr.A[k])
        np.testing.assert_array_equal(head.H, tr.select(k).H)
    concat = np.concatenate([s.H for s in singles], axis=-1)  # T×(h·d_v)
    np.testing.assert_allclose(tr.O, concat @ Wo, rtol=1e-12, atol=1e-12)


def test_batch_broadcast_and_select():
    rng = np.random.default_rng(3)
    B, T, D, h = 2, 4, 4, 2
    X = rng.normal(size=(B, T, D))
    W = [rng.normal(size=(D, D)) for _ in range(4)]
    tr = trace(X, *W, n_heads=h)
    assert tr.A.shape == (B, h, T, T) and tr.O.shape == (B, T, D)
    with pytest.raises(ValueError, match="select a sequence first"):
        tr.heads  # noqa: B018
    for b in range(B):
        one = trace(X[b], *W, n_heads=h)
        sel = tr.select(b)
        assert sel.n_heads == h
        for name in one.names:
            np.testing.assert_allclose(sel[name], one[name], rtol=1e-12, atol=1e-12)
        assert len(sel.heads) == h
        np.testing.assert_array_equal(sel.heads[1].A, tr.A[b, 1])
        ex = tr.select(b, 1).explain(T - 1)
        np.testing.assert_allclose(ex.h, tr.H[b, 1, T - 1], atol=1e-12)
    # a per-sequence mask (B, T, T) broadcasts over heads
    lengths = np.array([4, 2])
    allowed = masks.combine(masks.causal(T)[None], masks.key_padding(lengths, T)[:, None, :])
    trm = trace(X, *W, n_heads=h, mask=allowed)
    assert np.all(trm.A[1, :, :, 2:] == 0.0)


def test_package_exports():
    assert ca.trace is trace and ca.Trace is Trace
    assert list(STAGES)[:4] == ["X", "W_q", "W_k", "W_v"]


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        (
            (X4, np.eye(3), I2, WV4),
            {},
            "projections: X is T×d_model = 4×2 but W_q is 3×3; its rows must be d_model = 2",
        ),
        (
            (X4, I2, np.ones((2, 3)), WV4),
            {},
            "scores: W_q gives d_k = 2 but W_k gives 3; Q Kᵀ contracts the inner d_k axes, which "
            "must match",
        ),
        ((X4, np.ones(2), I2, WV4), {}, "projections: W_q must be 2-D, got shape (2,)"),
        ((X4, I2, I2, np.ones(2)), {}, "projections: W_v must be 2-D, got shape (2,)"),
        ((np.ones(2), I2, I2, WV4), {}, "projections: X must have at least 2 axes, got shape (2,)"),
        (
            (np.zeros((0, 2)), I2, I2, WV4),
            {},
            "projections: X is 0×2; a sequence needs T >= 1 token",
        ),
        (
            (np.array([["a", "b"]]), I2, I2, WV4),
            {},
            "projections: X must be a real numeric array, got dtype <U1",
        ),
        (
            (X4, I2, I2, WV4, np.eye(3)),
            {},
            "output projection: H is T×(h·d_v) = 4×2 but W_o is 3×3; its rows must be h·d_v = 2",
        ),
        (
            (X4, I2, I2, WV4, np.ones(3)),
            {},
            "output projection: W_o must be 2-D, got shape (3,)",
        ),
        (
            (X4, I2, I2, WV4),
            {"mask": np.ones((4, 4))},
            "mask: must be boolean (True = may read), got dtype float64",
        ),
        (
            (X4, I2, I2, WV4),
            {"mask": np.ones((3, 3), bool)},
            "mask: must end in T×T = 4×4, got shape (3, 3)",
        ),
        (
            (X4, I2, I2, WV4),
            {"mask": np.ones(4, bool)},
            "mask: must end in T×T = 4×4, got shape (4,)",
        ),
        (
            (X4, I2, I2, WV4),
            {"mask": np.ones((3, 2, 4, 4), bool), "n_heads": 2},
            "mask: with n_heads=2 and X of leading axes (), give T×T, X's leading axes + T×T, "
            "or X's leading axes + (h, T, T); got shape (3, 2, 4, 4)",
        ),
        (
            (X4, np.eye(2, 4), np.eye(2, 4), np.eye(2, 3)),
            {"n_heads": 2},
            "projections: W_v has 3 columns, not divisible by n_heads=2 (it must be d_model×(h·d))",
        ),
        (
            (X4, np.eye(2, 3), np.eye(2, 3), np.eye(2, 4)),
            {"n_heads": 2},
            "projections: W_q has 3 columns, not divisible by n_heads=2 (it must be d_model×(h·d))",
        ),
        (
            (X4, I2, I2, WV4),
            {"n_heads": 0},
            "projections: n_heads must be a positive integer, got 0",
        ),
        (
            (X4, I2, I2, WV4),
            {"n_heads": True},
            "projections: n_heads must be a positive integer, got True",
        ),
        (
            (X4, I2, I2, WV4),
            {"scale": float("nan")},
            "scores: scale must be a finite number, got nan",
        ),
        ((X4, I2, I2, WV4), {"scale": True}, "scores: scale must be a finite number, got True"),
        ((X4, I2, I2, WV4), {"scale": "1"}, "scores: scale must be a finite number, got '1'"),
        (
            (X4, I2, I2, WV4),
            {"lengths": [4]},
            "mask: lengths, key_padding_mask, prefix_lengths or a per-sequence mask need X of "
            "shape (B, T, d_model); got leading axes ()",
        ),
        ((X4, I2, I2, WV4), {"dropout_p": 2.0}, "dropout: dropout_p must lie in [0, 1], got 2.0"),
    ],
)
def test_bad_input_messages_in_full(args, kwargs, message):
    with pytest.raises(ValueError) as e:
        trace(*args, **kwargs)
    assert str(e.value) == message
