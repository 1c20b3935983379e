"""engine="auto": the native engine on the CPU wherever it is built; without it the stored
table decides between tiled and sdpa; the user's own table and CAUSALATTN_ENGINE override
it; `causalattn bench --tune` writes what auto then reads."""

from __future__ import annotations

import json
import re

import pytest
import torch

import causalattn as ca
from causalattn import engines
from causalattn.engines import auto, cpp, make_problem, pick_engine, registry


def _forget():
    """The choices remembered per call shape and per features."""
    registry._refusal.cache_clear()
    auto._ladder_for.cache_clear()
    auto._cached_scalar_refusal.cache_clear()
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


def test_a_table_that_timed_cpp_picks_the_faster_engine_per_shape(tmp_path, monkeypatch):
    """Where this machine's table (`causalattn bench tune`) timed cpp slower than SDPA (as a
    loaded 2-core machine times (1, 4, 256, 64) forward), auto runs SDPA there, and cpp where
    the table timed cpp the faster; `bench shape`'s auto row names the same engine."""
    if cpp.unavailable():
        pytest.skip(cpp.unavailable())
    from causalattn.bench import shape as shape_bench

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(auto.ENV, raising=False)
    path = auto.user_table_path()
    path.parent.mkdir(parents=True)

    def entry(T, ms):
        best = min(ms, key=ms.get)
        return {"device": "cpu", "dtype": "float32", "kind": "causal", "d": 64, "T": T,
                "pass": "fwd", "best": best, "ms": ms}  # fmt: skip

    entries = [
        entry(256, {"cpp": 44.0, "tiled": 120.0, "sdpa": 18.3}),
        entry(1024, {"cpp": 3.0, "tiled": 9.0, "sdpa": 5.0}),
    ]
    path.write_text(json.dumps({"provenance": {}, "entries": entries}))
    try:
        auto.table(reload=True)
        _forget()
        for T, want in ((256, "sdpa"), (1024, "cpp")):
            q = torch.randn(1, 4, T, 64)
            assert pick_engine(make_problem(q, q, q)) == want, T
            assert shape_bench.auto_pick(q, q, q, grad=False) == want, T
    finally:  # the user's cache folder back first: the reload must not keep this table
        monkeypatch.undo()
        auto.table(reload=True)
        _forget()


def _entry(d=8, T=16, best="sdpa", **kw):
    """One measurement of a hand-written table (no timings: only the winner is read)."""
    return {"dtype": "float32", "kind": "causal", "d": d, "T": T, "pass": "fwd", "best": best,
            **kw}  # fmt: skip


@pytest.fixture()
def user_table(tmp_path, monkeypatch):
    """write(document): this machine's table is the given JSON document (no forcing
    variable), read anew; the package's table back afterwards."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(auto.ENV, raising=False)
    path = auto.user_table_path()
    path.parent.mkdir(parents=True)

    def write(document):
        path.write_text(json.dumps(document))
        auto.table(reload=True)
        _forget()
        return path

    yield write
    monkeypatch.undo()
    auto.table(reload=True)
    _forget()


def _pick(T_q, T_k, d=8, dtype=torch.float32, grad=False, **kw):
    q = torch.zeros(1, 2, T_q, d, dtype=dtype).requires_grad_(grad)
    k = torch.zeros(1, 2, T_k, d, dtype=dtype)
    with torch.enable_grad():
        return pick_engine(make_problem(q, k, k, **kw))


@pytest.mark.parametrize("document", [{"entries": {"a": 1}}, {"provenance": {}}, [1, 2], "x"])
def test_a_user_table_without_a_list_of_entries_leaves_the_packages(user_table, document):
    path = user_table(document)
    assert auto.table()["source"] == str(auto.PACKAGED) != str(path)
    assert auto.table()["entries"] == json.loads(auto.PACKAGED.read_text())["entries"]


def test_the_table_is_read_once_and_again_only_on_reload(user_table):
    """A table written (or removed) later changes nothing until table(reload=True)."""
    path = user_table({"entries": [_entry()]})
    assert auto.table()["source"] == str(path)
    path.unlink()
    assert auto.table()["source"] == str(path)  # still the one read
    assert auto.table(reload=True)["source"] == str(auto.PACKAGED)


def test_with_no_readable_table_at_all_auto_runs_tiled(user_table, without_cpp, monkeypatch):
    monkeypatch.setattr(auto, "PACKAGED", auto.PACKAGED.with_name("missing.json"))
    user_table("not a table")
    assert auto.table()["entries"] == []
    assert _pick(16, 16) == "tiled"


def test_a_head_size_of_one_reads_the_entries_measured_at_one(user_table, without_cpp):
    user_table({"entries": [_entry(d=1, best="sdpa"), _entry(d=4, best="tiled")]})
    assert _pick(16, 16, d=1) == "sdpa"
    assert _pick(16, 16, d=4) == "tiled"


def test_entries_without_a_device_are_cpu_ones_and_cuda_ones_are_left_out(user_table, without_cpp):
    """(d = 8) a CPU measurement at T = 16 (no "device": CPU) names sdpa; a CUDA one at
    T = 1024 names tiled: on the CPU at T = 1024 the CPU one still decides."""
    user_table({"entries": [_entry(T=16), _entry(T=1024, best="tiled", device="cuda")]})
    assert _pick(1024, 1024) == "sdpa"


def test_an_unmeasured_dtype_reads_the_float32_entries(user_table, without_cpp):
    user_table({"entries": [_entry(best="sdpa")]})
    assert _pick(16, 16, dtype=torch.float64) == "sdpa"


def test_a_call_without_a_mask_reads_the_causal_entries_and_no_other_kind_does(
    user_table, without_cpp
):
    """Only causal entries, naming sdpa: a call without a mask (kind "full") reads them; a
    decoding step (kind "decode") has none of its kind and runs tiled."""
    user_table({"entries": [_entry(best="sdpa")]})
    assert _pick(16, 16, causal=False) == "sdpa"
    assert _pick(1, 16) == "tiled"


def test_a_table_without_timings_leaves_cpp_the_choice(user_table):
    """Entries naming only their winner (no "ms"): nothing measured cpp, so it runs."""
    if cpp.unavailable():
        pytest.skip(cpp.unavailable())
    user_table({"entries": [_entry(best="sdpa")]})
    assert _pick(16, 16) == "cpp"


def test_the_variable_set_to_auto_is_as_if_unset(packaged, monkeypatch):
    want = _pick(16, 16)
    monkeypatch.setenv(auto.ENV, "auto")
    _forget()
    assert _pick(16, 16) == want != "auto"


def test_the_variable_forces_its_engine_at_every_length(packaged, monkeypatch):
    monkeypatch.setenv(auto.ENV, "reference")
    for T in (1, 200, 5000):
        assert _pick(T, T) == "reference", T


def test_while_tracing_the_tiny_backward_step_is_left_out(packaged, monkeypatch):
    """A bound at SDPA_GRAD_T would guard T_k in the traced graph: traced, a tiny backward
    runs the native engine, as a long one does."""
    if cpp.unavailable():
        pytest.skip(cpp.unavailable())
    assert _pick(8, 8, grad=True) == "sdpa"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert _pick(8, 8, grad=True) == "cpp"


def test_hint_gives_a_sizes_int_or_its_hint():
    """An int as it is; a symbolic size: its example value (its hint), 1024 with none."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    assert auto.hint(7) == 7
    env = ShapeEnv()
    backed = env.create_symintnode(env.create_symbol(37, ConstantSource("T")), hint=37)
    assert type(backed) is torch.SymInt and auto.hint(backed) == 37
    assert auto.hint(env.create_unbacked_symint()) == 1024


@pytest.mark.parametrize("shortcut", [True, False], ids=["plain call", "with a softcap"])
def test_bad_scalar_keywords_are_refused_by_name_and_good_ones_run(shortcut):
    """Each of causal, window, chunk (and softcap) refused with the value it was given,
    also an unhashable one; the same keywords with good values run."""
    _forget()
    q = torch.randn(1, 2, 6, 8)
    extra = {} if shortcut else {"softcap": 30.0}
    for kw, words in (
        ({"causal": "yes"}, "causal must be True or False, got 'yes'"),
        ({"window": 0}, "window must be >= 1, got 0"),
        ({"window": [2]}, "window must be a positive integer, got [2]"),
        ({"chunk": 0}, "chunk must be >= 1, got 0"),
        ({"chunk": 2.5}, "chunk must be a positive integer, got 2.5"),
    ):
        with pytest.raises(ValueError, match=re.escape(words)):
            ca.attention(q, q, q, **kw, **extra)
    if not shortcut:
        with pytest.raises(ValueError, match=re.escape("softcap must be finite and > 0, got -1.0")):
            ca.attention(q, q, q, softcap=-1.0)
    for kw in ({"causal": False}, {"causal": True, "window": 3}, {"chunk": 4}, {}):
        out = ca.attention(q, q, q, **kw, **extra)
        want = ca.attention(q, q, q, engine="reference", **kw, **extra)
        torch.testing.assert_close(out, want)


def test_scalar_refusal_is_the_patterns_own_message_or_empty():
    """What the checks before any engine runs read: "" for good values, else Pattern's
    message naming the keyword and its value (an unhashable value too)."""
    _forget()
    assert auto.scalar_refusal(True, None, None, None) == ""
    assert auto.scalar_refusal(False, 3, 4, 30.0) == ""
    for args, words in (
        (("yes", None, None, None), "causal must be True or False, got 'yes'"),
        ((True, 0, None, None), "window must be >= 1, got 0"),
        ((True, [2], None, None), "window must be a positive integer, got [2]"),
        ((True, None, 0, None), "chunk must be >= 1, got 0"),
        ((True, None, None, -1.0), "softcap must be finite and > 0, got -1.0"),
    ):
        assert words in auto.scalar_refusal(*args), args
