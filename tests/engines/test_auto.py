"""engine="auto": the native engine on the CPU wherever it is built; without it the stored
table decides between tiled and sdpa; the user's own table and CAUSALATTN_ENGINE override
it; `causalattn bench --tune` writes what auto then reads."""

from __future__ import annotations

import json

import pytest
import torch

import causalattn as ca
from causalattn import engines
from causalattn.engines import auto, cpp, make_problem, pick_engine, registry


def _forget():
    """The choices remembered per call shape and per features."""
    registry._refusal.cache_clear()
    auto._ladder_for.cache_clear()
    engines._PLAIN.clear()


@pytest.fixture()
def without_cpp(monkeypatch):
    """As on a machine without a C++ compiler: the native engine unavailable, named."""
    monkeypatch.setitem(cpp._STATE, "why", "engine 'cpp': no C++ compiler found (test)")
    _forget()
    yield
    monkeypatch.undo()
    _forget()


@pytest.fixture()
def packaged(tmp_path, monkeypatch):
    """No user table (an empty cache directory), no forcing variable: the package's table."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(auto.ENV, raising=False)
    auto.table(reload=True)
    yield auto.table()
    auto.table(reload=True)
    _forget()


def _problem(entry):
    """A CPU problem with the entry's features (B = H = 1: only d, T, kind and pass count)."""
    d, T, kind = entry["d"], entry["T"], entry["kind"]
    dt = getattr(torch, entry["dtype"])
    T_q = 1 if kind == "decode" else T
    grad = entry["pass"] == "fwd+bwd"
    q = torch.empty(1, 1, T_q, d, dtype=dt).requires_grad_(grad)
    k = torch.empty(1, 1, T, d, dtype=dt)
    kw = {}
    if kind == "padded":
        kw["lengths"] = [T // 2]
    if kind == "packed":
        kw["cu_seqlens"] = [0, T // 3, T]
    return make_problem(q, k, k, **kw)


def test_the_package_ships_a_measured_table_with_provenance(packaged):
    assert packaged["source"].endswith("auto_table.json")
    prov = packaged["provenance"]
    assert prov["command"] == "causalattn bench --tune" and prov["torch"] and prov["date"]
    kinds = {(e["kind"], e["pass"]) for e in packaged["entries"]}
    assert {("causal", "fwd"), ("causal", "fwd+bwd"), ("padded", "fwd"), ("decode", "fwd")} <= kinds
    for e in packaged["entries"]:  # the winner by the median of the paired ratios
        assert e["best"] == ("tiled" if e["tiled_over_sdpa_speed"] >= 1 else "sdpa")
        assert set(e["ms"]) == {"tiled", "sdpa"} and e["reps"] >= 3


def test_auto_on_cpu_runs_the_native_engine_wherever_it_is_built(packaged):
    assert not cpp.unavailable()
    for e in packaged["entries"]:
        with torch.enable_grad():
            assert pick_engine(_problem(e)) == "cpp", e
            assert pick_engine(_problem(e), return_lse=True) == "cpp", e


def test_a_tiny_backward_runs_on_sdpa_and_a_larger_one_on_cpp(packaged):
    """Up to SDPA_GRAD_T keys a call with a backward costs less on SDPA (cpp's autograd
    wiring is the larger fixed cost); without a backward, or past it, the native engine."""
    assert not cpp.unavailable()
    T = auto.SDPA_GRAD_T
    for T_k, grad, lse, want in (
        (8, True, False, "sdpa"),
        (T, True, False, "sdpa"),
        (T + 1, True, False, "cpp"),
        (8, False, False, "cpp"),
        (8, True, True, "cpp"),  # SDPA returns no lse
    ):
        q = torch.zeros(1, 2, T_k, 16).requires_grad_(grad)
        with torch.enable_grad():
            assert pick_engine(make_problem(q, q, q), return_lse=lse) == want, (T_k, grad, lse)


def test_without_the_native_engine_auto_agrees_with_the_stored_table(packaged, without_cpp):
    for e in packaged["entries"]:
        with torch.enable_grad():
            assert pick_engine(_problem(e)) == e["best"], e


def test_return_lse_never_picks_an_engine_without_it(packaged):
    for e in packaged["entries"]:
        assert pick_engine(_problem(e), return_lse=True) != "sdpa"


def test_the_user_table_and_the_variable_override(tmp_path, monkeypatch, without_cpp):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(auto.ENV, raising=False)
    path = auto.user_table_path()
    assert path == tmp_path / "causalattn" / "auto_table.json"
    path.parent.mkdir(parents=True)
    entry = {
        "device": "cpu",
        "dtype": "float32",
        "kind": "causal",
        "d": 8,
        "T": 16,
        "pass": "fwd",
        "best": "sdpa",
        "ms": {"tiled": 2.0, "sdpa": 1.0},
    }
    path.write_text(json.dumps({"provenance": {}, "entries": [entry]}))
    try:
        auto.table(reload=True)
        q = torch.randn(1, 2, 16, 8)
        assert pick_engine(make_problem(q, q, q)) == "sdpa"
        monkeypatch.setenv(auto.ENV, "reference")
        assert pick_engine(make_problem(q, q, q)) == "reference"
        out = ca.attention(q, q, q)  # runs what the variable names
        torch.testing.assert_close(out, ca.attention(q, q, q, engine="reference"), rtol=0, atol=0)
    finally:  # the user's cache folder back first: the reload must not keep this table
        monkeypatch.undo()
        auto.table(reload=True)


def test_tune_writes_the_table_auto_then_reads(tmp_path, monkeypatch):
    from causalattn.bench import tune

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(auto.ENV, raising=False)
    monkeypatch.setattr(tune, "cases", lambda: [tune.TuneCase("float32", "causal", 1, 2, 32, 8)])
    try:
        path, table = tune.tune(budget_s=0.05)
        assert path == auto.user_table_path() and path.exists()
        assert auto.table()["source"] == str(path)
        (e,) = [x for x in table["entries"] if x["pass"] == "fwd"]
        assert e["best"] in e["ms"] and ("cpp" in e["ms"]) == (not cpp.unavailable())
        q = torch.randn(1, 2, 32, 8)
        assert pick_engine(make_problem(q, q, q)) == e["best"]  # a table that timed cpp
    finally:  # the user's cache folder back first: the reload must not keep this table
        monkeypatch.undo()
        auto.table(reload=True)
