"""The judge's per-probe findings on hand-made measurement records (determinism, linearity
in V, the width of V, the output projection, large scores, long fp16 rows), findings merged
by head, what a further probe adds to the main one, what the probes that ran cannot show,
and the verdict."""

from __future__ import annotations

import math

import numpy as np
from _judge_records import C0, CAUSAL, REF, T, _probe, _slice

from causalattn.check.judge import judge, probe_findings
from causalattn.check.measure import Linearity, Projection, RowSums, Width
from causalattn.check.report import Finding

ON_MAIN = " (on main probe)"


def _nan_row(row=4):
    A = REF.copy()
    A[row] = np.nan
    return A


# -- determinism ------------------------------------------------------------------------------
def test_two_calls_that_differ_by_the_tolerance_exactly_are_within_the_rule():
    """The accuracy rule allows ``tol``: a repeat of exactly ``tol`` is deterministic."""
    assert judge([_probe(_slice(REF.copy()), repeat=1e-12)]) == []
    (f,) = judge([_probe(_slice(REF.copy()), repeat=2e-12)])
    assert (f.stage, f.fault, f.measurement) == ("H", None, {"repeat": 2e-12})


def test_a_nondeterministic_function_hides_every_further_probe():
    """Two calls disagree: no record of one call says what it computes, the further probes'
    records included; the finding names its own probe."""
    main = _probe(_slice(REF.copy()), kind="T = d_k", probe="T = d_k probe", repeat=0.5)
    two = _probe(_slice(REF.copy(), mode="cols"), kind="two-head")
    (f,) = judge([main, two])
    assert (f.stage, f.fault, f.probe, f.rows, f.slice) == ("H", None, "T = d_k probe", (), ())
    assert f.message.startswith("H: the function is not deterministic: called twice on the same")
    assert "same input (T = d_k probe, V = I)" in f.message


# -- linearity in V -----------------------------------------------------------------------------
def test_a_function_not_linear_in_v_is_named_whole_with_what_v_0_gives():
    head = (
        "H: the output is not A V: with random values it differs from (its weights measured "
        "with V = I) · V by up to 0.5 (the accuracy rule allows 1e-12)"
    )
    lin = Linearity(err=0.5, tol=1e-12, zero=0.25)
    main = _probe(_slice(REF.copy()), kind="T = d_k", probe="T = d_k probe", linearity=lin)
    assert judge([main]) == [
        Finding(
            "H",
            None,
            head + "; with V = 0 the output is up to 0.25, not 0",
            probe="T = d_k probe",
            measurement={"err": 0.5, "zero": 0.25},
        )
    ]
    for zero in (0.0, 1e-12):  # within the rule, V = 0 gives 0
        lin = Linearity(err=0.5, tol=1e-12, zero=zero)
        (f,) = judge([_probe(_slice(REF.copy()), linearity=lin)])
        assert f.message == head + "; with V = 0 it is 0"
        assert f.measurement == {"err": 0.5, "zero": zero}


def test_linear_within_the_rule_exactly_reads_its_weights_back():
    lin = Linearity(err=1e-12, tol=1e-12, zero=0.0)
    main = _probe(_slice(REF.copy()), linearity=lin)
    assert judge([main]) == []
    from causalattn.check.judge import further_kinds, reads_back

    assert reads_back(main) and "two-head" in further_kinds(main)


def test_nan_weights_at_ordinary_scores_are_stage_a_not_a_nonlinear_h():
    """A NaN in the weights makes every random-V output NaN: the linearity check is left
    to stage A, which names the rows."""
    lin = Linearity(err=math.inf, tol=1e-12, zero=0.0)
    (f,) = judge([_probe(_slice(_nan_row(4)), linearity=lin)])
    assert (f.stage, f.fault, f.rows) == ("A", None, (4,))
    assert f.message.startswith("A: row 5 hold NaN or inf weights at ordinary scores")


def test_a_nonlinear_function_is_judged_on_the_weights_it_recorded_with_d_model():
    """The recorded weights are judged like the main probe's, d_model included: their
    scale 1/√12 is the one size d_model = 12 names."""
    lin = Linearity(err=0.5, tol=1e-12, zero=0.0)
    recorded = (_slice(REF.copy(), fit=(12**-0.5, 0.0)),)
    main = _probe(_slice(REF.copy()), linearity=lin, recorded=recorded)
    (f,) = judge([main], d_model=12)
    assert (f.stage, f.fault) == ("S", "scale-by-sqrt-dmodel")
    (f,) = judge([main])
    assert (f.stage, f.fault) == ("S", None)
    clean = _probe(_slice(REF.copy()), linearity=lin, recorded=(_slice(REF.copy()),))
    (f,) = judge([clean])
    assert (f.stage, f.fault) == ("H", None) and "not A V" in f.message


# -- the width of V -------------------------------------------------------------------------------
WIDTH_HEAD = "S: the weights change with the width of V (d_v)"


def test_weights_that_move_by_the_tolerance_exactly_do_not_change_with_d_v():
    assert judge([_probe(_slice(REF.copy()), width=Width(1e-12, 1e-12, (0.2, 0.0), 6))]) == []


def test_the_width_finding_names_its_probe_and_says_only_what_was_measured():
    """Without a fitted scale for d_v doubled, or for the main probe's own weights, the
    finding says that the weights change and no more (and names no fault)."""
    w = Width(diff=0.1, tol=1e-12, fit=None, d_v=6)
    (f,) = judge([_probe(_slice(REF.copy()), kind="T = d_k", probe="T = d_k probe", width=w)])
    assert f == Finding("S", None, WIDTH_HEAD, probe="T = d_k probe", measurement={"diff": 0.1})
    wide = Width(diff=0.1, tol=1e-12, fit=(12**-0.5, 0.0), d_v=6)
    loose = _probe(_slice(REF.copy(), fit=(6**-0.5, 0.5)), width=wide)  # no tight fit
    plain = Finding("S", None, WIDTH_HEAD, probe="main probe", measurement={"diff": 0.1})
    assert judge([loose])[-1] == plain
    assert judge([_probe(width=wide)]) == [plain]  # no slice to fit


def test_nan_weights_leave_the_width_of_v_unjudged():
    w = Width(diff=math.inf, tol=1e-12, fit=None, d_v=6)
    (f,) = judge([_probe(_slice(_nan_row(2)), width=w)])
    assert (f.stage, f.rows) == ("A", (2,))


def test_the_factor_follows_d_v_only_when_both_widths_fit_it():
    """1/√d_v named only when the main probe fits 1/√d_v and d_v doubled fits 1/√(2 d_v)."""
    d_v = 6
    cases = [
        ((d_v**-0.5, 0.0), (12**-0.5, 0.0), "scale-by-sqrt-dv"),
        ((C0, 0.0), (12**-0.5, 0.0), None),  # the main probe's scale is right
        ((d_v**-0.5, 0.0), (0.2, 0.0), None),  # d_v doubled does not follow
    ]
    for fit, wide_fit, want in cases:
        w = Width(diff=0.1, tol=1e-12, fit=wide_fit, d_v=d_v)
        f = judge([_probe(_slice(REF.copy(), fit=fit), width=w)])[-1]
        assert (f.stage, f.fault) == ("S", want), (fit, wide_fit)
        assert f.message == (
            f"{WIDTH_HEAD}: Q Kᵀ · {fit[0]:.4g} with d_v = 6, · {wide_fit[0]:.4g} with d_v = "
            f"12; expected · {C0:.4g} (1/√d_k, d_k = 3)"
        )


# -- the output projection ------------------------------------------------------------------------
def _o(**kw):
    """The main probe's findings with this projection record (its weights right)."""
    return judge([_probe(_slice(REF.copy()), projection=Projection(tol=1e-6, **kw))])


def _o_finding(fault, what, err):
    return Finding(
        "O", fault, f"O: {what} (H from the measured weights)", "main probe", {"err": err}
    )


def test_an_output_projection_within_the_rule_has_no_finding():
    assert _o(err=0.0, err_missing=0.3, err_transposed=0.2) == []
    assert _o(err=1e-6, err_missing=0.3, err_transposed=None) == []  # the rule allows tol
    assert judge([_probe(_slice(REF.copy()))]) == []  # no projection record


def test_each_output_projection_fault_is_worded_whole():
    assert _o(err=0.5, err_missing=1e-6, err_transposed=0.4) == [
        _o_finding("output-projection-missing", "O equals H: W_O is never applied", 0.5)
    ]
    assert _o(err=0.5, err_missing=0.4, err_transposed=1e-6) == [
        _o_finding("output-projection-transposed", "O equals H W_Oᵀ", 0.5)
    ]
    assert _o(err=0.5, err_missing=0.4, err_transposed=0.3) == [
        _o_finding(None, "O differs from H W_O by up to 0.5", 0.5)
    ]
    # W_O not square: neither O = H nor H W_Oᵀ has H W_O's shape
    assert _o(err=0.5, err_missing=None, err_transposed=None) == [
        _o_finding(None, "O differs from H W_O by up to 0.5", 0.5)
    ]
    assert _o(err=0.5, err_missing=None, err_transposed=0.0) == [
        _o_finding("output-projection-transposed", "O equals H W_Oᵀ", 0.5)
    ]
    shapes = dict(shape=(6, 4), expected_shape=(6, 5))
    assert _o(err=None, err_missing=None, err_transposed=None, **shapes) == [
        _o_finding(None, "O has shape (6, 4), H W_O is (6, 5)", None)
    ]
    assert _o(err=None, err_missing=0.0, err_transposed=None, **shapes) == [
        _o_finding("output-projection-missing", "O equals H: W_O is never applied", None)
    ]


def test_an_output_projection_that_raised_says_what_it_raised():
    pm = _probe(
        _slice(REF.copy()),
        probe="T = d_k probe",
        kind="T = d_k",
        projection=Projection(error="ValueError: bad shapes"),
    )
    assert judge([pm]) == [
        Finding(
            "O",
            None,
            "O: with random W_V, W_O the function raised ValueError: bad shapes",
            "T = d_k probe",
        )
    ]


# -- large scores ---------------------------------------------------------------------------------
def _large(*slices, kind="large", **kw):
    return _probe(*slices, kind=kind, S_max=40.0, **kw)


def test_every_stability_probe_kind_is_judged_for_overflow():
    """The large, huge and negative probes: NaN where ordinary scores gave none is the
    unstable softmax, named on the probe, with its rows and nothing measured beside them."""
    main = _probe(_slice(REF.copy()))
    for kind in ("large", "huge", "negative"):
        pm = _large(_slice(_nan_row(4)), kind=kind, probe=f"{kind} probe")
        assert probe_findings(pm, main) == [
            Finding(
                "A",
                "unstable-softmax",
                "A: at scores up to |S| = 40 row 5 comes out NaN or inf: exp overflows "
                "without the row maximum subtracted",
                f"{kind} probe",
                rows=(4,),
            )
        ], kind
        assert probe_findings(_large(_slice(REF.copy()), kind=kind), main) == []


def test_overflow_is_not_judged_where_ordinary_scores_gave_nan_already():
    main = _probe(_slice(_nan_row(4)))
    assert probe_findings(_large(_slice(_nan_row(4))), main) == []
    assert probe_findings(_large(_slice(_nan_row(1))), main) == []
    leak = REF.copy()
    leak[2, 5] = 0.2
    assert probe_findings(_large(_slice(leak)), main) == []


def test_overflow_in_any_head_names_every_row_once():
    main = _probe(_slice(REF.copy()))
    pm = _large(
        _slice(_nan_row(4), index=(0, 0)),
        _slice(_nan_row(1), index=(0, 1)),
        _slice(_nan_row(4), index=(0, 2)),
        H=3,
    )
    (f,) = probe_findings(pm, main)
    assert (f.fault, f.rows) == ("unstable-softmax", (1, 4))
    assert f.message.startswith("A: at scores up to |S| = 40 rows 2, 5 come out NaN or inf: ")


def test_weight_on_blocked_keys_in_any_head_or_batch_row():
    """The rows of every slice that leak, the largest weight of any (its size: a negative
    weight leaks too), the probe's largest score."""
    main = _probe(_slice(REF.copy()))
    a, b = REF.copy(), REF.copy()
    a[2, 5] = 0.1
    b[4, 5] = -0.3
    b[1, 3] = 0.05
    pm = _large(
        _slice(a, index=(0, 0)),
        _slice(REF.copy(), index=(0, 1)),
        _slice(REF.copy(), index=(1, 0)),
        _slice(b, index=(1, 1)),
        B=2,
        H=2,
    )
    (f,) = probe_findings(pm, main)
    assert f == Finding(
        "M",
        "finite-fill-too-weak",
        "M: at scores up to |S| = 40 blocked keys get weight (up to 0.3) on rows 2..3, 5: the "
        "fill that blocks them is finite and the scores overcome it",
        "large probe",
        {"weight": 0.3, "S_max": 40.0},
        (1, 2, 4),
    )


def test_weight_at_or_below_the_read_back_noise_is_not_read():
    main = _probe(_slice(REF.copy()))
    for w, leaks in ((0.005, False), (0.01, False), (0.02, True)):
        leak = REF.copy()
        leak[2, 5] = w
        found = probe_findings(_large(_slice(leak), noise=0.01), main)
        assert [f.fault for f in found] == (["finite-fill-too-weak"] if leaks else []), w


def test_a_row_with_no_readable_key_does_not_leak():
    """A row that may read no key gets whatever the fill gives it, whatever the scores: a
    weight there is no sign that the scores overcame the fill."""
    allowed = CAUSAL.copy()
    allowed[0] = False
    ref = REF.copy()
    ref[0] = 0.0
    main = _probe(_slice(ref.copy(), ref=ref, allowed=allowed))
    A = ref.copy()
    A[0] = 1 / T  # the empty row reads every key alike
    assert probe_findings(_large(_slice(A, ref=ref, allowed=allowed)), main) == []
    A[3, 4] = 0.2
    (f,) = probe_findings(_large(_slice(A, ref=ref, allowed=allowed)), main)
    assert (f.rows, f.measurement["weight"]) == ((3,), 0.2)


def test_keys_the_main_probe_read_count_only_where_its_record_has_the_same_shape():
    """A key the main probe read already is no news; on a probe of another shape (more
    heads, or more tokens) no key of the main probe's lines up with it, so every one counts."""
    leak = REF.copy()
    leak[2, 5] = 0.2
    main = _probe(_slice(leak.copy()))
    assert probe_findings(_large(_slice(leak.copy())), main) == []
    two = _large(_slice(REF.copy(), index=(0, 0)), _slice(leak.copy(), index=(0, 1)), H=2)
    (f,) = probe_findings(two, main)
    assert (f.fault, f.rows) == ("finite-fill-too-weak", (2,))
    E8 = np.tril(np.ones((8, 8), bool))
    A8 = E8 / E8.sum(-1, keepdims=True)
    A8[2, 5] = 0.2
    longer = _large(_slice(A8, ref=E8 / E8.sum(-1, keepdims=True), allowed=E8))
    (f,) = probe_findings(longer, main)
    assert (f.fault, f.rows) == ("finite-fill-too-weak", (2,))


# -- the long fp16 rows ---------------------------------------------------------------------------
def _long(sums, tol=3e-3):
    r = RowSums(np.array(sums, float), 2500, 1e-3, tol)
    return _probe(kind="long fp16", probe="long fp16 rows", sums=r)


def test_long_fp16_rows_within_the_rule_have_no_finding():
    main = _probe(_slice(REF.copy()))
    assert probe_findings(_long([1.0, 1.001, 0.999, 1.0]), main) == []
    assert probe_findings(_long([1.0, 1.25, 0.75, 1.0], tol=0.25), main) == []  # at the rule


def test_long_fp16_rows_off_either_way_or_nan_are_worded_whole():
    main = _probe(_slice(REF.copy()))
    for sums, said in (
        ([0.9, 0.91, 0.9, 0.92], "0.9, 0.91, 0.9, 0.92"),
        ([1.0, 1.1, 1.0, 1.0], "1, 1.1, 1, 1"),
        ([1.0, np.nan, 1.0, 1.0], "1, nan, 1, 1"),
    ):
        (f,) = probe_findings(_long(sums), main)
        assert (f.stage, f.fault, f.probe, f.rows, f.slice) == (
            "A",
            "softmax-fp16-accumulation",
            "long fp16 rows",
            (),
            (),
        )
        assert f.message == (
            f"A: in fp16, rows reading 2500 keys sum to {said} instead of 1 (plain fp16 math "
            "with fp32 accumulation is off by 0.001): the softmax accumulates in fp16"
        )
        m = f.measurement
        assert sorted(m) == ["keys", "plain_err", "sums"]
        assert (m["keys"], m["plain_err"]) == (2500, 1e-3)
        assert np.array_equal(m["sums"], sums, equal_nan=True) and isinstance(m["sums"], list)


def test_long_fp16_rows_are_judged_only_where_the_main_probe_reads_back_summing_rows():
    off = _long([0.9, 0.91, 0.9, 0.92])
    for main in (
        _probe(_slice(REF.copy(), mode="cols")),
        _probe(_slice(_nan_row(3))),
        _probe(_slice(REF.copy()), repeat=0.5),
        _probe(_slice(REF.copy()), linearity=Linearity(0.5, 1e-12, 0.0)),
    ):
        assert probe_findings(off, main) == []
    assert len(probe_findings(off, _probe(_slice(REF.copy())))) == 1


def test_the_further_probes_that_can_still_show_something():
    from causalattn.check.judge import further_kinds, reads_back

    rest = ("two-head", "decoding", "padding", "large", "huge", "negative", "fp16")
    ok = _probe(_slice(REF.copy()), _slice(REF.copy(), index=(0, 1)), H=2)
    assert reads_back(ok) and further_kinds(ok) == (*rest, "long fp16")
    cols = _probe(_slice(REF.copy()), _slice(REF.copy(), index=(0, 1), mode="cols"), H=2)
    assert reads_back(cols) and further_kinds(cols) == rest
    nan = _probe(_slice(REF.copy()), _slice(_nan_row(3), index=(0, 1)), H=2)
    assert reads_back(nan) and further_kinds(nan) == rest
    for main in (
        _probe(_slice(REF.copy()), repeat=0.5),
        _probe(_slice(REF.copy()), linearity=Linearity(0.5, 1e-12, 0.0)),
    ):
        assert not reads_back(main) and further_kinds(main) == ()


# -- a further probe's findings -------------------------------------------------------------------
def test_an_fp16_probe_names_no_scale():
    """Rounding the inputs to fp16 moves the fitted scale: an fp16 probe's S findings are
    left out, its other findings kept; another probe's scale is its own finding."""
    main = _probe(_slice(REF.copy()))
    scaled = _slice(REF.copy(), fit=(1.0, 0.0))
    assert probe_findings(_probe(scaled, kind="fp16"), main) == []
    both = _slice(REF.copy(), fit=(1.0, 0.0), mode="cols")
    assert [(f.stage, f.fault) for f in probe_findings(_probe(both, kind="fp16"), main)] == [
        ("A", "softmax-query-axis")
    ]
    assert [(f.stage, f.fault) for f in probe_findings(_probe(both, kind="decoding"), main)] == [
        ("S", "missing-scale"),
        ("A", "softmax-query-axis"),
    ]


def test_a_further_probes_scale_is_named_with_d_model():
    main = _probe(_slice(REF.copy()))
    pm = _probe(_slice(REF.copy(), fit=(12**-0.5, 0.0)), kind="decoding")
    (f,) = probe_findings(pm, main, 12)
    assert (f.stage, f.fault, f.probe) == ("S", "scale-by-sqrt-dmodel", "decoding probe")
    (f,) = probe_findings(pm, main)
    assert (f.stage, f.fault) == ("S", None)
    found = judge([main, pm], d_model=12)
    assert [(f.fault, f.probe) for f in found] == [("scale-by-sqrt-dmodel", "decoding probe")]
