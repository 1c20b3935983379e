"""diagnose names every finding: two faults give two findings, the main probe's first;
patched rows do not hide a catalogued fault; wrong values are placed at H and lost precision
at A; the CLI prints and --json carries every finding; learn grades on the same findings."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from causalattn import diagnose
from causalattn.check import Diagnosis
from causalattn.cli import app
from causalattn.learn import grade

sys.path.insert(0, str(Path(__file__).parents[1]))
from faulty import two_faults  # noqa: E402

FAULTY = Path(__file__).parents[1] / "faulty"
SOL = Path(__file__).parents[1] / "learn_solutions"
_SEEN: dict = {}


def _diagnosed(name: str) -> Diagnosis:
    """diagnose(two_faults.<name>) once per test process (in a worker, as by default)."""
    if name not in _SEEN:
        _SEEN[name] = diagnose(getattr(two_faults, name), **two_faults.DECLARED.get(name, {}))
    return _SEEN[name]


@pytest.mark.parametrize("name", list(two_faults.FINDINGS))
def test_every_fault_is_a_finding_main_probe_first(name):
    d = _diagnosed(name)
    want = two_faults.FINDINGS[name]
    assert [(f.stage, f.fault) for f in d.findings] == want, str(d)
    first = d.findings[0]
    assert (d.stage, d.fault) == want[0] and d.message == first.text
    assert d.status == ("fault" if first.fault else "unknown")
    assert d.also == [fid for _, fid in want[1:] if fid and fid != d.fault]
    mains = [f.probe == "main probe" for f in d.findings]
    assert mains == sorted(mains, reverse=True), "the main probe's findings come first"
    back = Diagnosis.from_dict(json.loads(json.dumps(d.to_dict())))
    assert back.findings == d.findings and back.also == d.also


def test_the_lesser_fault_does_not_hide_the_one_every_square_call_shows():
    d = _diagnosed("mask_after_softmax_tril")
    masked, top_left = d.findings
    assert masked.probe == "main probe" and "rows sum to less than 1" in masked.message
    assert len(masked.measurement["row_sums"]) == 6 and min(masked.measurement["row_sums"]) < 1
    assert top_left.probe.startswith("decoding") and "rows 1..3" in top_left.message


def test_an_overflow_is_not_lost_behind_a_mask_fault():
    d = _diagnosed("unstable_tril")
    assert d.fault == "causal-top-left" and d.also == ["unstable-softmax"]
    overflow = d.findings[1]
    assert overflow.probe == "large-score probe" and "NaN or inf" in overflow.message


@pytest.mark.parametrize(
    "name", ["diagonal_blocked_row_one_patched", "diagonal_blocked_row_one_uniform"]
)
def test_a_patched_first_row_still_names_the_fault(name):
    d = _diagnosed(name)
    assert d.fault == "diagonal-blocked" and d.stage == "M", str(d)
    f = d.findings[0]
    assert f.measurement["patched_rows"] == [0] and set(f.rows) - {0} == {1, 2, 3, 4, 5}
    assert "every row but row 1 has diagonal-blocked's form (it is patched)" in d.message
    assert "rows 2..6 do not read their own key" in d.message


def test_patched_rows_with_no_readable_key_still_name_the_fault():
    d = _diagnosed("no_mask_padding_rows_zeroed")
    assert d.fault == "no-mask" and d.findings[0].measurement["patched_rows"] == [4, 5], str(d)
    assert "every row but rows 5..6 has no-mask's form (they are patched)" in d.message


@pytest.mark.parametrize(
    "name, rows",
    [("values_from_the_previous_row", [5, 0, 1, 2, 3, 4]), ("values_reversed", [5, 4, 3, 2, 1, 0])],
)
def test_values_from_the_wrong_rows_are_placed_at_H(name, rows):
    d = _diagnosed(name)
    assert d.stage == "H" and d.status == "unknown" and len(d.findings) == 1, str(d)
    assert d.findings[0].measurement["value_rows"] == rows
    assert "the weights are right" in d.message and "wrong rows" in d.message


@pytest.mark.parametrize(
    "name, bits", [("weights_rounded_to_bf16", 8), ("weights_rounded_to_fp16", 11)]
)
def test_lost_precision_is_placed_at_A_with_its_error_and_dtype(name, bits):
    d = _diagnosed(name)
    assert d.stage == "A" and len(d.findings) == 1, str(d)
    m = d.findings[0].measurement
    assert m["dtype"] == "float64" and m["err"] > m["tol"] and abs(m["bits"] - bits) < 1.5, m
    assert "in float64" in d.message and "precision is lost" in d.message
    assert abs(m["scale"] * np.sqrt(3) - 1) < 5e-3  # the shape is right: the scale fits


def test_cli_prints_every_finding_one_line_each_and_json_carries_them():
    target = f"{FAULTY / 'two_faults.py'}:unstable_tril"
    r = CliRunner().invoke(app, ["diagnose", target], env={"COLUMNS": "60"})
    assert r.exit_code == 1, r.output
    lines = r.output.splitlines()
    assert lines[0] == "diagnose: fault causal-top-left (stage M)"
    assert lines[1].startswith("  causal-top-left: M: rows 1..3") and lines[1].endswith("3×7)")
    also = [s for s in lines if s.startswith("  also, ")]
    assert len(also) == 1 and also[0].startswith("  also, A: unstable-softmax: A: at scores")
    r = CliRunner().invoke(app, ["diagnose", target, "--json"])
    d = json.loads(r.stdout)
    assert d["positions"] == "1-based" and [f["fault"] for f in d["findings"]] == [
        "causal-top-left",
        "unstable-softmax",
    ]
    assert d["findings"][0]["rows"] == [1, 2, 3] and d["also"] == ["unstable-softmax"]


def test_learn_grades_on_the_same_findings(tmp_path):
    src = (SOL / "attention_numpy.py").read_text()
    planted = tmp_path / "attention.py"
    planted.write_text(
        src.replace("S = q @ k.T / np.sqrt(d_k)", "S = q @ k.T").replace(
            "np.exp(Z - Z.max(axis=-1, keepdims=True))", "np.exp(Z)"
        )
    )
    g = grade.grade_file(planted)
    assert g.fault == "missing-scale" and g.stage == "S" and g.hint == grade.HINTS["missing-scale"]
    assert [(a["stage"], a["fault"]) for a in g.also] == [("A", "unstable-softmax")], str(g)
    assert g.also[0]["hint"] == grade.HINTS["unstable-softmax"]
    assert "also wrong, stage A: unstable-softmax: A: at scores" in str(g)
    assert grade.Grade.from_dict(json.loads(json.dumps(g.to_dict()))).also == g.also
