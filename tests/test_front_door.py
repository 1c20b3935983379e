"""One front door: every public entry point takes ``pattern=`` and exactly Pattern's keywords
(same names, order and defaults, from the one list), refuses a keyword given together with
``pattern=`` by naming both, and computes the same with either; ``attention()`` stays short,
and a refusal names the engines that do run the call."""

from __future__ import annotations

import inspect
from dataclasses import fields

import numpy as np
import pytest
import torch

import causalattn as ca
from causalattn import masks
from causalattn.cli import audit as cli_audit
from causalattn.cli import diagnose as cli_diagnose
from causalattn.cli._options import CLI_PATTERN, NOT_ON_CLI
from causalattn.distributed.ring import ring_attention
from causalattn.engines import make_problem
from causalattn.engines.registry import ENGINES, features, refusal
from causalattn.integrations.hf_attention import attention_forward
from causalattn.masks import PATTERN_KEYWORDS, Pattern

ENTRY_POINTS = {
    "attention": ca.attention,
    "trace": ca.trace,
    "audit": ca.audit,
    "diagnose": ca.diagnose,
    "CausalSelfAttention.forward": ca.CausalSelfAttention.forward,
    "HF attention function": attention_forward,
    "ring_attention": ring_attention,
    "make_problem": make_problem,
}


def test_the_one_list_is_patterns_fields_less_the_placement():
    names = [f.name for f in fields(Pattern)]
    assert list(PATTERN_KEYWORDS) == [n for n in names if n not in ("q_start", "k_start")]


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_every_entry_point_takes_pattern_and_exactly_patterns_keywords(name):
    params = inspect.signature(ENTRY_POINTS[name]).parameters
    assert "pattern" in params
    names = list(params)
    at = names.index("pattern") + 1
    assert names[at : at + len(PATTERN_KEYWORDS)] == list(PATTERN_KEYWORDS)  # the same order
    pattern_like = [n for n in names if n in PATTERN_KEYWORDS]
    assert pattern_like == list(PATTERN_KEYWORDS)  # none missing, none twice
    defaults = {f.name: f.default for f in fields(Pattern)}
    for n in PATTERN_KEYWORDS:
        assert params[n].kind is inspect.Parameter.KEYWORD_ONLY, n
        assert params[n].default is defaults[n], (n, params[n].default)


def test_the_cli_options_are_the_ones_of_the_list_it_can_express():
    assert set(CLI_PATTERN) | set(NOT_ON_CLI) == set(PATTERN_KEYWORDS)
    assert not set(CLI_PATTERN) & set(NOT_ON_CLI)
    for cmd in (cli_audit.audit_cmd, cli_diagnose.diagnose_cmd):
        params = inspect.signature(cmd).parameters
        assert [n for n in params if n in PATTERN_KEYWORDS] == list(CLI_PATTERN)


# ---- one call, two spellings --------------------------------------------------------------

QKV = [torch.randn(2, 2, 6, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
KW = {"window": 3, "lengths": torch.tensor([6, 4])}


def _trace(**kw):
    X = np.random.default_rng(0).normal(size=(2, 6, 4))
    W = [np.random.default_rng(i).normal(size=(4, 4)) for i in (1, 2, 3)]
    return ca.trace(X, *W, **kw)


def _layer(**kw):
    torch.manual_seed(0)
    layer = ca.CausalSelfAttention(8, 2)
    with torch.no_grad():
        return layer(torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(4)), **kw)


def _audit(**kw):
    tr = _trace(**KW)
    arrays = {n: getattr(tr, n) for n in ("Q", "K", "V", "S", "A", "H")}
    return ca.audit(arrays, **kw).to_dict()


def _hf(**kw):
    return attention_forward(None, *QKV, None, **kw)[0]


def _diagnose(**kw):
    def fn(q, k, v):
        return ca.attention(q, k, v, window=3, engine="reference")

    return str(ca.diagnose(fn, isolate=False, **kw))


CALLS = {
    "attention": lambda **kw: ca.attention(*QKV, **kw),
    "trace": lambda **kw: _trace(**kw).A,
    "audit": _audit,
    "CausalSelfAttention.forward": _layer,
    "HF attention function": _hf,
    "make_problem": lambda **kw: make_problem(*QKV, **kw).allowed(),
}


def _same(a, b):
    if isinstance(a, dict):
        assert a == b
    else:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("name", list(CALLS))
def test_keywords_and_pattern_give_the_same_result(name):
    call = CALLS[name]
    _same(call(**KW), call(pattern=Pattern(**KW)))
    # and the pattern's keywords do bite (the two agree on something that is not causal)
    assert not np.array_equal(np.asarray(call(**KW)), np.asarray(call())) or name == "audit"


def test_diagnose_gives_the_same_verdict_with_keywords_and_with_pattern():
    assert _diagnose(window=3) == _diagnose(pattern=Pattern(window=3))
    assert "clean" in _diagnose(window=3)


@pytest.mark.parametrize("name", [*CALLS, "diagnose", "ring_attention"])
def test_a_keyword_with_pattern_is_refused_naming_both(name):
    call = {
        **CALLS,
        "diagnose": _diagnose,
        "ring_attention": lambda **kw: ring_attention(*QKV, **kw),
    }[name]
    with pytest.raises(ValueError) as e:
        call(pattern=Pattern(), window=3)
    msg = str(e.value)
    assert "pattern=" in msg and "not both (got window)" in msg, msg


def test_an_unknown_keyword_is_a_type_error_naming_it():
    with pytest.raises(
        TypeError, match="attention\\(\\) got an unexpected keyword argument 'windw'"
    ):
        ca.attention(*QKV, windw=3)


def test_ring_attention_names_the_keywords_it_does_not_run_before_any_transfer():
    with pytest.raises(ValueError, match="ring_attention: chunk is not supported; it runs causal"):
        ring_attention(*QKV, chunk=2)
    with pytest.raises(ValueError, match="ring_attention: causal=False is not supported"):
        ring_attention(*QKV, causal=False)


def test_the_layer_refuses_a_keyword_it_holds_itself_by_name():
    layer = ca.CausalSelfAttention(8, 2, window=2)
    with pytest.raises(ValueError, match="window is the layer's own"):
        layer(torch.randn(1, 4, 8), window=3)
    with pytest.warns(DeprecationWarning, match="attn_bias is now bias"):
        old = layer(torch.ones(1, 4, 8), attn_bias=torch.zeros(4, 4))
    torch.testing.assert_close(old, layer(torch.ones(1, 4, 8), bias=torch.zeros(4, 4)))


def test_attention_refuses_a_placed_pattern_by_name():
    with pytest.raises(ValueError, match="attention: pattern is placed"):
        ca.attention(*QKV, pattern=Pattern(q_start=2))


# ---- attention() and the engines' data ------------------------------------------------------


def _body_lines(fn) -> int:
    """Lines of a function's body after its docstring (blank ones left out)."""
    src = inspect.getsource(fn)
    doc_end = src.index('"""', src.index('"""') + 3) + 3
    return len([line for line in src[doc_end:].splitlines() if line.strip()])


def test_attention_reads_top_to_bottom_in_at_most_60_lines():
    assert _body_lines(ca.attention) <= 60


def test_a_refusal_names_the_engines_that_run_the_call():
    q, k, v = QKV
    f = features(q, k, v, tensors={"sinks": torch.zeros(2)}, lse=True)
    why = refusal("sdpa", f)
    runs = [n for n in ENGINES if not refusal(n, f)]
    assert runs and "sdpa" not in runs
    assert why.endswith(f"engines that run this call: {', '.join(map(repr, runs))}"), why
    assert why.startswith("engine 'sdpa': return_lse: PyTorch's SDPA does not return")
    assert "sinks: PyTorch's SDPA has no sink term" in why  # everything it lacks, once
    with pytest.raises(ValueError) as e:
        ca.attention(q, k, v, engine="sdpa", return_lse=True, sinks=torch.zeros(2))
    assert str(e.value) == why


def test_every_engine_declares_what_it_runs_as_data():
    for e in ENGINES.values():
        assert e.devices, e.name
        asks = {"return_lse", "score_mod", "sinks", "rel_bias", "softcap"}
        asks.add("learnable alibi_slopes")
        assert {what for what, _ in e.lacks} <= asks, e.name


def test_masks_from_kwargs_is_patterns_constructor_with_the_checks():
    assert Pattern.from_kwargs(window=2).window == 2
    p = Pattern(chunk=3)
    assert Pattern.from_kwargs(p) is p
    with pytest.raises(ValueError, match="attention: pattern must be a causalattn.masks.Pattern"):
        Pattern.from_kwargs("causal")
    with pytest.raises(TypeError, match="unexpected keyword argument 'chunks'"):
        Pattern.from_kwargs(chunks=3)
    assert masks.keywords_of(None, {}, "x") == masks.DEFAULTS
