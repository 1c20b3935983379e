"""Stage M check by check (causalattn.check.stage_mask): where the mask is read from (a
declared mask, M, Z or the keys A reads), what each check says, the catalogue fault it names,
and when padding is inferred."""

from __future__ import annotations

import numpy as np
import pytest

import causalattn as ca
from causalattn import masks
from causalattn.check import AuditInputError, audit

T = 6  # the conftest trace `tr` has 6 tokens


def _qkv(tr):
    return {"q": tr.Q, "k": tr.K, "v": tr.V}


def _m(rep):
    """Stage M's checks by name."""
    return {c.name: c for c in rep.checks if c.stage == "M"}


def _weights(S, al):
    """softmax over the allowed keys, zero rows where none is."""
    return ca.matrix_form.softmax_last(np.where(al, S, 0.0), al)


CAUSAL_OK = "0 on and below the diagonal, blocked above"


# ---- where the mask comes from -------------------------------------------------------------
@pytest.mark.parametrize("fill", [-np.inf, -1e9, -1e4])
def test_an_additive_M_is_read_and_nothing_is_recomputed_for_it(tr, fill):
    M = np.where(masks.causal(T), 0.0, fill)
    rep = audit({"S": tr.S, "M": M, "A": tr.A})
    assert rep.ok, str(rep)
    assert list(_m(rep)) == ["mask is causal (+ padding)"]
    c = _m(rep)["mask is causal (+ padding)"]
    assert c.message == f"M: {CAUSAL_OK}" and c.evidence == {} and c.hint is None
    assert "M" not in rep.recomputed


def test_an_M_entry_neither_zero_nor_blocked_is_named(tr):
    M = np.where(masks.causal(T), 0.0, -np.inf)
    M[2, 4] = 0.5
    M[3, 1] = -3.0
    c = _m(audit({"S": tr.S, "M": M, "A": tr.A}))["M is 0 or blocked"]
    assert (c.ok, c.fault) == (False, None)
    assert c.message == "M has entries that are neither 0 nor -inf (or a large negative fill)"
    assert c.evidence == {"rows": [2, 3], "cols": [1, 4]}
    assert c.hint == (
        "M must be 0 where a key may be read and -inf (or a large negative fill) where it may "
        "not; a bias belongs in S"
    )
    Mb = np.stack([np.where(masks.causal(T), 0.0, -np.inf), M])  # (B, T, T): the index too
    c = _m(audit({"S": np.stack([tr.S, tr.S]), "M": Mb}))["M is 0 or blocked"]
    assert c.evidence == {"index": (1,), "rows": [2, 3], "cols": [1, 4]}


def test_scores_with_the_mask_in_them_are_read_as_Z(tr):
    Z = np.where(masks.causal(T), tr.S, -np.inf)
    rep = audit({"Z": Z, "A": tr.A, "V": tr.V})
    assert rep.ok, str(rep)
    assert _m(rep)["mask is causal (+ padding)"].message == f"Z: {CAUSAL_OK}"
    assert rep.recomputed[:2] == ["S", "M"]
    Zf = np.where(masks.causal(T), tr.S, -2e4)  # a large negative fill blocks as -inf does
    assert _m(audit({"Z": Zf, "A": tr.A}))["mask is causal (+ padding)"].ok
    Zw = np.where(masks.causal(T), tr.S, -5e3)  # above the threshold: every key readable
    c = _m(audit({"Z": Zw, "A": tr.A}))["mask is causal (+ padding)"]
    assert not c.ok and c.fault == "no-mask", c
    Zn = Z.copy()
    Zn[4, 2] = np.nan  # not finite: blocked
    c = _m(audit({"Z": Zn}))["mask is causal (+ padding)"]
    assert not c.ok and c.evidence == {"rows": [4], "cols": [2]}, c


def test_with_S_and_Z_given_S_is_kept(tr):
    Z = np.where(masks.causal(T), tr.S, -np.inf)
    rep = audit({"S": tr.S, "Z": Z, "A": tr.A})
    assert rep.ok and "S" not in rep.recomputed and "M" in rep.recomputed, str(rep)


def test_the_sources_are_compared_with_the_first(tr):
    M = np.where(masks.causal(T), 0.0, -np.inf)
    Z = np.where(masks.causal(T), tr.S, -np.inf)
    rep = audit({"S": tr.S, "M": M, "Z": Z, "allowed": masks.causal(T), "A": tr.A})
    assert rep.ok, str(rep)
    checks = _m(rep)
    assert list(checks) == [
        "M agrees with declared mask",
        "Z agrees with declared mask",
        "mask is causal (+ padding)",
    ]
    assert checks["M agrees with declared mask"].message == "M and declared mask agree"
    assert checks["Z agrees with declared mask"].message == "Z and declared mask agree"
    assert checks["mask is causal (+ padding)"].message == f"declared mask: {CAUSAL_OK}"
    assert "M" not in rep.recomputed
    al = masks.causal(T).copy()
    al[3, 4] = True
    rep = audit({"S": tr.S, "M": M, "allowed": al})
    c = _m(rep)["M agrees with declared mask"]
    assert (c.ok, c.message) == (False, "M and declared mask disagree")
    assert c.evidence == {"rows": [3], "cols": [4]} and c.hint is None
    s = _m(rep)["mask is causal (+ padding)"]  # the first source is the one judged
    assert s.message == "declared mask: does not match causal ∧ padding"
    assert s.hint == "some queries read future keys (j > i): the causal mask is wrong"
    c = _m(audit({"Z": Z, "M": np.where(al, 0.0, -np.inf)}))["Z agrees with M"]
    assert (c.ok, c.message, c.evidence) == (False, "Z and M disagree", {"rows": [3], "cols": [4]})


def test_a_declared_mask_alone_is_what_M_is_recomputed_from(tr):
    rep = audit({"S": tr.S, "allowed": masks.causal(T), "A": tr.A})
    assert rep.ok and "M" in rep.recomputed, str(rep)
    assert _m(rep)["mask is causal (+ padding)"].message == f"declared mask: {CAUSAL_OK}"


def test_without_a_mask_or_A_the_declared_pattern_is_the_mask(tr):
    rep = audit({**_qkv(tr), "H": tr.H})
    assert rep.ok and _m(rep) == {} and rep.recomputed[:3] == ["S", "M", "A"], str(rep)
    rep = audit({**_qkv(tr), "H": tr.H}, window=2)  # the window is the mask H is checked by
    assert not rep.ok and rep.first_failure.stage == "H", str(rep)
    Hw = ca.trace(tr.X, tr["W_q"], tr["W_k"], tr["W_v"], window=2).H
    assert audit({**_qkv(tr), "H": Hw}, window=2).ok
    # S given, no A: the mask is still the declared pattern
    rep = audit({"S": tr.S, "V": tr.V, "H": tr.H})
    assert rep.ok and "M" in rep.recomputed and _m(rep) == {}, str(rep)


def test_q_and_k_alone_give_the_shape_with_their_leading_axes():
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(3, 2, 1, 5, 4))
    k = np.broadcast_to(k, (2, 3, 5, 4))  # (B, 1) and (B, H) leading axes broadcast
    v = np.broadcast_to(v, (2, 3, 5, 4))
    s = q @ np.swapaxes(k, -1, -2) / 2.0
    a = _weights(s, masks.causal(5))
    h = a @ v
    rep = audit({"Q": q, "K": k, "V": v, "H": h})
    assert rep.ok and "M" in rep.recomputed, str(rep)
    rep = audit({"Q": q, "K": k, "V": v, "H": h}, window=2)
    assert not rep.ok and rep.first_failure.stage == "H", str(rep)


def test_more_queries_than_keys_leave_stage_M_out(tr):
    S = tr.S[:, :4]
    rep = audit({"S": S, "M": np.zeros_like(S) + 0.5})
    assert list(_m(rep)) == ["mask is T×T"] and "M" not in rep.recomputed, str(rep)
    c = _m(rep)["mask is T×T"]  # no causal mask has more query rows than keys
    assert (c.ok, c.message) == (False, "M is 6×4: more query rows than keys"), c


# ---- shapes a mask may have ------------------------------------------------------------------
def test_a_batch_mask_missing_its_head_axis_is_fitted():
    rng = np.random.default_rng(5)
    X = rng.normal(size=(3, T, 8))  # B = 3, H = 2: a (B, T, T) mask does not broadcast as is
    W = [rng.normal(size=(8, 8)) for _ in range(3)]
    al = _padded([6, 4, 5])  # (B, T, T), the stages (B, H, T, T)
    t = ca.trace(X, *W, n_heads=2, mask=al[:, None], causal=False)
    for given in ({"allowed": al}, {"M": np.where(al, 0.0, -np.inf)}):
        rep = audit({"S": t.S, "A": t.A, **given, "n_heads": 2})
        assert rep.ok and _m(rep)[STRUCT].ok, str(rep)
        assert rep.empty_rows == [
            {"index": [1, 0], "rows": [4, 5]},
            {"index": [1, 1], "rows": [4, 5]},
            {"index": [2, 0], "rows": [5]},
            {"index": [2, 1], "rows": [5]},
        ]
    with pytest.raises(
        AuditInputError, match=r"^M: shape \(4, 6, 6\) does not broadcast to \(3, 2, 6, 6\)$"
    ):
        audit({"S": t.S, "M": np.zeros((4, T, T)), "n_heads": 2})
    with pytest.raises(
        AuditInputError, match=r"^mask: shape \(4, 6, 6\) does not broadcast to \(3, 2, 6, 6\)$"
    ):
        audit({"S": t.S, "allowed": np.ones((4, T, T), bool), "n_heads": 2})
    with pytest.raises(  # no heads named: a 3-D mask is not taken for (B, T, T)
        AuditInputError, match=r"^mask: shape \(3, 6, 6\) does not broadcast to \(3, 2, 6, 6\)$"
    ):
        audit({"S": t.S, "allowed": al})
    with pytest.raises(
        AuditInputError, match=r"^mask: shape \(2, 6, 6\) does not broadcast to \(3, 6, 6\)$"
    ):
        audit({"S": np.zeros((3, T, T)), "allowed": al[:2]})


# ---- no mask given: the keys A reads ---------------------------------------------------------
READS = "A reads what the pattern allows"


def test_weights_that_read_the_causal_keys_match_the_declared_pattern(tr):
    rep = audit({**_qkv(tr), "A": tr.A})
    c = _m(rep)[READS]
    assert rep.ok and c.ok and list(_m(rep)) == [READS], str(rep)
    assert c.message == "the keys A reads match the declared pattern (causal)"
    assert rep.notes == [] and "M" in rep.recomputed
    A = tr.A.copy()
    A[3] = np.nan  # a row of NaN reads nothing here: stage A says what is wrong with it
    rep = audit({**_qkv(tr), "A": A})
    assert _m(rep)[READS].ok and rep.first_failure.stage == "A", str(rep)


@pytest.mark.parametrize(
    "name, al, fault, msg, evidence, hint",
    [
        (
            "no mask",
            np.ones((T, T), bool),
            "no-mask",
            "rows 1..5 read future keys (row 1 reads keys 2, 3, 4, 5, 6)",
            {"rows": [0, 1, 2, 3, 4], "cols": [1, 2, 3, 4, 5]},
            "no-mask: no causal mask: queries read future keys; add the causal mask M before "
            "the softmax",
        ),
        (
            "transposed",
            masks.causal(T).T,
            "anti-causal-mask",
            "rows 1..5 read future keys (row 1 reads keys 2, 3, 4, 5, 6); rows 2..6 do not read "
            "keys they may (row 2 skips key 1)",
            {"rows": [0, 1, 2, 3, 4, 5], "cols": [0, 1, 2, 3, 4, 5]},
            "anti-causal-mask: mask transposed: queries read j >= i; queries read j <= i: the "
            "lower triangle, not the upper",
        ),
        (
            "diagonal blocked",
            np.tril(np.ones((T, T), bool), -1),
            "diagonal-blocked",
            "rows 2..6 do not read their own key (row 1 does)",
            {"rows": [1, 2, 3, 4, 5], "cols": [1, 2, 3, 4, 5]},
            "diagonal-blocked: the diagonal is blocked (j < i allowed): a token cannot read "
            "itself; allow j <= i: each token must be able to read itself; key 6 is read by no "
            "query: if that is padding, declare key_padding_mask= or lengths=",
        ),
        (
            "one future key",
            masks.causal(T) | (np.arange(T)[:, None] == 1) & (np.arange(T) == 3),
            None,
            "row 2 reads future keys (row 2 reads key 4)",
            {"rows": [1], "cols": [3]},
            "A gives weight to keys the pattern blocks: the mask is too weak or wrong",
        ),
        (
            "two keys nobody reads",
            masks.causal(T) & (np.arange(T) < 4) | np.diag(np.arange(T) == 4),
            None,
            "row 6 does not read its own key (rows 1..5 do); row 6 does not read keys it may "
            "(row 6 skips key 5)",
            {"rows": [5], "cols": [4, 5]},
            "A leaves out keys the pattern allows: the mask is stricter than declared (a window "
            "or a padding rule nobody declared?); key 6 is read by no query: if that is "
            "padding, declare key_padding_mask= or lengths=",
        ),
        (
            "keys 5 and 6 read by nobody",
            masks.causal(T) & (np.arange(T) < 4),
            None,
            "rows 5..6 do not read their own key (rows 1..4 do); row 6 does not read keys it "
            "may (row 6 skips key 5)",
            {"rows": [4, 5], "cols": [4, 5]},
            "A leaves out keys the pattern allows: the mask is stricter than declared (a window "
            "or a padding rule nobody declared?); keys 5, 6 are read by no query: if that is "
            "padding, declare key_padding_mask= or lengths=",
        ),
    ],
)
def test_weights_that_read_other_keys_fail_with_what_differs(
    tr, name, al, fault, msg, evidence, hint
):
    A = _weights(tr.S, al)
    for given in (_qkv(tr), {"A": A, "V": tr.V}):  # with S (recomputed) and without
        c = audit({**given, "A": A}).first_failure
        assert (c.stage, c.name, c.fault) == ("M", READS, fault), (name, c)
        assert c.message == f"the keys A reads differ from the declared pattern (causal): {msg}"
        assert c.evidence == evidence and c.hint == hint, (name, c)


def _padded(lengths, T_q=T):
    """(B, T_q, T) causal ∧ padding masks, bottom-right aligned."""
    return np.stack(
        [masks.Pattern(lengths=[L]).allowed(1, 1, T, T)[0, 0][T - T_q :] for L in lengths]
    )


NOTE = "padding assumed from A (keys and query rows from L on read nothing): "


@pytest.mark.parametrize(
    "lengths, said",
    [
        ([4, 6, 3, 5, 2], "[0] L = 4; [2] L = 3; [3] L = 5; [4] L = 2"),
        ([2, 3, 4, 5, 1, 6, 3], "[0] L = 2; [1] L = 3; [2] L = 4; [3] L = 5 ..."),
        ([2, 3, 4, 5, 1], "[0] L = 2; [1] L = 3; [2] L = 4; [3] L = 5 ..."),
        ([6, 5], "[1] L = 5"),
    ],
)
def test_unambiguous_padding_per_sequence_is_inferred_and_said(tr, lengths, said):
    al = _padded(lengths)
    S = np.broadcast_to(tr.S, al.shape)
    for given in ({"S": S}, {"V": np.broadcast_to(tr.V, al.shape[:1] + tr.V.shape)}):
        rep = audit({**given, "A": _weights(S, al)})
        assert rep.ok and _m(rep)[READS].ok, str(rep)
        assert rep.notes == [NOTE + said + "; declare lengths= to state it"], rep.notes
        assert [r["index"] for r in rep.empty_rows] == [[b] for b, L in enumerate(lengths) if L < T]


def test_padding_inferred_for_one_sequence_and_for_queries_at_the_end(tr):
    al = _padded([4])[0]
    rep = audit({"A": _weights(tr.S, al), "V": tr.V})
    assert rep.ok and rep.notes == [NOTE + "L = 4; declare lengths= to state it"], str(rep)
    al = _padded([4], T_q=3)[0]  # decoding: the last 3 queries, 1 real, 2 padding
    rep = audit({"S": tr.S[-3:], "A": _weights(tr.S[-3:], al)})
    assert rep.ok and rep.notes == [NOTE + "L = 4; declare lengths= to state it"], str(rep)
    al = _padded([4], T_q=2)[0]  # the two padding queries only: nothing read at all, no L
    rep = audit({"S": tr.S[-2:], "A": _weights(tr.S[-2:], al)})
    assert rep.notes == [] and not rep.ok, str(rep)


def test_padding_is_not_inferred_when_it_is_ambiguous_or_declared(tr):
    al = _padded([4])[0]
    A = _weights(tr.S, al)
    rep = audit({"A": A, "V": tr.V}, lengths=[4])  # declared: nothing to assume
    assert rep.ok and rep.notes == [], str(rep)
    rep = audit({"A": A, "V": tr.V, "lengths": np.array([4])})
    assert rep.ok and rep.notes == [], str(rep)
    kp = np.arange(T)[None] < 4  # key padding only: the query rows from 4 on read keys 1..4
    rep = audit({"A": A, "V": tr.V, "key_padding_mask": kp})
    assert _m(rep)[READS].ok and rep.notes == [], str(rep)
    assert _m(rep)[READS].message.endswith("(causal + padding)")
    assert rep.first_failure.stage == "A"  # the zero padding rows: stage A says so
    # a padding query row that reads a real key: the keys from 4 on are not padding
    al2 = al.copy()
    al2[5, 0] = True
    rep = audit({"A": _weights(tr.S, al2), "V": tr.V})
    c = _m(rep)[READS]
    assert rep.notes == [] and not c.ok, str(rep)
    assert c.message.endswith(
        "(causal): row 6 does not read its own key (rows 1..5 do); row 6 does not read keys it "
        "may (row 6 skips keys 2, 3, 4, 5)"
    )  # row 5 reads nothing: left to stage A
    assert c.hint.endswith(
        "keys 5, 6 are read by no query: if that is padding, declare key_padding_mask= or lengths="
    )
    # a later key read (key 5, by row 6): no L from which on nothing is read
    al3 = al.copy()
    al3[5, 5] = True
    rep = audit({"A": _weights(tr.S, al3), "V": tr.V})
    assert rep.notes == [] and not _m(rep)[READS].ok, str(rep)
    assert _m(rep)[READS].hint.endswith(
        "key 5 is read by no query: if that is padding, declare key_padding_mask= or lengths="
    )


def test_a_weight_that_underflowed_to_zero_is_not_a_blocked_key(tr):
    S = tr.S.copy()
    S[5, 0] = -1e4  # exp underflows: A[5, 0] is exactly 0 though key 0 is readable
    A = _weights(S, masks.causal(T))
    assert A[5, 0] == 0.0
    assert audit({"S": S, "A": A}).ok
    rep = audit({"A": A, "V": tr.V})  # without S the zero is read as a blocked key
    c = _m(rep)[READS]
    assert not c.ok and c.message.endswith("row 6 does not read keys it may (row 6 skips key 1)")
    A2 = A.copy()
    A2[4, 0], A2[4, 1] = 0.0, A2[4, 1] + A2[4, 0]  # a zero the scores do not explain
    c = _m(audit({"S": S, "A": A2}))[READS]
    assert not c.ok and c.message.endswith("row 5 does not read keys it may (row 5 skips key 1)")


# ---- a given mask against causal ∧ padding ------------------------------------------------------
STRUCT = "mask is causal (+ padding)"
C = masks.causal(T)
HINTS = {
    "none": "no-mask: no causal mask: every query reads future keys (add M before the softmax)",
    "anti": "anti-causal-mask: the mask is transposed (anti-causal): queries read j >= i instead "
    "of j <= i",
    "diag": "diagonal-blocked: the diagonal is blocked (j < i): each token must be able to read "
    "itself",
    "future": "some queries read future keys (j > i): the causal mask is wrong",
    "padding": "padding-ignored: padding keys are readable: the padding mask was not applied to "
    "keys",
    "over": "the mask blocks keys that should be readable (j <= i, not padding)",
}


def _one_future():
    al = C.copy()
    al[1, 3] = True
    return al


def _one_blocked():
    al = C.copy()
    al[4, 1] = False
    return al


@pytest.mark.parametrize(
    "kind, al, fault, evidence",
    [
        (
            "none",
            np.ones((T, T), bool),
            "no-mask",
            {"rows": [0, 1, 2, 3, 4], "cols": [1, 2, 3, 4, 5]},
        ),
        ("anti", C.T, "anti-causal-mask", {"rows": list(range(6)), "cols": list(range(6))}),
        (
            "diag",
            np.tril(C, -1),
            "diagonal-blocked",
            {"rows": [0, 1, 2, 3, 4], "cols": [0, 1, 2, 3, 4]},
        ),
        ("future", _one_future(), None, {"rows": [1], "cols": [3]}),
        ("over", _one_blocked(), None, {"rows": [4], "cols": [1]}),
    ],
)
def test_a_mask_that_is_not_causal_is_named_by_its_kind(tr, kind, al, fault, evidence):
    for given in ({"allowed": al}, {"M": np.where(al, 0.0, -np.inf)}):
        src = "declared mask" if "allowed" in given else "M"
        rep = audit({"S": tr.S, **given})
        c = _m(rep)[STRUCT]
        assert (c.ok, c.fault, c.hint) == (False, fault, HINTS[kind]), (kind, c)
        assert c.message == f"{src}: does not match causal ∧ padding"
        assert c.evidence == evidence, (kind, c.evidence)
        assert rep.first_failure is c
    # with a leading axis: the first failing slice is named
    rep = audit({"S": np.stack([tr.S] * 3), "allowed": np.stack([C, al, al])})
    c = _m(rep)[STRUCT]
    assert c.evidence == {"index": (1,), "slices_failing": 2, **evidence}, c.evidence
    assert c.hint == HINTS[kind]


def test_the_worst_kind_in_a_batch_is_the_one_named(tr):
    kinds = {"none": np.ones((T, T), bool), "future": _one_future(), "over": _one_blocked()}
    kinds |= {"anti": C.T, "diag": np.tril(C, -1)}
    order = ["none", "anti", "diag", "future", "over"]
    for i, k in enumerate(order):
        for later in order[i + 1 :]:
            for al in (np.stack([kinds[later], kinds[k]]), np.stack([kinds[k], kinds[later]])):
                c = _m(audit({"S": np.stack([tr.S] * 2), "allowed": al}))[STRUCT]
                assert c.hint == HINTS[k], (k, later, c.hint)


def test_anti_and_diagonal_are_named_only_for_plain_causal_square_masks(tr):
    # with a window declared, the transposed mask is "future keys", not the catalogue's fault
    c = _m(audit({"S": tr.S, "allowed": C.T}, window=3))[STRUCT]
    assert (c.hint, c.fault) == (HINTS["future"], None), c
    Cw = masks.Pattern(window=3).allowed(1, 1, T, T)[0, 0]
    c = _m(audit({"S": tr.S, "allowed": Cw & ~np.eye(T, dtype=bool)}, window=3))[STRUCT]
    assert (c.hint, c.fault) == (HINTS["over"], None), c
    c = _m(audit({"S": tr.S[2:], "allowed": masks.causal(4, T)}))[STRUCT]  # decoding
    assert c.ok and c.message == f"declared mask: {CAUSAL_OK}", c
    c = _m(audit({"S": tr.S[:4, :4], "allowed": masks.causal(4).T}))[STRUCT]
    assert c.fault == "anti-causal-mask"


def test_a_mask_as_declared_and_its_padding_are_said(tr):
    Cw = masks.Pattern(window=3).allowed(1, 1, T, T)[0, 0]
    c = _m(audit({"S": tr.S, "allowed": Cw}, window=3))[STRUCT]
    assert c.ok and c.message == "declared mask: as declared (causal + window 3)", c
    assert c.evidence == {} and c.hint is None and c.fault is None
    c = _m(audit({"S": tr.S, "allowed": C}, window=3))[STRUCT]
    assert not c.ok and c.hint == HINTS["future"] and c.evidence["rows"] == [3, 4, 5]
    P = _padded([4])[0]
    c = _m(audit({"S": tr.S, "allowed": P}))[STRUCT]
    assert (
        c.ok and c.message == f"declared mask: {CAUSAL_OK}, padding keys (read by no query) blocked"
    )
    c = _m(audit({"S": tr.S, "allowed": P, "lengths": np.array([4])}))[STRUCT]
    assert c.ok and c.message == f"declared mask: {CAUSAL_OK}, padding blocked"
    c = _m(audit({"S": tr.S, "allowed": P}, lengths=[4]))[STRUCT]
    assert c.ok and c.message == f"declared mask: {CAUSAL_OK}, padding blocked"
    Pw = P & Cw
    c = _m(audit({"S": tr.S, "allowed": Pw}, window=3, lengths=[4]))[STRUCT]
    assert c.ok and c.message == "declared mask: as declared (causal + window 3), padding blocked"
    c = _m(audit({"S": tr.S, "allowed": C, "lengths": np.array([4])}))[STRUCT]
    assert not c.ok and c.hint == HINTS["padding"] and c.fault == "padding-ignored"
    assert c.evidence == {"rows": [4, 5], "cols": [4, 5]}
    kp = np.arange(T)[None] < 4  # key padding only: the padding rows read the real keys
    c = _m(audit({"S": tr.S, "allowed": C & kp, "key_padding_mask": kp}))[STRUCT]
    assert c.ok and c.message == f"declared mask: {CAUSAL_OK}, padding blocked", c
    c = _m(audit({"S": tr.S, "allowed": C, "key_padding_mask": kp}))[STRUCT]
    assert not c.ok and c.fault == "padding-ignored" and c.evidence["cols"] == [4, 5], c


def test_a_wrong_decoding_mask_is_a_finding_at_M(tr):
    Cd = masks.causal(4, T)
    diag = Cd & ~np.eye(4, T, 2, dtype=bool)  # each query's own key blocked
    c = _m(audit({"S": tr.S[2:], "allowed": diag}))[STRUCT]
    assert (c.ok, c.hint, c.fault) == (False, HINTS["over"], None), c


# ---- the declared pattern in the stages' shape; the modified scores and sinks ---------------
def _mh_trace(x_shape, h, **kw):
    rng = np.random.default_rng(7)
    X = rng.normal(size=x_shape)
    W = [rng.normal(size=(8, 8)) for _ in range(3)]
    return ca.trace(X, *W, n_heads=h, **kw)


SHAPES = {  # name -> (X's shape, heads, the axis squeezed from the trace's (B?, H, T, T) or None)
    "T×T": ((T, 8), 1, 0),
    "H×T×T": ((T, 8), 2, None),
    "B×H×T×T": ((2, T, 8), 2, None),
    "B×T×T": ((3, T, 8), 1, 1),
    "B1×T×T": ((1, T, 8), 1, 1),
}


MODIFIERS = [
    ({"sinks": [0.3, -0.5]}, {"sinks": [1.5, 0.5]}),
    ({"softcap": 2.0}, {"softcap": 3.0}),
    ({"alibi_slopes": [0.5, 0.25]}, {"alibi_slopes": [0.25, 0.5]}),
    ({"alibi_slopes": [0.5, 0.25], "softcap": 2.0}, {"alibi_slopes": [0.5, 0.25]}),
]
HEAD_MOD = (
    {"score_mod": lambda s, b, h, q, k: s * (1 + h)},
    {"score_mod": lambda s, b, h, q, k: s},
)


@pytest.mark.parametrize(
    "shape, kw, other",
    [(sh, kw, o) for sh in SHAPES for kw, o in MODIFIERS],
)
def test_the_declared_modifiers_and_sinks_are_what_A_is_checked_against(shape, kw, other):
    x_shape, h, squeeze = SHAPES[shape]
    cut = {k: v[:h] if isinstance(v, list) else v for k, v in kw.items()}
    cut_other = {k: v[:h] if isinstance(v, list) else v for k, v in other.items()}
    t = _mh_trace(x_shape, h, **cut)
    S, A = (t.S, t.A) if squeeze is None else (t.S.squeeze(squeeze), t.A.squeeze(squeeze))
    given = {"S": S, "A": A} | ({"n_heads": h} if squeeze is None else {})
    rep = audit(given, **cut)
    assert rep.ok and _m(rep)[READS].ok, (shape, str(rep))
    if cut_other == cut:
        return
    c = audit(given, **cut_other).first_failure
    assert (c.stage, c.name) == ("A", "A = softmax_last(S + M)"), (shape, c)


def test_per_head_parameters_need_the_head_axis_named():
    t = _mh_trace((T, 8), 2, sinks=[0.3, -0.5])
    assert audit({"S": t.S, "A": t.A, "n_heads": 2}, sinks=[0.3, -0.5]).ok
    with pytest.raises(AuditInputError) as err:  # (2, T, T) without heads: a batch of 2
        audit({"S": t.S, "A": t.A}, sinks=[0.3, -0.5])
    assert str(err.value) == (
        "mask: the declared pattern does not fit the stages (2, 6, 6): sinks: expected one "
        "logit per head, shape (H,) = (1,), got (2,)"
    )


@pytest.mark.parametrize("n_heads", [None, 2])
def test_a_per_sequence_pattern_reads_a_single_leading_axis_as_the_batch(tr, n_heads):
    S = np.stack([tr.S, tr.S])
    al = _padded([6, 4])
    A = _weights(S, al)
    given = {"S": S, "A": A} | ({} if n_heads is None else {"n_heads": n_heads})
    rep = audit(given, lengths=[6, 4])
    assert rep.ok and rep.notes == [], str(rep)
    assert not audit(given, lengths=[4, 6]).ok
    with pytest.raises(AuditInputError) as err:
        audit(given, lengths=[6, 4, 3])
    assert str(err.value) == (
        "mask: the declared pattern does not fit the stages (2, 6, 6): lengths: expected shape "
        "(B,) = (2,), got (3,)"
    )
    with pytest.raises(
        AuditInputError,
        match=r"^mask: the declared pattern does not fit the "
        r"stages \(6, 6\): lengths: expected shape \(B,\) = \(1,\), got \(2,\)$",
    ):
        audit({"S": tr.S, "A": tr.A}, lengths=[6, 4])
    S4 = np.stack([S] * 3, 1)  # (B, H, T, T)
    al4 = np.broadcast_to(al[:, None], S4.shape)
    assert audit({"S": S4, "A": _weights(S4, al4)}, lengths=[6, 4]).ok
    assert not audit({"S": S4, "A": _weights(S4, al4)}, lengths=[4, 6]).ok


# ---- more of what the weights are read for ------------------------------------------------------
def test_the_mask_shape_is_the_scores_then_Z_then_M_then_A(tr):
    rep = audit({"S": tr.S, "A": tr.A[:, :5]})  # A of another shape: not read for the mask
    assert READS not in _m(rep) and "M" in rep.recomputed, str(rep)
    assert rep.first_failure.name == "A has S's shape"
    Z = np.where(C, tr.S, -1e4)  # exactly at the threshold: blocked
    c = _m(audit({"Z": Z, "A": tr.A[:, :5]}))[STRUCT]
    assert c.ok and c.message == f"Z: {CAUSAL_OK}", c
    M = np.where(C, 0.0, -np.inf)
    rep = audit({"M": M, "A": np.stack([tr.A, tr.A])})
    assert _m(rep)[STRUCT].ok and READS not in _m(rep), str(rep)
    assert rep.first_failure.message == "A is (2, 6, 6) but the mask/scores are (6, 6)"


def test_a_failing_slice_and_the_declared_pattern_are_named(tr):
    S = np.stack([tr.S, tr.S, tr.S])
    al = np.stack([C, np.ones((T, T), bool), C])
    c = audit({"S": S, "A": _weights(S, al)}).first_failure
    assert (c.name, c.fault) == (READS, "no-mask")
    assert c.message == (
        "the keys A reads differ from the declared pattern (causal): rows 1..5 read future keys "
        "(row 1 reads keys 2, 3, 4, 5, 6) (at index [1])"
    )
    assert c.evidence == {"index": (1,), "rows": [0, 1, 2, 3, 4], "cols": [1, 2, 3, 4, 5]}
    c = audit({"S": tr.S, "A": tr.A}, window=3).first_failure
    assert c.name == READS and c.message == (
        "the keys A reads differ from the declared pattern (causal + window 3): rows 4..6 read "
        "keys they may not (row 4 reads key 1)"
    )
    assert c.hint == "A gives weight to keys the pattern blocks: the mask is too weak or wrong"
    Cw = masks.Pattern(window=3).allowed(1, 1, T, T)[0, 0]
    c = audit({"S": tr.S, "A": _weights(tr.S, Cw & ~np.eye(T, dtype=bool))}, window=3)
    assert c.first_failure.fault == "diagonal-blocked", str(c)


def test_at_most_six_keys_nobody_reads_are_listed():
    g = np.random.default_rng(1)
    S = g.normal(size=(9, 9))
    al = np.zeros((9, 9), bool)
    al[:, 0] = True  # every query reads key 1 only
    c = audit({"S": S, "A": _weights(S, al)}).first_failure
    assert c.name == READS and c.fault is None
    assert c.hint.endswith(
        "; keys 2, 3, 4, 5, 6, 7 are read by no query: if that is padding, declare "
        "key_padding_mask= or lengths="
    )


def test_decoding_weights_that_read_every_key_are_no_mask(tr):
    S = tr.S[2:]
    c = audit({"S": S, "A": _weights(S, np.ones((4, T), bool))}).first_failure
    assert (c.name, c.fault) == (READS, "no-mask"), c
    assert audit({"S": S, "A": _weights(S, masks.causal(4, T))}).ok


def test_all_zero_weights_infer_no_padding(tr):
    rep = audit({"S": tr.S, "A": np.zeros((T, T))})
    assert rep.notes == [] and not rep.ok, str(rep)
    assert rep.first_failure.stage == "A"


def test_declared_lengths_win_over_the_arrays_lengths(tr):
    A = _weights(tr.S, _padded([4])[0])
    assert audit({"S": tr.S, "A": A, "lengths": np.array([5])}, lengths=[4]).ok
    assert not audit({"S": tr.S, "A": A, "lengths": np.array([4])}, lengths=[5]).ok
    kp4, kp5 = np.arange(T)[None] < 4, np.arange(T)[None] < 5
    Ak = _weights(tr.S, C & kp4)
    assert _m(audit({"S": tr.S, "A": Ak, "key_padding_mask": kp5}, key_padding_mask=kp4))[READS].ok
    assert not _m(audit({"S": tr.S, "A": Ak, "key_padding_mask": kp4}, key_padding_mask=kp5))[
        READS
    ].ok


def test_a_decoding_mask_with_padding_is_read_bottom_right(tr):
    al = _padded([4], T_q=3)[0]
    c = _m(audit({"S": tr.S[-3:], "allowed": al}))[STRUCT]
    assert (
        c.ok and c.message == f"declared mask: {CAUSAL_OK}, padding keys (read by no query) blocked"
    )
    c = _m(audit({"S": tr.S[-3:], "allowed": al, "lengths": np.array([4])}))[STRUCT]
    assert c.ok and c.message == f"declared mask: {CAUSAL_OK}, padding blocked", c


def test_padding_rows_are_judged_row_by_row(tr):
    L4 = {"lengths": np.array([4])}
    P = _padded([4])[0]
    al = P.copy()
    al[5, [4, 5]] = True  # a padding query reading only the padding keys before it
    c = _m(audit({"S": tr.S, "allowed": al, **L4}))[STRUCT]
    assert (c.ok, c.fault, c.evidence) == (
        False,
        "padding-ignored",
        {"rows": [5], "cols": list(range(6))},
    )
    al = P.copy()
    al[4, 4] = True  # row 5 reads its own (padding) key; row 6 reads token 0 only: that is fine
    al[5, 0] = True
    c = _m(audit({"S": tr.S, "allowed": al, **L4}))[STRUCT]
    assert (c.ok, c.evidence) == (False, {"rows": [4], "cols": [0, 1, 2, 3, 4]}), c
    al = P.copy()
    al[1, 3] = True  # a real row reading a future key; row 6 reads token 0 only: fine
    al[5, 0] = True
    c = _m(audit({"S": tr.S, "allowed": al}))[STRUCT]
    assert (c.ok, c.hint, c.evidence) == (False, HINTS["future"], {"rows": [1], "cols": [3]}), c
    al = P.copy()
    al[2, 0] = False  # a real row leaving out a key, padding declared: blocked too much
    c = _m(audit({"S": tr.S, "allowed": al, **L4}))[STRUCT]
    assert (c.ok, c.hint, c.fault) == (False, HINTS["over"], None), c
    al = C.copy()
    al[0] = ~C[0]  # a row that differs from causal in every key
    c = _m(audit({"S": tr.S, "allowed": al}))[STRUCT]
    assert (c.ok, c.evidence) == (False, {"rows": [0], "cols": [0, 1, 2, 3, 4, 5]}), c


def test_padding_in_any_slice_is_said_and_decoding_padding_rows_are_bottom_right(tr):
    al = np.stack([_padded([4])[0], C])  # padding in the first slice only
    c = _m(audit({"S": np.stack([tr.S, tr.S]), "allowed": al}))[STRUCT]
    assert (
        c.ok and c.message == f"declared mask: {CAUSAL_OK}, padding keys (read by no query) blocked"
    )
    al = _padded([4], T_q=4)[0]  # queries 3..6: two real, two padding rows reading nothing
    for given in ({}, {"lengths": np.array([4])}):
        c = _m(audit({"S": tr.S[2:], "allowed": al, **given}))[STRUCT]
        assert c.ok and c.message.startswith(f"declared mask: {CAUSAL_OK}, padding"), c


def test_a_nan_row_in_a_batch_reads_nothing(tr):
    A = np.stack([tr.A, tr.A])
    A[1, 3] = np.nan  # one row of the second sequence: stage A's finding, not a mask's
    rep = audit({"S": np.stack([tr.S, tr.S]), "A": A})
    assert _m(rep)[READS].ok and rep.first_failure.stage == "A", str(rep)


@pytest.mark.parametrize("x_shape, h", [((T, 8), 2), ((2, T, 8), 2)])
def test_a_per_head_bias_is_added_head_by_head(x_shape, h):
    rb = np.linspace(-1, 1, 2 * T - 1)[None] * np.arange(1, h + 1)[:, None]  # (H, 2T - 1)
    t = _mh_trace(x_shape, h, rel_bias=rb)
    given = {"S": t.S, "A": t.A, "n_heads": h}
    assert audit(given, rel_bias=rb).ok
    c = audit(given, rel_bias=rb[::-1].copy()).first_failure  # the heads' biases swapped
    assert (c.stage, c.name) == ("A", "A = softmax_last(S + M)"), c


def test_declared_padding_keys_are_not_listed_as_read_by_no_query(tr):
    al = _padded([4])[0]
    al[1, 2] = True  # row 2 reads a future key; keys 5, 6 are padding, declared
    c = audit({"S": tr.S, "A": _weights(tr.S, al)}, lengths=[4]).first_failure
    assert c.name == READS and c.message.endswith("row 2 reads future keys (row 2 reads key 3)")
    assert c.hint == "A gives weight to keys the pattern blocks: the mask is too weak or wrong"


# ---- the stages' shape from Q and K alone; S rebuilt from Z keeps Z's precision ----------
def _h_of(Q, K, V, lengths=None):
    """H = softmax_last(Q Kᵀ/√d_k + M) V, M causal (+ padding by ``lengths``); rows with
    no readable key are 0. Q (..., T_q, d), K (..., T_k, d), V (T_k, d_v)."""
    G = Q @ np.swapaxes(K, -1, -2) / np.sqrt(Q.shape[-1])
    T_q, T_k = G.shape[-2:]
    al = masks.causal(T_q, T_k)
    if lengths is not None:  # padding keys are never read, padding queries read nothing
        n = np.asarray(lengths)[:, None, None]
        al = al & (np.arange(T_k) < n) & (np.arange(T_q)[:, None] < n)
    Z = np.where(al, G, -np.inf)
    E = np.exp(Z - np.where(np.isfinite(Z), Z, -1e300).max(-1, keepdims=True))
    A = np.where(al.any(-1, keepdims=True), E / np.maximum(E.sum(-1, keepdims=True), 1e-300), 0)
    return A @ V


@pytest.mark.parametrize(
    "q_shape, k_shape, lengths",
    [
        ((2, 5, 3), (2, 5, 3), None),
        ((2, 5, 3), (5, 3), [3, 5]),  # the batch axis from Q only
        ((5, 3), (2, 5, 3), [3, 5]),  # ... or from K only
        ((2, 3), (5, 3), None),  # decoding: 2 queries, 5 keys
        ((2, 3, 5, 3), (2, 3, 5, 3), None),  # (B, H) = (2, 3)
    ],
)
def test_q_and_k_without_scores_or_weights_give_stage_m_its_shape(q_shape, k_shape, lengths):
    """With no S, Z, M or A, the mask is the declared one over broadcast(Q, K)'s leading axes
    × (T_q, T_k), and H = A V is checked against it."""
    rng = np.random.default_rng(5)
    Q, K, V = rng.normal(size=q_shape), rng.normal(size=k_shape), rng.normal(size=(5, 3))
    kw = {} if lengths is None else {"lengths": lengths}
    rep = audit({"Q": Q, "K": K, "V": V, "H": _h_of(Q, K, V, lengths)}, **kw)
    assert rep.ok and "M" in rep.recomputed, str(rep)
    wrong = _h_of(Q, K, V, None if lengths is None else [5, 5])
    if lengths is not None:  # the padding is read from the declared lengths, per batch row
        assert not audit({"Q": Q, "K": K, "V": V, "H": wrong}, **kw).ok


def test_s_rebuilt_from_a_float32_z_keeps_z_precision():
    """A float32 Z and the float64 weights of the exact scores: they agree to float32's
    precision, which is Z's, so stage A passes."""
    rng = np.random.default_rng(6)
    Q, K = rng.normal(size=(5, 3)), rng.normal(size=(5, 3))
    Z = np.where(masks.causal(5, 5), Q @ K.T / np.sqrt(3), -np.inf)
    E = np.exp(Z - Z.max(-1, keepdims=True))
    rep = audit({"Z": Z.astype(np.float32), "A": E / E.sum(-1, keepdims=True)})
    assert rep.ok, str(rep)


@pytest.mark.parametrize(
    "q_lead, k_lead, lengths",
    [((2,), (), None), ((2,), (), [3, 5]), ((), (2,), [3, 5]), ((2, 1), (3,), None)],
)
def test_q_and_k_that_do_not_multiply_still_give_stage_m_its_shape(q_lead, k_lead, lengths):
    """Q Kᵀ fails (d_k 3 vs 4), so S is not rebuilt: stage M takes its shape from Q's and K's
    leading axes broadcast × (T_q, T_k) and builds the declared mask there (per batch row with
    ``lengths``) instead of failing."""
    rng = np.random.default_rng(8)
    Q, K = rng.normal(size=(*q_lead, 5, 3)), rng.normal(size=(*k_lead, 5, 4))
    kw = {} if lengths is None else {"lengths": lengths}
    rep = audit({"Q": Q, "K": K, "V": rng.normal(size=(5, 3)), "H": rng.normal(size=(5, 3))}, **kw)
    assert rep.recomputed == ["M"], str(rep)
    assert (rep.first_failure.stage, rep.first_failure.name) == ("S", "Q Kᵀ shapes")
