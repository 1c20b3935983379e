"""diagnose: every catalogued fault, planted by hand in tests/faulty, is named; clean code is
clean."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from causalattn import diagnose
from causalattn.check import CATALOGUE
from causalattn.cli import app

sys.path.insert(0, str(Path(__file__).parents[1]))
from faulty import more_faults, numpy_qkv, torch_qkv, xweights  # noqa: E402

FAULTY = Path(__file__).parents[1] / "faulty"

# catalogue id -> the hand-written implementation that plants it
PLANTED = {
    "k-not-transposed": numpy_qkv.k_not_transposed,
    "missing-scale": torch_qkv.missing_scale,
    "scale-by-dk": numpy_qkv.scale_by_dk,
    "diagonal-blocked": numpy_qkv.diagonal_blocked,
    "no-mask": torch_qkv.no_mask,
    "anti-causal-mask": numpy_qkv.anti_causal_mask,
    "padding-ignored": numpy_qkv.padding_ignored,
    "padding-queries-only": numpy_qkv.padding_queries_only,
    "finite-min-added-twice": torch_qkv.finite_min_added_twice,
    "softmax-query-axis": torch_qkv.softmax_query_axis,
    "softmax-all-entries": numpy_qkv.softmax_all_entries,
    "mask-after-softmax": torch_qkv.mask_after_softmax,
    "unstable-softmax": torch_qkv.unstable_softmax,
    "nan-on-empty-rows": numpy_qkv.nan_on_empty_rows,
    "output-projection-missing": xweights.output_projection_missing,
    "output-projection-transposed": xweights.output_projection_transposed,
    "causal-top-left": more_faults.causal_top_left,
    "window-off-by-one": more_faults.window_off_by_one,
    "finite-fill-too-weak": more_faults.finite_fill_too_weak,
    "some-heads-only": more_faults.some_heads_only,
    "scale-by-sqrt-dv": more_faults.scale_by_sqrt_dv,
    "scale-by-sqrt-dmodel": more_faults.ScaleByModelWidth(),
    "softmax-fp16-accumulation": more_faults.softmax_fp16_accumulation,
}
DECLARED = {"window-off-by-one": {"window": 3}}  # what the planted code is meant to compute


def test_every_catalogue_fault_is_planted():
    assert set(PLANTED) == {f.id for f in CATALOGUE}


@pytest.mark.parametrize("fault", list(PLANTED))
def test_planted_fault_is_named(fault):
    d = diagnose(PLANTED[fault], **DECLARED.get(fault, {}))
    assert d.status == "fault" and d.fault == fault, str(d)
    stage = next(f.stage for f in CATALOGUE if f.id == fault)
    assert d.stage == stage or (stage == "heads" and d.stage in ("S", "M", "A")), str(d)
    assert fault in d.message
    json.dumps(d.to_dict())


@pytest.mark.parametrize(
    "fn",
    [numpy_qkv.correct, torch_qkv.correct, xweights.correct, xweights.CausalSelfAttention()],
    ids=["numpy", "torch", "x-weights", "module"],
)
def test_correct_implementations_are_clean(fn):
    d = diagnose(fn)
    assert d.ok and d.fault is None and "matches the reference" in d.message, str(d)


def test_two_faults_name_the_earliest():
    d = diagnose(numpy_qkv.missing_scale_and_query_axis)
    assert d.fault == "missing-scale" and d.stage == "S", str(d)
    assert d.also == ["softmax-query-axis"]


def test_module_and_whitebox_location():
    d = diagnose(xweights.QueryAxisAttention(), signature="module")
    assert d.fault == "softmax-query-axis"
    assert d.details["whitebox"]["softmax over the key axis"] is False
    src = (FAULTY / "torch_qkv.py").read_text().splitlines()
    for fault, marker in [
        ("softmax-query-axis", "fault: over the query axis"),
        ("mask-after-softmax", "fault: zeroed after the softmax"),
        ("missing-scale", "fault: no / sqrt(d_k)"),
    ]:
        line = next(i + 1 for i, s in enumerate(src) if marker in s)
        d = diagnose(PLANTED[fault])
        # relative to the current directory, as documented
        assert d.location == f"{os.path.relpath(FAULTY / 'torch_qkv.py')}:{line}", (fault, str(d))
    # NumPy code is recorded too (an ndarray subclass sees every ufunc and np.where)
    src = (FAULTY / "numpy_qkv.py").read_text().splitlines()
    for fault, marker in [
        ("scale-by-dk", "fault: / d_k"),
        ("softmax-all-entries", "fault: one distribution over T×T"),
    ]:
        line = next(i + 1 for i, s in enumerate(src) if marker in s)
        d = diagnose(PLANTED[fault])
        assert d.location == f"{os.path.relpath(FAULTY / 'numpy_qkv.py')}:{line}", (fault, str(d))
    assert diagnose(PLANTED["softmax-all-entries"]).details["whitebox"]["normalized over axis"] == (
        -2,
        -1,
    )


def test_bad_signature():
    with pytest.raises(ValueError, match="is not a signature diagnose takes"):
        diagnose(lambda a, b: a)
    with pytest.raises(ValueError, match="signature must be"):
        diagnose(numpy_qkv.correct, signature="qk")


def test_cli_runs_the_file_in_a_subprocess(tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["diagnose", f"{FAULTY / 'torch_qkv.py'}:softmax_query_axis", "--json"])
    assert r.exit_code == 1, r.output
    d = json.loads(r.stdout)
    assert d["fault"] == "softmax-query-axis" and d["stage"] == "A"
    src = (FAULTY / "torch_qkv.py").read_text().splitlines()
    line = next(i + 1 for i, s in enumerate(src) if "fault: over the query axis" in s)
    assert d["location"].endswith(f"torch_qkv.py:{line}")


def test_unknown_fault():
    d = diagnose(lambda q, k, v: 2 * numpy_qkv.correct(q, k, v))
    assert d.status == "unknown" and d.fault is None and d.stage == "H", str(d)
    # torch: the recorded softmax weights go through the audit, which locates the stage
    d = diagnose(torch_qkv.half_scale)
    assert d.status == "unknown" and d.stage == "S" and "0.5774" in d.message, str(d)


def test_hang_and_crash_are_reported(tmp_path):
    d = diagnose(f"{FAULTY / 'numpy_qkv.py'}:hangs", timeout=5)
    assert d.status == "timeout" and "did not finish" in d.message
    crash = tmp_path / "crash.py"
    crash.write_text("import os\nos._exit(3)\n")
    d = diagnose(f"{crash}:attention", timeout=60)
    assert d.status == "crashed" and "exit code 3" in d.message
    r = CliRunner().invoke(app, ["diagnose", "no_colon_here"])
    assert r.exit_code == 2 and "Traceback" not in r.output


@pytest.mark.parametrize(
    "fn,declared",
    [
        (more_faults.window_off_by_one, 3),  # reads w + 1 keys
        (more_faults.window_one_too_narrow, 3),  # reads w - 1 keys
        (more_faults.window_one_too_narrow, 1),  # reads 2 keys where w = 1 allows 1
    ],
)
def test_a_window_one_key_off_either_way_is_window_off_by_one(fn, declared):
    d = diagnose(fn, window=declared)
    assert d.status == "fault" and d.fault == "window-off-by-one", str(d)
    assert d.stage == "M", str(d)


def test_a_window_two_keys_off_is_not_called_off_by_one():
    d = diagnose(more_faults.window_one_too_narrow, window=4)  # reads 2 where 4 are declared
    assert not d.ok and d.fault is None and d.stage == "M", str(d)
    assert "do not read keys they may" in d.message, str(d)
