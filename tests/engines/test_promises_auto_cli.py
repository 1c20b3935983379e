"""What engine="auto" and the CLI's --help promise, each pinned by the behaviour that would
break: the tiny-backward rule (SDPA below SDPA_GRAD_T keys) only for the call kinds it
names; without the native engine the table's nearest measurement decides at long T; --help
lists the commands in the documented order."""

from __future__ import annotations

import math

import pytest
import torch

from causalattn import engines
from causalattn.engines import auto, cpp, make_problem, pick_engine, registry

HAS_CPP = not cpp.unavailable()


def _forget():
    registry._refusal.cache_clear()
    auto._ladder_for.cache_clear()
    engines._PLAIN.clear()


@pytest.fixture()
def packaged(tmp_path, monkeypatch):
    """The package's table: no user table, no forcing variable."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(auto.ENV, raising=False)
    auto.table(reload=True)
    _forget()
    yield auto.table()
    auto.table(reload=True)
    _forget()


@pytest.fixture()
def without_cpp(monkeypatch):
    monkeypatch.setitem(cpp._STATE, "why", "engine 'cpp': no C++ compiler found (test)")
    _forget()
    yield
    monkeypatch.undo()
    _forget()


def _pick(T_q, T_k, grad=True, d=16, dtype=torch.float32, **kw):
    q = torch.zeros(1, 2, T_q, d, dtype=dtype).requires_grad_(grad)
    k = torch.zeros(1, 2, T_k, d, dtype=dtype)
    with torch.enable_grad():
        return pick_engine(make_problem(q, k, k, **kw))


@pytest.mark.skipif(not HAS_CPP, reason="the native engine is not built here")
def test_the_tiny_backward_rule_applies_only_to_the_kinds_it_names(packaged):
    T = auto.SDPA_GRAD_T
    # the kinds it names: plain causal, no mask at all, decoding
    assert _pick(8, 8) == "sdpa"
    assert _pick(T, T, causal=False) == "sdpa"
    assert _pick(4, T) == "sdpa"
    # the same tiny backward with anything else: the native engine
    others = {
        "window": {"window": 4},
        "chunk": {"chunk": 4},
        "alibi": {"alibi_slopes": torch.tensor([0.5, 0.25])},
        "lengths": {"lengths": [5]},
        "key padding": {"key_padding_mask": torch.tensor([[True] * 6 + [False] * 2])},
        "softcap": {"softcap": 20.0},
        "dense mask": {"mask": torch.ones(8, 8, dtype=torch.bool).tril()},
    }
    for name, kw in others.items():
        assert _pick(8, 8, **kw) == "cpp", name
    # and without a backward the rule never applies
    assert _pick(8, 8, grad=False) == "cpp"


def _nearest(entries, dtype, kind, pass_, d, T):
    """By hand from the table: the entry of this dtype, kind and pass whose head size, then
    length, is nearest on a log scale."""
    sel = [e for e in entries if (e["dtype"], e["kind"], e["pass"]) == (dtype, kind, pass_)]
    dd = min(abs(math.log2(e["d"] / d)) for e in sel)
    sel = [e for e in sel if abs(math.log2(e["d"] / d)) == dd]
    return min(sel, key=lambda e: abs(math.log2(e["T"] / T)))


@pytest.mark.parametrize("T", [12_000, 12_288, 16_384])
@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "fwd+bwd"])
def test_without_cpp_the_choice_at_long_T_is_the_tables(packaged, without_cpp, T, grad):
    entries = [e for e in packaged["entries"] if e.get("device", "cpu") == "cpu"]
    for d, dtype in ((64, torch.float32), (128, torch.float32), (64, torch.bfloat16)):
        name = str(dtype).replace("torch.", "")
        e = _nearest(entries, name, "causal", "fwd+bwd" if grad else "fwd", d, T)
        assert _pick(T, T, grad=grad, d=d, dtype=dtype) == e["best"], (d, name, e)


def test_the_table_decides_differently_on_either_side_of_long_T(packaged, without_cpp):
    """The packaged table at d = 64, fwd+bwd: SDPA measured best at T = 4096, tiled at
    32768; the boundary is their geometric middle (about 11585): the test above is not
    vacuous."""
    by_T = {
        e["T"]: e["best"]
        for e in packaged["entries"]
        if (e["dtype"], e["kind"], e["pass"], e["d"]) == ("float32", "causal", "fwd+bwd", 64)
    }
    assert by_T[4096] != by_T[32768]
    assert _pick(11_000, 11_000, d=64) == by_T[4096]
    assert _pick(12_000, 12_000, d=64) == by_T[32768]


# ---- the CLI ----------------------------------------------------------------------------------
# the documented order (cli/__init__: `demo`, the main job, first)
ORDER = [
    "demo",
    "shapes",
    "masks",
    "trace",
    "audit",
    "diagnose",
    "learn",
    "heads",
    "explore",
    "bench",
    "build",
]


def test_help_lists_the_commands_in_the_documented_order():
    import re

    from typer.testing import CliRunner

    from causalattn.cli import app

    r = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "120", "NO_COLOR": "1"})
    assert r.exit_code == 0, r.output
    listed = [
        m.group(1)
        for line in r.output.split("Commands")[1].splitlines()
        if (m := re.match(r"^│? {1,2}([a-z]+) {2,}\S", line))  # a name, then its help
    ]
    assert listed == ORDER, r.output
