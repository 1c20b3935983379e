"""CausalSelfAttention speaks the pattern: window, chunk, ALiBi, softcap, learned sinks, dropout."""

import numpy as np
import pytest
import torch

from causalattn import CausalSelfAttention, masks


@pytest.mark.parametrize(
    "kw",
    [
        {"window": 3},
        {"chunk": 4},
        {"alibi_slopes": True},
        {"softcap": 5.0},
        {"sinks": True},
        {"window": 2, "alibi_slopes": True, "sinks": True, "softcap": 3.0},
    ],
)
def test_the_layer_equals_its_own_float64_trace(kw):
    torch.manual_seed(0)
    layer = CausalSelfAttention(16, 4, engine="reference", **kw).double()
    if layer.sinks is not None:
        with torch.no_grad():
            layer.sinks.copy_(torch.randn(4))
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    out = layer(x)
    tr = layer.trace(x)
    np.testing.assert_allclose(out.detach().numpy(), tr.O, atol=1e-10)
    if "window" in kw:
        assert (tr.A[..., 8, : 8 - kw["window"] + 1] == 0).all()


def test_learned_sinks_get_a_gradient_and_alibi_slopes_are_not_saved():
    layer = CausalSelfAttention(8, 2, sinks=True, alibi_slopes=True, engine="reference")
    layer(torch.randn(1, 5, 8)).sum().backward()
    assert layer.sinks.grad is not None and torch.isfinite(layer.sinks.grad).all()
    assert "alibi_slopes" not in layer.state_dict() and "sinks" in layer.state_dict()
    np.testing.assert_allclose(layer.alibi_slopes.numpy(), masks.alibi_slopes(2))
    assert "window" not in repr(layer) and "sinks=True" in repr(layer)


def test_attention_dropout_acts_in_train_mode_only():
    torch.manual_seed(1)
    layer = CausalSelfAttention(8, 2, dropout_p=0.5, engine="reference")
    x = torch.randn(1, 6, 8)
    layer.eval()
    a, b = layer(x), layer(x)
    assert torch.equal(a, b)
    layer.train()
    torch.manual_seed(2)
    c = layer(x)
    torch.manual_seed(2)
    d = layer(x)
    assert torch.equal(c, d) and not torch.allclose(c, a)


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"window": 0}, "window"),
        ({"chunk": 1.5}, "chunk"),
        ({"softcap": -1.0}, "softcap"),
        ({"dropout_p": 1.5}, "dropout_p"),
        ({"alibi_slopes": 1}, "alibi_slopes"),
        ({"scale": float("nan")}, "scale"),
        ({"sinks": "yes"}, "sinks"),
    ],
)
def test_bad_pattern_arguments_are_refused_at_construction(kw, msg):
    with pytest.raises(ValueError, match=msg):
        CausalSelfAttention(8, 2, **kw)
