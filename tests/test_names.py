"""One name, one meaning: ``causalattn.trace`` is the function whatever has been imported
(the package is a plain module, no custom type), and the layer's renamed keywords
(``proj_bias``, ``alibi_slopes``, ``dropout_p``: attention's spellings) keep their older
names for one release, each with a DeprecationWarning."""

from __future__ import annotations

import importlib
import inspect
import sys
import types
import warnings

import numpy as np
import pytest
import torch

import causalattn
from causalattn import CausalSelfAttention, matrix_form


def test_causalattn_trace_is_the_function_after_every_import():
    importlib.import_module("causalattn._trace")  # the module of Trace, loaded
    from causalattn import trace

    assert type(causalattn) is types.ModuleType  # no module type working around a clash
    assert causalattn.trace is trace is matrix_form.trace and callable(causalattn.trace)
    X = np.eye(3)
    tr = causalattn.trace(X, X, X, X)
    assert isinstance(tr, causalattn.Trace)
    assert causalattn.Trace is sys.modules["causalattn._trace"].Trace
    assert causalattn.trace is matrix_form.trace  # still the function once Trace was used
    with pytest.raises(ModuleNotFoundError):  # no submodule of that name to rebind it
        __import__("causalattn.trace")


def test_the_layer_takes_attentions_spellings():
    params = inspect.signature(CausalSelfAttention.__init__).parameters
    assert {"proj_bias", "alibi_slopes", "dropout_p"} <= set(params)
    assert not {"bias", "alibi", "attn_dropout"} & set(params)


@pytest.mark.parametrize(
    "old, new, value, seen",
    [
        ("bias", "proj_bias", True, lambda m: m.b_q is not None and m.b_o is not None),
        ("alibi", "alibi_slopes", True, lambda m: m.alibi_slopes is not None),
        ("attn_dropout", "dropout_p", 0.25, lambda m: m.dropout_p == 0.25),
    ],
)
def test_an_older_layer_keyword_still_works_with_a_deprecation_warning(old, new, value, seen):
    with pytest.warns(DeprecationWarning, match=f"{old}= is now {new}="):
        layer = CausalSelfAttention(8, 2, **{old: value})
    assert seen(layer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new name warns of nothing
        assert seen(CausalSelfAttention(8, 2, **{new: value}))
    torch.manual_seed(0)
    a = CausalSelfAttention(8, 2, engine="reference", **{new: value}).eval()
    torch.manual_seed(0)
    with pytest.warns(DeprecationWarning):
        b = CausalSelfAttention(8, 2, engine="reference", **{old: value}).eval()
    x = torch.randn(1, 5, 8)
    assert torch.equal(a(x), b(x))  # the same layer either way


def test_an_older_keyword_with_its_new_one_names_both_and_an_unknown_one_is_refused():
    with pytest.raises(ValueError, match=r"bias= is the older name of proj_bias="):
        CausalSelfAttention(8, 2, bias=True, proj_bias=True)
    with pytest.raises(ValueError, match=r"attn_dropout= is the older name of dropout_p="):
        CausalSelfAttention(8, 2, attn_dropout=0.1, dropout_p=0.2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'alibi_slope'"):
        CausalSelfAttention(8, 2, alibi_slope=True)
    with pytest.raises(ValueError, match="proj_bias must be True or False"):
        CausalSelfAttention(8, 2, proj_bias=1)
