"""The float64 trace speaks every pattern: modifiers as stages, sinks, dropout, explain's
reasons."""

import numpy as np
import pytest

import causalattn as ca
from causalattn import masks


def _problem(T=6, d=4, B=None, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(T, d) if B is None else (B, T, d))
    W = [rng.normal(size=(d, d)) for _ in range(3)]
    return X, W


def _by_hand(X, W, allowed, bias=0.0, cap=None, sink=None):
    """softmax over readable keys of (cap(S) + bias), plain loops, one head."""
    Q, K, V = X @ W[0], X @ W[1], X @ W[2]
    S = Q @ K.T / np.sqrt(Q.shape[-1])
    if cap is not None:
        S = cap * np.tanh(S / cap)
    S = S + bias
    A = np.zeros_like(S)
    for i in range(S.shape[0]):
        cols = np.flatnonzero(allowed[i])
        if cols.size == 0:
            continue
        e = np.exp(S[i, cols])
        A[i, cols] = e / (e.sum() + (np.exp(sink) if sink is not None else 0.0))
    return A, A @ V


def test_window_trace_reads_the_last_w_keys():
    X, W = _problem(T=7)
    tr = ca.trace(X, *W, window=3)
    allowed = masks.Pattern(window=3).allowed(1, 1, 7, 7)[0, 0]
    A, H = _by_hand(X, W, allowed)
    np.testing.assert_allclose(tr.A, A, atol=1e-12)
    np.testing.assert_allclose(tr.H, H, atol=1e-12)
    assert tr.A[6, 3] == 0.0 and tr.A[6, 4] > 0
    ex = tr.explain(6)
    assert ex.blocked_by[3] == "window" and ex.blocked_by[0] == "window"
    assert ex.rows()[3]["blocked_by"] == "window" and ex.rows()[5]["blocked_by"] == ""
    assert "window" in str(ex)
    assert tr.explain(2).blocked_by[5] == "future"


def test_softcap_alibi_and_sinks_are_stages_and_match_the_formula():
    X, W = _problem(T=5)
    tr = ca.trace(X, *W, softcap=2.0, alibi_slopes=[0.25], sinks=[0.7])
    assert {"S_cap", "E"} <= set(tr.names)
    dist = np.abs(np.subtract.outer(np.arange(5), np.arange(5)))
    np.testing.assert_allclose(tr.E, -0.25 * dist)
    np.testing.assert_allclose(tr.S_cap, 2.0 * np.tanh(tr.S / 2.0))
    A, H = _by_hand(X, W, masks.causal(5), bias=-0.25 * dist, cap=2.0, sink=0.7)
    np.testing.assert_allclose(tr.A, A, atol=1e-12)
    np.testing.assert_allclose(tr.H, H, atol=1e-12)
    assert (tr.A.sum(-1) < 1).all()  # the sink takes weight and gives no value


def test_padding_prefix_and_documents_per_sequence():
    X, W = _problem(T=6, B=2)
    tr = ca.trace(X, *W, lengths=[6, 4], prefix_lengths=[3, 2])
    al = masks.Pattern(lengths=[6, 4], prefix_lengths=[3, 2]).allowed(2, 1, 6, 6)[:, 0]
    assert (tr.allowed == al).all()
    assert tr.A[0, 0, 2] > 0  # inside the prefix a query reads ahead
    assert (tr.A[1, 4:] == 0).all() and (tr.H[1, 4:] == 0).all()
    one = ca.trace(X[0], *W, cu_seqlens=[0, 2, 6])
    assert one.A[3, 1] == 0 and one.explain(3).blocked_by[1] == "document"


def test_heads_and_a_per_head_mask_follow_the_pattern():
    rng = np.random.default_rng(3)
    X = rng.normal(size=(2, 5, 4))
    W = [rng.normal(size=(4, 4)) for _ in range(3)]
    m = rng.random((1, 2, 5, 5)) > 0.3
    tr = ca.trace(X, *W, n_heads=2, mask=m, window=2)
    want = masks.Pattern(mask=m, window=2).allowed(2, 2, 5, 5)
    assert tr.A.shape == (2, 2, 5, 5)
    assert ((tr.A > 0) <= np.broadcast_to(want, tr.A.shape)).all()
    assert (tr.A[~np.broadcast_to(want, tr.A.shape)] == 0).all()


def test_dropout_stage_follows_A_and_feeds_H():
    X, W = _problem(T=8)
    tr = ca.trace(X, *W, dropout_p=0.5, dropout_seed=(11, 4))
    kept = tr.A_drop != 0
    np.testing.assert_allclose(tr.A_drop[kept], 2.0 * tr.A[kept])
    np.testing.assert_allclose(tr.H, tr.A_drop @ (X @ W[2]), atol=1e-12)
    again = ca.trace(X, *W, dropout_p=0.5, dropout_seed=(11, 4))
    assert np.array_equal(again.A_drop, tr.A_drop)
    assert (ca.trace(X, *W, dropout_p=1.0, dropout_seed=(1, 1)).H == 0).all()
    np.testing.assert_array_equal(ca.trace(X, *W, dropout_p=0.0).H, ca.trace(X, *W).H)


def test_a_saved_trace_keeps_its_stages_and_reasons(tmp_path):
    X, W = _problem(T=5)
    tr = ca.trace(X, *W, window=2, alibi_slopes=[0.5])
    assert tr.reasons.shape == (5, 5) and masks.REASONS[int(tr.reasons[4, 0])] == "window"
    tr.save(tmp_path / "t.npz")
    back = ca.Trace.load(tmp_path / "t.npz")
    assert np.array_equal(back.reasons, tr.reasons) and np.array_equal(back.E, tr.E)
    assert back.explain(4).blocked_by[0] == "window"


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"window": 0}, "window"),
        ({"scale": float("nan")}, "scale"),
        ({"lengths": [3, 2]}, "lengths"),
        ({"sinks": [0.1, 0.2]}, "sinks"),
        ({"dropout_p": 2.0}, "dropout_p"),
    ],
)
def test_bad_pattern_arguments_name_themselves(kw, msg):
    X, W = _problem(T=4)
    with pytest.raises(ValueError, match=msg):
        ca.trace(X, *W, **kw)


def test_explain_refuses_a_non_integer_query():
    X, W = _problem(T=4)
    with pytest.raises(ValueError, match="integer"):
        ca.trace(X, *W).explain(1.5)
