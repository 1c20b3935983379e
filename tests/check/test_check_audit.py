"""audit: no false verdicts (empty rows only where the pattern says; padding only when
unambiguous; the stage of a mask fault is M), the declared pattern, hints from the catalogue."""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest
from typer.testing import CliRunner

import causalattn as ca
from causalattn import masks
from causalattn.check import CATALOGUE, AuditInputError, audit
from causalattn.cli import app

T = 6  # the conftest trace `tr` has 6 tokens


def _qkv(tr):
    return {"q": tr.Q, "k": tr.K, "v": tr.V}


def test_all_zero_weights_fail_at_A(tr):
    rep = audit({**_qkv(tr), "A": np.zeros((T, T)), "H": np.zeros_like(tr.H)})
    assert not rep.ok and rep.first_failure.stage == "A", str(rep)
    assert rep.empty_rows == []


def test_a_key_nobody_reads_is_not_taken_for_padding(tr):
    A = tr.A.copy()
    A[:, -1] = 0
    A[-1] /= A[-1].sum()
    rep = audit({**_qkv(tr), "A": A})
    assert not rep.ok and rep.first_failure.stage == "M", str(rep)
    assert "row 6 does not read its own key" in rep.first_failure.message
    assert "key_padding_mask" in rep.first_failure.hint
    rep = audit({**_qkv(tr), "A": A}, key_padding_mask=np.array([[True] * (T - 1) + [False]]))
    assert rep.ok, str(rep)


def test_unambiguous_padding_is_inferred_and_said(tr):
    al = masks.Pattern(lengths=[4]).allowed(1, 1, T, T)[0, 0]
    S = tr.S
    A = ca.matrix_form.softmax_last(np.where(al, S, 0.0), al)
    rep = audit({**_qkv(tr), "A": A})
    assert rep.ok, str(rep)
    assert any("padding assumed" in n and "L = 4" in n for n in rep.notes), rep.notes


def test_window_weights_fail_at_M_unless_declared(tr):
    Aw = ca.trace(tr.X, tr["W_q"], tr["W_k"], tr["W_v"], window=3).A
    rep = audit({**_qkv(tr), "A": Aw})
    ff = rep.first_failure
    assert ff.stage == "M" and "scale" not in (ff.hint or ""), str(rep)
    assert "rows 4..6 do not read keys they may" in ff.message
    assert audit({**_qkv(tr), "A": Aw}, window=3).ok


def test_nothing_to_check(tr):
    with pytest.raises(AuditInputError, match="nothing to check"):
        audit(_qkv(tr))


def test_declared_modifiers_and_a_trace_brings_its_pattern(tr):
    for kw in (
        {"window": 2, "softcap": 3.0},
        {"chunk": 2},
        {"sinks": [0.3]},
        {"alibi_slopes": [0.5]},
    ):
        t = ca.trace(tr.X, tr["W_q"], tr["W_k"], tr["W_v"], **kw)
        assert audit(t).ok, (kw, str(audit(t)))
        rep = audit({**_qkv(t), "A": t.A}, **kw)
        assert rep.ok, (kw, str(rep))
    rep = audit({**_qkv(tr), "A": tr.A}, softcap=1.0)  # declared but not applied
    assert not rep.ok and rep.first_failure.stage == "A", str(rep)


def test_hints_name_catalogue_faults(tr):
    ids = {f.id for f in CATALOGUE}
    Z = np.where(masks.causal(T), tr.S, -np.inf)
    E = np.exp(Z - Z.max(0, keepdims=True))
    rep = audit({**_qkv(tr), "S": tr.S, "A": E / E.sum(0, keepdims=True)})  # over queries
    ff = rep.first_failure
    assert ff.fault == "softmax-query-axis" and ff.fault in ids and ff.hint.startswith(ff.fault)
    assert json.loads(rep.to_json())["first_failure"]["fault"] == "softmax-query-axis"


def test_cli_declared_window(tmp_path, tr):
    Aw = ca.trace(tr.X, tr["W_q"], tr["W_k"], tr["W_v"], window=3).A
    p = tmp_path / "dump.npz"
    np.savez(p, q=tr.Q, k=tr.K, v=tr.V, A=Aw)
    r = CliRunner().invoke(app, ["audit", str(p)])
    assert r.exit_code == 1 and "first failure at stage M" in r.output, r.output
    r = CliRunner().invoke(app, ["audit", str(p), "--window", "3"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["audit", str(p), "--window", "0"])
    assert r.exit_code == 2 and "window" in r.output
    np.savez(p, q=tr.Q, k=tr.K, v=tr.V)
    r = CliRunner().invoke(app, ["audit", str(p)])
    assert r.exit_code == 2 and "nothing to check" in r.output


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf"), "1"])
def test_audit_and_diagnose_refuse_a_declared_scale_that_is_not_finite_and_positive(scale):
    from causalattn import diagnose

    with pytest.raises(AuditInputError, match=r"^audit: scale must be a finite number > 0"):
        audit({}, scale=scale)
    with pytest.raises(ValueError, match=r"^diagnose: scale must be a finite number > 0"):
        diagnose(lambda q, k, v: v, scale=scale, isolate=False)


@pytest.mark.parametrize(
    "kw, other",
    [
        ({"lengths": [4]}, {"lengths": [5]}),
        ({"prefix_lengths": [3]}, {"prefix_lengths": [2]}),
        ({"cu_seqlens": [0, 2, 6]}, {"cu_seqlens": [0, 3, 6]}),
        ({"causal": False}, {}),
        ({"scale": 0.25}, {"scale": 0.5}),
        # an M of every kind: a rule, a score function and two biases, each a keyword of audit
        (
            {"mask_mod": lambda b, h, q, k: (q - k) % 2 == 0},
            {"mask_mod": lambda b, h, q, k: q - k < 3},
        ),
        (
            {"score_mod": lambda s, b, h, q, k: 0.5 * s},
            {"score_mod": lambda s, b, h, q, k: 2.0 * s},
        ),
        ({"bias": np.arange(T * T).reshape(T, T) % 3 * 0.5}, {"bias": np.eye(T)}),
        ({"rel_bias": np.linspace(-1, 1, 2 * T - 1)[None]}, {"rel_bias": np.zeros((1, 2 * T - 1))}),
    ],
)
def test_every_declared_keyword_is_what_the_weights_are_checked_against(tr, kw, other):
    t = ca.trace(tr.X[None], tr["W_q"], tr["W_k"], tr["W_v"], **kw)  # (B, T, d_model), B = 1
    arrays = {**_qkv(t), "S": t.S, "A": t.A}
    assert audit(arrays, **kw).ok, (kw, str(audit(arrays, **kw)))
    assert not audit(arrays, **other).ok, (other, str(audit(arrays, **other)))


def test_an_object_that_is_no_input_is_named():
    with pytest.raises(
        AuditInputError, match=r"^audit: expected a Trace, a mapping of arrays or a path, got int$"
    ):
        audit(42)


# ---- the shared numerics of the stage checks -------------------------------------------
def test_relative_tolerance_is_100_eps_clamped():
    from causalattn.check.numerics import _rtol

    assert _rtol() == 1e-9 and _rtol(0.0) == 1e-9 and _rtol(1e-15) == 1e-9
    assert _rtol(1e-6) == pytest.approx(1e-4) and _rtol(1e-6, 2e-6) == pytest.approx(2e-4)
    assert _rtol(1e-3) == 0.03 and _rtol(1.0, 0.5) == 0.03
    assert type(_rtol(1e-6)) is float


def test_differences_count_nan_on_one_side_only_and_scale_by_the_magnitude():
    from causalattn.check.numerics import _close, _diff

    want = np.array([[1.0, 2.0, np.nan], [np.inf, -50.0, 0.0]])
    got = want.copy()
    with np.errstate(all="raise"):  # inf - inf is no floating-point error here, whoever calls
        e, mag, err = _diff(got, want)
    assert e == 0.0 and mag == 50.0 and not err.any()  # NaN == NaN and inf == inf agree here
    got[0, 0] = np.nan  # NaN on one side only: an infinite error
    e, _, err = _diff(got, want)
    assert e == np.inf and err[0, 0] == np.inf and err[1].sum() == 0
    e, _, _ = _diff(got, want, where=np.array([[False, True, True], [True, True, True]]))
    assert e == 0.0  # outside `where`: not counted
    got = want.copy()
    got[1, 1] = -49.0
    ok, e, bad = _close(got, want, 0.02)  # 1 <= 0.02 · 50
    assert ok and e == 1.0 and not bad.any()
    ok, e, bad = _close(got, want, 0.019)
    assert not ok and bad.tolist() == [[False, False, False], [False, True, False]]
    small = np.array([0.1, -0.2])
    assert _diff(small + 0.01, small)[1] == 1.0  # magnitudes below 1 count as 1
    assert _diff(np.zeros(0), np.zeros(0))[:2] == (0.0, 1.0)


def test_evidence_names_the_first_failing_slice_its_rows_and_columns():
    from causalattn.check.numerics import _locate

    bad = np.zeros((2, 3, 12, 12), bool)
    assert _locate(bad, 2) == {}
    bad[1, 2, 5, [3, 1]] = True
    bad[1, 2, 7, 0] = True
    bad[0, 1, 9, 9] = True  # an earlier slice: it comes first
    assert _locate(bad, 2) == {"index": (0, 1), "rows": [9], "cols": [9], "slices_failing": 2}
    bad[0, 1, 9, 9] = False
    assert _locate(bad, 2) == {"index": (1, 2), "rows": [5, 7], "cols": [0, 1, 3]}
    assert _locate(bad, 2, with_cols=False) == {"index": (1, 2), "rows": [5, 7]}
    many = np.ones((12, 12), bool)
    assert _locate(many, 0) == {"rows": list(range(8)), "cols": list(range(8))}  # 8 shown
    assert _locate(np.array([False, True, True]), 0) == {"rows": [1, 2]}


def test_additive_masks_are_read_with_a_blocking_threshold():
    from causalattn.check.conventions import additive_allowed as _mask_from_additive
    from causalattn.check.numerics import BLOCKED_BELOW, _looks_masked

    assert BLOCKED_BELOW == -1e4
    M = np.array([0.0, -np.inf, -1e4, -1e4 + 1, -1e9, 0.5, np.nan])
    allowed, odd = _mask_from_additive(M)
    assert allowed.tolist() == [True, False, False, False, False, False, False]
    assert odd.tolist() == [False, False, False, True, False, True, True]
    S = np.arange(9.0).reshape(3, 3)
    assert not _looks_masked(S)
    Z = np.where(np.triu(np.ones((3, 3), bool), 1), -np.inf, S)
    assert _looks_masked(Z) and _looks_masked(np.where(np.isinf(Z), -1e9, Z))
    assert _looks_masked(np.stack([Z, Z]))
    part = Z.copy()
    part[0, 2] = 1.0  # one future entry not masked
    assert not _looks_masked(part) and not _looks_masked(np.where(np.isinf(Z), -9e3, Z))
    assert _looks_masked(np.where(np.triu(np.ones((2, 4), bool), 3), -np.inf, 0.0))  # T_q < T_k
    assert not _looks_masked(np.zeros((1, 4)))  # one query reading every key: nothing in the future
    assert not _looks_masked(np.full((3, 2), -np.inf))  # T_q > T_k


def test_a_file_is_read_within_audit_s_max_bytes(tmp_path, tr):
    f = tmp_path / "t.npz"
    np.savez(f, **_qkv(tr), A=tr.A)
    assert audit(f).ok
    with pytest.raises(AuditInputError, match="max_bytes|budget|larger"):
        audit(f, max_bytes=256)


def test_nan_and_inf_in_the_arrays_are_findings_not_floating_point_errors(tr):
    Q = tr.Q.copy()
    Q[2, 0] = np.inf
    with np.errstate(all="raise"):  # the caller's numpy settings do not reach the checks
        rep = audit({"q": Q, "k": tr.K, "v": tr.V, "A": tr.A})
    assert not rep.ok and rep.first_failure.stage == "S", str(rep)


def test_a_shape_error_no_check_foresaw_is_an_audit_input_error(monkeypatch, tr):
    audit_module = importlib.import_module("causalattn.check.audit")  # (the name is the function)

    def unforeseen(inp):
        raise ValueError("operands could not be broadcast together")

    monkeypatch.setattr(audit_module, "_run_stages", unforeseen)
    with pytest.raises(AuditInputError) as err:
        audit({**_qkv(tr), "A": tr.A})
    assert str(err.value) == (
        "audit: the arrays do not fit together (operands could not be broadcast together)"
    )


def test_s_looks_masked_when_every_future_score_is_at_or_below_the_blocking_threshold():
    from causalattn.check.numerics import BLOCKED_BELOW, _looks_masked

    S = np.zeros((3, 3))
    S[np.triu_indices(3, 1)] = BLOCKED_BELOW  # exactly at the threshold: blocked
    assert _looks_masked(S)
    S[0, 2] = BLOCKED_BELOW / 2  # one future score above it: a plain S
    assert not _looks_masked(S)
    S[0, 2] = -np.inf
    assert _looks_masked(S[None, None])  # leading axes
    assert not _looks_masked(np.zeros((3, 2)))  # T_q > T_k: no future part to read


# ---- stage A (check/stage_weights.py): verdicts at the tolerance edges, hints, evidence ----
TOL32 = 100 * float(np.finfo(np.float32).eps)  # _rtol of a float32 A: 100 eps, exactly 100·2⁻²³


def _a_checks(rep):
    return {c.name: c for c in rep.checks if c.stage == "A"}


def _masked_softmax(S, al):
    return ca.matrix_form.softmax_last(np.where(al, S, 0.0), al)


def test_weights_recomputed_from_s_keep_s_precision_and_need_s(tr):
    S32 = tr.S.astype(np.float32)  # A = softmax(S32) differs from tr.A by ~3e-8
    rep = audit({"S": S32, "V": tr.V, "H": tr.H})
    assert "A" in rep.recomputed and rep.ok, str(rep)  # H is judged at S's (float32) precision
    assert not audit({"S": S32, "V": tr.V, "H": tr.H + 1e-3}).ok
    M = np.where(masks.causal(T), 0.0, -np.inf)
    rep = audit({"M": M, "V": tr.V, "H": tr.H})  # no S: no A to compute, so H is not checked
    assert "A" not in rep.recomputed and [c.name for c in rep.checks] == [
        "mask is causal (+ padding)"
    ]


def test_an_m_of_more_queries_than_keys_leaves_a_checked_against_plain_causal():
    # stage M cannot read a 4×2 M, so stage A builds the causal mask of A's own shape (the M
    # itself fails at stage M: test_audit.py's ..._fails_at_M_with_both_shapes; only A here)
    M = np.zeros((4, 2))
    for T_q, T_k in ((3, 3), (2, 3)):
        al = masks.causal(T_q, T_k)
        A = _masked_softmax(np.zeros((T_q, T_k)), al)
        chk = _a_checks(audit({"M": M, "A": A}))
        assert list(chk) == ["rows sum to 1", "forbidden entries exactly 0", "readable rows finite"]
        assert all(c.ok for c in chk.values()), (T_q, T_k, chk)
        A[0, -1] = 0.25  # a future key read
        chk = _a_checks(audit({"M": M, "A": A}))
        assert not chk["forbidden entries exactly 0"].ok
        assert chk["forbidden entries exactly 0"].evidence == {"rows": [0], "cols": [T_k - 1]}


def test_row_sums_at_the_tolerance_edge_pass_and_past_it_fail():
    # float32 A: tol = 100·2⁻²³; a one-entry row of 1 + tol sums to exactly 1 + tol
    A = np.array([[1 + TOL32, 0, 0], [0.5, 0.5, 0], [0.25, 0.25, 0.5]], np.float32)
    assert _a_checks(audit({"A": A}))["rows sum to 1"].ok  # |sum - 1| = tol: inside
    A_sink = A.copy()
    A_sink[1:] *= 0.5  # sinks declared: rows sum to at most 1 (+ tol), the sink takes the rest
    assert _a_checks(audit({"A": A_sink}, sinks=[0.3]))["rows sum to 1"].ok
    A[0, 0] = A_sink[0, 0] = 1 + 2 * TOL32
    assert not _a_checks(audit({"A": A}))["rows sum to 1"].ok
    assert not _a_checks(audit({"A": A_sink}, sinks=[0.3]))["rows sum to 1"].ok


def test_rows_that_do_not_sum_to_1_are_counted_with_their_sums_and_stop_the_softmax_check(tr):
    A = tr.A.copy()
    A[3] *= 0.123456 / A[3].sum()
    rep = audit({**_qkv(tr), "S": tr.S, "A": A})
    c = _a_checks(rep)["rows sum to 1"]
    assert not c.ok and c.message == (
        "1 readable row does not sum to 1 over its readable columns (e.g. 0.1235)"
    )
    assert c.evidence == {"rows": [3], "row_sums": [0.1235]}
    assert "A = softmax_last(S + M)" not in _a_checks(rep)  # A already failed its own checks
    assert "A = softmax_last(S + M)" in _a_checks(audit({**_qkv(tr), "S": tr.S, "A": tr.A}))


def test_passing_weight_checks_carry_no_hint_or_evidence(tr):
    rep = audit({**_qkv(tr), "S": tr.S, "A": tr.A})
    assert list(_a_checks(rep)) == [
        "rows sum to 1",
        "forbidden entries exactly 0",
        "readable rows finite",
        "A = softmax_last(S + M)",
    ]  # no empty rows here: no check for them
    al = masks.Pattern(lengths=[4]).allowed(1, 1, T, T)[0, 0]
    rep = audit({"S": tr.S, "A": _masked_softmax(tr.S, al)}, lengths=[4])
    chk = _a_checks(rep)
    assert list(chk)[-2:] == ["rows with no readable key are zero", "A = softmax_last(S + M)"]
    for c in chk.values():
        assert c.ok and c.hint is None and c.fault is None and c.evidence == {}, c
    assert chk["forbidden entries exactly 0"].message == "blocked entries have exactly zero weight"
    assert chk["rows with no readable key are zero"].message == (
        "rows with no readable key have zero weight"
    )


def test_nan_rows_are_blamed_on_exp_overflow_only_past_80_in_a_readable_score(tr):
    A = tr.A.copy()
    A[3] = np.nan

    def finite_check(S):
        return _a_checks(audit({"S": S, "A": A}))["readable rows finite"]

    S = tr.S.copy()
    S[0, 5] = 1000.0  # blocked: softmax never exponentiates it
    S[2, 1] = 80.0
    c = finite_check(S)
    assert not c.ok and c.message == "1 readable row holds NaN or inf"
    assert c.evidence == {"rows": [3]}
    assert c.fault is None and c.hint == "NaN/inf weights in rows that can read a key"
    S[2, 1] = 80.5
    c = finite_check(S)
    assert c.fault == "unstable-softmax" and c.hint == (
        "unstable-softmax: scores this large overflow exp(): subtract the row maximum before "
        "exponentiating (stable softmax)"
    )


def test_rows_with_no_readable_key_must_be_zero_even_when_no_row_has_one():
    A = np.zeros((T, T))
    A[2, 1] = np.nan
    rep = audit({"A": A}, lengths=[0])  # every row empty
    assert rep.empty_rows == [{"index": [], "rows": list(range(T))}]
    c = _a_checks(rep)["rows with no readable key are zero"]
    assert not c.ok and c.message == "1 rows with no readable key are not zero (NaN)"
    assert c.evidence == {"rows": [2]} and c.fault == "nan-on-empty-rows"
    assert c.hint == (
        "nan-on-empty-rows: a row whose keys are all blocked must give zero weights; -inf on "
        "every entry makes softmax NaN (0/0), a finite fill spreads weight over forbidden keys"
    )


def test_a_nan_in_a_readable_row_is_not_laid_on_the_empty_rows(tr):
    al = masks.Pattern(lengths=[4]).allowed(1, 2, T, T)  # (B, H) = (1, 2); rows 5, 6 empty
    A = _masked_softmax(np.stack([tr.S, 2 * tr.S])[None], al)
    A[0, 0, 0, 5] = np.nan  # row 1 reads a NaN in key 6's column; rows 5 and 6 stay zero
    chk = _a_checks(audit({"A": A}, lengths=[4]))
    assert not chk["readable rows finite"].ok
    assert chk["rows with no readable key are zero"].ok, chk


def test_softmax_comparison_is_at_the_coarser_of_a_and_s_precision(tr):
    ok = "A = softmax_last(S + M)"
    assert _a_checks(audit({"S": tr.S, "A": tr.A.astype(np.float32)}))[ok].ok  # A float32
    S32 = tr.S.astype(np.float32)  # A from the unrounded scores: off by ~3e-8
    assert _a_checks(audit({"S": S32, "A": tr.A}))[ok].ok  # S float32
    assert not _a_checks(audit({"S": S32, "A": tr.A * (1 + 1e-3)}))["rows sum to 1"].ok


def _rows_fault(A, **kw):
    c = _a_checks(audit(A, **kw))["rows sum to 1"]
    assert not c.ok, c
    return c.fault, c.hint


def test_softmax_hint_tolerances_are_4_tol_inclusive():
    e = TOL32
    for k, want in ((4, "softmax-query-axis"), (4.5, None)):  # columns sum to 1 (+ k tol)
        A = np.array([[0.5, 0], [0.5, 1 + k * e]], np.float32)
        assert _rows_fault({"A": A})[0] == want, k
    for k, want in ((4, "softmax-all-entries"), (4.5, "mask-after-softmax")):  # the total
        A = np.array([[0.25, 0], [0.25, 0.5 + k * e]], np.float32)
        assert _rows_fault({"A": A})[0] == want, k
    # a row of exactly 1 + tol still counts as "at most 1": the others lost their weight
    A = np.array([[1 + e, 0, 0], [0.25, 0.25, 0], [0.25, 0.25, 0.25]], np.float32)
    assert _rows_fault({"A": A})[0] == "mask-after-softmax"
    c = _a_checks(audit({"A": A}))["rows sum to 1"]
    assert c.message.startswith("2 readable rows") and c.evidence["rows"] == [1, 2]


def test_softmax_hint_over_the_query_axis_reads_only_columns_someone_reads(tr):
    al = masks.Pattern(lengths=[4]).allowed(1, 1, T, T)[0, 0]  # keys 5, 6: read by no query
    A = _masked_softmax(tr.S.T, al.T).T  # normalized over the queries
    assert _rows_fault({"A": A}, lengths=[4])[0] == "softmax-query-axis"


def test_softmax_hint_over_all_entries_is_per_slice(tr):
    al = masks.causal(T)
    Z = np.where(al, np.stack([tr.S, 2 * tr.S]), -np.inf)  # two sequences
    E = np.exp(Z - Z.max(axis=(-1, -2), keepdims=True))
    A = E / E.sum(axis=(-1, -2), keepdims=True)
    fault, hint = _rows_fault({"A": A})
    assert fault == "softmax-all-entries" and hint == (
        "softmax-all-entries: the whole matrix sums to 1: softmax ran over all entries at once"
    )


def test_softmax_hint_for_a_mask_after_softmax_ignores_non_finite_entries(tr):
    al = masks.causal(T)
    full = ca.matrix_form.softmax_last(tr.S, np.ones((T, T), bool))
    A = np.where(al, full, 0.0)  # masked after the softmax, not renormalized
    A[4] = np.nan  # one row NaN: the others still show the fault
    assert _rows_fault({"A": A}) == (
        "mask-after-softmax",
        "mask-after-softmax: rows sum to less than 1 with zeros in the right place: the mask "
        "was likely applied after the softmax without renormalizing",
    )
    exact = (
        "mask-after-softmax: mask applied after softmax without renormalizing: rows sum to "
        "less than 1 (the forbidden weight was dropped, not redistributed)"
    )
    A = np.where(al, full, 0.0)
    A[1, 5] = np.nan  # a blocked entry: not compared with the masked softmax
    assert _rows_fault({"S": tr.S, "A": A}) == ("mask-after-softmax", exact)
    for delta, hint in ((2e-9, exact), (4.5e-9, None)):  # within 4 tol (float64: 4e-9)?
        A = np.where(al, full - delta, 0.0)
        got = _rows_fault({"S": tr.S, "A": A})
        assert got[0] == "mask-after-softmax" and (got[1] == exact) == (hint is not None), delta


def test_softmax_hint_for_unnormalized_rows_beside_a_nan_row(tr):
    A = tr.A.copy()
    A[2] = np.nan
    A[4] *= 2
    assert _rows_fault({"A": A}) == (None, "rows are not normalized over the key axis")
