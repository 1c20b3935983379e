"""audit, stages Q, K, V and S (check/stage_qkv.py): n_heads read from whichever stage has a
head axis, projections against X W (shapes, heads, one head of several, precision), S's
shape and scale, and the scale read back from A when S is absent."""

from __future__ import annotations

import numpy as np
import pytest

from causalattn import masks
from causalattn.check import audit
from causalattn.reference import softmax_last, split_heads

T, D, H, DK = 5, 4, 2, 3  # T, d_model, heads, d_k (H·d_k = 6): a wrong axis shows
B = 7  # a batch axis
PROJ = (("Q", "W_q"), ("K", "W_k"), ("V", "W_v"))


def _parts():
    rng = np.random.default_rng(28)
    X = rng.normal(size=(T, D))
    W = {w: rng.normal(size=(D, H * DK)) for _, w in PROJ}
    heads = {s: split_heads(X @ W[w], H) for s, w in PROJ}  # (H, T, d_k)
    S = heads["Q"] @ np.swapaxes(heads["K"], -1, -2) / np.sqrt(DK)
    A = softmax_last(np.where(masks.causal(T), S, 0.0), masks.causal(T))
    return {"X": X, **W, **heads, "S": S, "A": A}


@pytest.fixture(scope="module")
def p():
    return _parts()


def _check(rep, stage, name):
    hits = [c for c in rep.checks if c.stage == stage and c.name == name]
    assert len(hits) == 1, str(rep)
    return hits[0]


# -- n_heads from the first stage with a head axis, stage Q/K/V -----------------------------


@pytest.mark.parametrize("s, w", PROJ)
def test_n_heads_is_read_from_the_one_projection_given(p, s, w):
    rep = audit({"X": p["X"], w: p[w], s: p[s]})
    assert rep.ok, str(rep)
    c = _check(rep, s, f"{s} = X {w}")
    assert c.ok and c.message == f"max |{s} - X {w}| = 0", str(rep)
    assert rep.recomputed == [] and len(rep.checks) == 1


@pytest.mark.parametrize("s", ["A", "S"])
def test_n_heads_is_read_from_a_or_s_when_no_projection_is_given(p, s):
    rep = audit({"X": p["X"], "W_q": p["W_q"], "W_k": p["W_k"], s: p[s]})
    assert rep.ok, str(rep)
    assert rep.recomputed[:2] == ["Q", "K"]
    if s == "S":
        assert _check(rep, "S", "scale 1/√d_k").ok
    else:  # S is recomputed per head, and its scale read back from the heads' weights
        c = _check(rep, "S", "scale 1/√d_k (read back from A)")
        assert c.ok and f"expected · {1 / np.sqrt(DK):.4g}" in c.message, str(rep)


def test_an_array_without_a_head_axis_says_nothing_about_heads(p):
    # one head's Q (T, d_k) is no head axis: the projection is read as one head of X W_q
    rep = audit({"X": p["X"], "W_q": p["W_q"], "Q": p["Q"][1]})
    c = _check(rep, "Q", "Q = X W_q")
    assert rep.ok and c.message == "Q is head 1 of X W_q", str(rep)


# -- X W: the weight's rows, its columns against the heads ----------------------------------


@pytest.mark.parametrize("bad", ["Q", "K", "V"])
def test_a_weight_with_the_wrong_rows_fails_its_stage_and_the_others_are_still_checked(p, bad):
    arrays = {"X": p["X"]}
    for s, w in PROJ:
        arrays[w] = p[w] if s != bad else np.ones((D + 1, DK))
        arrays[s] = p[s]
    rep = audit(arrays)
    ws = dict(PROJ)[bad]
    assert [(c.stage, c.name) for c in rep.failures] == [(bad, f"{bad} = X {ws}")], str(rep)
    assert rep.first_failure.message == (
        f"X is T×d_model = {T}×{D} but {ws} is {D + 1}×{DK}; its rows must be d_model = {D}"
    )
    assert {c.stage for c in rep.checks if c.ok} == {"Q", "K", "V"} - {bad}, str(rep)


def test_a_weight_with_the_wrong_rows_under_a_batch_axis_names_t_and_d_model(p):
    X = np.zeros((B, T, D))
    rep = audit({"X": X, "W_q": np.ones((D + 1, DK)), "Q": np.zeros((B, T, DK))})
    assert rep.first_failure.message == (
        f"X is T×d_model = {T}×{D} but W_q is {D + 1}×{DK}; its rows must be d_model = {D}"
    )


@pytest.mark.parametrize("bad", ["Q", "K", "V"])
def test_a_weight_whose_columns_do_not_split_into_the_heads_fails(p, bad):
    arrays = {"X": p["X"], "n_heads": np.array(H)}
    for s, w in PROJ:
        arrays[w] = p[w] if s != bad else p[w][:, :-1]  # 5 columns, 2 heads
        arrays[s] = p[s]
    rep = audit(arrays)
    ws = dict(PROJ)[bad]
    assert [(c.stage, c.name) for c in rep.failures] == [(bad, f"{bad} = X {ws}")], str(rep)
    assert rep.first_failure.message == f"{ws} has {H * DK - 1} columns, not divisible by {H} heads"
    assert {c.stage for c in rep.checks if c.ok} == {"Q", "K", "V"} - {bad}, str(rep)


# -- Q given: one head of X W (a Trace.select), the full projection, a wrong shape ----------


def test_one_head_of_the_projection_is_found_and_a_wrong_one_is_named(p):
    ref = p["X"] @ p["W_q"]  # (T, 6): two heads of 3
    rep = audit({"X": p["X"], "W_q": p["W_q"], "Q": ref[:, :DK], "W_k": p["W_k"], "K": ref})
    assert _check(rep, "Q", "Q = X W_q").message == "Q is head 0 of X W_q", str(rep)
    # the K check after it still runs (the full K here is not X W_k)
    assert not _check(rep, "K", "K = X W_k").ok, str(rep)
    rep = audit({"X": p["X"], "W_q": p["W_q"], "Q": ref[:, 1 : DK + 1]})
    c = _check(rep, "Q", "Q = X W_q")
    assert not c.ok and c.message == f"Q ({(T, DK)}) is no head of X W_q ({(T, H * DK)})", str(rep)


@pytest.mark.parametrize("t", [2, 8])  # T below d_k, T above H·d_k
def test_with_a_batch_axis_the_full_projection_and_one_head(p, t):
    X = np.random.default_rng(t).normal(size=(B, t, D))
    ref = X @ p["W_q"]
    rep = audit({"X": X, "W_q": p["W_q"], "Q": ref})
    assert _check(rep, "Q", "Q = X W_q").message == "max |Q - X W_q| = 0", str(rep)
    rep = audit({"X": X, "W_q": p["W_q"], "Q": ref[..., DK:]})
    c = _check(rep, "Q", "Q = X W_q")
    assert c.ok and c.message == "Q is head 1 of X W_q", str(rep)


def test_the_full_projection_without_heads_is_compared_whole(p):
    rep = audit({"X": p["X"], "W_q": p["W_q"], "Q": p["X"] @ p["W_q"]})
    c = _check(rep, "Q", "Q = X W_q")
    assert rep.ok and c.message == "max |Q - X W_q| = 0" and c.evidence == {}, str(rep)
    assert c.hint is None


@pytest.mark.parametrize(
    "shape",
    [
        (T, 4),  # columns that do not divide X W's 6
        (T - 1, DK),  # a head's width but not its rows
        (T, H * DK + 3),  # wider than X W
    ],
)
def test_a_projection_of_the_wrong_shape_fails_and_the_next_is_still_checked(p, shape):
    Q = np.zeros(shape)
    rep = audit({"X": p["X"], "W_q": p["W_q"], "Q": Q, "W_k": p["W_k"], "K": p["X"] @ p["W_k"]})
    c = _check(rep, "Q", "Q = X W_q")
    assert not c.ok and c.message == f"Q has shape {shape} but X W_q gives {(T, H * DK)}", str(rep)
    assert _check(rep, "K", "K = X W_k").ok and rep.first_failure is c, str(rep)


def test_a_projection_narrower_than_its_heads_is_a_wrong_shape_once_heads_are_known(p):
    # Q (H, T, 1) tells n_heads = 2; its width 1 divides d_k = 3 but it is no head
    rep = audit({"X": p["X"], "W_q": p["W_q"], "Q": p["Q"][..., :1]})
    c = _check(rep, "Q", "Q = X W_q")
    assert not c.ok and c.message == f"Q has shape {(H, T, 1)} but X W_q gives {(H, T, DK)}"


def test_a_wrong_projection_says_where_and_how_far_off(p):
    Q = p["Q"].copy()
    Q[1, 3, 2] += 0.5
    rep = audit({"X": p["X"], "W_q": p["W_q"], "Q": Q, "W_k": p["W_k"], "K": p["K"]})
    c = rep.first_failure
    assert (c.stage, c.name) == ("Q", "Q = X W_q")
    assert c.message == "max |Q - X W_q| = 0.5 (too far off)"
    assert c.evidence == {"index": (1,), "rows": [3], "max_err": pytest.approx(0.5)}, c.evidence
    assert c.hint == (
        "Q was not computed as X W_q; check which weight was used and whether a bias or a "
        "transpose slipped in"
    )
    assert _check(rep, "K", "K = X W_k").ok and c.fault is None


@pytest.mark.parametrize("low", ["Q", "X", "W_q"])
@pytest.mark.parametrize("head", [False, True])
def test_each_stage_s_precision_sets_the_projection_s_tolerance(p, low, head):
    """Q computed in float64, then one of Q, X, W_q stored in float32: within the float32
    tolerance; an error 100 times it is not."""
    X, W = p["X"], p["W_q"]
    Q = X @ W
    if head:
        Q = Q[:, DK:]
    for err, ok in ((0.0, True), (1e-3, False)):
        arrays = {"X": X, "W_q": W, "Q": Q + err}
        arrays[low] = arrays[low].astype(np.float32)
        c = _check(audit(arrays), "Q", "Q = X W_q")
        assert c.ok is ok, (low, err, c)
        if head and ok:
            assert c.message == "Q is head 1 of X W_q"


@pytest.mark.parametrize("low", ["X", "W_q", "W_k"])
def test_recomputed_projections_carry_their_sources_precision(p, low):
    """Q and K recomputed from X, W_q, W_k, one of them stored in float32; S computed in
    float64 before that rounding is within the float32 tolerance, an error 100 times it is
    not."""
    for err, ok in ((0.0, True), (1e-3, False)):
        arrays = {"X": p["X"], "W_q": p["W_q"], "W_k": p["W_k"], "S": p["S"] + err}
        arrays[low] = arrays[low].astype(np.float32)
        rep = audit(arrays)
        assert rep.recomputed[:2] == ["Q", "K"]
        assert _check(rep, "S", "scale 1/√d_k").ok is ok, (low, err, str(rep))


# -- T agrees across K, V and X --------------------------------------------------------------


@pytest.mark.parametrize(
    "lens, stage, text",
    [
        ({"K": T, "V": T - 1}, "V", f"K: {T}, V: {T - 1}"),
        ({"X": T - 1, "K": T}, "X", f"K: {T}, X: {T - 1}"),
        ({"X": T - 2, "K": T, "V": T - 1}, "X", f"K: {T}, V: {T - 1}, X: {T - 2}"),
    ],
)
def test_sequence_lengths_of_k_v_and_x_must_agree(lens, stage, text):
    rng = np.random.default_rng(0)
    arrays = {s: rng.normal(size=(n, DK)) for s, n in lens.items()}
    arrays["Q"] = rng.normal(size=(T - 3, DK))  # Q may have fewer rows (decoding)
    rep = audit(arrays)
    c = _check(rep, stage, "sequence lengths agree")
    assert not c.ok and c.message == f"T differs between {text}", str(rep)
    assert rep.first_failure is c


def test_equal_sequence_lengths_add_no_check(p):
    rep = audit({"X": p["X"], "W_k": p["W_k"], "K": p["K"], "V": p["V"]})
    assert rep.ok and [c.name for c in rep.checks] == ["K = X W_k"], str(rep)
