"""diagnose measures: uncatalogued mutations get the right stage and pattern; no false
verdicts; declared patterns; the CLI's grid and --json; the README's table of faults."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from causalattn import diagnose, masks
from causalattn.check import CATALOGUE, Diagnosis
from causalattn.check.faults import table_markdown
from causalattn.cli import app
from causalattn.reference import softmax_last

sys.path.insert(0, str(Path(__file__).parent))
from faulty import more_faults, mutations, numpy_qkv  # noqa: E402

FAULTY = Path(__file__).parent / "faulty"
ROOT = Path(__file__).parent.parent


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


def test_readme_fault_table_is_the_catalogue():
    readme = (ROOT / "README.md").read_text()
    assert table_markdown() in readme
    ids = re.findall(r"^\| `([a-z0-9-]+)` \|", readme, re.M)
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
    assert STAGES == ("S", "M", "A", "H", "O")
    keys = [Finding(s, None, "").key() for s in ("S", "M", "A", "H", "O", "heads")]
    assert keys == [0, 1, 2, 3, 4, 5]
    f = Finding("A", "x", "m")
    assert (f.slice, f.probe) == ((), "")
