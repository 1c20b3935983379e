"""The judge's per-slice findings on hand-made measurement records: values through the
wrong rows or through Aᵀ, the read pattern against the catalogue's forms, weights that no
softmax gives, lost precision and rows scaled by a factor of their own."""

from __future__ import annotations

import numpy as np
import pytest
from _judge_records import C0, CAUSAL, REF, T, _probe, _renorm, _slice

from causalattn import masks
from causalattn.check.judge import judge, match_pattern


def _stages(found):
    return [(f.stage, f.fault) for f in found]


def test_no_scale_is_measured_in_weights_no_softmax_gives():
    """A loose fit of log A is an S finding (the scores are no multiple of Q Kᵀ) only where
    the weights could be a softmax's: negative weights, or rows that sum as no softmax's
    (mode "none"), say A alone."""
    loose = (C0, 0.5)
    (f,) = judge([_probe(_slice(REF.copy(), fit=loose))])  # a softmax: the fit speaks
    assert (f.stage, f.fault) == ("S", None) and f.measurement == {"misfit": 0.5}
    neg = REF.copy()
    neg[3, 1], neg[3, 0] = -0.1, neg[3, 0] + 0.1
    (f,) = judge([_probe(_slice(neg, fit=loose))])  # rows still sum to 1
    assert (f.stage, f.fault, f.rows) == ("A", None, (3,)) and "negative" in f.message
    off = REF.copy()
    off[2] *= 0.5
    (f,) = judge([_probe(_slice(off, mode="none", fit=loose))])
    assert (f.stage, f.fault, f.rows) == ("A", None, (2,))
    assert f.message.startswith("A: row 3 sums to 0.5 instead of 1")
    # the same rows, summing as a softmax's: the loose fit is S again
    assert _stages(judge([_probe(_slice(off, mode="rows", fit=loose))])) == [("S", None)]


def test_a_patched_row_that_the_form_leaves_with_nothing_to_read():
    """Chunks of 3 with the own key blocked: the first query of each chunk (rows 1 and 4)
    has nothing left to read, so a function patches both rows (here: to read their own key,
    as the reference does). Row 4 is no first row, yet it is patchable: the fault's form
    reads no key there."""
    pat = masks.Pattern(chunk=3)
    E = pat.allowed(1, 1, T, T)[0, 0]
    form = E & ~np.eye(T, dtype=bool)
    assert not form[3].any() and E[3].any()  # row 4: nothing left to read in the form
    P = form.copy()
    P[0, 0] = P[3, 3] = True
    pm = _probe(pattern=pat)
    assert match_pattern(pm, form, E) == ("diagonal-blocked", [])
    assert match_pattern(pm, P, E) == ("diagonal-blocked", [0, 3])
    ref = _renorm(E.astype(float))
    (f,) = judge([_probe(_slice(_renorm(P.astype(float)), ref=ref, allowed=E), pattern=pat)])
    assert (f.stage, f.fault, f.rows) == ("M", "diagonal-blocked", (1, 2, 4, 5))
    assert f.measurement == {"patched_rows": [0, 3]}
    assert f.message.startswith("M: ") and "; expected causal + chunk 3 (on main probe" in f.message
    tail = "; every row but rows 1, 4 has diagonal-blocked's form (they are patched)"
    assert f.message.endswith(tail)
    # a row of the form that reads keys is no patch: row 5 reading its own key too is not the form
    P[4, 4] = True
    assert match_pattern(pm, P, E) == (None, [])


def test_a_row_scaled_answers_whatever_numpys_error_setting():
    """_row_scaled is silent and does not raise where the caller set NumPy to raise on
    floating-point errors: a row of inf weights (no factor: not judged), a subnormal weight
    where the reference is 0 (not compared)."""
    from causalattn.check.judge import _row_scaled

    scaled = REF.copy()
    scaled[2] *= 0.99
    inf_row = scaled.copy()
    inf_row[4] = np.where(CAUSAL[4], np.inf, 0.0)
    tiny = scaled.copy()
    tiny[0, 5] = 5e-324  # on a blocked key
    with np.errstate(all="raise"):
        assert _row_scaled(_slice(inf_row))
        assert _row_scaled(_slice(tiny))
        assert not _row_scaled(_slice(REF.copy()))


def test_a_spread_of_exactly_the_bound_is_still_one_factor():
    """_row_scaled's bound is inclusive: a row whose ratios to the reference spread by
    exactly 1e-3 of its offset from 1, plus 1e-12, is one factor (r1, r2: floats found so
    that r2 - r1 equals that bound exactly)."""
    from causalattn.check.judge import _row_scaled

    r1, r2 = float.fromhex("0x1.d23be827b5b24p-3"), float.fromhex("0x1.d3d0d6c56680bp-3")
    off = abs(r1 - 1)
    assert r2 - r1 == 1e-3 * off + 1e-12  # the bound, exactly
    A = REF.copy()
    A[1, :2] = 0.5 * r1, 0.5 * r2  # row 2's reference: 0.5, 0.5 (ratios exact)
    assert _row_scaled(_slice(A))
    A[1, 1] = 0.5 * np.nextafter(r2, 2)  # one step wider: two factors
    assert not _row_scaled(_slice(A))


def test_window_off_by_one_beside_score_modifiers_that_name_the_heads():
    """A sliding window with attention sinks or ALiBi (one per head): the forms one key
    narrower or wider keep the pattern's other fields, checked against the probe's heads."""
    narrow = masks.Pattern(window=2).allowed(1, 1, T, T)[0, 0]
    for extra in (dict(sinks=np.zeros(2)), dict(alibi_slopes=np.array([0.5, 0.25]))):
        pat = masks.Pattern(window=3, **extra)
        E = pat.allowed(1, 2, T, T)[0, 0]
        assert match_pattern(_probe(pattern=pat, H=2), narrow, E) == ("window-off-by-one", [])


# scattered rounding of the reference: 0.3% up and down in turn along each row
ROUNDED = REF * (1 + 0.003 * (-1.0) ** np.add.outer(np.arange(T), np.arange(T)))


def _tiny_first_key(first: float):
    """The reference with row 6 weighing key 1 at 1e-4 (below the 1e-3 that relative error
    compares), and weights equal to it but for row 6's key 1, which is ``first``."""
    ref = REF.copy()
    ref[5] = [1e-4] + [(1 - 1e-4) / 5] * 5
    A = ref.copy()
    A[5, 0] = first
    return A, ref


def test_lost_precision_is_named_within_the_shape_rules():
    (f,) = judge([_probe(_slice(ROUNDED))])  # the control: 0.3% scattered, in shape
    assert (f.stage, f.fault) == ("A", None) and "precision is lost" in f.message
    assert f.slice == (0, 0)  # the slice it was measured on
    # rows that sum 0.05 over the reference's: a normalization fault, not precision
    A, ref = _tiny_first_key(0.05)
    (f,) = judge([_probe(_slice(A, ref=ref, mode="none"))])
    assert f.message == (
        "A: row 6 sums to 1.05 instead of 1 (more than 1: no softmax sums so) (on main probe)"
    )
    A, ref = _tiny_first_key(0.01)  # 0.01 over: within the 0.02 the rule allows
    (f,) = judge([_probe(_slice(A, ref=ref, mode="none"))])
    assert "precision is lost" in f.message


def test_a_loose_fit_is_the_scores_not_lost_precision():
    """log A off c·Q Kᵀ beyond 0.02, or a scale off by more than 5e-3 where the fit is not
    tight: the scores are at fault (S), whatever the rounding; a misfit of 0.02 itself is
    still the shape."""
    for fit in ((C0 * 1.01, 0.01), (C0, 0.03)):
        (f,) = judge([_probe(_slice(ROUNDED, fit=fit))])
        assert (f.stage, f.fault, f.measurement) == ("S", None, {"misfit": fit[1]}), fit
    (f,) = judge([_probe(_slice(ROUNDED, fit=(C0, 0.02)))])
    assert (f.stage, f.fault) == ("A", None) and "precision is lost" in f.message


def test_weights_off_by_exactly_what_the_accuracy_rule_allows_are_right():
    tol = 2.0**-20
    A = REF.copy()
    A[1] = [0.5 + tol, 0.5 - tol, 0, 0, 0, 0]
    assert judge([_probe(_slice(A), tol=tol)]) == []
    A[1] = [0.5 + 2 * tol, 0.5 - 2 * tol, 0, 0, 0, 0]
    (f,) = judge([_probe(_slice(A), tol=tol)])
    assert f.stage == "A" and "precision is lost" in f.message


def test_weights_off_only_where_the_reference_is_below_1e3_count_60_bits():
    """No weight the relative error compares is off (relative error 0): the bits are
    counted from 2⁻⁶⁰, not infinite."""
    A, ref = _tiny_first_key(1e-4 + 1e-6)
    (f,) = judge([_probe(_slice(A, ref=ref))])
    assert f.measurement["rel_err"] == 0.0 and f.measurement["bits"] == 60
    assert "(relative 0: about 60 significant bits;" in f.message


def test_rows_off_the_reference_sums_by_exactly_002_are_still_in_shape():
    """The sums rule allows 0.02 itself. Near 1 no two sums differ by the float 0.02 exactly
    (their spacing, 2⁻⁵³, does not divide it); a reference row summing to 1/128 (as rows
    beside an attention sink may) does: weights adding 0.02 on a key the reference weighs
    0 there are off by exactly 0.02."""
    ref, allowed = REF.copy(), CAUSAL.copy()
    ref[1, :2] = 2.0**-8
    allowed[1, 2] = True
    A = ref.copy()
    A[1, 2] = 0.02
    s = _slice(A, ref=ref, allowed=allowed, mode="none")
    assert s.sums[1] - s.ref_sums[1] == 0.02  # exactly
    (f,) = judge([_probe(s)])
    assert (f.stage, f.fault) == ("A", None) and "precision is lost" in f.message
    A[1, 2] = np.nextafter(0.02, 1)  # beyond: the row's sum is at fault
    (f,) = judge([_probe(_slice(A, ref=ref, allowed=allowed, mode="none"))])
    assert f.rows == (1,) and f.message.startswith("A: row 2 sums to 0.02781 instead of 0.007812")


def _faint_first_key(first: float, *, key0: float):
    """Row 6 of the reference weighs key 1 at ``key0`` (the other five keys share the rest);
    the weights are the reference's but for row 6's key 1, which is ``first``."""
    ref = REF.copy()
    ref[5] = [key0] + [(1 - key0) / 5] * 5
    A = ref.copy()
    A[5, 0] = first
    return A, ref


def test_with_read_back_noise_a_key_the_reference_weighs_below_it_counts_as_read():
    """Weights read back through W_V = pinv(x)·V carry noise: a key the reference weighs at
    most 10× the noise may read back as zero (unread) without the mask being at fault; a key
    weighed more than that, read back as zero, is a mask fault; so is a blocked key read."""
    noise = 2.0**-30

    def judged(first, key0):
        A, ref = _faint_first_key(first, key0=key0)
        return judge([_probe(_slice(A, ref=ref), noise=noise, tol=2.0**-10)])

    assert judged(0.0, 10 * noise) == []  # at 10× the noise: may be lost in it
    assert judged(0.0, noise) == []
    (f,) = judged(0.0, 11 * noise)  # above 10× the noise: not read, and should be
    assert (f.stage, f.rows) == ("M", (5,))
    (f,) = judged(0.0, 0.2)
    assert (f.stage, f.rows) == ("M", (5,))
    leak = REF.copy()
    leak[2, 4] = 0.1  # a blocked key (the reference weighs 0 there) read
    (f,) = judge([_probe(_slice(leak), noise=noise, tol=2.0**-10)])
    assert (f.stage, f.rows) == ("M", (2,))


def test_each_batch_row_is_matched_against_its_own_padding():
    """Key padding that differs by batch row (key 3 padding in row 2 only): a function that
    pads the queries instead of the keys reads, in batch row 2, every earlier key, and
    nothing from query 3; that is named from row 2's padding, not row 1's."""
    kpm = np.ones((2, T), bool)
    kpm[1, 2] = False
    pat = masks.Pattern(key_padding_mask=kpm)
    E = pat.allowed(2, 1, T, T)[:, 0]
    P = CAUSAL & kpm[1][:, None]  # padding on the queries only
    ok = _slice(_renorm(E[0].astype(float)), ref=_renorm(E[0].astype(float)), allowed=E[0])
    bad = _slice(
        _renorm(P.astype(float)), ref=_renorm(E[1].astype(float)), allowed=E[1], index=(1, 0)
    )
    (f,) = judge([_probe(ok, bad, pattern=pat, B=2)])
    assert (f.stage, f.fault, f.slice) == ("M", "padding-queries-only", (1, 0))
    assert f.rows == (2, 3, 4, 5)  # query 3 reads nothing, queries 4..6 read key 3
    assert f.measurement == {"patched_rows": []}  # the form itself, no row patched


def test_rows_holding_nan_are_left_to_stage_a_and_no_other_row():
    """Row 4 comes out NaN on a blocked key (it reads it, as NaN): stage A names it; the M
    finding is about row 2 alone, which reads the future."""
    A = REF.copy()
    A[3, 5] = np.nan
    A[1] = [0.25, 0.25, 0.5, 0, 0, 0]  # row 2 reads key 3
    found = judge([_probe(_slice(A))])
    assert [(f.stage, f.rows) for f in found] == [("M", (1,)), ("A", (3,))]
    nan = found[1].message
    assert nan.startswith("A: row 4 ") and "NaN or inf weights at ordinary scores" in nan
    assert found[1].slice == (0, 0) and found[1].probe == "main probe"
    A[1] = REF[1]
    assert [(f.stage, f.rows) for f in judge([_probe(_slice(A))])] == [("A", (3,))]


# (NaN cells, their words; the padded length, the empty rows' words): one row, then two
NAN_WORDS = [
    ([(3, 5)], "row 4 holds", 5, "row 6 has no readable key and comes out"),
    ([(3, 2), (4, 0)], "rows 4..5 hold", 4, "rows 5..6 have no readable key and come out"),
]


@pytest.mark.parametrize("cells, said, length, empty_said", NAN_WORDS)
def test_rows_of_nan_are_worded_in_the_singular_or_the_plural(cells, said, length, empty_said):
    A = REF.copy()
    for i, j in cells:
        A[i, j] = np.nan
    (f,) = judge([_probe(_slice(A))])
    assert f.message == f"A: {said} NaN or inf weights at ordinary scores (on main probe)"
    pat = masks.Pattern(lengths=[length])
    E = pat.allowed(1, 1, T, T)[0, 0]
    ref = _renorm(E.astype(float))
    A = ref.copy()
    A[length:] = np.nan  # the rows past the length read no key (padding) and come out NaN
    (f,) = judge([_probe(_slice(A, ref=ref, allowed=E), pattern=pat)])
    assert f.fault == "nan-on-empty-rows"
    assert f.message.startswith(f"A: {empty_said} NaN, not zero")


def _values_via(R, misfit=0.0):
    """The record of H = ref R V: V = I reads back A = ref R, whose value map is R."""
    return judge([_probe(_slice(REF @ R, value_map=R, value_misfit=misfit))])


def _value_rows(found):
    return [f.measurement["value_rows"] for f in found if "value_rows" in f.measurement]


def test_values_from_wrong_rows_need_a_gather_other_than_the_identity():
    """A = ref G with G a gather of value rows (one 1 per row, the rest 0) other than I;
    the value map's misfit to it up to 1e-3."""
    assert _values_via(np.eye(T)) == []  # a right function's value map is I
    G = np.eye(T)[[1, 1, 2, 3, 4, 5]]  # keys 1 and 2 both take v_2: a gather, no permutation
    (f,) = _values_via(G)
    assert (f.stage, f.fault, f.slice) == ("H", None, (0, 0))
    assert f.measurement == {"value_rows": [1, 1, 2, 3, 4, 5]}
    assert "from the wrong rows: key 1 → v_2 (on main probe)" in f.message
    (f,) = _values_via(G, misfit=1e-3)  # a misfit of 1e-3 itself: still the gather
    assert f.measurement == {"value_rows": [1, 1, 2, 3, 4, 5]}
    off = G.copy()
    off[3, 0] = 0.01  # 0.01 off a gather: not one
    assert _value_rows(_values_via(off, misfit=0.01)) == []
    two = np.eye(T)
    two[0, 1] = 1  # key 1's weight multiplies v_1 + v_2: no gather
    assert _value_rows(_values_via(two)) == []


@pytest.mark.parametrize(
    "perm, moves",
    [
        ([1, 0, 3, 2, 4, 5], "key 1 → v_2, key 2 → v_1, key 3 → v_4, key 4 → v_3"),
        ([1, 2, 3, 4, 0, 5], "key 1 → v_2, key 2 → v_3, key 3 → v_4, key 4 → v_5 ..."),
    ],
)
def test_four_moves_are_all_listed_a_fifth_is_an_ellipsis(perm, moves):
    (f,) = _values_via(np.eye(T)[perm])
    assert f.message.endswith(f"from the wrong rows: {moves} (on main probe)")


def test_a_weight_below_zero_by_exactly_the_accuracy_rule_is_not_negative():
    """-tol on a blocked key (read back as unread): within the rule, the weights are right;
    one step further below zero they are not."""
    from causalattn.check.measure import SliceMeasure

    tol = 2.0**-20

    def judged(w):
        A = REF.copy()
        A[3, 5] = w
        return judge(
            [_probe(SliceMeasure((0, 0), A, REF, CAUSAL, CAUSAL, "rows", (C0, 0.0)), tol=tol)]
        )

    assert judged(-tol) == []
    assert [f.stage for f in judged(np.nextafter(-tol, -1))] == ["A"]


def test_weights_read_back_transposed_within_the_accuracy_rule():
    """Aᵀ is named where V = I reads back the reference's weights transposed, within the
    accuracy rule (off by tol itself: still Aᵀ); weights within the rule of a symmetric
    reference are right, not transposed; Aᵀ with a NaN row is left to stage A."""
    tol = 2.0**-20
    A = REF.T.copy()
    A[0, 0] += tol
    (f,) = judge([_probe(_slice(A), tol=tol)])
    assert (f.stage, f.fault, f.measurement) == ("H", None, {"transposed": True})
    assert f.message.startswith("H: the output is Aᵀ V: V = I reads back the reference's ")
    assert f.message.endswith(" through the transposed weights (on main probe)")
    assert f.slice == (0, 0) and f.probe == "main probe"
    full = np.ones((T, T), bool)
    flat = full / T  # bidirectional, uniform: the reference is its own transpose
    near = flat.copy()
    near[0, :2] += tol, -tol
    pm = _probe(_slice(near, ref=flat, allowed=full), pattern=masks.Pattern(causal=False), tol=tol)
    assert judge([pm]) == []
    A = REF.T.copy()
    A[2, 4] = np.nan
    found = judge([_probe(_slice(A))])
    assert "transposed" not in str([f.measurement for f in found])
    assert ("A", (2,)) in [(f.stage, f.rows) for f in found]


def test_rows_with_no_key_to_read_that_come_out_nan():
    """Padding: row 6 (a padding query) reads no key; NaN there, not zero, is
    nan-on-empty-rows, and nothing else is wrong."""
    pat = masks.Pattern(lengths=[5])
    E = pat.allowed(1, 1, T, T)[0, 0]
    ref = _renorm(E.astype(float))
    A = ref.copy()
    A[5] = np.nan
    (f,) = judge([_probe(_slice(A, ref=ref, allowed=E), pattern=pat)])
    assert (f.stage, f.fault, f.rows, f.slice) == ("A", "nan-on-empty-rows", (5,), (0, 0))
    assert f.message.startswith("A: row 6 ") and "no readable key" in f.message
    assert f.message.endswith(" out NaN, not zero (on main probe)")


def test_the_scale_is_named_by_d_model_where_the_code_has_one():
    c = 12**-0.5
    (f,) = judge([_probe(_slice(REF.copy(), fit=(c, 0.0)))], d_model=12)
    assert (f.stage, f.fault) == ("S", "scale-by-sqrt-dmodel")
    assert f.message.endswith("; the factor is 1/√d_model (d_model = 12) (on main probe)")
    (f,) = judge([_probe(_slice(REF.copy(), fit=(c, 0.0)))])  # no d_model: no size fits
    assert (f.stage, f.fault) == ("S", None) and "d_model" not in f.message


def test_a_scale_that_fits_tightly_but_differs_is_s_not_lost_precision():
    """The fit is tight (misfit 1e-4) and the factor 0.3% off 1/√d_k: S names it, though
    0.3% is within the 0.5% that lost precision allows its scale."""
    fine = REF * (1 + 1e-4 * (-1.0) ** np.add.outer(np.arange(T), np.arange(T)))
    (f,) = judge([_probe(_slice(fine, fit=(C0 * 1.003, 1e-4)))])
    assert (f.stage, f.fault) == ("S", None)
    assert f.measurement == {"scale": C0 * 1.003, "expected": C0}


def test_mask_after_softmax_is_named_only_where_the_scale_fits():
    """Rows summing to less than 1 as softmax over all keys zeroed at blocked keys: named
    mask-after-softmax where log A fits c·Q Kᵀ tightly (the softmax over all keys is taken
    at that c); with a loose fit the rows' sums are all that is said."""
    mask_after = np.tril(np.ones((T, T))) / T
    (f,) = judge([_probe(_slice(mask_after, mode="none", full_err=0.0))])
    assert f.fault == "mask-after-softmax"
    loose = _slice(mask_after, mode="none", full_err=0.0, fit=(C0, 0.5))
    (f,) = judge([_probe(loose)])
    assert (f.stage, f.fault, f.rows) == ("A", None, (0, 1, 2, 3, 4))
    assert f.message.startswith("A: rows 1..5 sum to 0.1667, 0.3333")


def test_every_slice_of_a_probe_is_judged_not_the_last_alone():
    """Head 1 of 2 reads the future, head 2 is right: the finding is head 1's."""
    bad = _slice(_renorm(np.ones((T, T))), index=(0, 0))
    ok = _slice(REF.copy(), index=(0, 1))
    (f,) = judge([_probe(bad, ok, H=2)])
    assert (f.stage, f.fault, f.slice) == ("M", "some-heads-only", (0, 0))
    assert f.measurement["heads"] == [0] and f.measurement["fault"] == "no-mask"


def test_window_off_by_one_in_a_head_whose_mask_differs_from_head_1():
    """A window of 3 beside a per-head mask (head 2 may not read key 1); head 2 reads a
    window of 2: that is window-off-by-one in head 2's own pattern."""
    m = np.ones((2, T, T), bool)
    m[1, :, 0] = False
    pat = masks.Pattern(window=3, mask=m)
    E = pat.allowed(1, 2, T, T)[0]
    P = masks.Pattern(window=2, mask=m).allowed(1, 2, T, T)[0]
    ok = _slice(_renorm(E[0].astype(float)), ref=_renorm(E[0].astype(float)), allowed=E[0])
    narrow = _slice(
        _renorm(P[1].astype(float)), ref=_renorm(E[1].astype(float)), allowed=E[1], index=(0, 1)
    )
    (f,) = judge([_probe(ok, narrow, pattern=pat, H=2)])
    assert (f.stage, f.fault) == ("M", "some-heads-only")
    assert f.measurement["fault"] == "window-off-by-one"
    assert f.measurement["patched_rows"] == []  # head 2's own form, exactly: nothing patched
