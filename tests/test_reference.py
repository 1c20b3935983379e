"""The float64 reference and its Trace: the chapter's numbers, properties, bad input, files."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import causalattn as ca
from causalattn import masks
from causalattn._trace import STAGES, Trace
from causalattn.matrix_form import softmax_last, stages, trace, weighted_values

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
    tr = trace(X, Wq, Wk, Wv, mask=allowed, causal=False)
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
    clean = trace(X, Wq, Wk, Wv, mask=allowed, causal=False)
    Xbad = X.copy()
    for b, L in enumerate(lengths):
        Xbad[b, L:] = np.nan
    dirty = trace(Xbad, Wq, Wk, Wv, mask=allowed, causal=False)
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
    a = trace(X, Wq, Wk, Wv, mask=allowed, fill="-inf", causal=False)
    b = trace(X, Wq, Wk, Wv, mask=allowed, fill="finite", causal=False)
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
    trm = trace(X, *W, n_heads=h, mask=allowed, causal=False)
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
        (
            (X4, np.ones((3, 2)), I2, WV4),
            {},
            "projections: X is T×d_model = 4×2 but W_q is 3×2; its rows must be d_model = 2",
        ),
        (
            (np.ones((2, 4, 2)), I2, I2, WV4, np.ones((3, 5))),
            {},
            "output projection: H is T×(h·d_v) = 4×2 but W_o is 3×5; its rows must be h·d_v = 2",
        ),
    ],
)
def test_bad_input_messages_in_full(args, kwargs, message):
    with pytest.raises(ValueError) as e:
        trace(*args, **kwargs)
    assert str(e.value) == message


# -- softmax_last and weighted_values by hand ------------------------------------------


def _softmax_by_hand(z, readable, sink=None):
    """One row: exp over the readable entries, over their sum (+ e^sink); 0 elsewhere."""
    out = np.zeros(len(z))
    cols = np.flatnonzero(readable)
    if cols.size:
        e = np.exp(z[cols] - z[cols].max())
        denom = e.sum() + (0.0 if sink is None else np.exp(sink - z[cols].max()))
        out[cols] = e / denom
    return out


def test_softmax_last_matches_the_row_by_hand_and_ignores_blocked_values():
    Z = np.array([[1.0, 2.0, 3.0], [0.5, -1.0, 7.0], [4.0, 4.0, 4.0], [1.0, 2.0, 3.0]])
    allowed = np.array([[1, 0, 1], [1, 1, 0], [0, 0, 0], [0, 1, 0]], bool)
    A = softmax_last(Z, allowed)
    for i in range(4):
        np.testing.assert_allclose(A[i], _softmax_by_hand(Z[i], allowed[i]), rtol=1e-15)
    # blocked entries: exactly 0, and neither a huge finite value nor NaN there moves a row
    dirty = np.where(allowed, Z, np.array([[1e300], [np.nan], [-np.inf], [np.inf]]))
    np.testing.assert_array_equal(softmax_last(dirty, allowed), A)
    assert np.all(A[~allowed] == 0.0) and np.all(A[2] == 0.0)
    # a readable NaN poisons its row where it reads, and only there
    Zn = Z.copy()
    Zn[0, 0] = np.nan
    row = softmax_last(Zn, allowed)[0]
    assert np.isnan(row[[0, 2]]).all() and row[1] == 0.0
    # the key axis may be empty: no weights at all, not an error
    assert softmax_last(np.zeros((3, 0)), np.zeros((3, 0), bool)).shape == (3, 0)


def test_softmax_last_broadcasts_allowed_over_leading_axes():
    rng = np.random.default_rng(5)
    Z = rng.normal(size=(2, 3, 4, 4))
    A = softmax_last(Z, masks.causal(4))
    for b, h, i in np.ndindex(2, 3, 4):
        np.testing.assert_allclose(
            A[b, h, i], _softmax_by_hand(Z[b, h, i], masks.causal(4)[i]), rtol=1e-14
        )


def test_sinks_join_the_denominator_and_a_sink_above_the_row_is_exact():
    Z = np.array([[0.0, 1.0, 2.0], [0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    allowed = np.array([[1, 1, 1], [1, 1, 0], [0, 0, 0]], bool)
    for sink in (-3.0, 0.5, 5.0, 700.0):  # below, inside, above the row's maximum
        A = softmax_last(Z, allowed, sinks=np.full((3, 1), sink))
        for i in range(2):
            np.testing.assert_allclose(
                A[i], _softmax_by_hand(Z[i], allowed[i], sink), rtol=1e-13, atol=1e-300
            )
        assert np.all(A[2] == 0.0)  # no readable key: still a zero row, the sink reads nothing
        assert np.all(A.sum(axis=-1)[:2] < 1.0)
    # one sink per row, broadcast as (T_q, 1)
    sinks = np.array([[0.0], [2.0], [9.0]])
    A = softmax_last(Z, allowed, sinks=sinks)
    np.testing.assert_allclose(A[1], _softmax_by_hand(Z[1], allowed[1], 2.0), rtol=1e-14)


def test_softmax_last_raises_no_floating_point_warning():
    # huge logits, a huge sink beside a row with no key, NaN at blocked cells: all quiet
    Z = np.array([[1e308, -1e308, np.nan], [0.0, 0.0, 0.0]])
    allowed = np.array([[1, 1, 0], [0, 0, 0]], bool)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        A = softmax_last(Z, allowed, sinks=np.full((2, 1), 1000.0))
        B = softmax_last(Z, allowed)
    assert A[1].tolist() == [0.0, 0.0, 0.0] and A[0, 2] == 0.0
    assert B[0].tolist() == [1.0, 0.0, 0.0]


def test_weighted_values_keeps_nonfinite_values_out_of_rows_that_cannot_read_them():
    rng = np.random.default_rng(6)
    T, d = 5, 3
    V = rng.normal(size=(2, T, d))
    allowed = np.broadcast_to(masks.causal(T), (2, T, T)).copy()
    allowed[1, 4, 2] = False  # head 1's last row may not read key 2
    A = softmax_last(rng.normal(size=(2, T, T)), allowed)
    clean = weighted_values(A, V, allowed)
    np.testing.assert_array_equal(clean, A @ V)  # all finite: the plain product
    bad = V.copy()
    bad[:, 2] = [np.nan, np.inf, -np.inf]
    H = weighted_values(A, bad, allowed)
    # rows before key 2 (and head 1's last row) cannot read it: bit for bit as before
    np.testing.assert_array_equal(H[:, :2], clean[:, :2])
    np.testing.assert_allclose(H[1, 4], A[1, 4, [0, 1, 3, 4]] @ V[1, [0, 1, 3, 4]], rtol=1e-14)
    # the rows that read it are not finite
    assert not np.isfinite(H[0, 2:]).any() and not np.isfinite(H[1, 2:4]).any()


# -- the modifiers' stages, each by hand ------------------------------------------------


def _batched(B=2, T=4, D=4, seed=7):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(B, T, D)), [rng.normal(size=(D, D)) for _ in range(4)]


def _distance(T):
    i, j = np.indices((T, T))
    return np.abs(i - j).astype(float)


def test_softcap_is_its_own_stage_before_the_mask():
    X, W = _batched()
    tr = trace(X, *W, n_heads=2, softcap=1.5)
    assert tr.names[7:11] == ["S", "S_cap", "M", "Z"]
    np.testing.assert_allclose(tr.S_cap, 1.5 * np.tanh(tr.S / 1.5), rtol=1e-15)
    np.testing.assert_array_equal(tr.Z, tr.S_cap + tr.M)
    np.testing.assert_array_equal(tr.A, softmax_last(tr.S_cap, masks.causal(4)))


def test_alibi_bias_and_rel_bias_add_up_in_E():
    X, W = _batched()
    T = 4
    slopes = np.array([0.5, 0.25])
    bias = np.arange(16.0).reshape(4, 4) / 10
    rel = np.arange(2 * 7, dtype=float).reshape(2, 7) / 7  # (H, 2T - 1): rel[h, T-1 + j-i]
    tr = trace(X, *W, n_heads=2, alibi_slopes=slopes, bias=bias, rel_bias=rel)
    assert tr.names[7:11] == ["S", "E", "M", "Z"] and tr.E.ndim == tr.S.ndim
    i, j = np.indices((T, T))
    for h in range(2):
        want = -slopes[h] * _distance(T) + bias + rel[h, T - 1 + j - i]
        np.testing.assert_allclose(tr.E[0, h], want, rtol=1e-15)
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(tr.Z, tr.S + tr.E + tr.M)
    np.testing.assert_array_equal(tr.A, softmax_last(tr.S + tr.E, masks.causal(T)))
    # one slope per sequence and head: (B, H)
    per = trace(X, *W, n_heads=2, alibi_slopes=[[0.5, 0.25], [1.0, 2.0]])
    assert per.E.shape == (2, 2, T, T)
    for b, h in np.ndindex(2, 2):
        np.testing.assert_allclose(per.E[b, h], -[[0.5, 0.25], [1.0, 2.0]][b][h] * _distance(T))
    # without heads E is T×T beside a T×T S, and broadcast beside a batch
    one = trace(X[0], *W, alibi_slopes=[0.5])
    assert one.E.shape == (T, T) and np.array_equal(one.E, -0.5 * _distance(T))
    assert trace(X, *W, alibi_slopes=[0.5]).E.shape == (1, T, T)


def test_E_keeps_the_axes_of_S_beside_two_batch_axes_and_select_reads_it():
    rng = np.random.default_rng(8)
    X = rng.normal(size=(2, 3, 4, 4))
    W = [rng.normal(size=(4, 4)) for _ in range(4)]
    tr = trace(X, *W, n_heads=2, alibi_slopes=[0.5, 0.25])
    assert tr.S.shape == (2, 3, 2, 4, 4) and tr.E.shape == (1, 1, 2, 4, 4)
    flat = trace(X, *W, bias=np.eye(4))
    assert flat.E.shape == (1, 1, 4, 4)
    one = trace(X[1, 2], *W, n_heads=2, alibi_slopes=[0.5, 0.25])
    sel = tr.select(1, 2)
    for name in one.names:
        np.testing.assert_allclose(sel[name], one[name], rtol=1e-12, atol=1e-12)
    # the batched trace's select reads the broadcast E too
    two = trace(X[0], *W, n_heads=2, alibi_slopes=[0.5, 0.25])
    assert two.E.shape == (1, 2, 4, 4)
    np.testing.assert_array_equal(two.select(2).E, two.E[0])
    np.testing.assert_array_equal(two.select(2, 1).E, -0.25 * _distance(4))
    np.testing.assert_array_equal(trace(X[0], *W, alibi_slopes=[0.5]).select(1).E, tr.E[0, 0, 0])


def test_score_mod_sees_the_batch_head_and_positions_of_each_cell():
    X, W = _batched()
    T = 4

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + 10 * b + h + 0.1 * (q_idx - kv_idx)

    tr = trace(X, *W, n_heads=2, score_mod=score_mod, alibi_slopes=[0.5, 0.25])
    assert tr.names[7:12] == ["S", "E", "S_mod", "M", "Z"]
    i, j = np.indices((T, T))
    for b, h in np.ndindex(2, 2):
        want = tr.S[b, h] + tr.E[0, h] + 10 * b + h + 0.1 * (i - j)
        np.testing.assert_allclose(tr.S_mod[b, h], want, rtol=1e-14)
    np.testing.assert_array_equal(tr.A, softmax_last(tr.S_mod, masks.causal(T)))
    # one sequence and no heads: b = h = 0, S_mod T×T
    one = trace(X[0], *W, score_mod=score_mod)
    assert one.S_mod.shape == (T, T)
    np.testing.assert_allclose(one.S_mod, one.S + 0.1 * (i - j), rtol=1e-14)
    # a batch without heads: b counts the sequences
    bat = trace(X, *W, score_mod=score_mod)
    np.testing.assert_allclose(bat.S_mod[1], bat.S[1] + 10 + 0.1 * (i - j), rtol=1e-14)
    with pytest.raises(ValueError) as e:
        trace(X[None], *W, score_mod=score_mod)
    assert str(e.value) == "score_mod: X needs at most one batch axis, got leading axes (1, 2)"


def test_mask_mod_blocks_its_cells_and_names_them():
    X, W = _batched()
    tr = trace(X, *W, n_heads=2, mask_mod=lambda b, h, q, kv: (kv != 1) | (b == 1))
    want = masks.causal(4) & (np.arange(4) != 1)
    assert np.all(tr.A[0][:, ~want] == 0.0) and np.all(tr.A[1, :, 1:, 1] > 0)
    assert tr.reasons[0, 0, 2, 1] == masks.MASK_MOD and tr.reasons[0, 0, 1, 2] == masks.FUTURE
    assert tr.reasons[1, 0, 2, 1] == masks.READABLE


def test_sinks_lower_every_row_sum_one_logit_per_head():
    X, W = _batched()
    tr = trace(X, *W, n_heads=2, sinks=[0.5, 3.0])
    for b, h, i in np.ndindex(2, 2, 4):
        z = tr.Z[b, h, i]
        np.testing.assert_allclose(
            tr.A[b, h, i], _softmax_by_hand(z, z > -np.inf, [0.5, 3.0][h]), rtol=1e-13
        )
    one = trace(X[0], *W, sinks=[2.0])
    for i in range(4):
        np.testing.assert_allclose(
            one.A[i], _softmax_by_hand(one.S[i], masks.causal(4)[i], 2.0), rtol=1e-13
        )


# -- what M is made of ------------------------------------------------------------------

_RULES = [  # (keyword, value, X's leading axes): every rule that keeps causal on beside a mask
    ("window", 2, ()),
    ("chunk", 2, ()),
    ("cu_seqlens", [0, 2, 4], ()),
    ("lengths", [4, 3], (2,)),
    ("key_padding_mask", np.ones((2, 4), bool), (2,)),
    ("prefix_lengths", [1, 2], (2,)),
]


@pytest.mark.parametrize("name, value, lead", _RULES, ids=[r[0] for r in _RULES])
def test_a_mask_beside_any_rule_keeps_the_causal_rule(name, value, lead):
    rng = np.random.default_rng(9)
    X = rng.normal(size=(*lead, 4, 2))
    everything = np.ones((4, 4), bool)
    tr = trace(X, I2, I2, WV4, mask=everything, **{name: value})
    assert tr.pattern.causal is True
    np.testing.assert_array_equal(tr.A, trace(X, I2, I2, WV4, **{name: value}).A)
    assert np.all(tr.A[..., 0, 3] == 0.0)  # no rule here lets the first query read the last key
    # the keyword reaches the Pattern as given
    got = getattr(tr.pattern, name)
    assert np.array_equal(np.asarray(got), np.asarray(value))


def test_a_mask_is_anded_with_causal_unless_causal_is_false():
    everything = np.ones((4, 4), bool)
    np.testing.assert_array_equal(trace(X4, I2, I2, WV4, mask=everything).A, chapter().A)
    alone = trace(X4, I2, I2, WV4, mask=everything, causal=False)
    assert alone.pattern.causal is False and np.all(alone.A > 0)
    np.testing.assert_allclose(alone.A.sum(axis=-1), 1.0)
    assert trace(X4, I2, I2, WV4).pattern.causal is True
    both = trace(X4, I2, I2, WV4, mask=everything, causal=True)
    np.testing.assert_array_equal(both.A, chapter().A)
    free = trace(X4, I2, I2, WV4, causal=False)
    assert free.pattern.causal is False and np.all(free.A > 0)


def test_the_reasons_name_the_rule_that_blocks_each_cell():
    lower = masks.causal(4)
    keep = lower & ~np.eye(4, k=-1, dtype=bool)  # the mask blocks the cells just below the diagonal
    tr = trace(X4, I2, I2, WV4, mask=keep, causal=True)
    want = np.where(lower, np.where(keep, masks.READABLE, masks.MASK), masks.FUTURE)
    np.testing.assert_array_equal(tr.reasons, want)
    np.testing.assert_array_equal(tr.allowed, keep)
    assert tr.reasons.dtype == np.uint8
    # the same for every sequence and head: one T×T table
    X, W = _batched()
    assert trace(X, *W, n_heads=2).reasons.shape == (4, 4)
    padded = trace(X, *W, n_heads=2, lengths=[4, 2])
    assert padded.reasons.shape == (2, 1, 4, 4)
    assert padded.reasons[1, 0, 1, 2] == masks.PADDING and padded.reasons[1, 0, 1, 1] == 0
    assert padded.reasons[0, 0, 1, 2] == masks.FUTURE


def test_a_4d_mask_beside_a_batch_and_heads_is_the_patterns_own():
    X, W = _batched()
    m = np.ones((2, 2, 4, 4), bool)
    m[1, 0, :, 0] = False  # sequence 1, head 0 may not read key 0
    tr = trace(X, *W, n_heads=2, mask=m, causal=True)
    assert tr.pattern.mask is not None and tr.pattern.per_head
    assert tr.reasons[1, 0, 2, 0] == masks.MASK and tr.reasons[1, 1, 2, 0] == 0
    assert np.all(tr.A[1, 0, :, 0] == 0.0) and np.all(tr.A[0, :, :, 0] > 0)
    # a mask of the same shape broadcast against S otherwise: not the Pattern's
    rng = np.random.default_rng(10)
    X2 = rng.normal(size=(2, 2, 4, 4))
    assert trace(X2, *W, mask=m, causal=True).pattern.mask is None
    assert trace(X[0], *W, n_heads=2, mask=m[0, :1], causal=True).pattern.mask is None


def test_a_general_mask_is_read_per_sequence_and_per_head():
    X, W = _batched()
    per_seq = np.ones((2, 4, 4), bool)
    per_seq[1, :, 0] = False
    tr = trace(X, *W, n_heads=2, mask=per_seq, causal=True)  # (B, T, T): over the heads
    assert tr.pattern.mask is None
    assert np.all(tr.A[1, :, :, 0] == 0.0) and np.all(tr.A[0, :, :, 0] > 0)
    assert tr.reasons.shape == tr.S.shape and tr.reasons[1, 1, 3, 0] == masks.MASK
    rng = np.random.default_rng(11)
    X2 = rng.normal(size=(2, 3, 4, 4))
    per_head = np.ones((2, 3, 2, 4, 4), bool)  # X's leading axes + (h, T, T)
    per_head[1, 2, 1, :, 0] = False
    tr2 = trace(X2, *W, n_heads=2, mask=per_head, causal=True)
    assert np.all(tr2.A[1, 2, 1, :, 0] == 0.0) and np.all(tr2.A[1, 2, 0, :, 0] > 0)
    with pytest.raises(ValueError) as e:
        trace(X, *W, mask=np.ones((3, 4, 4), bool), causal=False)
    assert str(e.value) == "mask: shape (3, 4, 4) does not broadcast to S (2, 4, 4)"


# -- dropout, C, scale, dtypes ----------------------------------------------------------


def _keep(seed, offset, B, H, T, p):
    """The dropout keep cells of (b, h, i, j), one sequence and head at a time."""
    import torch

    from causalattn import dropout

    pos = torch.arange(T)
    return np.stack(
        [
            np.stack([dropout.keep_mask(seed, offset, b, h, pos, pos, p).numpy() for h in range(H)])
            for b in range(B)
        ]
    )


def test_dropout_drops_the_cells_of_the_seed_and_rescales_the_rest():
    X, W = _batched(T=6)
    p = 0.4
    tr = trace(X, *W, n_heads=2, dropout_p=p, dropout_seed=(5, 3))
    assert tr.names[tr.names.index("A") + 1] == "A_drop"
    keep = _keep(5, 3, 2, 2, 6, p)
    assert 0 < keep.mean() < 1
    np.testing.assert_array_equal(tr.A_drop, np.where(keep, tr.A / (1 - p), 0.0))
    np.testing.assert_allclose(tr.H, tr.A_drop @ tr.V, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(tr.C.sum(axis=-2), tr.H, rtol=1e-13, atol=1e-15)
    # no heads: head 0's cells
    one = trace(X, *W, dropout_p=p, dropout_seed=(5, 3))
    np.testing.assert_array_equal(one.A_drop, np.where(keep[:, 0], one.A / (1 - p), 0.0))
    # p = 1 drops everything: zeros, not a division by zero
    gone = trace(X, *W, n_heads=2, dropout_p=1.0, dropout_seed=(5, 3))
    assert np.all(gone.A_drop == 0.0) and np.all(gone.H == 0.0)
    np.testing.assert_array_equal(gone.A, tr.A)  # A itself is the same


def test_dropout_without_a_seed_draws_it_from_torch():
    import torch

    from causalattn import dropout

    X, W = _batched(T=6)
    torch.manual_seed(123)
    a = trace(X, *W, dropout_p=0.5)
    torch.manual_seed(123)
    seed = dropout.seed_from()
    np.testing.assert_array_equal(a.A_drop, trace(X, *W, dropout_p=0.5, dropout_seed=seed).A_drop)


def test_C_is_kept_up_to_its_byte_limit(monkeypatch):
    from causalattn import matrix_form

    X, W = _batched()
    W[2] = np.ones((4, 6))  # d_v = 3 per head
    size = 2 * 2 * 4 * 4 * 3 * 8  # B·h·T·T·d_v float64 bytes
    monkeypatch.setattr(matrix_form, "C_LIMIT_BYTES", size)
    assert trace(X, *W[:3], n_heads=2).C.shape == (2, 2, 4, 4, 3)
    monkeypatch.setattr(matrix_form, "C_LIMIT_BYTES", size - 1)
    assert "C" not in trace(X, *W[:3], n_heads=2)


def test_scale_multiplies_the_scores_and_defaults_to_one_over_root_d_k():
    X, W = _batched()
    tr = trace(X, *W, n_heads=2)
    assert tr.scale == 1 / np.sqrt(2) and type(tr.scale) is float
    np.testing.assert_allclose(tr.S, tr.Q @ np.swapaxes(tr.K, -1, -2) / np.sqrt(2), rtol=1e-15)
    for scale in (2, np.float32(0.25), 0.0):
        got = trace(X, *W, n_heads=2, scale=scale)
        assert got.scale == float(scale)
        np.testing.assert_array_equal(got.S, (got.Q @ np.swapaxes(got.K, -1, -2)) * scale)
    with pytest.raises(ValueError) as e:
        trace(X, *W, scale=np.inf)
    assert str(e.value) == "scores: scale must be a finite number, got inf"


def test_integer_and_boolean_inputs_are_read_as_float64():
    Xi = np.array([[1, 0], [0, 1], [1, 1]])
    tr = trace(Xi, np.eye(2, dtype=int), np.eye(2, dtype=int), np.eye(2, dtype=bool))
    assert all(tr[n].dtype == np.float64 for n in tr.names)
    ref = trace(Xi.astype(float), I2, I2, I2)
    for name in ref.names:
        np.testing.assert_array_equal(tr[name], ref[name])


def test_the_trace_keeps_its_tokens_pattern_and_output_weights():
    rng = np.random.default_rng(12)
    Wo = rng.normal(size=(2, 3))
    tr = trace(X4, I2, I2, WV4, Wo, tokens=list("abcd"), window=2)
    assert tr.tokens == list("abcd") and tr.pattern.window == 2 and tr.n_heads is None
    np.testing.assert_array_equal(tr.W_o, Wo)
    np.testing.assert_array_equal(tr.O, tr.H @ Wo)
    assert tr.names[-2:] == ["W_o", "O"]


# -- stages(): from given Q, K, V --------------------------------------------------------


def test_stages_from_q_k_v_are_the_traces():
    X, W = _batched(T=5)
    pattern = masks.Pattern(window=3, alibi_slopes=[0.5, 0.25], softcap=4.0)
    tr = trace(X, *W, n_heads=2, window=3, alibi_slopes=[0.5, 0.25], softcap=4.0)
    arrays, allowed, reasons = stages(tr.Q, tr.K, tr.V, pattern)
    assert list(arrays) == ["S", "S_cap", "E", "M", "Z", "A", "H", "C"]
    for name, a in arrays.items():
        np.testing.assert_array_equal(a, tr[name])
    np.testing.assert_array_equal(allowed, tr.allowed)
    np.testing.assert_array_equal(reasons, tr.reasons)
    small, _, _ = stages(tr.Q, tr.K, tr.V, pattern, with_C=False)
    assert "C" not in small
    half, _, _ = stages(tr.Q.tolist(), tr.K, tr.V, masks.Pattern(), scale=0.5)
    np.testing.assert_array_equal(half["S"], (tr.Q @ np.swapaxes(tr.K, -1, -2)) * 0.5)
    # one head, a different d_v
    rng = np.random.default_rng(13)
    Q, K, V = (
        rng.normal(size=(1, 1, 3, 2)),
        rng.normal(size=(1, 1, 3, 2)),
        rng.normal(size=(1, 1, 3, 5)),
    )
    one, _, _ = stages(Q, K, V, masks.Pattern())
    ref = trace(np.eye(3), Q[0, 0], K[0, 0], V[0, 0])  # X = I: Q, K, V are the weights
    np.testing.assert_allclose(one["H"][0, 0], ref.H, rtol=1e-14)


@pytest.mark.parametrize(
    "shapes",
    [
        ((2, 3, 4), (2, 3, 4), (2, 3, 4)),
        ((1, 2, 3, 4), (1, 2, 3, 5), (1, 2, 3, 4)),
        ((1, 2, 3, 4), (1, 2, 3, 4), (1, 2, 2, 4)),
        ((1, 1, 2, 3, 4),) * 3,
    ],
)
def test_stages_refuse_q_k_v_not_laid_out_b_h_t_d(shapes):
    Q, K, V = (np.zeros(s) for s in shapes)
    with pytest.raises(ValueError) as e:
        stages(Q, K, V, masks.Pattern())
    if Q.ndim < 4:
        assert str(e.value) == "scores: Q must have at least 4 axes, got shape (2, 3, 4)"
    else:
        assert str(e.value) == (
            "scores: Q, K must be (B, H, T, d_k) alike and V (B, H, T, d_v); got Q "
            f"{shapes[0]}, K {shapes[1]}, V {shapes[2]}"
        )


def test_no_floating_point_warning_from_overflowing_or_nonfinite_inputs():
    X = np.array([[1e200, 1.0], [1.0, -1e200], [np.inf, 0.0], [np.nan, 1.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tr = trace(X, I2, I2, WV4, causal=False)
        flat = trace(X, I2, I2, WV4, scale=0.0)  # inf · 0 in S's scaling
        cap = trace(X, I2, I2, WV4, softcap=2.0, alibi_slopes=[0.5])
        big = trace(X4, I2, I2, WV4, score_mod=lambda s, b, h, q, kv: s * 1e308 * (q + 1))
    assert np.isinf(tr.S).any() and np.isnan(tr.S).any()
    assert np.isnan(flat.S[0, 0])  # inf · 0
    assert np.isfinite(cap.A[:2]).all()
    assert np.isinf(big.S_mod).any() and big.A[0, 0] == 1.0


def test_per_sequence_rules_without_heads_keep_one_table_per_sequence():
    X, W = _batched()
    tr = trace(X, *W, lengths=[4, 2], mask_mod=lambda b, h, q, kv: kv != 0)
    assert tr.reasons.shape == (2, 4, 4) and tr.A.shape == (2, 4, 4)
    assert tr.reasons[1, 1, 2] == masks.PADDING and tr.reasons[0, 1, 2] == masks.FUTURE
    assert tr.reasons[0, 3, 0] == masks.MASK_MOD and tr.reasons[1, 1, 1] == masks.READABLE
    assert np.all(tr.A[1, :2, 2:] == 0.0) and np.all(tr.A[1, 2:] == 0.0)
    # a mask_mod alone is no per-sequence rule: a single sequence takes it
    one = trace(X4, I2, I2, WV4, mask_mod=lambda b, h, q, kv: kv != 0)
    assert one.reasons.shape == (4, 4) and np.all(one.A[1:, 0] == 0.0) and one.A[0, 0] == 0.0


def test_dropout_of_a_single_sequence_is_sequence_0_head_0():
    p = 0.5
    tr = trace(X4, I2, I2, WV4, dropout_p=p, dropout_seed=(1, 2))
    keep = _keep(1, 2, 1, 1, 4, p)[0, 0]
    assert 0 < keep[np.tril_indices(4)].mean() < 1
    np.testing.assert_array_equal(tr.A_drop, np.where(keep, tr.A / (1 - p), 0.0))
    heads = trace(
        X4, np.eye(2, 4), np.eye(2, 4), np.eye(2, 4), n_heads=2, dropout_p=p, dropout_seed=(1, 2)
    )
    keep2 = _keep(1, 2, 1, 2, 4, p)[0]
    np.testing.assert_array_equal(heads.A_drop, np.where(keep2, heads.A / (1 - p), 0.0))


@pytest.mark.parametrize(
    "which, bad, message",
    [
        ("K", np.zeros((1, 3, 2)), "scores: K must have at least 4 axes, got shape (1, 3, 2)"),
        ("V", np.zeros((1, 3, 2)), "scores: V must have at least 4 axes, got shape (1, 3, 2)"),
        ("V", np.full((1, 1, 3, 2), "a"), "scores: V must be a real numeric array, got dtype <U1"),
    ],
)
def test_stages_name_the_bad_array(which, bad, message):
    qkv = dict(Q=np.zeros((1, 1, 3, 2)), K=np.zeros((1, 1, 3, 2)), V=np.zeros((1, 1, 3, 2)))
    qkv[which] = bad
    with pytest.raises(ValueError) as e:
        stages(qkv["Q"], qkv["K"], qkv["V"], masks.Pattern())
    assert str(e.value) == message


def test_a_readable_inf_value_is_not_turned_into_nan_by_an_unreadable_nan():
    # key 1's value is +inf and readable by query 3; key 3's is NaN, readable by nobody before it
    V = np.array([[1.0, 0.0], [np.inf, 0.0], [0.5, 1.0], [np.nan, np.nan]])
    allowed = masks.causal(4) & ~np.eye(4, dtype=bool)  # nobody reads itself: key 3 unread
    allowed[0, 0] = True
    A = softmax_last(np.zeros((4, 4)), allowed)
    H = weighted_values(A, V, allowed)
    assert H[3].tolist() == [np.inf, 1 / 3] and H[2, 0] == np.inf
    assert H[0].tolist() == [1.0, 0.0] and H[1].tolist() == [1.0, 0.0]


def test_one_head_and_one_token_keep_their_axes():
    tr = trace(X4, I2, I2, WV4, n_heads=1)
    assert tr.A.shape == (1, 4, 4) and tr.n_heads == 1
    np.testing.assert_array_equal(tr.A[0], chapter().A)
    one = trace(np.array([[0.3, -2.0]]), I2, I2, WV4)
    assert one.reasons.shape == (1, 1) and one.allowed.shape == (1, 1)


def test_a_square_mask_is_read_for_every_sequence_and_head():
    X, W = _batched()
    keep = masks.causal(4) & (np.arange(4) != 0)
    keep[0, 0] = True
    tr = trace(X, *W, n_heads=2, mask=keep, causal=True)
    assert np.all(tr.A[:, :, 1:, 0] == 0.0) and np.all(tr.A[:, :, 0, 0] == 1.0)
    # a stack of masks beside one sequence: one trace per mask
    stack = np.stack([masks.causal(4), np.ones((4, 4), bool)])
    both = trace(X4, I2, I2, WV4, mask=stack, causal=False)
    assert both.A.shape == (2, 4, 4)
    for k in range(2):
        np.testing.assert_array_equal(
            both.A[k], trace(X4, I2, I2, WV4, mask=stack[k], causal=False).A
        )


def test_stages_reasons_are_uint8_codes():
    X, W = _batched()
    tr = trace(X, *W, n_heads=2, lengths=[4, 2])
    _, allowed, reasons = stages(tr.Q, tr.K, tr.V, masks.Pattern(lengths=[4, 2]))
    assert reasons.dtype == np.uint8 and allowed.dtype == np.bool_
    np.testing.assert_array_equal(reasons, tr.reasons)


def test_no_floating_point_warning_from_huge_modified_scores_or_full_dropout():
    X = np.array([[1e154, 0.0], [0.0, 1.0], [-1e154, 0.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cap = trace(X, I2, I2, I2, softcap=0.1)  # S / c overflows: tanh(inf) = 1
        biased = trace(X, I2, I2, I2, bias=np.full((3, 3), 1.5e308))  # S + E overflows
        proj = trace(X, I2 * 1e200, I2, I2)  # X W_q overflows
        nan = trace(X4, I2, I2, WV4, score_mod=lambda s, b, h, q, kv: s * 1e308 * 4 - s * 1e308 * 4)
        gone = trace(X4, I2, I2, WV4, dropout_p=1.0, dropout_seed=(0, 0))
        # S = +inf at a future cell meets M = -inf there
        blocked = trace(np.array([[1.0, 0.0], [1e200, 0.0]]), I2 * 1e200, I2, I2)
    assert cap.S_cap[0, 0] == 0.1 and np.isinf(biased.Z[0, 0]) and np.isinf(proj.Q[0, 0])
    assert np.isnan(nan.S_mod[0, 0]) and np.all(gone.A_drop == 0.0)
    assert np.isinf(blocked.S[0, 1]) and blocked.A[0].tolist() == [1.0, 0.0]
