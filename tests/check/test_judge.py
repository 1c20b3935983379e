"""The judge on hand-made measurement records: no function is run, nothing is kept between
calls. Each record says what a function did on a probe; the judge names the findings."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from _judge_records import C0, CAUSAL, REF, T, _bare, _probe, _renorm, _slice

from causalattn import masks
from causalattn.check.judge import further_kinds, judge, match_pattern, probe_findings
from causalattn.check.measure import Linearity, RowSums


def test_a_clean_record_has_no_findings():
    assert judge([_probe(_slice(REF.copy()))]) == []


def test_scale_read_pattern_and_normalization():
    (f,) = judge([_probe(_slice(REF.copy(), fit=(1.0, 0.0)))])
    assert (f.stage, f.fault) == ("S", "missing-scale") and f.measurement["scale"] == 1.0
    (f,) = judge([_probe(_slice(REF.copy(), mode="cols"))])
    assert (f.stage, f.fault) == ("A", "softmax-query-axis")
    (f,) = judge([_probe(_slice(_renorm(np.ones((T, T)))))])
    assert (f.stage, f.fault) == ("M", "no-mask") and f.rows == (0, 1, 2, 3, 4)


def test_catalogue_forms_hold_on_every_row_but_a_patched_one():
    no_diag = CAUSAL & ~np.eye(T, dtype=bool)
    pm = _probe()
    assert match_pattern(pm, no_diag, CAUSAL) == ("diagonal-blocked", [])
    patched = no_diag.copy()
    patched[0, 0] = True  # row 1 reads itself so that it is not NaN
    assert match_pattern(pm, patched, CAUSAL) == ("diagonal-blocked", [0])
    uniform = no_diag.copy()
    uniform[0] = True  # or reads every key
    assert match_pattern(pm, uniform, CAUSAL) == ("diagonal-blocked", [0])
    twice = no_diag.copy()
    twice[0, 0] = twice[3, 3] = True  # a second row differs: not the catalogue's form
    assert match_pattern(pm, twice, CAUSAL) == (None, [])
    (f,) = judge([_probe(_slice(_renorm(patched.astype(float))))])
    assert f.fault == "diagonal-blocked" and f.measurement["patched_rows"] == [0]
    assert "every row but row 1 has diagonal-blocked's form" in f.message


# every catalogued form of M on these probes, with its first row patched three ways: to read
# every key (uniform), to read what the reference reads, or only its own key
PATCHED = {
    "causal": (masks.Pattern(), T, T, ["no-mask", "anti-causal-mask", "diagonal-blocked"]),
    "lengths": (
        masks.Pattern(lengths=[4]),
        T,
        T,
        ["no-mask", "padding-ignored", "anti-causal-mask", "diagonal-blocked"],
    ),
    "decoding": (masks.Pattern(), 3, 7, ["no-mask", "diagonal-blocked", "causal-top-left"]),
    "window": (
        masks.Pattern(window=3),
        T,
        T,
        ["no-mask", "anti-causal-mask", "diagonal-blocked", "window-off-by-one"],
    ),
}


@pytest.mark.parametrize("case", list(PATCHED))
def test_every_catalogued_form_with_a_patched_first_row(case):
    from causalattn.check.judge import _forms

    pat, T_q, T_k, want = PATCHED[case]
    pm = _probe(pattern=pat, T_q=T_q, T_k=T_k)
    E = pat.allowed(1, 1, T_q, T_k)[0, 0]
    own = np.zeros(T_k, bool)
    own[T_k - T_q] = True
    named = set()
    for fid, F in _forms(pm, E, E, 0):
        if F is None:
            continue
        for row0 in (np.ones(T_k, bool), E[0], own):
            P = F.copy()
            P[0] = row0
            if (P[0] == F[0]).all() or (P == E).all():
                continue  # not a patch of this form
            got = match_pattern(pm, P, E)
            if fid == "padding-queries-only":  # the same as the reference here: not shown
                assert got == (None, []), got
                continue
            assert got == (fid, [0]), (fid, row0.astype(int), got)
            named.add(fid)
    assert sorted(named) == sorted(want)


def test_the_main_probe_first_then_what_it_does_not_explain():
    mask_after = REF * 0 + np.tril(np.ones((T, T))) / T  # softmax over all keys, zeroed
    main = _probe(_slice(mask_after, mode="none", full_err=0.0))
    top_left = np.pad(np.tril(np.ones((3, 3), bool)), ((0, 0), (0, 4)))
    bottom_right = np.tril(np.ones((3, 7), bool), 4)
    ref7 = bottom_right / bottom_right.sum(-1, keepdims=True)
    A7 = np.where(top_left, 1 / 7, 0.0)  # reads top-left, rows sum to less than 1
    decoding = _probe(
        _slice(A7, ref=ref7, allowed=bottom_right, mode="none", full_err=0.0), kind="decoding"
    )
    found = judge([main, decoding])
    assert [(f.stage, f.fault, f.probe) for f in found] == [
        ("A", "mask-after-softmax", "main probe"),
        ("M", "causal-top-left", "decoding probe"),  # the decoding probe's A: explained
    ]
    assert judge([main, decoding]) == found  # nothing kept between calls
    assert judge([main]) == found[:1]


def test_some_heads_only():
    ok, wrong = _slice(REF.copy(), index=(0, 0)), _slice(REF.copy(), index=(0, 1), mode="cols")
    main = _probe(_slice(REF.copy()))
    (f,) = judge([main, _probe(ok, wrong, kind="two-head", H=2)])
    assert (f.stage, f.fault) == ("A", "some-heads-only") and f.measurement["heads"] == [1]
    assert f.measurement["fault"] == "softmax-query-axis"
    assert (
        f.message.startswith("head 2 of 2: A: columns sum to 1") and "head 1 matches" in f.message
    )


def test_values_from_other_rows_and_lost_precision():
    G = np.roll(np.eye(T), 1, axis=1)  # key j's weight multiplies v_{j+1}
    A = REF @ G
    (f,) = judge([_probe(_slice(A, value_map=G, value_misfit=0.0))])
    assert f.stage == "H" and f.measurement["value_rows"] == [1, 2, 3, 4, 5, 0]
    rng = np.random.default_rng(0)
    rounded = REF * (1 + 0.003 * rng.choice([-1, 1], size=REF.shape))  # scattered, 8 bits
    (f,) = judge([_probe(_slice(rounded, fit=(C0 * 1.0005, 0.004)))])
    assert f.stage == "A" and f.fault is None and "precision is lost" in f.message
    assert f.measurement["dtype"] == "float64" and 7 <= f.measurement["bits"] <= 9
    scaled = REF * 0.99  # one factor per row: a normalization fault, not rounding
    (f,) = judge([_probe(_slice(scaled, mode="none", fit=(C0, 0.0)))])
    assert f.stage == "H" and "0.99·A V" in f.message


def test_large_scores_overflow_and_leak():
    main = _probe(_slice(REF.copy()))
    nan = REF.copy()
    nan[4] = np.nan
    (f,) = probe_findings(_probe(_slice(nan), kind="large"), main)
    assert (f.stage, f.fault, f.rows) == ("A", "unstable-softmax", (4,))
    leak = REF.copy()
    leak[2, 5] = 0.2
    (f,) = probe_findings(_probe(_slice(leak), kind="large", S_max=40.0), main)
    assert (f.stage, f.fault) == ("M", "finite-fill-too-weak") and f.measurement["weight"] == 0.2
    reads_it = _probe(_slice(leak))  # the main probe read that key already: nothing new
    assert probe_findings(_probe(_slice(leak), kind="large"), reads_it) == []


def test_long_fp16_rows_only_where_short_rows_sum_right():
    sums = RowSums(np.array([0.9, 0.91, 0.9, 0.92]), 2500, 1e-3, 3e-3)
    long_rows = _probe(kind="long fp16", probe="long fp16 rows", sums=sums)
    main = _probe(_slice(REF.copy()))
    (f,) = probe_findings(long_rows, main)
    assert f.fault == "softmax-fp16-accumulation" and "2500 keys" in f.message
    off = _probe(_slice(REF * 0.5, mode="none"))
    assert "long fp16" not in further_kinds(off) and probe_findings(long_rows, off) == []


def test_a_function_not_linear_in_V_is_judged_on_its_main_probe_only():
    lin = Linearity(err=0.5, tol=1e-12, zero=0.25)
    main = _probe(_slice(REF.copy(), mode="cols"), linearity=lin)
    (f,) = judge([main, _probe(_slice(REF.copy(), mode="all"), kind="two-head")])
    assert f.stage == "H" and "not A V" in f.message and f.measurement["zero"] == 0.25
    assert further_kinds(main) == ()
    recorded = (_slice(REF.copy(), mode="cols"),)  # the softmax it computed, recorded
    main = _probe(_slice(REF.copy()), linearity=lin, recorded=recorded)
    (f,) = judge([main])
    assert f.fault == "softmax-query-axis"


@pytest.mark.parametrize("w", [2, 4])
def test_window_off_by_one(w):
    pat = masks.Pattern(window=3)
    E = pat.allowed(1, 1, T, T)[0, 0]
    P = masks.Pattern(window=w).allowed(1, 1, T, T)[0, 0]
    assert match_pattern(_probe(pattern=pat), P, E) == ("window-off-by-one", [])


def test_measuring_is_pure_on_a_hand_made_run():
    """measure() reads a Run (what a function returned) without running anything."""
    from causalattn.check.measure import expected_weights, measure
    from causalattn.check.observe import Run
    from causalattn.check.probes import eye, qkv_probe

    p = qkv_probe(
        "main probe",
        np.random.default_rng(0),
        T_q=T,
        T_k=T,
        d_k=3,
        mag=1.2,
        dtype=np.float64,
        pattern=masks.Pattern(),
    )
    A = expected_weights(p, C0)  # what a right function returns for V = I
    V = np.random.default_rng(1).normal(size=(1, 1, T, T))
    p.values.update(eye=eye(T), random=V, zero=np.zeros_like(V))
    right = Run(p, {"eye": A, "random": A @ V, "zero": 0 * V}, np.dtype("float64"))
    pm = measure(right, scale=None, sig="qkv")
    (s,) = pm.slices
    assert (s.read == CAUSAL).all() and s.mode == "rows" and abs(s.fit[0] / C0 - 1) < 1e-9
    assert pm.linearity.err <= pm.linearity.tol and judge([pm]) == []
    G = np.roll(np.eye(T), 1, axis=1)
    wrong = Run(p, {"eye": A @ G, "random": A @ G @ V, "zero": 0 * V}, np.dtype("float64"))
    (s,) = measure(wrong, scale=None, sig="qkv").slices
    assert np.allclose(s.value_map, G) and s.value_misfit < 1e-9


def _found(*measures):
    return [(f.stage, f.fault, f.rows, f.message, f.measurement) for f in judge(list(measures))]


def test_each_normalization_finding_is_worded_whole_with_its_measurement():
    on = " (on main probe)"
    neg = REF.copy()
    neg[3, 1], neg[3, 0] = -0.1, neg[3, 0] + 0.1
    not_softmax = ": no softmax gives a negative weight, so the normalization is not a softmax"
    assert _found(_probe(_slice(neg))) == [
        (
            "A",
            None,
            (3,),
            f"A: row 4 holds negative weights (down to -0.1){not_softmax}"
            f" (is the exp missing?){on}",
            {"min_weight": -0.1},
        )
    ]
    neg[4, 2], neg[4, 0] = -0.25, neg[4, 0] + 0.25
    assert _found(_probe(_slice(neg)))[0][2:4] == (
        (3, 4),
        f"A: rows 4..5 hold negative weights (down to -0.25){not_softmax}"
        f" (is the exp missing?){on}",
    )
    off = REF.copy()
    off[2] *= 0.5
    ((stage, fault, rows, msg, m),) = _found(_probe(_slice(off, mode="none")))
    assert (stage, fault, rows, msg) == ("A", None, (2,), f"A: row 3 sums to 0.5 instead of 1{on}")
    assert np.allclose(m["row_sums"], off.sum(-1)) and list(m) == ["row_sums"]
    off[4] *= 1.5
    assert _found(_probe(_slice(off, mode="none")))[0][3] == (
        f"A: rows 3, 5 sum to 0.5, 1.5 instead of 1, 1 (more than 1: no softmax sums so){on}"
    )
    assert _found(_probe(_slice(REF * 0.99, mode="none"))) == [
        (
            "H",
            None,
            (),
            "H: the output is 0.99·A V: every row's weights sum to 0.99, and "
            f"divided by that they are right{on}",
            {"factor": 0.99},
        )
    ]
    by_column = CAUSAL / CAUSAL.sum(0, keepdims=True)
    ((stage, fault, rows, msg, m),) = _found(_probe(_slice(by_column, mode="cols")))
    assert (stage, fault, msg) == (
        "A",
        "softmax-query-axis",
        "A: columns sum to 1, rows do not (row sums 0.1667, 0.3667, 0.6167, 0.95 ...): the "
        "softmax ran over the query axis",
    )
    assert np.allclose(m["row_sums"], by_column.sum(-1))
    ((stage, fault, rows, msg, m),) = _found(_probe(_slice(CAUSAL / CAUSAL.sum(), mode="all")))
    assert (stage, fault, msg) == (
        "A",
        "softmax-all-entries",
        "A: the whole 6×6 matrix sums to 1 (row sums 0.04762, 0.09524, 0.1429, 0.1905 ...): "
        "one softmax over all entries",
    )
    assert np.allclose(m["row_sums"], np.arange(1, T + 1) / 21)


def test_a_function_that_is_not_deterministic_is_named_at_h_alone():
    (f,) = judge([_probe(_slice(REF.copy(), mode="cols"), repeat=0.5)])
    assert (f.stage, f.fault, f.probe, f.measurement) == ("H", None, "main probe", {"repeat": 0.5})
    assert f.message == (
        "H: the function is not deterministic: called twice on the same input (main probe, "
        "V = I) its outputs differ by up to 0.5 (the accuracy rule allows 1e-12); something "
        "random runs in it (dropout left on in eval?)"
    )
    assert judge([_probe(_slice(REF.copy()), repeat=1e-13)]) == []  # within the rule


def test_some_heads_only_names_the_heads_that_match():
    ok = [_slice(REF.copy(), index=(0, h)) for h in (0, 2)]
    bad = _slice(REF.copy(), index=(0, 1), mode="cols")
    (f,) = judge([_probe(_slice(REF.copy())), _probe(ok[0], bad, ok[1], kind="two-head", H=3)])
    assert f.message.startswith("head 2 of 3: A: columns sum to 1")
    assert f.message.endswith("; heads 1, 3 match the reference")
    assert f.measurement["heads"] == [1] and f.probe == "two-head probe"


def test_values_from_other_rows_list_four_moves_then_an_ellipsis():
    head = "H: the weights are right (V = I reads back A = softmax(S + M)) but H takes the values"
    for perm, moves in (
        ([1, 2, 3, 4, 5, 0], "key 1 → v_2, key 2 → v_3, key 3 → v_4, key 4 → v_5 ..."),
        ([1, 0, 2, 3, 4, 5], "key 1 → v_2, key 2 → v_1"),
    ):
        G = np.eye(T)[perm]
        (f,) = judge([_probe(_slice(REF @ G, value_map=G, value_misfit=0.0))])
        assert f.message == f"{head} from the wrong rows: {moves} (on main probe)"
        assert f.measurement == {"value_rows": perm}


def test_lost_precision_records_what_it_measured():
    rng = np.random.default_rng(0)
    rounded = REF * (1 + 0.003 * rng.choice([-1, 1], size=REF.shape))
    (f,) = judge([_probe(_slice(rounded, fit=(C0 * 1.0005, 0.004)))])
    m = f.measurement
    assert sorted(m) == ["bits", "dtype", "err", "rel_err", "scale", "tol"]
    assert abs(m["err"] - 0.003) < 1e-9 and abs(m["rel_err"] - 0.003) < 1e-9
    assert m["tol"] == 1e-12 and m["scale"] == pytest.approx(C0 * 1.0005)
    assert f.message.startswith("A: the weights have the reference's pattern, scale and sums, ")
    assert "about 8 significant bits; the accuracy rule allows 1e-12 in float64" in f.message


def test_what_the_probes_that_ran_cannot_show():
    from causalattn.check.judge import untested

    full = dict(sig="qkv", has_wo=True, pad_kind="lengths", declared={"window": 3})
    ran = ["main probe", "decoding probe", "long fp16 rows"]
    assert untested(**full, ran=ran, main_kind="main") == [
        "k-not-transposed",
        "scale-by-sqrt-dmodel",
    ]
    assert untested(**full, ran=ran, main_kind="T = d_k") == ["scale-by-sqrt-dmodel"]
    assert untested(**full, ran=[*ran, "T = d_k probe"], main_kind="main") == [
        "scale-by-sqrt-dmodel"
    ]
    assert untested("sdpa", True, "lengths", {"window": 3}, ran, "main") == []
    # in the catalogue's order
    assert untested("sdpa", False, None, {}, ["main probe"], "main") == [
        "causal-top-left",
        "window-off-by-one",
        "padding-ignored",
        "padding-queries-only",
        "finite-min-added-twice",
        "softmax-fp16-accumulation",
        "nan-on-empty-rows",
        "output-projection-missing",
        "output-projection-transposed",
    ]


def test_the_verdict_names_the_probes_and_the_pattern_it_shows():
    from causalattn.check.judge import verdict

    main = _probe(_slice(REF.copy()))
    clean = verdict([], [main], details={"probes": ["main probe", "large probe"]}, untested=[])
    assert clean.message == "matches the reference on every probe (main probe, large probe)"
    bad = _slice(REF.copy(), index=(0, 1), mode="cols")
    two = _probe(_slice(REF.copy()), bad, kind="two-head", H=2)
    found = judge([main, two])
    details = {"probes": ["main probe", "two-head probe"]}
    d = verdict(found, [main, two], details=details, untested=[])
    assert d.fault == "some-heads-only" and d.stage == "A"
    assert details["pattern_of"] == {
        "probe": "two-head probe",
        "slice": [0, 1],
        "pattern": bad.read.tolist(),
        "expected": bad.allowed.tolist(),
    }


def test_scores_that_are_no_multiple_of_qk_and_weights_read_transposed():
    (f,) = judge([_probe(_slice(REF.copy(), fit=(C0, 0.5)))])
    assert (f.stage, f.fault, f.measurement) == ("S", None, {"misfit": 0.5})
    assert f.message == (
        "S: log A is not c·Q Kᵀ plus a constant per row on the keys each row reads (misfit "
        "0.5 in log space): the scores are not a multiple of Q Kᵀ (on main probe)"
    )
    (f,) = judge([_probe(_slice(REF.T.copy()))])
    assert (f.stage, f.fault, f.measurement) == ("H", None, {"transposed": True})
    assert f.message.startswith("H: the output is Aᵀ V: V = I reads back the reference's")
    details = {"probes": ["main probe"]}
    d = verdict_of([f], details)
    assert d.pattern is None and (d.expected == CAUSAL).all()  # Aᵀ does not show what rows read


def verdict_of(found, details, main=None):
    from causalattn.check.judge import verdict

    main = main or _probe(_slice(REF.T.copy()))
    return verdict(found, [main], details=details, untested=[])


def test_the_verdict_shows_the_main_probes_pattern_expected_and_scale():
    A = _renorm(np.ones((T, T)))  # reads the future: no mask
    main = _probe(_slice(A, fit=(C0, 0.0)))
    found = judge([main])
    d = verdict_of(found, {"probes": ["main probe"]}, main)
    assert (d.pattern == np.ones((T, T), bool)).all() and (d.expected == CAUSAL).all()
    assert d.scale == pytest.approx(C0) and d.d_k == 3


def test_large_scores_name_their_probe_and_what_they_saw():
    main = _probe(_slice(REF.copy()))
    nan = REF.copy()
    nan[4] = np.nan
    (f,) = probe_findings(_probe(_slice(nan), kind="large", S_max=40.0), main)
    assert (f.probe, f.rows) == ("large probe", (4,))
    assert f.message == (
        "A: at scores up to |S| = 40 row 5 comes out NaN or inf: exp overflows without the "
        "row maximum subtracted"
    )
    nan[1] = np.inf
    (f,) = probe_findings(_probe(_slice(nan), kind="large", S_max=40.0), main)
    assert f.message.startswith("A: at scores up to |S| = 40 rows 2, 5 come out NaN or inf: ")
    leak = REF.copy()
    leak[2, 5] = 0.2
    (f,) = probe_findings(_probe(_slice(leak), kind="large", S_max=40.0), main)
    assert (f.probe, f.rows, f.measurement) == ("large probe", (2,), {"weight": 0.2, "S_max": 40.0})
    assert f.message == (
        "M: at scores up to |S| = 40 blocked keys get weight (up to 0.2) on row 3: the fill "
        "that blocks them is finite and the scores overcome it"
    )


def test_weights_that_change_with_the_width_of_v():
    from causalattn.check.measure import Width

    d_v = 6
    by_dv = 1 / math.sqrt(d_v)  # Q Kᵀ / √d_v: the weights follow d_v
    wide = Width(diff=0.1, tol=1e-12, fit=(1 / math.sqrt(2 * d_v), 0.0), d_v=d_v)
    (f,) = judge([_probe(_slice(REF.copy(), fit=(by_dv, 0.0)), width=wide)])[-1:]
    assert (f.stage, f.fault, f.measurement) == ("S", "scale-by-sqrt-dv", {"diff": 0.1})
    assert f.message == (
        f"S: the weights change with the width of V (d_v): Q Kᵀ · {by_dv:.4g} with d_v = 6, "
        f"· {1 / math.sqrt(12):.4g} with d_v = 12; expected · {C0:.4g} (1/√d_k, d_k = 3)"
    )
    other = Width(diff=0.1, tol=1e-12, fit=(0.9, 0.0), d_v=d_v)
    (f,) = judge([_probe(_slice(REF.copy(), fit=(by_dv, 0.0)), width=other)])[-1:]
    assert f.fault is None and f.message.startswith("S: the weights change with the width of V")
    assert judge([_probe(_slice(REF.copy()), width=Width(1e-13, 1e-12, None, d_v))]) == []


def test_the_factor_is_named_by_the_one_size_it_equals():
    """_scale_name: each size the factor may be, named with its value; two sizes that fit
    (d_v = T_k here) name neither unless the run with d_v doubled tells them apart."""
    from causalattn.check.judge import _scale_name
    from causalattn.check.measure import Width

    pm = _probe(T_k=6)  # d_k = 3, d_v = T_k = 6 (V = I)
    assert _scale_name(pm, 1.0, None) == ("missing-scale", "; the factor is 1")
    assert _scale_name(pm, 1 / 3, None) == ("scale-by-dk", "; the factor is 1/d_k (d_k = 3)")
    assert _scale_name(pm, 12**-0.5, 12) == (
        "scale-by-sqrt-dmodel",
        "; the factor is 1/√d_model (d_model = 12)",
    )
    both = "; the factor is 1/√d_v (d_v = 6) or 1/√T_k (T_k = 6)"
    assert _scale_name(pm, 6**-0.5, None) == (None, both)
    assert _scale_name(_probe(T_k=8, H=2), 6**-0.5, None) == (
        None,
        "; the factor is 1/√(H·d_k) (H·d_k = 6)",
    )
    assert _scale_name(_probe(T_k=8, d_v=5), 8**-0.5, None) == (
        None,
        "; the factor is 1/√T_k (T_k = 8)",
    )
    # with d_v doubled (12) the factor follows d_v: it is 1/√d_v
    wide = Width(diff=1.0, tol=1e-3, fit=(12**-0.5, 0.0), d_v=6)
    assert _scale_name(_probe(T_k=6, width=wide), 6**-0.5, None) == (
        "scale-by-sqrt-dv",
        "; the factor is 1/√d_v (d_v = 6)",
    )
    # it stays: it is 1/√T_k; and where the weights did not change at all, that is said
    still = Width(diff=1e-3, tol=1e-3, fit=(6**-0.5, 0.0), d_v=6)
    assert _scale_name(_probe(T_k=6, width=still), 6**-0.5, None) == (
        None,
        "; the factor is 1/√T_k (T_k = 6); with d_v = 12 the weights do not change",
    )
    moved = Width(diff=1.0, tol=1e-3, fit=(6**-0.5, 0.0), d_v=6)
    assert _scale_name(_probe(T_k=6, width=moved), 6**-0.5, None) == (
        None,
        "; the factor is 1/√T_k (T_k = 6)",
    )
    # the d_v rule is read only when 1/√d_v fits
    assert _scale_name(_probe(T_k=6, width=still), 1.0, None) == (
        "missing-scale",
        "; the factor is 1",
    )


def test_a_row_scaled_by_one_factor_of_its_own_is_a_normalization_fault_not_rounding():
    """_row_scaled: every row that differs is the reference times one factor (rows 2 and 4,
    by their own factors; the others exact); scattered rounding, or no row that differs, is not."""
    from causalattn.check.judge import _row_scaled

    scaled = REF.copy()
    scaled[2] *= 0.99
    scaled[4] *= 0.995
    assert _row_scaled(_slice(scaled))
    scattered = scaled.copy()
    scattered[4, 0] *= 1.001  # row 4's factor no longer one
    assert not _row_scaled(_slice(scattered))
    noise = REF * (1 + 1e-6 * np.cos(np.arange(T * T).reshape(T, T)))
    assert not _row_scaled(_slice(noise))
    assert not _row_scaled(_slice(REF.copy()))
    # each row is judged by its own offset: row 2's large factor does not excuse row 4
    uneven = scaled.copy()
    uneven[4] = REF[4] * (1 - 1e-4)
    uneven[4, 1] = REF[4, 1] * (1 - 1e-4 + 1e-6)  # a spread of 1e-6 on an offset of 1e-4
    assert not _row_scaled(_slice(uneven))
    tiny_factor = REF.copy()
    tiny_factor[3] *= 1 - 1e-10
    assert _row_scaled(_slice(tiny_factor))
    wide = np.tril(np.ones((3, 5)), 2) / np.tril(np.ones((3, 5)), 2).sum(-1, keepdims=True)
    wide_scaled = wide.copy()
    wide_scaled[1] *= 0.98  # T_q = 3 < T_k = 5: rows are rows
    assert _row_scaled(_slice(wide_scaled, ref=wide, allowed=wide > 0))
    tiny = REF.copy()
    tiny[5] = 0.0
    tiny[5, 0] = 1e-4  # a reference weight of at most 1e-3 is not compared
    ref = REF.copy()
    ref[5] = 0.0
    ref[5, 0] = 1e-3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a row with nothing to compare warns no one)
        assert not _row_scaled(_slice(tiny, ref=ref))


def test_what_the_main_probe_explains_of_a_further_probes_finding():
    """_explained: the same fault; an unnamed finding of a stage the main probe found at;
    for S, M and A: values from other rows or through Aᵀ, or an unnamed one beside a value
    (H) fault; nothing else."""
    from causalattn.check.judge import _explained

    f = _bare
    assert _explained(f("M", "no-mask"), [f("S", "no-mask")])
    assert _explained(f("M", None, {"fault": "no-mask"}), [f("A", "no-mask")])
    assert _explained(f("M"), [f("M", "window-off-by-one")])
    assert not _explained(f("M"), [f("S", "missing-scale")])
    assert not _explained(f("O", "output-projection-missing"), [f("A", None, value_rows=[1])])
    for stage in ("S", "M", "A"):
        assert _explained(f(stage, "x"), [f("H", None, value_rows=[1])]), stage
        assert _explained(f(stage, "x"), [f("H", None, transposed=True)]), stage
        assert not _explained(f(stage, "x"), [f("H", "y")]), stage
        assert _explained(f(stage), [f("H", "y")]), stage
        assert not _explained(f(stage, "x"), [f("O", "y")]), stage
    assert not _explained(f("M", "x"), [])


def _band(T_q, T_k, lo, hi):
    """T_q×T_k bool: query i (at position i + T_k - T_q) reads keys p - hi .. p - lo."""
    p = np.arange(T_q)[:, None] + T_k - T_q
    d = p - np.arange(T_k)[None, :]
    return (d >= lo) & (d <= hi)


@pytest.mark.parametrize(
    "pattern, T_q, T_k, nopad, real",
    [
        # padding beside a window: the forms keep the window (positions 4, 5 are padding)
        (masks.Pattern(lengths=[4], window=3), 6, 6, _band(6, 6, 0, 2), np.arange(6) < 4),
        # a window of 2: one key narrower is the own key alone
        (masks.Pattern(lengths=[4], window=2), 6, 6, _band(6, 6, 0, 1), np.arange(6) < 4),
        # beside chunks of 3: queries read their own chunk only
        (
            masks.Pattern(lengths=[5], chunk=3),
            6,
            6,
            _band(6, 6, 0, 5) & (np.arange(6)[:, None] // 3 == np.arange(6)[None, :] // 3),
            np.arange(6) < 5,
        ),
        # decoding (3 queries at positions 4..6 of 7 keys), key 2 padding
        (
            masks.Pattern(key_padding_mask=np.array([[1, 1, 0, 1, 1, 1, 1]], bool)),
            3,
            7,
            _band(3, 7, 0, 6),
            np.array([1, 1, 0, 1, 1, 1, 1], bool),
        ),
    ],
)
def test_each_form_of_m_on_a_padded_probe(pattern, T_q, T_k, nopad, real):
    """_forms: each catalogued fault's read pattern, written here from its definition
    (``nopad``: the pattern without its padding; ``real``: the keys that are not padding)."""
    from causalattn.check.judge import _forms

    E = pattern.allowed(1, 1, T_q, T_k)[0, 0]
    pm = _probe(pattern=pattern, T_q=T_q, T_k=T_k)
    got = {}
    for fid, F in _forms(pm, E, E, 0):
        got.setdefault(fid, []).append(F)
    assert (got.pop("no-mask")[0] == np.ones((T_q, T_k), bool)).all()
    assert (got.pop("padding-ignored")[0] == nopad).all()
    assert got.pop("finite-min-added-twice") == [None]
    assert (got.pop("diagonal-blocked")[0] == E & ~np.eye(T_q, T_k, T_k - T_q, bool)).all()
    if T_q == T_k:  # padding on the queries only: padding query rows read as if not padded
        assert (got.pop("padding-queries-only")[0] == nopad & real[:, None]).all()
        assert (got.pop("anti-causal-mask")[0] == nopad.T).all()
    if pattern.window is not None:
        w, both = pattern.window, real[:, None] & real[None, :]
        narrow, wide = got.pop("window-off-by-one")
        assert (narrow == _band(T_q, T_k, 0, w - 2) & both).all()
        assert (wide == _band(T_q, T_k, 0, w) & both).all()
    if T_q < T_k:  # top-left aligned, and no padded key read: the padded key 2 is not read
        top_left = np.tril(np.ones((T_q, T_k), bool))
        assert (got.pop("causal-top-left")[0] == top_left & real[None, :]).all()
    assert not got, sorted(got)


def test_rows_patched_are_named_one_or_many():
    """Padding ignored (causal + padding expected, plain causal read) with row 1 patched to
    read every key and the padding row 6 to read its own key only: both are patched."""
    pat = masks.Pattern(lengths=[4])
    E = pat.allowed(1, 1, T, T)[0, 0]

    def judged(P):
        ref = _renorm(E.astype(float))
        (f,) = judge([_probe(_slice(_renorm(P.astype(float)), ref=ref, allowed=E), pattern=pat)])
        return f

    P = CAUSAL.copy()
    P[0] = True
    f = judged(P)
    assert f.message.endswith("; every row but row 1 has padding-ignored's form (it is patched)")
    P[5] = False
    P[5, 5] = True
    f = judged(P)
    assert f.fault == "padding-ignored" and f.measurement == {"patched_rows": [0, 5]}
    assert f.message.endswith(
        "; every row but rows 1, 6 has padding-ignored's form (they are patched)"
    )


def test_a_further_finding_is_shown_once():
    """_duplicate: the same fault (named, or by its measurement's "fault"), or two unnamed
    findings of one stage, are one; anything else is another."""
    from causalattn.check.judge import _duplicate

    f = _bare
    assert _duplicate(f("M", "no-mask"), [f("S", "no-mask")])
    assert _duplicate(f("M", None, {"fault": "no-mask"}), [f("A", "no-mask")])
    assert _duplicate(f("M", "no-mask"), [f("A", None, {"fault": "no-mask"})])
    assert _duplicate(f("A"), [f("A")])
    assert not _duplicate(f("A"), [f("M")])
    assert not _duplicate(f("A", "x"), [f("A")])
    assert not _duplicate(f("A"), [f("A", "x")])
    assert not _duplicate(f("A", "x"), [f("A", "y")])
    assert not _duplicate(f("A"), [])


def test_mask_after_softmax_is_worded_whole_and_every_normalization_finding_names_its_slice():
    """Softmax over all keys, then zeroed: row i sums to (i + 1)/6; rows 1..5 fall short."""
    mask_after = np.tril(np.ones((T, T))) / T
    (f,) = judge([_probe(_slice(mask_after, mode="none", full_err=0.0, index=(0, 0)))])
    assert (f.stage, f.fault, f.rows, f.slice) == (
        "A",
        "mask-after-softmax",
        (0, 1, 2, 3, 4),
        (0, 0),
    )
    assert f.message == (
        "A: rows sum to less than 1 (0.1667, 0.3333, 0.5, 0.6667 ...): the weights are softmax "
        "over all keys, then zeroed at blocked keys without renormalizing"
    )
    assert np.allclose(f.measurement["row_sums"], np.arange(1, T + 1) / T)
    neg = REF.copy()
    neg[3, 1], neg[3, 0] = -0.1, neg[3, 0] + 0.1
    off = REF.copy()
    off[2] *= 0.5
    cases = [
        _slice(neg),
        _slice(off, mode="none"),
        _slice(REF * 0.99, mode="none"),
        _slice(CAUSAL / CAUSAL.sum(), mode="all"),
    ]
    for s in cases:
        (g,) = judge([_probe(s)])
        assert g.slice == (0, 0), g
