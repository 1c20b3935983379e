"""audit: no false verdicts (empty rows only where the pattern says; padding only when
unambiguous; the stage of a mask fault is M), the declared pattern, hints from the catalogue."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

import causalattn as ca
from causalattn import masks
from causalattn.check import CATALOGUE, AuditInputError, audit
from causalattn.cli import app

T = 6


@pytest.fixture(scope="module")
def tr():
    rng = np.random.default_rng(3)
    X = rng.normal(size=(T, 4))
    return ca.trace(X, *(rng.normal(size=(4, 3)) for _ in range(3)))


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
    A = ca.reference.softmax_last(np.where(al, S, 0.0), al)
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
