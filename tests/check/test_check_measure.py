"""diagnose measures: uncatalogued mutations get the right stage and pattern; no false
verdicts; declared patterns; the CLI's grid and --json; the docs' table of faults."""

from __future__ import annotations

import json
import re
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from causalattn import diagnose, masks
from causalattn.check import CATALOGUE, Diagnosis
from causalattn.check.faults import table_markdown
from causalattn.cli import app
from causalattn.matrix_form import softmax_last

sys.path.insert(0, str(Path(__file__).parents[1]))
from faulty import more_faults, mutations, numpy_qkv  # noqa: E402

FAULTY = Path(__file__).parents[1] / "faulty"
ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize("name", sorted(mutations.STAGE))
def test_uncatalogued_mutation_stage_and_pattern(name):
    d = diagnose(getattr(mutations, name), **mutations.DECLARED.get(name, {}))
    assert d.status in ("fault", "unknown") and not d.ok, str(d)
    assert d.stage == mutations.STAGE[name], str(d)
    want = mutations.TRUE_PATTERN[name](6)
    assert d.pattern is not None and d.pattern.shape == want.shape, str(d)
    assert (d.pattern == want).all(), (d.pattern.astype(int), want.astype(int))
    assert d.d_k == 3 and d.expected is not None


def test_at_least_ten_mutations():
    assert len(mutations.STAGE) >= 10


def test_measured_message_names_the_rows():
    d = diagnose(mutations.patched_first_row)
    assert d.stage == "M" and "rows 2..6 do not read their own key (row 1 does)" in d.message
    assert abs(d.scale - 1 / np.sqrt(3)) < 1e-6


def _nan(q, k, v):
    return np.full(q.shape[:-1] + v.shape[-1:], np.nan)


def _plus(q, k, v):
    return numpy_qkv.correct(q, k, v) + 1e-3


def _times(q, k, v):
    return numpy_qkv.correct(q, k, v) * 1.001


def test_no_false_verdicts():
    d = diagnose(_nan)
    assert d.status == "unknown" and d.fault is None and d.stage == "A", str(d)
    assert "NaN" in d.message and "together" not in d.message
    for fn in (_plus, _times):
        d = diagnose(fn)
        assert not d.ok and d.stage == "H", str(d)
    d = diagnose(_times)
    assert "1.001" in d.message


def _torch_helper(q, k, v):
    import torch

    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    T_q, T_k = s.shape[-2:]
    s = s.masked_fill(~torch.ones(T_q, T_k, dtype=torch.bool).tril(T_k - T_q), float("-inf"))
    return torch.softmax(s, -1) @ v


def torch_via_helper(q, k, v):
    return _torch_helper(q, k, v)  # names no torch: the framework is found by trying


def test_torch_code_behind_a_helper_is_called_with_tensors():
    d = diagnose(torch_via_helper)
    assert d.ok, str(d)
    assert d.details["framework"] in ("numpy", "torch")


def _declared_fn(**kw):
    def fn(q, k, v):
        q4, k4, v4 = (
            np.asarray(a, np.float64).reshape((1,) * (4 - a.ndim) + a.shape) for a in (q, k, v)
        )
        pat = masks.Pattern(**kw)
        R = pat.allowed(1, q4.shape[1], q4.shape[2], k4.shape[2])
        S = pat.modify_scores(q4 @ np.swapaxes(k4, -1, -2) / np.sqrt(q4.shape[-1]))
        R = np.broadcast_to(R, S.shape)
        if pat.sinks is not None:
            sink = np.broadcast_to(np.asarray(pat.sinks)[None, :, None, None], S.shape[:3] + (1,))
            has = R.any(-1, keepdims=True)
            A = softmax_last(
                np.concatenate([np.where(R, S, 0), sink], -1), np.concatenate([R, has], -1)
            )[..., :-1]
        else:
            A = softmax_last(np.where(R, S, 0), R)
        return (A @ v4).reshape(q.shape[:-1] + (v.shape[-1],))

    return fn


@pytest.mark.parametrize(
    "kw",
    [
        {"window": 3},
        {"chunk": 2},
        {"softcap": 5.0},
        {"alibi_slopes": [0.5]},
        {"sinks": [0.3]},
        {"causal": False},
    ],
    ids=str,
)
def test_declared_patterns(kw):
    fn = _declared_fn(**kw)
    d = diagnose(fn, isolate=False, **kw)
    assert d.ok, str(d)
    if "window" in kw or "chunk" in kw or "causal" in kw:  # plain causal was not what it does
        d = diagnose(fn, isolate=False)
        assert d.stage == "M" and not d.ok, str(d)


def test_diagnosis_fields_and_status_enum():
    d = diagnose(more_faults.window_off_by_one, window=3)
    assert d.status == "fault" and str(d.status) == "fault"
    assert d.pattern.dtype == bool and d.pattern.shape == (6, 6)
    assert (d.expected == masks.Pattern(window=3).allowed(1, 1, 6, 6)[0, 0]).all()
    back = Diagnosis.from_dict(json.loads(json.dumps(d.to_dict())))
    assert (back.pattern == d.pattern).all() and back.status == d.status and back.d_k == d.d_k


def test_timeout_values_are_refused():
    for bad in (float("inf"), 0, -5, float("nan")):
        with pytest.raises(ValueError, match="timeout"):
            diagnose(numpy_qkv.correct, timeout=bad)
    for bad in ("inf", "0", "-5", "nan"):
        r = CliRunner().invoke(
            app, ["diagnose", f"{FAULTY / 'numpy_qkv.py'}:correct", "--timeout", bad]
        )
        assert r.exit_code == 2 and r.output.count("error:") == 1, r.output
        assert "timeout" in r.output and "Traceback" not in r.output


def test_isolate_false_runs_here():
    calls = []

    def fn(q, k, v):
        calls.append(1)
        return numpy_qkv.correct(q, k, v)

    assert diagnose(fn, isolate=False).ok and calls
    calls.clear()
    assert diagnose(fn).ok and not calls  # by default a worker process ran it


CLI_CASES = [
    ("more_faults.py:window_off_by_one", ["--window", "3"], "M"),
    ("more_faults.py:finite_fill_too_weak", [], "M"),
    ("more_faults.py:scale_by_sqrt_dv", [], "S"),
    ("more_faults.py:some_heads_only", [], "M"),
    ("mutations.py:patched_first_row", [], "M"),
    ("mutations.py:epsilon_in_denominator", [], "A"),
    ("mutations.py:temperature", [], "S"),
]


@pytest.mark.parametrize("target, opts, stage", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_prints_the_stage(target, opts, stage):
    r = CliRunner().invoke(app, ["diagnose", str(FAULTY / target), *opts, "--json"])
    assert r.exit_code == 1, r.output
    d = json.loads(r.stdout)
    assert d["stage"] == stage, d["message"]
    assert {"pattern", "expected", "scale", "d_k"} <= set(d)


def test_cli_grid_when_patterns_differ():
    r = CliRunner().invoke(app, ["diagnose", f"{FAULTY / 'mutations.py'}:reads_next_token"])
    assert r.exit_code == 1
    assert "measured" in r.output and "expected" in r.output
    assert "# # . . . .   # . . . . .   <-" in r.output, r.output


def test_docs_fault_table_is_the_catalogue():
    page = (ROOT / "docs" / "guides" / "audit-diagnose.md").read_text()
    assert table_markdown() in page
    ids = re.findall(r"^\| `([a-z0-9-]+)` \|", page, re.M)
    assert ids == [f.id for f in CATALOGUE]


def test_declared_padding_is_passed_to_code_that_takes_it():
    kpm = np.array([[True] * 6, [False, False] + [True] * 4])  # left padding in row 2
    assert diagnose(numpy_qkv.correct, key_padding_mask=kpm).ok
    d = diagnose(numpy_qkv.padding_ignored, key_padding_mask=kpm)
    assert d.fault == "padding-ignored" and d.stage == "M", str(d)


# ---- measure's pieces on their own -------------------------------------------------------
def test_spans_fold_runs_of_consecutive_numbers_in_the_order_given():
    from causalattn.check.words import spans

    assert spans([]) == [] and spans([4]) == ["4"]
    assert spans([2, 3, 4, 7]) == ["2..4", "7"]
    assert spans([1, 3, 5]) == ["1", "3", "5"] and spans([5, 6, 1, 2]) == ["5..6", "1..2"]
    assert spans(np.array([0, 1]), dash="–") == ["0–1"] and spans([7, 7]) == ["7", "7"]


def test_rows_and_keys_are_said_1_based_and_folded():
    from causalattn.check.words import keys_text as _keys_text
    from causalattn.check.words import rows_text

    assert rows_text([]) == "no rows" and rows_text([0]) == "row 1"
    assert rows_text([1, 2, 3, 7]) == "rows 2..4, 8" and rows_text(np.array([0, 2])) == "rows 1, 3"
    assert rows_text(range(0, 20, 2)) == "rows 1, 3, 5, 7, 9, 11 ..."  # six parts shown
    assert rows_text([0, 2, 4, 6, 8, 10]) == "rows 1, 3, 5, 7, 9, 11"
    assert _keys_text([0]) == "key 1" and _keys_text([1, 2]) == "keys 2, 3"
    assert _keys_text(range(8)) == "keys 1, 2, 3, 4, 5, 6 ..."
    assert _keys_text(range(6)) == "keys 1, 2, 3, 4, 5, 6"


def test_describe_difference_names_own_keys_extra_and_missing_reads():
    from causalattn.check.words import describe_difference

    E = masks.causal(4)
    assert describe_difference(E, E, 4, 4) == ""
    P = E & ~np.eye(4, dtype=bool)
    assert describe_difference(P, E, 4, 4) == "rows 1..4 do not read their own key"
    P = E.copy()
    P[2, 2] = False
    assert describe_difference(P, E, 4, 4) == "row 3 does not read its own key (rows 1..2, 4 do)"
    P = E.copy()
    P[1, 1] = P[3, 3] = False
    assert describe_difference(P, E, 4, 4) == "rows 2, 4 do not read their own key (rows 1, 3 do)"
    P = E | np.triu(np.ones((4, 4), bool), 1)
    assert (
        describe_difference(P, E, 4, 4) == "rows 1..3 read future keys (row 1 reads keys 2, 3, 4)"
    )
    P = E.copy()
    P[3, 1] = False
    assert describe_difference(P, E, 4, 4) == "row 4 does not read keys it may (row 4 skips key 2)"
    P[2, 0] = False
    assert (
        describe_difference(P, E, 4, 4) == "rows 3..4 do not read keys they may (row 3 skips key 1)"
    )
    W = masks.Pattern(window=2).allowed(1, 1, 4, 4)[0, 0]
    P = E.copy()  # reads past the window, never the future
    assert describe_difference(P, W, 4, 4) == "rows 3..4 read keys they may not (row 3 reads key 1)"
    P = E.copy()
    P[0, 1], P[2, 2] = True, False
    assert describe_difference(P, E, 4, 4) == (
        "row 3 does not read its own key (rows 1..2, 4 do); row 1 reads future keys (row 1 reads "
        "key 2)"
    )
    # decoding, T_q < T_k: each query's own key is i + T_k - T_q
    E2 = masks.causal(2, 5)
    P2 = E2.copy()
    P2[0, 3] = False
    assert describe_difference(P2, E2, 2, 5) == "row 1 does not read its own key (row 2 does)"
    P2 = E2.copy()
    P2[0, 4] = True
    assert describe_difference(P2, E2, 2, 5) == "row 1 reads future keys (row 1 reads key 5)"


def test_read_pattern_and_tolerance():
    from causalattn.check.measure import read_pattern, tolerance
    from causalattn.check.report import STAGES, Finding

    A = np.array([[0.0, 1e-9, -0.2, np.nan, 0.5]])
    assert read_pattern(A).tolist() == [[False, True, True, True, True]]
    assert read_pattern(A, noise=1e-6).tolist() == [[False, False, True, True, True]]
    assert read_pattern(A, noise=0.2).tolist() == [[False, False, False, True, True]]
    ref, plain = np.array([0.5, 0.25]), np.array([0.5, 0.2501])
    eps32 = float(np.finfo(np.float32).eps)
    assert tolerance(ref, plain, np.float32) == pytest.approx(2e-4 + 8 * eps32)
    assert tolerance(ref * 10, plain * 10, np.float64) == pytest.approx(2e-3 + 8 * 2.2e-16 * 5)
    assert tolerance(ref, ref, np.int64) == pytest.approx(8 * 2.2e-16)
    assert tolerance(ref * 10, ref * 10, np.float32) == 8 * eps32 * 5.0  # the floor · |ref|
    assert STAGES == ("S", "M", "A", "H", "O")
    keys = [Finding(s, None, "").key() for s in ("S", "M", "A", "H", "O", "heads")]
    assert keys == [0, 1, 2, 3, 4, 5]
    f = Finding("A", "x", "m")
    assert (f.slice, f.probe) == ((), "")


# ---- measure's functions, each against a hand computation ----------------------------------
def _probe(T_q=4, T_k=4, d_k=3, B=1, H=1, dtype=np.float64, seed=0, **pat):
    from causalattn.check.probes import Probe

    rng = np.random.default_rng(seed)
    Q, K = rng.normal(size=(B, H, T_q, d_k)), rng.normal(size=(B, H, T_k, d_k))
    return Probe("p", Q, K, np.dtype(dtype), masks.Pattern(**pat), kind="main")


def _softmax_rows(Z, E):
    """Rows of softmax(Z) over E by hand (a row with no key: zeros)."""
    out = np.zeros(Z.shape)
    for idx in np.ndindex(Z.shape[:-1]):
        z, e = Z[idx], E[idx]
        if e.any():
            w = np.exp(z[e] - z[e].max())
            out[idx][e] = w / w.sum()
    return out


def test_work_dtype_is_the_lower_of_the_inputs_and_the_output():
    from causalattn.check.measure import _work_dtype

    p64, p32 = _probe(), _probe(dtype=np.float32)
    assert _work_dtype(p64, None) == np.float64 and _work_dtype(p32, None) == np.float32
    assert _work_dtype(p64, np.dtype(np.int64)) == np.float64  # not a float: the inputs'
    assert _work_dtype(p64, np.dtype(np.float32)) == np.float32
    assert _work_dtype(p64, np.dtype(np.float16)) == np.float16
    assert _work_dtype(p32, np.dtype(np.float16)) == np.float16
    assert _work_dtype(p32, np.dtype(np.float64)) == np.float32  # more digits out: the inputs'
    assert _work_dtype(p32, np.dtype(np.float32)) == np.float32


def test_noise_is_a_thousand_eps_of_the_largest_finite_weight():
    from causalattn.check.measure import _noise

    eps = float(np.finfo(np.float32).eps)
    A = np.array([[0.5, np.nan, -3.0, np.inf]])
    assert _noise(A, np.dtype(np.float32), "qkv") == 0.0
    assert _noise(A, np.dtype(np.float32), "x-weights") == pytest.approx(1e3 * eps * 3.0)
    assert _noise(A * 0.1, np.dtype(np.float32), "module") == pytest.approx(1e3 * eps)
    assert _noise(np.full((2, 2), np.nan), np.dtype(np.float16), "module") == pytest.approx(
        1e3 * float(np.finfo(np.float16).eps)
    )


def test_normalization_rows_cols_all_none_at_the_tolerance():
    from causalattn.check.measure import normalization

    E = masks.causal(2)
    ref = np.array([[1.0, 0.0], [0.5, 0.5]])
    assert normalization(ref, ref, E, 0.0) == "rows"
    A = np.array([[1.5, 0.0], [0.5, 0.5]])  # row 1 off by exactly 0.5
    assert normalization(A, ref, E, 0.5) == "rows" and normalization(A, ref, E, 0.25) != "rows"
    cols = np.array([[0.5, 0.0], [0.5, 1.0]])  # each column sums to 1, rows do not
    assert normalization(cols, ref, E, 0.0) == "cols"
    assert normalization(cols + [[0, 0], [0, 0.25]], ref, E, 0.25) == "cols"
    allsum = np.array([[0.25, 0.0], [0.25, 0.5]])  # only the whole sums to 1
    assert normalization(allsum, ref, E, 0.0) == "all"
    big = np.array([[0.25, 0.0], [1.0, 0.25]])  # sums to 1.5; rows, columns off by 0.75
    assert normalization(big, ref, E, 0.5) == "all"
    assert normalization(big, ref, E, 0.25) == "none"
    # non-finite entries count as 0; rows with no key are not compared
    assert normalization(np.array([[np.nan, 0], [0.5, 0.5]]), ref, E, 0.0) != "rows"
    E2 = np.array([[False, False], [True, True]])
    assert normalization(np.array([[3.0, 0], [0.5, 0.5]]), ref, E2, 0.0) == "rows"
    assert normalization(np.zeros((2, 2)), ref, np.zeros((2, 2), bool), 0.0) == "rows"
    # only the columns some row reads are compared
    E3 = np.array([[True, False], [True, False]])
    assert normalization(np.array([[0.5, 0], [0.5, 0]]), ref, E3, 0.0) == "cols"


def test_centered_subtracts_each_groups_mean_over_the_used_entries():
    from causalattn.check.measure import _centered

    X = np.array([[1.0, 2.0, 6.0], [4.0, 8.0, 0.0]])
    use = np.array([[True, True, False], [True, True, True]])
    assert _centered(X, use, "rows").tolist() == [[-0.5, 0.5, 0.0], [0.0, 4.0, -4.0]]
    assert _centered(X, use, "cols").tolist() == [[-1.5, -3.0, 0.0], [1.5, 3.0, 0.0]]
    mean = (1 + 2 + 4 + 8 + 0) / 5
    want = np.where(use, X - mean, 0.0)
    np.testing.assert_allclose(_centered(X, use, "all"), want, rtol=0, atol=1e-15)
    X4, use4 = X[None, None], use[None, None]  # (1, 1, T_q, T_k), as fit_scale passes it
    np.testing.assert_allclose(_centered(X4, use4, "all"), want[None, None], rtol=0, atol=1e-15)
    none = np.zeros((2, 3), bool)
    assert _centered(X, none, "rows").tolist() == [[0.0] * 3] * 2  # no entry: no 0/0


@pytest.mark.parametrize("mode", ["rows", "cols", "all"])
def test_fit_scale_recovers_c_in_each_mode(mode):
    from causalattn.check.measure import _centered, fit_scale

    p = _probe(5, 5, 3, seed=1, causal=False)
    G = p.G()
    c = 0.37
    use = np.ones(G.shape, bool)
    use[..., 0, 1] = False
    logA = c * G + (np.arange(5)[:, None] if mode == "rows" else 0.0)
    if mode == "cols":
        logA = c * G + np.arange(5)[None, :]
    fit = fit_scale(p, np.exp(logA), use, mode)
    assert fit[0] == pytest.approx(c, rel=1e-12) and fit[1] < 1e-12
    # a misfit shows as the largest centered residual
    bump = np.zeros(G.shape)
    bump[..., 2, 3] = 0.1
    got_c, misfit = fit_scale(p, np.exp(logA + bump), use, mode)
    L = _centered(np.log(np.exp(logA + bump)), use, mode)
    Gc = _centered(G, use, mode)
    want_c = float((L * Gc).sum() / (Gc * Gc).sum())
    assert got_c == pytest.approx(want_c, rel=1e-12)
    assert misfit == pytest.approx(float(np.abs(L - want_c * Gc).max()), rel=1e-12)


def test_fit_scale_needs_three_finite_entries_and_a_spread():
    from causalattn.check.measure import fit_scale

    p = _probe(2, 2, 3, seed=2, causal=False)
    A = np.full((1, 1, 2, 2), 0.5)
    two = np.zeros((1, 1, 2, 2), bool)
    two[..., 0, :] = True
    assert fit_scale(p, A, two, "rows") is None  # 2 entries
    three = np.ones((1, 1, 2, 2), bool)
    three[..., 1, 1] = False
    assert fit_scale(p, A, three, "all") is not None
    zero = A.copy()
    zero[..., 0, 0] = 0.0  # log 0 = -inf is dropped: 2 left
    assert fit_scale(p, zero, three, "all") is None
    flat = _probe(2, 2, 3, seed=2, causal=False)
    flat.K[...] = flat.K[..., :1, :]  # every key alike: no spread of Q Kᵀ in a row
    assert fit_scale(flat, A, np.ones((1, 1, 2, 2), bool), "rows") is None
    # a given G replaces Q Kᵀ
    G = np.array([[[[1.0, 2.0], [3.0, 5.0]]]])
    c, mis = fit_scale(p, np.exp(0.5 * G), np.ones((1, 1, 2, 2), bool), "all", G=G)
    assert c == pytest.approx(0.5, rel=1e-12) and mis < 1e-12


def test_fit_scale_takes_alibi_and_softcap_out():
    from causalattn.check.measure import fit_scale

    p = _probe(6, 6, 3, seed=3, alibi_slopes=[0.7])
    E = p.allowed()
    c = 0.4
    logA = p.pattern.modify_scores(p.G() * c)  # c·G - 0.7·|i - j|
    use = E & np.ones(E.shape, bool)
    fit = fit_scale(p, np.where(E, np.exp(logA), 0.0), use, "rows")
    assert fit[0] == pytest.approx(c, rel=1e-10) and fit[1] < 1e-10
    s = _probe(6, 6, 3, seed=3, softcap=2.0)
    logA = s.pattern.modify_scores(s.G() * 1.3)  # 2·tanh(1.3·G / 2): not linear in G
    fit = fit_scale(s, np.where(E, np.exp(logA), 0.0), use, "rows")
    assert fit[0] == pytest.approx(1.3, rel=1e-6) and fit[1] < 1e-6
    lo = fit_scale(s, np.where(E, np.exp(s.pattern.modify_scores(s.G() * 2e-4)), 0.0), use, "rows")
    assert lo[0] == pytest.approx(2e-4, rel=1e-3)  # the grid's low end, bracketed by its first
    hi = fit_scale(s, np.where(E, np.exp(s.pattern.modify_scores(s.G() * 90.0)), 0.0), use, "rows")
    assert hi[0] == pytest.approx(90.0, rel=1e-3)
    # the search's ends, 1e-4 and 100, are found (a cap that keeps c·Q Kᵀ/cap near 0.3)
    for c, cap in ((1e-4, 1e-3), (100.0, 1e3)):
        e = _probe(6, 6, 3, seed=3, softcap=cap)
        A = np.where(E, np.exp(e.pattern.modify_scores(e.G() * c)), 0.0)
        assert fit_scale(e, A, use, "rows")[0] == pytest.approx(c, rel=1e-9)
    # zeros and negative weights among the used ones are dropped quietly (log 0, log -x)
    Z = np.where(E, np.exp(s.pattern.modify_scores(s.G() * 1.3)), 0.0)
    Z[0, 0, 5, 0], Z[0, 0, 5, 1] = 0.0, -0.25
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit = fit_scale(s, Z, use, "rows")
    assert fit[0] == pytest.approx(1.3, rel=1e-6)


def test_expected_weights_with_and_without_sinks():
    from causalattn.check.measure import expected_weights

    p = _probe(4, 4, 3, B=2, H=2, seed=4, lengths=[4, 2])
    E = p.allowed()
    want = _softmax_rows(p.G() * 0.5, E)
    np.testing.assert_allclose(expected_weights(p, 0.5), want, rtol=0, atol=1e-15)
    full = np.ones(E.shape, bool)
    np.testing.assert_allclose(
        expected_weights(p, 0.5, full), _softmax_rows(p.G() * 0.5, full), rtol=0, atol=1e-15
    )
    s = _probe(4, 4, 3, B=2, H=2, seed=4, lengths=[4, 2], sinks=[0.3, -1.0])
    got = expected_weights(s, 0.5)
    Z = s.G() * 0.5
    for b, h, i in np.ndindex(2, 2, 4):
        e = E[b, h, i]
        if not e.any():  # no key: no weight, the sink takes none either
            assert (got[b, h, i] == 0).all()
            continue
        z = np.append(Z[b, h, i][e], [0.3, -1.0][h])
        w = np.exp(z - z.max())
        np.testing.assert_allclose(got[b, h, i][e], (w / w.sum())[:-1], rtol=1e-14, atol=0)
        assert (got[b, h, i][~e] == 0).all()


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_plain_weights_is_torch_softmax_in_the_dtype_then_numpy_without_torch(dtype, monkeypatch):
    import torch

    from causalattn.check.measure import plain_weights

    p = _probe(4, 4, 3, B=2, seed=5, lengths=[4, 1], sinks=[0.25])
    E = p.allowed()
    Z = np.where(E, p.G() * 0.6, -np.inf)
    Zs = np.concatenate([Z, np.full(Z.shape[:3] + (1,), 0.25)], -1)
    tdt = {np.float16: torch.float16, np.float32: torch.float32}.get(dtype, torch.float64)
    want = torch.softmax(torch.from_numpy(Zs).to(tdt), -1).double().numpy()[..., :4]
    got = plain_weights(p, 0.6, dtype)
    assert np.array_equal(got, np.where(E.any(-1, keepdims=True), want, 0.0))
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    Zt = Zs.astype(dtype)
    with np.errstate(invalid="ignore"):
        ex = np.exp(Zt - Zt.max(-1, keepdims=True))
        want = (ex / ex.sum(-1, keepdims=True)).astype(np.float64)[..., :4]
    got = plain_weights(p, 0.6, dtype)
    assert got.dtype == np.float64
    assert np.array_equal(got, np.where(E.any(-1, keepdims=True), np.nan_to_num(want), 0.0))
    empty = _probe(3, 3, 2, B=2, seed=6, lengths=[3, 0])  # no key, no sink: 0 / 0, quietly
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = plain_weights(empty, 1.0, dtype)
    assert not got[1].any() and np.isfinite(got).all()
    q = _probe(3, 3, 2, seed=6)  # no sinks: nothing appended
    Zq = np.where(q.allowed(), q.G(), -np.inf).astype(dtype)
    ex = np.exp(Zq - Zq.max(-1, keepdims=True))
    assert np.array_equal(plain_weights(q, 1.0, dtype), (ex / ex.sum(-1, keepdims=True)))


def test_plain_fp16_row_sums_in_torch_and_in_numpy(monkeypatch):
    import torch

    from causalattn.check.measure import plain_fp16_row_sums

    Z = np.random.default_rng(7).normal(size=(24, 500)) * 4
    Z[1, 100:] = -np.inf
    Z[2] += 60.0  # rows far apart: each is shifted by its own maximum, never overflows
    Z[3] -= 60.0
    want = torch.softmax(torch.from_numpy(Z).half(), -1).float().sum(-1).double().numpy()
    got = plain_fp16_row_sums(Z)
    assert got.dtype == np.float64 and np.array_equal(got, want)
    assert np.abs(got - 1).max() > 1e-5  # fp16 rounding shows in long rows
    monkeypatch.setitem(sys.modules, "torch", None)
    Z32 = Z.astype(np.float16).astype(np.float32)
    e = np.exp(Z32 - Z32.max(-1, keepdims=True))
    A = (e / e.sum(-1, keepdims=True)).astype(np.float16)
    np_got = plain_fp16_row_sums(Z)
    assert np_got.dtype == np.float64
    assert np.array_equal(np_got, A.astype(np.float32).sum(-1).astype(np.float64))


def test_row_sums_reads_the_last_four_rows():
    from causalattn.check.measure import _row_sums, plain_fp16_row_sums

    p = _probe(7, 7, 3, seed=8, window=3)
    ones = np.arange(7.0)[None, None, :, None] + 0.5
    r = _row_sums(p, ones, 0.5)
    assert r.sums.tolist() == [3.5, 4.5, 5.5, 6.5] and r.keys == 3
    E = p.allowed()[0, 0, 3:]
    plain = plain_fp16_row_sums(np.where(E, (p.Q[0, 0, 3:] @ p.K[0, 0].T) * 0.5, -np.inf))
    err = float(np.abs(plain - 1).max())
    assert r.plain_err == err and r.tol == 2 * err + 8 * float(np.finfo(np.float16).eps)
    short = _probe(3, 3, 3, seed=8)
    r = _row_sums(short, np.arange(3.0)[None, None, :, None], 0.5)
    assert r.sums.tolist() == [0.0, 1.0, 2.0] and r.keys == 3


def test_linearity_compares_h_with_the_measured_a_v():
    from causalattn.check.measure import _linearity, tolerance

    p = _probe(3, 3, 2, seed=9)
    V = np.random.default_rng(9).normal(size=(1, 1, 3, 2))
    p.values["random"] = V
    A = np.array([[[[1.0, 0, 0], [0.5, 0.5, 0], [0.2, 0.3, 0.5]]]])
    H = A @ V
    t = np.dtype(np.float32)
    plain = (A.astype(t) @ V.astype(t)).astype(np.float64)
    tol = tolerance(H, plain, t) + 1e-4 * 3 * float(np.abs(V).max())
    lin = _linearity(p, A, {"random": H + 0.25, "zero": np.full((1, 1, 3, 2), -0.5)}, t, 1e-4)
    assert lin.err == pytest.approx(0.25, abs=1e-15) and lin.zero == 0.5
    assert lin.tol == pytest.approx(tol, rel=1e-12)
    bad = H.copy()
    bad[0, 0, 1, 0] = np.nan
    assert _linearity(p, A, {"random": bad, "zero": np.zeros((1, 1, 0, 2))}, t, 0).err == np.inf
    allbad = np.full(H.shape, np.inf)
    lin = _linearity(p, A, {"random": allbad, "zero": np.zeros((1, 1, 0, 2))}, t, 0)
    assert lin.err == np.inf and lin.zero == 0.0
    with warnings.catch_warnings():  # nothing read is finite: inf, and no NumPy warning
        warnings.simplefilter("error")
        nan = np.full(H.shape, np.nan)
        assert _linearity(p, A, {"random": nan, "zero": np.zeros((1, 1, 0, 2))}, t, 0).err == np.inf


def test_width_compares_the_weights_read_back_with_d_v_doubled():
    from causalattn.check.measure import _width, expected_weights, fit_scale, read_pattern

    p = _probe(4, 4, 3, seed=10)
    A = expected_weights(p, 0.5)
    wide = np.concatenate([A + 0.125, np.zeros(A.shape)], -1)
    t = np.dtype(np.float32)
    w = _width(p, A, wide, t, 0.01)
    assert w.diff == pytest.approx(0.125) and w.d_v == 4
    assert w.tol == pytest.approx(1e3 * float(np.finfo(t).eps) + 0.01)
    A2 = A + 0.125
    use = read_pattern(A2) & p.allowed() & (A2 > 1e-3 * A2.max())
    assert w.fit == fit_scale(p, A2, use, "rows")
    # the keys read: above 1e-3 of the largest weight (0.5 here), the boundary left out
    A2 = expected_weights(p, 0.5) * 0.5
    assert A2.max() == 0.5
    A2[0, 0, 3, 0], A2[0, 0, 3, 1] = 1e-3, 5e-4  # off the fit's line; 5e-4 = 1e-3·0.5
    use = read_pattern(A2) & p.allowed() & (A2 > 1e-3 * A2.max())
    assert use[0, 0, 3, 0] and not use[0, 0, 3, 1]
    w = _width(p, A, np.concatenate([A2, np.zeros(A.shape)], -1), t, 0.0)
    assert w.fit == fit_scale(p, A2, use, "rows")
    assert w.fit != fit_scale(p, A2, use | (A2 == 5e-4), "rows")
    assert w.fit != fit_scale(p, A2, use & (A2 != 1e-3), "rows")
    wide[0, 0, 2, 1] = np.nan
    w = _width(p, A, wide, t, 0.0)
    assert w.diff == np.inf and w.fit is None
    w = _width(p, A, np.concatenate([A, A], -1), t, 0.0)
    assert w.diff == 0.0 and w.fit[0] == pytest.approx(0.5, rel=1e-9)
    Ainf = A.copy()
    Ainf[0, 0, 1, 0] = np.inf  # inf read back twice: inf - inf, and no NumPy warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w = _width(p, Ainf, np.concatenate([Ainf, A], -1), t, 0.0)
    assert w.diff == np.inf and w.fit is None


def test_projection_against_h_w_o_h_and_h_w_o_transposed():
    from dataclasses import replace

    from causalattn.check.measure import Projection, _projection, tolerance
    from causalattn.check.observe import Run
    from causalattn.matrix_form import merge_heads, split_heads

    rng = np.random.default_rng(11)
    p = _probe(3, 3, 2, H=2, seed=11)
    x = rng.normal(size=(1, 3, 4)).astype(np.float32)  # the probe's inputs are in its dtype
    w_v = rng.normal(size=(4, 4)).astype(np.float32)
    w_o = (rng.normal(size=(4, 4)) * 3).astype(np.float32)
    p = replace(p, inputs={"x": x}, projection=(w_v, w_o))
    A = np.broadcast_to(np.array([[1.0, 0, 0], [0.5, 0.5, 0], [0.2, 0.3, 0.5]]), (1, 2, 3, 3))
    Vh = split_heads(x.astype(np.float64) @ w_v.astype(np.float64), 2)
    Hm = merge_heads(A @ Vh)
    t = np.dtype(np.float32)
    plain = (merge_heads(A.astype(t) @ Vh.astype(t)) @ w_o.astype(t)).astype(np.float64)
    ref = Hm @ w_o.astype(np.float64)
    assert np.abs(plain - ref).max() > 1e-8 and np.abs(ref).max() > 2  # float32 shows
    pr = _projection(p, A, Run(p, O=ref + 0.5), t, 0.001)
    assert pr.err == float(np.abs(ref + 0.5 - ref).max()) and pr.error is None
    assert pr.err_missing == float(np.abs(ref + 0.5 - Hm).max())
    assert pr.err_transposed == float(np.abs(ref + 0.5 - Hm @ w_o.T.astype(np.float64)).max())
    assert pr.tol == tolerance(ref, plain, t) + 0.001 * float(np.abs(ref).max())
    assert pr.shape == (3, 4) and pr.expected_shape == (3, 4)
    assert _projection(p, A, Run(p, O=Hm @ w_o.T), t, 0).err_transposed == pytest.approx(
        0, abs=1e-5
    )
    w_o5 = rng.normal(size=(4, 5)).astype(np.float32)
    wide = replace(p, projection=(w_v, w_o5))
    O = np.zeros((1, 3, 5))
    pr = _projection(wide, A, Run(wide, O=O), t, 0)
    assert pr.err_transposed is None and pr.err_missing is None  # (3, 5) is not H's (3, 4)
    assert pr.err == float(np.abs(Hm @ w_o5.astype(np.float64)).max())
    assert pr.shape == (3, 5) and pr.expected_shape == (3, 5)
    pr = _projection(wide, A, Run(wide, O=np.zeros((1, 2, 5))), t, 0)
    assert pr.err is None and pr.shape == (2, 5) and pr.expected_shape == (3, 5)
    assert _projection(p, A, Run(p, O_error="boom"), t, 0) == Projection(error="boom")


def test_value_map_only_for_a_square_invertible_reference():
    from causalattn.check.measure import _value_map

    ref = np.array([[1.0, 0, 0], [0.5, 0.5, 0], [0.2, 0.3, 0.5]])
    E = ref > 0
    P = np.eye(3)[[0, 2, 1]]  # the values of keys 2 and 3 swapped
    R, mis = _value_map(ref, ref @ P, E)
    np.testing.assert_allclose(R, P, atol=1e-12) and mis < 1e-12
    R, mis = _value_map(ref, ref @ P + [[0, 0.25, 0]] * 3, E)
    assert mis == pytest.approx(float(np.abs(R - np.rint(R)).max())) and mis > 0.2
    assert _value_map(ref[:, :2], ref[:, :2], E[:, :2]) == (None, None)  # not square
    E0 = E.copy()
    E0[1] = False
    assert _value_map(ref, ref, E0) == (None, None)  # a row with no key
    nan = ref.copy()
    nan[2, 2] = np.nan
    assert _value_map(ref, nan, E) == (None, None)
    flat = np.array([[1.0, 0, 0], [1.0, 0, 0], [0.2, 0.3, 0.5]])  # singular
    assert _value_map(flat, flat, E) == (None, None)
    at = np.diag([1.0, 1e-8])  # condition number 1e8 exactly: still solved
    assert np.linalg.cond(at) == 1e8 and _value_map(at, at, at > 0)[0] is not None
    over = np.diag([1.0, 1 / (1e8 + 0.5)])  # just over 1e8: refused
    assert 1e8 < np.linalg.cond(over) < 1e8 + 1 and _value_map(over, over, over > 0) == (None, None)


def test_slice_measure_properties():
    from causalattn.check.measure import SliceMeasure

    E = masks.causal(3)
    E[0] = False  # row 1 reads nothing
    ref = np.array([[0, 0, 0], [0.5, 0.5, 0], [0.2, 0.3, 0.5]])
    A = np.array([[np.nan, 0, 0], [0.5, np.inf, 0], [0.1, 0.3, 0.5]])
    s = SliceMeasure((0, 0), A, ref, E, A != 0)
    assert s.has_key.tolist() == [False, True, True]
    assert s.nonfinite_rows.tolist() == [1] and s.empty_nan_rows.tolist() == [0]
    assert s.sums.tolist() == [0.0, 0.5, 0.9] and s.ref_sums.tolist() == [0.0, 1.0, 1.0]
    assert np.isnan(s.err) or s.err == np.inf  # row 2 holds inf - 0.5
    B = np.array([[7.0, 0, 0], [0.5, 0.25, 0], [0.2, 0.3, 0.5]])
    s = SliceMeasure((0, 0), B, ref, E, B != 0)
    assert s.err == 0.25  # row 1 has no key: its 7 is not compared
    assert s.rel_err == 0.5  # only entries the reference weights above 1e-3
    tiny = SliceMeasure((0, 0), np.full((3, 3), 9.0), np.full((3, 3), 1e-3), E, E)
    assert tiny.rel_err == 0.0
    assert (
        SliceMeasure(
            (0, 0),
            np.zeros((0, 0)),
            np.zeros((0, 0)),
            np.zeros((0, 0), bool),
            np.zeros((0, 0), bool),
        ).err
        == 0.0
    )


def test_fitted_scale_only_when_the_fit_is_tight():
    from causalattn.check.measure import ProbeMeasure, SliceMeasure

    z = np.zeros((2, 2))
    for dtype, eps in (("float64", 2.2e-16), ("float16", float(np.finfo(np.float16).eps))):
        pm = ProbeMeasure("p", "main", 2, 2, 2, 1, 1, dtype, 1.0)
        tight = 2e-3 + 1e3 * float(np.finfo(np.dtype(dtype)).eps)
        at = SliceMeasure((0, 0), z, z, z > 0, z > 0, fit=(0.7, tight))
        over = SliceMeasure((0, 0), z, z, z > 0, z > 0, fit=(0.7, tight * (1 + 1e-9)))
        assert pm.fitted_scale(at) == 0.7 and pm.fitted_scale(over) is None
        assert pm.fitted_scale(SliceMeasure((0, 0), z, z, z > 0, z > 0)) is None
        assert tight > 2e-3 + 900 * eps


def _eye_run(p, A, **kw):
    from causalattn.check.observe import Run

    return Run(p, outputs={"eye": A}, dtype=np.dtype(np.float64), **kw)


def test_measure_of_a_correct_function_on_the_main_probe():
    from causalattn.check.measure import expected_weights, measure

    p = _probe(5, 5, 3, B=2, H=2, seed=12, lengths=[5, 3])
    A = expected_weights(p, 1 / np.sqrt(3))
    pm = measure(_eye_run(p, A), scale=None, sig="qkv")
    assert (pm.probe, pm.kind, pm.T_q, pm.T_k, pm.d_k, pm.B, pm.H) == ("p", "main", 5, 5, 3, 2, 2)
    assert pm.dtype == "float64" and pm.scale0 == 1 / np.sqrt(3) and pm.noise == 0.0
    assert pm.S_max == pytest.approx(float(np.abs(p.G()).max()) / np.sqrt(3), rel=1e-15)
    assert pm.pattern is p.pattern and pm.tol == pytest.approx(8 * 2.2e-16, rel=0.1)
    assert [s.index for s in pm.slices] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert (pm.read == (A != 0)).all() and pm.recorded is None
    for s in pm.slices:
        b, h = s.index
        assert s.mode == "rows" and (s.A == A[b, h]).all() and (s.ref == A[b, h]).all()
        assert (s.allowed == p.allowed()[b, h]).all() and s.fit[0] == pytest.approx(1 / np.sqrt(3))
        assert s.fit_kt is None  # T ≠ d_k
        assert s.full_err == pytest.approx(
            float(
                np.abs(
                    A[b, h]
                    - expected_weights(p.slice(b, h), s.fit[0], np.ones((1, 1, 5, 5), bool))[0, 0]
                    * (A[b, h] != 0)
                ).max()
            ),
            abs=1e-12,
        )
        if b == 0:  # every row reads a key: R = I
            np.testing.assert_allclose(s.value_map, np.eye(5), atol=1e-9)
            assert s.value_misfit < 1e-9
        else:  # rows 4, 5 read nothing
            assert s.value_map is None and s.value_misfit is None
    # the scale given, and weights returned alongside
    pm = measure(_eye_run(p, A * 1.0, weights=A), scale=0.25, sig="x-weights")
    assert pm.scale0 == 0.25 and pm.noise == pytest.approx(1e3 * 2.220446049250313e-16)
    assert len(pm.recorded) == 4 and all((r.A == A[r.index]).all() for r in pm.recorded)
    assert measure(_eye_run(p, A, weights=A[:, :1]), scale=None, sig="qkv").recorded is None


def test_measure_reads_each_optional_output():
    from dataclasses import replace

    from causalattn.check.measure import expected_weights, measure

    p = _probe(3, 3, 3, seed=13)  # T = d_k: Q K is fitted too
    A = expected_weights(p, 0.5)
    V = np.random.default_rng(13).normal(size=(1, 1, 3, 2))
    p = replace(p, values={"eye": np.eye(3), "random": V})
    outs = {
        "eye": A,
        "random": A @ V,
        "zero": np.zeros((1, 1, 3, 2)),
        "wide": np.concatenate([A, np.zeros(A.shape)], -1),
    }
    from causalattn.check.observe import Run

    pm = measure(Run(p, outputs=outs, dtype=np.dtype(np.float64)), scale=0.5, sig="qkv")
    assert pm.linearity.err < 1e-15 and pm.width.diff == 0.0 and pm.projection is None
    assert pm.slices[0].fit_kt is not None and pm.sums is None
    ones = measure(Run(p, outputs={"ones": np.ones((1, 1, 3, 1))}), scale=0.5, sig="qkv")
    assert ones.sums.keys == 3 and ones.slices == () and ones.tol == 0.0
    assert ones.dtype == "float64" and ones.S_max == pytest.approx(float(np.abs(p.G()).max()) / 2)
    empty = _probe(0, 3, 3, seed=13)
    pm = measure(_eye_run(empty, np.zeros((1, 1, 0, 3))), scale=None, sig="qkv")
    assert pm.S_max == 0.0 and pm.tol == 8 * float(np.finfo(np.float64).eps)
    assert [s.mode for s in pm.slices] == ["rows"] and pm.slices[0].fit is None
    f32 = measure(
        Run(p, outputs={"eye": A}, dtype=np.dtype(np.float32)), scale=0.5, sig="x-weights"
    )
    assert f32.dtype == "float32" and f32.noise == pytest.approx(
        1e3 * float(np.finfo(np.float32).eps)
    )


def test_measure_reads_in_the_functions_own_precision():
    """A float32 function: the tolerance, the width's and the projection's bounds are float32's."""
    from dataclasses import replace

    from causalattn.check.measure import (
        _noise,
        _projection,
        _width,
        expected_weights,
        measure,
        plain_weights,
        tolerance,
    )
    from causalattn.check.observe import Run

    rng = np.random.default_rng(14)
    p = _probe(4, 4, 3, seed=14)
    x = rng.normal(size=(1, 4, 3)).astype(np.float32)
    w_v, w_o = (rng.normal(size=(3, 3)).astype(np.float32) for _ in range(2))
    p = replace(p, inputs={"x": x}, projection=(w_v, w_o), dtype=np.dtype(np.float32))
    A = expected_weights(p, 0.5)
    wide = np.concatenate([A, np.zeros(A.shape)], -1)
    run = Run(
        p, outputs={"eye": A, "wide": wide}, dtype=np.dtype(np.float32), O=np.zeros((1, 4, 3))
    )
    pm = measure(run, scale=0.5, sig="x-weights")
    t = np.dtype(np.float32)
    noise = _noise(A, t, "x-weights")
    assert pm.tol == tolerance(A, plain_weights(p, 0.5, t), t) + noise
    assert pm.tol != tolerance(A, plain_weights(p, 0.5, np.float64), np.float64) + noise
    assert pm.width == _width(p, A, wide, t, noise)
    assert pm.projection == _projection(p, A, run, t, noise)
    assert pm.width.tol == 1e3 * float(np.finfo(t).eps) + noise


def test_recorded_weights_are_read_in_float64_with_the_signatures_noise():
    """Weights the function returned (or the recorder saw) are measured as float64 slices,
    with the read-back noise of the calling convention (none for fn(q, k, v))."""
    from causalattn.check.measure import _noise, expected_weights, measure

    p = _probe(4, 4, 3, seed=15)
    A = expected_weights(p, 0.5)
    W = A.astype(np.float32)
    W[0, 0, 3, 1] = 1e-14  # read, but under the read-back noise of pinv(x)·V
    for sig in ("qkv", "x-weights"):
        pm = measure(_eye_run(p, A, weights=W), scale=0.5, sig=sig)
        (rec,) = pm.recorded
        assert rec.A.dtype == np.float64 and np.array_equal(rec.A, W.astype(np.float64)[0, 0])
        assert bool(rec.read[3, 1]) == (sig == "qkv")
    run = _eye_run(p, A, weights=W)
    run.dtype = np.dtype(np.float32)
    pm = measure(run, scale=0.5, sig="x-weights")
    noise = _noise(W.astype(np.float64), np.dtype(np.float32), "x-weights")
    W2 = W.copy()
    W2[0, 0, 3, 1] = noise * 0.5  # under float32's read-back noise, above float64's
    run.weights = W2
    (rec,) = measure(run, scale=0.5, sig="x-weights").recorded
    assert not rec.read[3, 1] and noise > 1e3 * 2.3e-16 * 10


def test_slices_fit_only_the_weights_above_a_thousandth_of_the_largest():
    from causalattn.check.measure import _slices, expected_weights, fit_scale

    p = _probe(5, 5, 3, seed=16)
    A = expected_weights(p, 0.5)
    A[0, 0, 4, 1], A[0, 0, 3, 1] = 1e-5, 1e-3  # off the line: under, at 1e-3 of the top (1.0)
    (s,) = _slices(p, A, A, 0.0, 0.0)
    E = p.allowed()
    use = (A != 0) & E & (np.abs(A) > 1e-3 * np.abs(A).max())
    assert not use[0, 0, 3, 1]
    assert s.fit == fit_scale(p.slice(0, 0), A, use, "rows")
    assert s.fit != fit_scale(p.slice(0, 0), A, (A != 0) & E, "rows")
    B = expected_weights(p, 0.5) * 0.5  # the largest weight 0.5: the bound is 5e-4
    assert np.abs(B).max() == 0.5
    for (i, j), w in zip(((4, 0), (4, 1), (3, 0), (3, 1)), (5e-4, 7e-4, 1.5e-3, 1e-5)):
        B[0, 0, i, j] = w  # each off the line: at the bound, and on either side of 1e-3
    (s,) = _slices(p, B, B, 0.0, 0.0)
    use = (B != 0) & E & (np.abs(B) > 5e-4)
    assert s.fit == fit_scale(p.slice(0, 0), B, use, "rows")
    for other in (use | (B == 5e-4), use & (B != 7e-4), use & (B != 1.5e-3)):
        assert s.fit != fit_scale(p.slice(0, 0), B, other, "rows")
    N = A.copy()
    N[0, 0, 4, 2] = np.nan  # a read NaN: the softmax over all keys is off by inf there
    (s,) = _slices(p, N, A, 0.0, 0.0)
    assert s.fit is not None and s.full_err == np.inf
    nan = np.full(A.shape, np.nan)  # nothing finite: no fit, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (s,) = _slices(p, nan, A, 0.0, 0.0)
        (s2,) = _slices(p, np.where(E, np.inf, 0.0), A, 0.0, 0.0)
    assert s.fit is None and s.full_err is None and s.mode == "none"
    assert s2.fit is None and s2.value_map is None
    big = _probe(5, 5, 3, seed=16)
    big.Q[...] *= 300  # scores of ±1e5: weights that underflow to 0, a singular reference
    R = expected_weights(big, 0.5)
    assert np.linalg.matrix_rank(R[0, 0]) < 5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (s,) = _slices(big, R, R, 0.0, 0.0)
    assert s.value_map is None
