"""audit, stages Q, K, V and S (check/stage_qkv.py): n_heads read from whichever stage has a
head axis, projections against X W (shapes, heads, one head of several, precision), S's
shape and scale, and the scale read back from A when S is absent."""

from __future__ import annotations

import numpy as np
import pytest

from causalattn import masks
from causalattn.check import audit
from causalattn.matrix_form import softmax_last, split_heads

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


# -- stage S: scores that carry the mask, S without Q or K, the shapes of Q Kᵀ ----------------

NOTE_Z = "the given scores carry the mask already; read as Z = S + M"
CAUSAL = masks.causal(T)


def _z(S):
    return np.where(CAUSAL, S, -np.inf)


def test_scores_that_carry_the_mask_are_read_as_z(p):
    rep = audit({"Q": p["Q"][0], "K": p["K"][0], "S": _z(p["S"][0])})
    assert rep.ok and rep.notes == [NOTE_Z], str(rep)
    assert rep.given == ["Q", "K", "Z"] and "S" in rep.recomputed
    # with Z given too, the masked S stays S and is checked as S
    rep = audit({"Q": p["Q"][0], "K": p["K"][0], "S": _z(p["S"][0]), "Z": _z(p["S"][0])})
    assert rep.ok and rep.notes == [] and rep.given == ["Q", "K", "S", "Z"], str(rep)
    assert _check(rep, "S", "scale 1/√d_k").ok


def test_masked_scores_in_float32_keep_their_precision_as_z(p):
    S, A = p["S"][0], p["A"][0]  # computed in float64, the scores then stored in float32
    rep = audit({"S": _z(S).astype(np.float32), "A": A})
    assert rep.ok and rep.notes == [NOTE_Z], str(rep)
    S = S.copy()
    S[3, 1] += 1e-3  # one score off by 100 times the float32 tolerance
    rep = audit({"S": _z(S).astype(np.float32), "A": A})
    assert not _check(rep, "A", "A = softmax_last(S + M)").ok, str(rep)


def test_q_k_and_z_without_s_recompute_s_and_read_the_scale_back_from_a(p):
    rep = audit({"Q": p["Q"][0], "K": p["K"][0], "Z": _z(p["S"][0]), "A": p["A"][0]})
    assert rep.ok and rep.recomputed[0] == "S", str(rep)
    assert _check(rep, "S", "scale 1/√d_k (read back from A)").ok


@pytest.mark.parametrize("with_z", [False, True])
def test_s_without_q_or_k_is_checked_for_its_shape_only(p, with_z):
    S = p["S"][0]
    extra = {"Z": _z(S)} if with_z else {}
    c = _check(audit({"S": S, **extra}), "S", "S is T×T")
    assert c.ok and c.message == f"S is {T}×{T}" and c.evidence == {} and c.hint is None
    c = _check(audit({"S": S[:2], "Q": p["Q"][0]}), "S", "S is T×T")  # decoding: 2 of T rows
    assert c.ok and c.message == f"S is 2×{T}"
    St = np.zeros((T + 1, T))
    c = _check(audit({"S": St}), "S", "S is T×T")
    assert not c.ok and c.message == f"S is {T + 1}×{T}" and c.evidence == {"shape": (T + 1, T)}
    assert c.hint == "more query rows than key columns: is it transposed?" and c.fault is None


def test_q_and_k_with_different_d_k_fail_at_s_naming_both(p):
    Q, K = np.zeros((B, T, DK)), np.zeros((B, T + 1, DK + 1))
    rep = audit({"Q": Q, "K": K, "S": np.zeros((B, T, T + 1))})
    c = _check(rep, "S", "Q Kᵀ shapes")
    assert not c.ok and rep.first_failure is c, str(rep)
    assert c.message == (
        f"Q is T×d_k = {T}×{DK} but K is {T + 1}×{DK + 1}; the inner d_k axes must match"
    )


def test_q_and_k_whose_leading_axes_do_not_broadcast_fail_at_s(p):
    Q, K = np.zeros((2, T, DK)), np.zeros((3, T, DK))
    rep = audit({"Q": Q, "K": K, "S": np.zeros((T, T))})
    c = _check(rep, "S", "Q Kᵀ shapes")
    assert not c.ok and rep.first_failure is c, str(rep)
    assert c.message == f"Q {Q.shape} and K {K.shape}: leading axes do not broadcast"


@pytest.mark.parametrize(
    "q, k, s",
    [
        ((T, DK), (DK, DK), (T, T)),  # T_k = d_k, S T×T
        ((T, DK), (T - 1, DK), (T, DK)),  # S T×d_k with T_k ≠ d_k
        ((B, T, DK), (B, DK, DK), (B, DK, DK)),
        ((B, T, DK), (B, DK, DK), (B, DK)),
        ((1, H, T, DK), (1, H, DK, DK), (1, H, T, H)),
        ((B, T, DK), (B, DK, DK), (B, T, 2)),
    ],
)
def test_s_of_the_wrong_shape_fails_with_its_shape_and_no_hint(q, k, s):
    rng = np.random.default_rng(1)
    Q, K, S = rng.normal(size=q), rng.normal(size=k), rng.normal(size=s)
    rep = audit({"Q": Q, "K": K, "S": S})
    c = _check(rep, "S", "S is T×T")
    G = (Q @ np.swapaxes(K, -1, -2)).shape
    assert not c.ok and rep.first_failure is c, str(rep)
    assert c.message == f"S is {s[-2]}×{s[-1]} but Q Kᵀ is {G[-2]}×{G[-1]} (T_q×T_k)"
    assert c.evidence == {"shape": s} and c.hint is None and c.fault is None


def test_s_whose_batch_axes_do_not_match_q_k_fails(p):
    S = np.zeros((3, T, T))
    rep = audit({"Q": p["Q"], "K": p["K"], "S": S})
    c = _check(rep, "S", "S is T×T")
    assert not c.ok and rep.first_failure is c, str(rep)
    assert c.message == f"S is {S.shape} but Q Kᵀ is {(H, T, T)}: the batch/head axes do not match"
    assert c.evidence == {"shape": S.shape} and c.hint is None


def test_decoding_scores_with_heads_pass_with_their_shape_and_scale(p):
    Q = p["Q"][:, -2:]  # the last 2 queries of each head, all T keys
    rep = audit({"Q": Q, "K": p["K"], "S": p["S"][:, -2:]})
    assert rep.ok, str(rep)
    assert _check(rep, "S", "S is T×T").message == f"S is 2×{T}"
    msg = _check(rep, "S", "scale 1/√d_k").message
    assert msg.startswith(f"S = Q Kᵀ · {1 / np.sqrt(DK):.4g} (d_k = {DK}); max error "), msg


def test_blocked_entries_of_s_are_not_compared(p):
    S = p["S"].copy()
    S[..., 0] = -1e9  # a padded first key, filled in S (not read as Z: the future is not blocked)
    S[0, 3, 1] = -1e4  # exactly the fill bound
    rep = audit({"Q": p["Q"], "K": p["K"], "S": S})
    assert _check(rep, "S", "scale 1/√d_k").ok and rep.notes == [], str(rep)


@pytest.mark.parametrize("low", ["S", "Q", "K"])
def test_each_of_s_q_k_s_precision_sets_the_scale_tolerance(p, low):
    for err, ok in ((0.0, True), (1e-3, False)):
        arrays = {"Q": p["Q"], "K": p["K"], "S": p["S"] + err}
        arrays[low] = arrays[low].astype(np.float32)
        assert _check(audit(arrays), "S", "scale 1/√d_k").ok is ok, (low, err)


def _scale_fail(rep):
    c = _check(rep, "S", "scale 1/√d_k")
    assert not c.ok and rep.first_failure is c, str(rep)
    return c


def test_a_wrong_scale_is_named_where_and_how_far_off(p):
    G = p["Q"] @ np.swapaxes(p["K"], -1, -2)
    c = _scale_fail(audit({"Q": p["Q"], "K": p["K"], "S": G}))
    assert (c.fault, c.hint) == (
        "missing-scale",
        "missing-scale: the 1/√d_k scale is missing (S = Q Kᵀ)",
    )
    e = np.abs(G - G / np.sqrt(DK)).max()
    assert c.message == f"S differs from Q Kᵀ/√d_k by up to {e:.3g}"
    assert c.evidence["index"] == (0,) and c.evidence["max_err"] == pytest.approx(e)
    assert c.evidence["slices_failing"] == H and c.evidence["rows"] == list(range(T))
    c = _scale_fail(audit({"Q": p["Q"], "K": p["K"], "S": G / DK}))
    assert c.fault == "scale-by-dk"
    assert c.hint == f"scale-by-dk: S was divided by d_k = {DK} instead of √d_k"
    c = _scale_fail(audit({"Q": p["Q"], "K": p["K"], "S": G * 0.3}))
    assert c.fault is None
    assert c.hint == f"S = Q Kᵀ · 0.3, expected · {1 / np.sqrt(DK):.4g} (1/√d_k, d_k = {DK})"
    S = p["S"].copy()
    S[1, 2, 0] += 1.0  # one wrong score: no factor explains it
    c = _scale_fail(audit({"Q": p["Q"], "K": p["K"], "S": S}))
    assert c.hint is None and c.fault is None
    assert c.evidence == {"index": (1,), "rows": [2], "cols": [0], "max_err": pytest.approx(1.0)}


def test_a_wrong_scale_ignores_blocked_scores_when_naming_the_factor(p):
    G = p["Q"] @ np.swapaxes(p["K"], -1, -2)
    for S, fault in ((G.copy(), "missing-scale"), (G / DK, "scale-by-dk"), (G * 0.3, None)):
        S[..., 0] = -1e9  # a padded first key
        c = _scale_fail(audit({"Q": p["Q"], "K": p["K"], "S": S}))
        assert c.fault == fault and (fault is not None or "· 0.3, expected" in c.hint), c


def test_k_not_transposed_is_named_when_t_equals_d_k():
    rng = np.random.default_rng(5)
    Q, K = rng.normal(size=(DK, DK)), rng.normal(size=(DK, DK))
    for S in (Q @ K / np.sqrt(DK), Q @ K):
        c = _scale_fail(audit({"Q": Q, "K": K, "S": S}))
        assert c.fault == "k-not-transposed", c
        assert c.hint == (
            "k-not-transposed: S = Q K, not Q Kᵀ: K was not transposed (shapes hid it: T = d_k)"
        )
    for S in (Q @ K / np.sqrt(DK), Q @ K):
        S[0, 1] = -1e9  # a blocked score is left out of the comparison
        assert _scale_fail(audit({"Q": Q, "K": K, "S": S})).fault == "k-not-transposed"
    Ks = K + K.T  # symmetric: Q K = Q Kᵀ, and the missing scale is what is named
    c = _scale_fail(audit({"Q": Q, "K": Ks, "S": Q @ Ks}))
    assert c.fault == "missing-scale", c


def test_the_fitted_factor_of_small_scores(p):
    Q, K = p["Q"] * 0.01, p["K"] * 0.01  # Σ (Q Kᵀ)² < 1
    c = _scale_fail(audit({"Q": Q, "K": K, "S": 0.3 * Q @ np.swapaxes(K, -1, -2)}))
    assert c.hint == f"S = Q Kᵀ · 0.3, expected · {1 / np.sqrt(DK):.4g} (1/√d_k, d_k = {DK})"


@pytest.mark.parametrize("low", ["Q", "K"])
def test_recomputed_s_carries_q_and_k_s_precision(p, low):
    """S recomputed from Q and K, one stored in float32: A computed in float64 before that
    rounding is the softmax within the float32 tolerance; one weight off by 1e-3 is not."""
    for err, ok in ((0.0, True), (1e-3, False)):
        A = p["A"].copy()
        A[1, 3, 1] += err
        A[1, 3, 0] -= err
        arrays = {"Q": p["Q"], "K": p["K"], "A": A}
        arrays[low] = arrays[low].astype(np.float32)
        rep = audit(arrays)
        assert _check(rep, "A", "A = softmax_last(S + M)").ok is ok, (low, err, str(rep))


def test_a_declared_scale_is_not_blamed_as_the_candidate_it_equals():
    """scale = 1 + 2^-42 (1 to 1e-12): S = Q Kᵀ with one score just past float64's tolerance
    (1e-9) from it and just inside it from Q Kᵀ · 1: the hint is the fitted factor, not
    'missing-scale'."""
    rng = np.random.default_rng(6)
    Q, K = rng.normal(size=(T, DK)), rng.normal(size=(T, DK))
    G = Q @ K.T
    c0 = 1 + 2**-42
    j = np.unravel_index(np.argmax(G), G.shape)
    S = G.copy()
    S[j] -= 1e-9 * np.abs(G).max() - G[j] * 2**-43
    c = _scale_fail(audit({"Q": Q, "K": K, "S": S}, scale=c0))
    assert c.fault is None and c.hint.startswith("S = Q Kᵀ · 1, expected · 1 "), c
    # scale = 1/3 + 1e-12 is not 1/d_k (1e-12 > 1e-12 · scale): 'scale-by-dk' is tried
    c0 = 1 / DK + 1e-12
    S = G / DK
    S[j] -= 1e-9 * np.abs(G * c0).max() - G[j] * 1e-12 / 2
    c = _scale_fail(audit({"Q": Q, "K": K, "S": S}, scale=c0))
    assert c.fault == "scale-by-dk", c


# -- S absent: its scale read back from A ------------------------------------------------------

READ = "scale 1/√d_k (read back from A)"


def _readback(rep):
    hits = [c for c in rep.checks if c.name == READ]
    return hits[0] if hits else None


def _weights(Q, K, c, allowed=None):
    G = Q @ np.swapaxes(K, -1, -2)
    al = masks.causal(*G.shape[-2:]) if allowed is None else allowed
    return softmax_last(np.where(al, c * G, 0.0), al)


def test_the_scale_read_back_from_a_with_heads_and_its_hints(p):
    Q, K = p["Q"], p["K"]
    c0 = 1 / np.sqrt(DK)
    c = _readback(audit({"Q": Q, "K": K, "A": p["A"]}))
    assert c.ok and c.stage == "S" and c.evidence == {} and c.hint is None and c.fault is None
    assert c.message == f"log A matches Q Kᵀ · {c0:.4g}; expected · {c0:.4g}"
    for factor, fault, hint in (
        (1.0, "missing-scale", "missing-scale: the 1/√d_k scale is missing (softmax of Q Kᵀ)"),
        (1 / DK, "scale-by-dk", f"scale-by-dk: S was divided by d_k = {DK} instead of √d_k"),
        (0.3, None, f"A is the softmax of Q Kᵀ · 0.3, expected · {c0:.4g}"),
    ):
        rep = audit({"Q": Q, "K": K, "A": _weights(Q, K, factor)})
        c = _readback(rep)
        assert c is not None and not c.ok and rep.first_failure is c, str(rep)
        assert (c.fault, c.hint) == (fault, hint)
        assert c.message == f"log A matches Q Kᵀ · {factor:.4g}; expected · {c0:.4g}"
        assert c.evidence == {"factor": pytest.approx(factor), "expected": pytest.approx(c0)}


def test_the_read_back_leaves_out_blocked_keys_and_underflowed_weights(p):
    A = p["A"].copy()
    A[0, 1, 3] = 1e-3  # weight on a blocked (future) key: stage M's fault, not the scale's
    A[1, 4, 2] = 1e-30  # an underflowed weight says nothing about the scale
    rep = audit({"Q": p["Q"], "K": p["K"], "A": A})
    c = _readback(rep)
    assert c is not None and c.ok, str(rep)
    assert rep.first_failure.stage == "M", str(rep)


def test_the_read_back_with_more_queries_than_keys(p):
    # no mask is known (T_q > T_k): every positive weight is read
    Q, K = p["Q"][0], p["K"][0, :3]
    A = _weights(Q, K, 1 / np.sqrt(DK), np.ones((T, 3), bool))
    c = _readback(audit({"Q": Q, "K": K, "A": A}))
    assert c is not None and c.ok, c


def test_the_read_back_needs_two_rows_with_two_readable_keys(p):
    rng = np.random.default_rng(7)
    for t, read in ((2, False), (3, True)):
        Q, K = rng.normal(size=(t, DK)), rng.normal(size=(t, DK))
        c = _readback(audit({"Q": Q, "K": K, "A": _weights(Q, K, 1.0)}))
        assert (c is not None) is read, t
        if read:
            assert not c.ok and c.fault == "missing-scale"


def test_the_read_back_with_sinks_whose_first_row_has_one_key(p):
    import causalattn as ca

    tr = ca.trace(p["X"], p["W_q"], p["W_k"], p["W_v"], sinks=[0.3])
    c = _readback(audit({"Q": tr.Q, "K": tr.K, "A": tr.A}, sinks=[0.3]))
    assert c is not None and c.ok, c


def test_the_read_back_with_small_scores(p):
    Q, K = p["Q"][0] * 0.05, p["K"][0] * 0.05  # Σ of the centred scores² well below 1
    c = _readback(audit({"Q": Q, "K": K, "A": _weights(Q, K, 1.0)}))
    assert c is not None and c.fault == "missing-scale", c


@pytest.mark.parametrize(
    "scale, delta, read",
    [
        (1.0, 0.03, True),  # spread of log A ≈ 5: a 0.03 error is within 1% of it
        (0.05, 0.016, False),  # spread < 1: the bound is 0.01, and 0.014 is past it
    ],
)
def test_the_read_back_only_when_a_is_nearly_a_softmax_of_a_multiple(scale, delta, read):
    rng = np.random.default_rng(8)
    Q, K = rng.normal(size=(8, 4)) * 2 * scale, rng.normal(size=(8, 4)) * 2
    A = _weights(Q, K, 0.5)
    A[7, 2] *= np.exp(delta)
    c = _readback(audit({"Q": Q, "K": K, "A": A}))
    assert (c is not None) is read, c
