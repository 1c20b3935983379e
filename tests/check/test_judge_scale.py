"""The judge's scale (S) and normalization (A) findings on hand-made measurement records:
the fitted factor and the size it is named by, and rows that do not sum as a softmax's."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from _judge_records import C0, REF, T, _probe, _slice

from causalattn import masks
from causalattn.check.judge import SCALE_RTOL, judge
from causalattn.check.measure import SliceMeasure, Width

# a float64 ratio r never lies exactly SCALE_RTOL from 1 (r - 1 is a multiple of 2^-53 there,
# SCALE_RTOL is not): only a wider float reaches the bound itself
WIDE = np.longdouble
wide_enough = pytest.mark.skipif(
    np.finfo(WIDE).nmant < 60, reason="long double is no wider than float64 here"
)


def _scale_finding(found):
    """The one S finding of a slice (the one that records the fitted scale)."""
    (f,) = [f for f in found if f.stage == "S" and "scale" in f.measurement]
    return f


def test_one_head_has_no_size_h_times_d_k():
    """With one head, H·d_k is d_k itself: a function that scales by 1/√d_k where another
    scale was declared is not told its factor is "1/√(H·d_k)"."""
    declared = 0.5
    pm = _probe(_slice(REF.copy(), fit=(C0, 0.0)), scale0=declared)
    (f,) = judge([pm])
    assert (f.stage, f.fault) == ("S", None)
    assert f.measurement == {"scale": C0, "expected": declared}
    assert "H·d_k" not in f.message
    # with two heads of d_k = 4 the size is there: 1/√8 is 1/√(H·d_k)
    heads = [_slice(REF.copy(), index=(0, h), fit=(8**-0.5, 0.0)) for h in (0, 1)]
    (f,) = judge([_probe(*heads, H=2, d_k=4, scale0=0.5, d_v=5)])  # one finding for the probe
    assert f.fault is None and "; the factor is 1/√(H·d_k) (H·d_k = 8) (" in f.message


@wide_enough
def test_a_factor_exactly_the_tolerance_off_a_size_is_that_size():
    """SCALE_RTOL: a fitted scale *within* it of a size is that size, the bound included."""
    at = WIDE(1) + WIDE(SCALE_RTOL)  # at/1 - 1 is exactly SCALE_RTOL
    assert abs(at / 1.0 - 1) == SCALE_RTOL
    f = _scale_finding(judge([_probe(_slice(REF.copy(), fit=(at, 0.0)))]))
    assert f.fault == "missing-scale" and "; the factor is 1 (on main probe)" in f.message
    past = WIDE(1) + WIDE(SCALE_RTOL) * WIDE(1.001)  # just outside: no size
    f = _scale_finding(judge([_probe(_slice(REF.copy(), fit=(past, 0.0)))]))
    assert f.fault is None and "the factor is" not in f.message


@wide_enough
def test_the_run_with_d_v_doubled_follows_exactly_at_the_tolerance():
    """1/√d_v is named when the run with d_v doubled fits 1/√(2 d_v) within SCALE_RTOL,
    the bound included (d_v = 2: the doubled run's factor is 1/2)."""
    d_v = 2
    at = (WIDE(1) + WIDE(SCALE_RTOL)) / 2  # · √(2 d_v) = 2: exactly SCALE_RTOL off 1
    assert abs(at * math.sqrt(2 * d_v) - 1) == SCALE_RTOL
    by_dv = d_v**-0.5
    wide = Width(diff=0.1, tol=1e-12, fit=(at, 0.0), d_v=d_v)
    pm = _probe(_slice(REF.copy(), fit=(by_dv, 0.0)), d_v=d_v, width=wide)
    f = _scale_finding(judge([pm]))
    assert f.fault == "scale-by-sqrt-dv" and "the factor is 1/√d_v (d_v = 2)" in f.message
    past = (WIDE(1) + WIDE(SCALE_RTOL) * WIDE(1.001)) / 2  # does not follow: not 1/√d_v
    wide = Width(diff=0.1, tol=1e-12, fit=(past, 0.0), d_v=d_v)
    pm = _probe(_slice(REF.copy(), fit=(by_dv, 0.0)), d_v=d_v, width=wide)
    f = _scale_finding(judge([pm]))
    assert f.fault is None and "1/√d_v" not in f.message


def test_a_scale_off_the_declared_one_is_one_finding_with_its_factor_and_size():
    """S: the fitted factor, the declared one, the size it equals (here 1/√d_model, named
    only because the judge is told d_model), on the slice and probe it was measured on."""
    c = 12**-0.5
    s = _slice(REF.copy(), index=(0, 1), fit=(c, 0.0))
    ok = _slice(REF.copy(), index=(0, 0))
    pm = _probe(ok, s, probe="two-head probe", H=2, d_v=5)
    (f,) = judge([_probe(_slice(REF.copy())), pm], d_model=12)
    assert (f.stage, f.fault, f.probe, f.slice, f.rows) == (
        "S",
        "some-heads-only",
        "two-head probe",
        (0, 1),
        (),
    )
    assert f.measurement == {
        "scale": c,
        "expected": C0,
        "heads": [1],
        "fault": "scale-by-sqrt-dmodel",
    }
    assert f.message == (
        "head 2 of 2: S: the weights are the softmax of Q Kᵀ · 0.2887; expected · 0.5774 "
        "(1/√d_k, d_k = 3); the factor is 1/√d_model (d_model = 12) (on two-head probe); "
        "head 1 matches the reference"
    )
    # not told d_model, the factor is no size of the probe's
    (f,) = judge([_probe(_slice(REF.copy(), fit=(c, 0.0)), d_v=5)])
    assert f.fault is None and f.message == (
        "S: the weights are the softmax of Q Kᵀ · 0.2887; expected · 0.5774 (1/√d_k, d_k = 3) "
        "(on main probe)"
    )
    # the declared scale itself, within SCALE_RTOL: nothing to say
    assert judge([_probe(_slice(REF.copy(), fit=(C0 * (1 + 0.9 * SCALE_RTOL), 0.0)))]) == []
    assert judge([_probe(_slice(REF.copy(), fit=(C0 * (1 - 0.9 * SCALE_RTOL), 0.0)))]) == []


def test_a_declared_scale_is_not_called_one_over_root_d_k():
    """diagnose(fn, scale=0.5) on a d_k = 3 probe expects · 0.5, which is not 1/√3: the
    finding must not say that the expected factor is 1/√d_k."""
    (f,) = judge([_probe(_slice(REF.copy(), fit=(C0, 0.0)), scale0=0.5)])
    assert "expected · 0.5 " in f.message
    assert "1/√d_k, d_k = 3" not in f.message
    assert "expected · 0.5 (the declared scale)" in f.message


# -- K not transposed: only the T = d_k probe can show it ---------------------------------
D6 = 6**-0.5  # the declared scale of a T = d_k = 6 probe
KT_TIGHT = 2e-3 + 1e3 * float(np.finfo(np.float32).eps)  # log A fits c·Q K this tightly


def _t_eq_dk(fit_kt, fit=(D6, 0.5)):
    """A T = d_k = 6 probe whose weights are no multiple of Q Kᵀ (misfit 0.5)."""
    s = _slice(REF.copy(), fit=fit, fit_kt=fit_kt)
    return _probe(s, kind="T = d_k", probe="T = d_k probe", d_k=6, scale0=D6)


def test_weights_that_fit_q_k_not_q_kt_name_k_not_transposed():
    (f,) = judge([_t_eq_dk((0.75, 0.0))])
    assert (f.stage, f.fault, f.probe, f.slice, f.rows) == (
        "S",
        "k-not-transposed",
        "T = d_k probe",
        (0, 0),
        (),
    )
    assert f.measurement == {"scale": 0.75}  # the factor on Q K, not the misfit
    assert f.message == (
        "S: the weights are the softmax of Q K · 0.75 (K not transposed; only runs when "
        "T = d_k = 6)"
    )


def test_q_k_fits_up_to_its_tolerance_then_the_scores_are_no_multiple():
    """The fit to Q K counts up to 2e-3 in log space plus a thousand float32 epsilons,
    the bound included; past it the scores are just not a multiple of Q Kᵀ (unnamed S)."""
    for misfit in (0.0, 2e-3, KT_TIGHT):
        (f,) = judge([_t_eq_dk((D6, misfit))])
        assert f.fault == "k-not-transposed", misfit
    for misfit in (np.nextafter(KT_TIGHT, 1.0), 0.01, 0.5):
        (f,) = judge([_t_eq_dk((D6, misfit))])
        assert (f.fault, f.measurement) == (None, {"misfit": 0.5}), misfit
    (f,) = judge([_t_eq_dk(None)])  # no fit to Q K (T ≠ d_k)
    assert (f.fault, f.measurement) == (None, {"misfit": 0.5})
    assert judge([_t_eq_dk((0.75, 0.0), fit=(D6, 0.0))]) == []  # Q Kᵀ fits: nothing to say


def test_scores_no_multiple_of_q_kt_are_one_unnamed_finding_on_their_slice():
    s = _slice(REF.copy(), index=(1, 0), fit=(C0, 0.25))
    (f,) = judge([_probe(s, B=2)])
    assert (f.stage, f.fault, f.probe, f.slice, f.rows) == ("S", None, "main probe", (1, 0), ())
    assert f.measurement == {"misfit": 0.25}
    assert f.message == (
        "S: log A is not c·Q Kᵀ plus a constant per row on the keys each row reads (misfit "
        "0.25 in log space): the scores are not a multiple of Q Kᵀ (on main probe)"
    )


@wide_enough
def test_a_fitted_scale_exactly_the_tolerance_off_the_declared_one_is_the_declared_one():
    """SCALE_RTOL, the bound included (a declared 1/2 = 1/√d_k, d_k = 4: c/c0 is exact)."""
    at = WIDE(0.5) * (WIDE(1) + WIDE(SCALE_RTOL))
    assert abs(at / 0.5 - 1) == SCALE_RTOL
    assert judge([_probe(_slice(REF.copy(), fit=(at, 0.0)), d_k=4, scale0=0.5)]) == []
    past = WIDE(0.5) * (WIDE(1) + WIDE(SCALE_RTOL) * WIDE(1.001))
    (f,) = judge([_probe(_slice(REF.copy(), fit=(past, 0.0)), d_k=4, scale0=0.5)])
    assert f.stage == "S" and f.measurement["expected"] == 0.5


# -- A: the normalization ------------------------------------------------------------------
def _a_findings(found):
    return [f for f in found if f.stage in ("A", "H")]


def test_a_row_with_no_readable_key_is_left_to_m_whatever_it_sums_to():
    """Key 1 is padding, so row 1 has no key to read; here it reads key 1 anyway (sums to 1,
    the reference's row sums to 0). That is M's to say; A names only row 4, which reads its
    keys but sums to 0.5."""
    pat = masks.Pattern(key_padding_mask=[[False, True, True, True, True, True]])
    allowed = pat.allowed(1, 1, T, T)[0, 0]
    ref = allowed / np.maximum(allowed.sum(-1, keepdims=True), 1)
    A = ref.copy()
    A[0, 0] = 1.0  # the row with no key reads the padded key
    A[3] *= 0.5
    s = _slice(A, ref=ref, allowed=allowed, mode="none", fit=None)
    found = judge([_probe(s, pattern=pat)])
    assert [f.stage for f in found] == ["M", "A"]
    assert found[0].rows == (0,)
    (a,) = _a_findings(found)
    assert (a.fault, a.rows) == (None, (3,))
    assert a.message == "A: row 4 sums to 0.5 instead of 1 (on main probe)"


def test_a_row_that_reads_nothing_is_left_to_m():
    """Row 3 reads no key at all (it sums to 0): M says so; its zero sum is no A finding,
    neither a missing normalization nor a softmax masked after (the other rows are the full
    softmax, which on this non-causal probe is the reference)."""
    pat = masks.Pattern(causal=False)
    allowed = np.ones((T, T), bool)
    ref = np.full((T, T), 1 / T)
    A = ref.copy()
    A[2] = 0.0
    s = _slice(A, ref=ref, allowed=allowed, mode="none", full_err=0.0)
    (f,) = judge([_probe(s, pattern=pat)])
    assert (f.stage, f.rows) == ("M", (2,))


def test_weights_that_read_nothing_anywhere_are_judged_without_a_warning():
    """No row reads a key (all weights 0): no factor to take a median of, and no warning."""
    s = _slice(np.zeros((T, T)), mode="none", fit=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = judge([_probe(s)])
    assert [f.stage for f in found] == ["M"]


def test_weights_that_sum_to_zero_are_no_multiple_of_the_reference():
    """Each row reads two keys with weights +5e-4 and -5e-4 (within the tolerance of 0,
    not negative beyond it): the rows sum to 0, and 0·A V is no finding; A names the sums."""
    tol = 1e-3
    A = np.zeros((T, T))
    A[:, 0], A[:, 1] = 5e-4, -5e-4
    ref = np.full((T, T), 1 / T)
    s = _slice(A, ref=ref, allowed=np.ones((T, T), bool), mode="none", fit=None)
    found = judge([_probe(s, pattern=masks.Pattern(causal=False), tol=tol)])
    (a,) = _a_findings(found)
    assert (a.stage, a.fault, a.rows) == ("A", None, tuple(range(T)))
    assert a.measurement == {"row_sums": [0.0] * T}


TOL = 2.0**-10  # a tolerance, and weights, exact in binary: the bounds are met exactly


def _times(k, off):
    """The reference times k, row 1's weight off by ``off`` (mode 'none': rows sum to k)."""
    A = k * REF
    A[0, 0] += off
    return _probe(_slice(A, mode="none"), tol=TOL)


def test_a_multiple_of_the_reference_within_the_tolerance_scaled_by_the_factor():
    """H k·A V: every weight within tol·max(1, k) of k times the reference's, the bound
    included; past it the rows' sums are A's."""
    for k, off in ((0.5, TOL), (2.0, 2 * TOL), (2.0, 1.5 * TOL), (1.5, 1.5 * TOL)):
        (f,) = judge([_times(k, off)])
        assert (f.stage, f.measurement) == ("H", {"factor": k}), (k, off)
    for k, off in ((0.5, 1.5 * TOL), (2.0, 2.5 * TOL)):
        (f,) = judge([_times(k, off)])
        assert (f.stage, f.fault, f.rows) == ("A", None, tuple(range(T))), (k, off)


def _masked_after(n=8, tol=2.0**-20, **kw):
    """An n×n causal probe whose function took the softmax over all n keys (equal scores:
    1/n each) and zeroed the blocked ones: row i sums to (i + 1)/n. Exact in binary."""
    causal = np.tril(np.ones((n, n), bool))
    ref = causal / causal.sum(-1, keepdims=True)
    A = np.where(causal, 1 / n, 0.0)
    return A, dict(ref=ref, allowed=causal, mode="none", full_err=0.0, **kw), tol


def _judged(A, fields, tol):
    return judge([_probe(_slice(A, **fields), tol=tol)])


def test_mask_after_softmax_needs_every_row_at_most_one():
    """A row that sums to more than 1 (here by 1e-7, beyond a tolerance of 2⁻⁴⁰ but within
    the 1e-6 the full softmax is matched to) is no softmax zeroed after: A names the sums."""
    A, fields, tol = _masked_after(tol=2.0**-40)
    (f,) = _judged(A, fields, tol)
    assert (f.fault, f.rows) == ("mask-after-softmax", tuple(range(7)))
    A[7, 7] += 1e-7
    (f,) = _judged(A, {**fields, "full_err": 1e-7}, tol)
    assert (f.stage, f.fault, f.rows) == ("A", None, tuple(range(8)))
    assert "(more than 1: no softmax sums so)" in f.message


def test_mask_after_softmax_rows_sum_to_one_within_the_tolerance_bounds_included():
    """Rows within tol of 1 sum to 1: the last row at exactly 1 + tol still lets the rest be
    a softmax zeroed after; at exactly 1 - tol it is not one of the rows that sum short."""
    A, fields, tol = _masked_after()
    A[7, 7] += tol  # the last row sums to 1 + tol exactly
    assert A.sum(-1)[7] == 1 + tol
    (f,) = _judged(A, {**fields, "full_err": tol}, tol)
    assert (f.fault, f.rows) == ("mask-after-softmax", tuple(range(7)))
    A[7, 7] -= 2 * tol  # 1 - tol exactly
    assert A.sum(-1)[7] == 1 - tol
    (f,) = _judged(A, {**fields, "full_err": tol}, tol)
    assert (f.fault, f.rows) == ("mask-after-softmax", tuple(range(7)))


def test_mask_after_softmax_matches_the_full_softmax_to_1e_6_or_the_tolerance():
    """The weights are the softmax over all keys, zeroed, when they are within max(tol, 1e-6)
    of it, the bound included: 1e-6 with a tolerance of 2⁻⁴⁰; 1e-6 beyond it is not."""
    A, fields, _ = _masked_after()
    tiny = 2.0**-40
    for err in (0.0, 1e-9, 1e-6):
        (f,) = _judged(A, {**fields, "full_err": err}, tiny)
        assert f.fault == "mask-after-softmax", err
    for err in (np.nextafter(1e-6, 1.0), 1e-3, 0.5):
        (f,) = _judged(A, {**fields, "full_err": err}, tiny)
        assert (f.fault, f.rows) == (None, tuple(range(7))), err
    # a tolerance above 1e-6 is the bound
    (f,) = _judged(A, {**fields, "full_err": TOL}, TOL)
    assert f.fault == "mask-after-softmax"
    (f,) = _judged(A, {**fields, "full_err": 2 * TOL}, TOL)
    assert f.fault is None


def test_rows_exactly_the_tolerance_short_beside_a_row_that_reads_nothing():
    """Non-causal, 8 keys: row 1 reads nothing (M's); row 2 sums to exactly 1 - tol, which
    is 1 within the tolerance: no A finding, not even a softmax masked after."""
    tol, n = 2.0**-20, 8
    A = np.full((n, n), 1 / n)
    A[0] = 0.0
    A[1, 0] -= tol
    assert A.sum(-1)[1] == 1 - tol
    ref = np.full((n, n), 1 / n)
    s = _slice(A, ref=ref, allowed=np.ones((n, n), bool), mode="none", full_err=tol)
    (f,) = judge([_probe(s, pattern=masks.Pattern(causal=False), tol=tol)])
    assert (f.stage, f.rows) == ("M", (0,))


def test_a_row_off_by_exactly_the_tolerance_sums_right():
    """Row 4 (four keys of 1/4: the reference's sum is exactly 1) sums to 1 - tol: right;
    row 2 sums to 0.5: A names row 2 alone."""
    tol = 2.0**-20
    A = REF.copy()
    A[3, 0] -= tol
    A[1] *= 0.5
    assert A.sum(-1)[3] == 1 - tol and REF.sum(-1)[3] == 1
    (f,) = judge([_probe(_slice(A, mode="none", fit=None), tol=tol)])
    assert (f.stage, f.fault, f.rows) == ("A", None, (1,))
    assert f.message == "A: row 2 sums to 0.5 instead of 1 (on main probe)"


def test_a_row_exactly_the_tolerance_over_one_is_not_said_to_sum_to_more_than_1():
    """'More than 1' is past 1 + tol, as 'at most 1' is up to it. Row 6 of the reference
    (six keys of 1/6) sums to 1 - 2⁻⁵³ in binary, so a row summing to exactly 1 + tol is off
    by more than tol, but not more than 1 beyond the tolerance."""
    tol = 2.0**-20
    A = REF.copy()
    A[5] = [0.25 + tol, 0.125, 0.125, 0.125, 0.125, 0.25]
    assert A.sum(-1)[5] == 1 + tol and REF.sum(-1)[5] == 1 - 2.0**-53
    (f,) = judge([_probe(_slice(A, mode="none", fit=None), tol=tol)])
    assert (f.stage, f.fault, f.rows) == ("A", None, (5,))
    assert "more than 1" not in f.message


def test_rows_that_sum_as_the_references_within_the_tolerance_have_no_a_finding():
    """Mode 'rows': every row sums within tol of the reference's. Here row 1 of a
    non-causal reference (1/6 each: its rows sum to 1 - 2⁻⁵³) sums to exactly tol below
    that, so below 1 - tol, and the weights are within tol of the full softmax: still no
    finding (not a softmax zeroed after)."""
    tol = 2.0**-20
    ref = np.full((T, T), 1 / T)
    rs = ref.sum(-1)[0]
    assert rs == 1 - 2.0**-53
    A = ref.copy()
    A[0, :2] -= tol / 2
    while A.sum(-1)[0] > rs - tol:  # to exactly rs - tol, an ulp at a time
        A[0, 0] = np.nextafter(A[0, 0], 0.0)
    while A.sum(-1)[0] < rs - tol:
        A[0, 0] = np.nextafter(A[0, 0], 1.0)
    s0 = A.sum(-1)[0]
    assert s0 == rs - tol and s0 < 1 - tol and abs(s0 - rs) <= tol
    err = float(np.abs(A - ref).max())
    assert err <= tol
    allowed = np.ones((T, T), bool)
    s = _slice(A, ref=ref, allowed=allowed, mode="rows", full_err=err)
    assert judge([_probe(s, pattern=masks.Pattern(causal=False), tol=tol)]) == []


def test_the_factor_of_weights_exactly_half_the_references_is_one_half():
    """k is each row's sum over the reference's: weights exactly half the reference's give
    0.5 exactly, also where the reference's rows sum to 1 - 2⁻⁵³ in binary (1/6 each)."""
    ref = np.full((T, T), 1 / T)
    assert (ref.sum(-1) == 1 - 2.0**-53).all()
    s = _slice(0.5 * ref, ref=ref, allowed=np.ones((T, T), bool), mode="none")
    (f,) = judge([_probe(s, pattern=masks.Pattern(causal=False))])
    assert (f.stage, f.measurement) == ("H", {"factor": 0.5})
    assert f.message.startswith("H: the output is 0.5·A V: every row's weights sum to 0.5,")


def test_weights_all_below_the_noise_are_not_said_to_sum_to_one():
    """Every weight is below the read-back noise (0.02), so no row 'reads' a key; they are
    1.5 times the reference's (rows sum to 1.5). The judge must not say they sum to 1."""
    n = 100
    ref = np.full((n, n), 1 / n)
    A = 1.5 * ref
    allowed = np.ones((n, n), bool)
    s = SliceMeasure((0, 0), A, ref, allowed, np.zeros((n, n), bool), "none", None)
    pm = _probe(s, pattern=masks.Pattern(causal=False), tol=0.01, noise=0.02)
    found = judge([pm])
    assert found and all("sum to 1," not in f.message for f in found)
    assert any("1.5" in f.message for f in found)


def test_the_common_factor_comes_from_the_rows_that_read():
    """60 of 100 rows read nothing (their weights are 0, within the accuracy rule of the
    reference's 0.01 each); the 40 that read hold 1.5 times the reference's weights. The
    factor is theirs, 1.5, not the median over every row with a key (0)."""
    n = 100
    ref = np.full((n, n), 1 / n)
    A = 1.5 * ref
    A[:60] = 0.0
    read = A > 0
    s = SliceMeasure((0, 0), A, ref, np.ones((n, n), bool), read, "none", None)
    pm = _probe(s, pattern=masks.Pattern(causal=False), tol=0.02)
    found = [f for f in judge([pm]) if f.stage == "H"]
    (f,) = found
    assert f.measurement["factor"] == pytest.approx(1.5, rel=1e-12)


def test_no_row_with_a_key_is_no_normalization_finding():
    """Every row is empty (a pattern that lets no query read): all-zero weights are the
    reference's, whatever mode their sums measured; nothing is said, and nothing warns."""
    z = np.zeros((T, T))
    s = SliceMeasure((0, 0), z, z, np.zeros((T, T), bool), np.zeros((T, T), bool), "none", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = judge([_probe(s, tol=0.02)])
    assert [f for f in found if f.stage in ("A", "H")] == []
