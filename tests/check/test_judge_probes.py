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
    assert f.message.startswith("A: row 5 holds NaN or inf weights at ordinary scores")


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


# -- findings merged by head ----------------------------------------------------------------------
def _heads(*slices, **kw):
    """A further probe of the given slices (B×H as their indices say)."""
    B = 1 + max(s.index[0] for s in slices)
    H = 1 + max(s.index[1] for s in slices)
    return _probe(*slices, kind="two-head", B=B, H=H, **kw)


def test_some_heads_only_keeps_the_first_findings_stage_rows_slice_and_measurement():
    """Heads 1 and 2 of 3 differ (head 2 at S, head 1 at A): the one finding is the earliest
    stage's, of head 2, with its rows, slice and measurement, and the fault it carries."""
    main = _probe(_slice(REF.copy()))
    off = REF.copy()
    off[2] *= 0.5
    pm = _heads(
        _slice(off, index=(0, 0), mode="none"),
        _slice(REF.copy(), index=(0, 1), fit=(1.0, 0.0)),
        _slice(REF.copy(), index=(0, 2)),
    )
    (f,) = probe_findings(pm, main)
    (scale,) = probe_findings(_probe(_slice(REF.copy(), fit=(1.0, 0.0)), kind="two-head"), main)
    assert (f.stage, f.fault, f.probe, f.rows, f.slice) == (
        "S",
        "some-heads-only",
        "two-head probe",
        (),
        (0, 1),
    )
    assert f.message == f"heads 1, 2 of 3: {scale.message}; head 3 matches the reference"
    assert f.measurement == {**scale.measurement, "heads": [0, 1], "fault": "missing-scale"}


def test_some_heads_only_keeps_the_rows_of_the_head_it_shows():
    main = _probe(_slice(REF.copy()))
    off = REF.copy()
    off[2] *= 0.5
    off[4] *= 0.5
    pm = _heads(_slice(REF.copy(), index=(0, 0)), _slice(off, index=(0, 1), mode="none"))
    (f,) = probe_findings(pm, main)
    assert (f.stage, f.fault, f.rows, f.slice) == ("A", "some-heads-only", (2, 4), (0, 1))
    assert f.message.startswith("head 2 of 2: A: rows 3, 5 sum to 0.5, 0.5 instead of 1, 1")
    assert f.message.endswith("; head 1 matches the reference")
    assert np.allclose(f.measurement.pop("row_sums"), off.sum(-1))
    assert f.measurement == {"heads": [1], "fault": None}


def test_a_fault_in_every_head_is_named_once_from_the_first_slice():
    main = _probe(_slice(REF.copy()))
    cols = [_slice(REF.copy(), index=(0, h), mode="cols") for h in range(2)]
    (f,) = probe_findings(_heads(*cols), main)
    assert (f.stage, f.fault, f.slice) == ("A", "softmax-query-axis", (0, 0))
    # the same head in two batch rows is one head: the others match
    bad = [_slice(REF.copy(), index=(b, 0), mode="cols") for b in range(2)]
    good = [_slice(REF.copy(), index=(b, 1)) for b in range(2)]
    (f,) = probe_findings(_heads(bad[0], good[0], bad[1], good[1]), main)
    assert (f.fault, f.slice, f.measurement["heads"]) == ("some-heads-only", (0, 0), [0])
    assert f.message.startswith("head 1 of 2: A: columns sum to 1")
    # one head in two batch rows: each (stage, fault) once, the first row's
    pm = _heads(_slice(REF.copy(), index=(0, 0), mode="cols"), _slice(REF.copy(), index=(1, 0)))
    (f,) = probe_findings(pm, main)
    assert (f.fault, f.slice) == ("softmax-query-axis", (0, 0))


def test_findings_of_one_stage_are_kept_when_their_faults_differ():
    """Merged by (stage, fault): one A finding per fault; each stage's unnamed one too."""
    main = _probe(_slice(REF.copy()))
    off = REF.copy()
    off[2] *= 0.5
    pm = _probe(
        _slice(off, index=(0, 0), mode="none", fit=(1.0, 0.0)),
        _slice(REF.copy(), index=(1, 0), mode="cols"),
        _slice(off, index=(2, 0), mode="none"),
        kind="decoding",
        B=3,
    )
    found = probe_findings(pm, main)
    assert [(f.stage, f.fault, f.slice) for f in found] == [
        ("S", "missing-scale", (0, 0)),
        ("A", None, (0, 0)),
        ("A", "softmax-query-axis", (1, 0)),
    ]
    scaled = _probe(_slice(off, mode="none", fit=(0.9, 0.0)), kind="decoding")  # no size
    assert [(f.stage, f.fault) for f in probe_findings(scaled, main)] == [("S", None), ("A", None)]


def test_a_multi_head_probe_that_matches_has_no_finding():
    main = _probe(_slice(REF.copy()))
    assert probe_findings(_heads(*[_slice(REF.copy(), index=(0, h)) for h in range(3)]), main) == []


# -- the main probe first, then what it does not explain ------------------------------------------
def test_the_main_probes_findings_come_in_stage_order():
    """Its weights (M), the width of V (S) and the output projection (O): S, M, O."""
    w = Width(diff=0.1, tol=1e-12, fit=None, d_v=6)
    A = np.tril(np.ones((T, T)), 1)
    main = _probe(
        _slice(A / A.sum(-1, keepdims=True)),
        width=w,
        projection=Projection(err=0.5, err_missing=0.0, tol=1e-6),
    )
    assert [(f.stage, f.fault) for f in judge([main])] == [
        ("S", None),
        ("M", None),
        ("O", "output-projection-missing"),
    ]


def test_a_further_probes_findings_come_in_stage_order_each_once():
    """Two further probes that both find the same unnamed A: shown once (the first's);
    each probe's own findings in stage order."""
    main = _probe(_slice(REF.copy()))
    off = REF.copy()
    off[2] *= 0.5
    first = _probe(
        _slice(off, mode="none", fit=(1.0, 0.0)), kind="decoding", probe="decoding probe"
    )
    second = _probe(_slice(off, mode="none"), kind="padding", probe="padding probe")
    found = judge([main, first, second])
    assert [(f.stage, f.fault, f.probe) for f in found] == [
        ("S", "missing-scale", "decoding probe"),
        ("A", None, "decoding probe"),
    ]
    assert [(f.stage, f.probe) for f in judge([main, second, first])] == [
        ("A", "padding probe"),
        ("S", "decoding probe"),
    ]


def test_a_further_finding_the_main_probe_explains_is_not_shown():
    cols = _probe(_slice(REF.copy(), mode="cols"))
    again = _probe(_slice(REF.copy(), mode="cols"), kind="decoding")
    assert [(f.probe, f.fault) for f in judge([cols, again])] == [
        ("main probe", "softmax-query-axis")
    ]


# -- what the probes that ran cannot show ---------------------------------------------------------
def test_padding_faults_are_shown_by_a_padding_probe_or_a_declared_padding():
    from causalattn.check.judge import untested

    ran = ["main probe", "decoding probe", "long fp16 rows"]
    padding = ["padding-ignored", "padding-queries-only", "finite-min-added-twice"]
    padding.append("nan-on-empty-rows")
    win = {"window": 3}
    assert untested("sdpa", True, None, win, ran, "main") == [
        "padding-ignored",
        "padding-queries-only",
        "finite-min-added-twice",
        "nan-on-empty-rows",
    ]
    for pad_kind, declared in (
        ("lengths", win),
        ("key_padding_mask", win),
        (None, {**win, "lengths": [4]}),
        (None, {**win, "key_padding_mask": np.ones((1, T), bool)}),
    ):
        got = untested("sdpa", True, pad_kind, declared, ran, "main")
        assert got == [], (pad_kind, sorted(declared))
    got = untested("sdpa", True, "lengths", {}, ran, "main")
    assert got == ["window-off-by-one"]


def test_decoding_long_rows_projection_and_k_transposed_each_by_what_ran():
    from causalattn.check.judge import untested

    win = {"window": 3}
    assert untested("sdpa", True, "lengths", win, ["main probe"], "main") == [
        "causal-top-left",
        "softmax-fp16-accumulation",
    ]
    ran = ["main probe", "decoding (T_q < T_k)", "long fp16 rows"]
    assert untested("sdpa", True, "lengths", win, ran, "main") == []
    assert untested("sdpa", False, "lengths", win, ran, "main") == [
        "output-projection-missing",
        "output-projection-transposed",
    ]
    assert untested("qkv", True, "lengths", win, ran, "main") == [
        "k-not-transposed",
        "scale-by-sqrt-dmodel",
    ]
    assert untested("qkv", True, "lengths", win, ran, "T = d_k") == ["scale-by-sqrt-dmodel"]
    assert untested("x", True, "lengths", win, ran, "main") == []


# -- the verdict ----------------------------------------------------------------------------------
def _verdict(found, measures, details=None, **kw):
    from causalattn.check.judge import verdict

    details = {"probes": [m.probe for m in measures]} if details is None else details
    return verdict(found, measures, details=details, untested=kw.pop("untested", []), **kw)


def test_a_clean_verdict_shows_the_main_probes_first_slice():
    from causalattn.check.report import Status

    main = _probe(_slice(REF.copy()), _slice(REF.copy(), index=(0, 1), fit=(1.0, 0.0)), H=2)
    details = {"probes": ["main probe", "large probe"]}
    d = _verdict([], [main], details, untested=["window-off-by-one"])
    assert (d.fault, d.stage, d.status, d.location, d.findings) == (
        None,
        None,
        Status.CLEAN,
        None,
        [],
    )
    assert d.message == "matches the reference on every probe (main probe, large probe)"
    assert d.untested == ["window-off-by-one"]
    assert d.details == {"probes": ["main probe", "large probe"]}
    assert (d.pattern == CAUSAL).all() and (d.expected == CAUSAL).all()
    assert d.scale == C0 and d.d_k == 3
    assert _verdict([], [main], {}).message == "matches the reference on every probe ()"
    bare = _verdict([], [_probe()])  # no weights read back: nothing to show
    assert (bare.pattern, bare.expected, bare.scale, bare.d_k) == (None, None, None, 3)


def test_the_verdict_names_the_first_finding_and_where_the_white_box_pass_put_it():
    from causalattn.check.report import Status

    main = _probe(_slice(REF.copy(), fit=(1.0, 0.0), mode="cols"))
    found = judge([main])
    assert [f.fault for f in found] == ["missing-scale", "softmax-query-axis"]
    details = {"probes": ["main probe"]}
    facts = {"line": 12}
    d = _verdict(found, [main], details, located=("attn.py:12", "s = q @ k.T", facts))
    assert (d.fault, d.stage, d.location, d.status) == (
        "missing-scale",
        "S",
        "attn.py:12",
        Status.FAULT,
    )
    assert d.message == "missing-scale: " + found[0].message and d.findings == found
    assert details == {"probes": ["main probe"], "whitebox": facts, "code": "s = q @ k.T"}
    assert d.scale == 1.0 and (d.pattern == CAUSAL).all()
    unnamed = _probe(_slice(REF.copy(), fit=(C0, 0.5)))
    found = judge([unnamed])
    details = {"probes": ["main probe"]}
    d = _verdict(found, [unnamed], details)
    assert (d.fault, d.stage, d.status, d.location) == (None, "S", Status.UNKNOWN, None)
    assert d.message == found[0].message and d.scale is None  # no tight fit
    assert details == {"probes": ["main probe"], "whitebox": {}, "code": ""}


def test_the_verdict_shows_the_slice_of_the_first_finding_on_the_main_probe():
    """Head 2 of the main probe lacks its scale: the pattern, expected pattern and scale
    shown are head 2's; a finding of no slice or of another probe shows head 1."""
    allowed1 = CAUSAL.copy()
    allowed1[5, 5] = False  # head 2's expected pattern, told apart from head 1's
    ref1 = allowed1 / allowed1.sum(-1, keepdims=True)
    head2 = _slice(ref1.copy(), ref=ref1, allowed=allowed1, index=(0, 1), fit=(1.0, 0.0))
    main = _probe(_slice(REF.copy()), head2, H=2)
    found = judge([main])
    assert [(f.fault, f.slice) for f in found] == [("some-heads-only", (0, 1))]
    d = _verdict(found, [main])
    assert (d.pattern == allowed1).all() and (d.expected == allowed1).all() and d.scale == 1.0
    head2 = _slice(ref1.copy(), ref=ref1, allowed=allowed1, index=(0, 1))  # right
    w = Width(diff=0.1, tol=1e-12, fit=None, d_v=6)
    main_w = _probe(_slice(REF.copy()), head2, H=2, width=w)
    found = judge([main_w])
    assert [(f.stage, f.slice) for f in found] == [("S", ())]
    d = _verdict(found, [main_w])
    assert (d.pattern == CAUSAL).all() and (d.expected == CAUSAL).all() and d.scale == C0
    cols = _slice(REF.copy(), index=(0, 1), mode="cols")
    other = _probe(_slice(REF.copy()), cols, kind="two-head", H=2)
    main_ok = _probe(_slice(REF.copy()), head2, H=2)
    found = judge([main_ok, other])
    assert [(f.probe, f.slice) for f in found] == [("two-head probe", (0, 1))]
    d = _verdict(found, [main_ok, other])
    assert (d.pattern == CAUSAL).all() and (d.expected == CAUSAL).all() and d.scale == C0


def test_the_verdict_shows_no_read_pattern_where_v_i_does_not_read_the_weights_back():
    main = _probe(_slice(REF.copy(), mode="cols"))
    found = judge([main])
    d = _verdict(found, [main], reads_back=False)
    assert d.pattern is None and (d.expected == CAUSAL).all() and d.scale == C0
    assert (_verdict(found, [main]).pattern == CAUSAL).all()  # reads back unless told


def test_the_pattern_of_a_further_probe_is_shown_only_for_its_own_slice():
    """details["pattern_of"]: the read and expected pattern of the first finding's slice
    when that finding is a further probe's, not the main probe's; none where the finding
    has no slice or names a slice or probe not measured."""
    main = _probe(_slice(REF.copy(), mode="cols"))
    found = judge([main])
    details = {"probes": ["main probe"]}
    _verdict(found, [main], details)
    assert "pattern_of" not in details
    ok = _probe(_slice(REF.copy()))
    nan = _nan_row(4)
    large = _large(_slice(nan))
    found = judge([ok, large])
    assert [(f.probe, f.slice) for f in found] == [("large probe", ())]
    details = {"probes": ["main probe", "large probe"]}
    _verdict(found, [ok, large], details)
    assert "pattern_of" not in details
    stray = [Finding("M", "no-mask", "M: ...", "elsewhere", slice=(0, 0))]
    details = {"probes": ["main probe"]}
    _verdict(stray, [ok], details)
    assert "pattern_of" not in details
    off_slice = [Finding("M", "no-mask", "M: ...", "large probe", slice=(0, 3))]
    details = {"probes": ["main probe", "large probe"]}
    _verdict(off_slice, [ok, large], details)
    assert "pattern_of" not in details


def test_the_main_probes_scale_is_named_with_d_model():
    main = _probe(_slice(REF.copy(), fit=(12**-0.5, 0.0)))
    (f,) = judge([main], d_model=12)
    assert (f.stage, f.fault, f.probe) == ("S", "scale-by-sqrt-dmodel", "main probe")
    (f,) = judge([main])
    assert (f.stage, f.fault) == ("S", None)
