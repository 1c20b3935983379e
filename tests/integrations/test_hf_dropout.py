"""Attention dropout through Hugging Face: HF's ``dropout=`` is causalattn's
``dropout_p``; GPT-2 with ``attn_pdrop = 0.1`` fine-tunes in train() mode and matches eager
in eval() mode."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import _hf_tiny as tiny  # noqa: E402

import causalattn as ca  # noqa: E402
from causalattn.integrations.transformers import attention_forward, register  # noqa: E402

T = 12


def batch():
    g = torch.Generator().manual_seed(5)
    return torch.randint(3, tiny.VOCAB, (4, T), generator=g)


def test_dropout_argument_is_dropout_p():
    module = tiny.model("llama").model.layers[0].self_attn
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 9, 8, generator=g)
    k, v = torch.randn(2, 2, 9, 8, generator=g), torch.randn(2, 2, 9, 8, generator=g)
    torch.manual_seed(7)
    got, _ = attention_forward(module, q, k, v, None, scaling=0.4, dropout=0.3)
    torch.manual_seed(7)
    want = ca.attention(q, k, v, scale=0.4, dropout_p=0.3).transpose(1, 2)
    assert torch.equal(got, want)  # the same counter-based pattern from the same seed
    plain, _ = attention_forward(module, q, k, v, None, scaling=0.4)
    assert (got - plain).abs().max() > 1e-3  # dropout really applied
    torch.manual_seed(8)
    other, _ = attention_forward(module, q, k, v, None, scaling=0.4, dropout=0.3)
    assert not torch.equal(other, got)


def test_gpt2_with_attn_pdrop_trains_and_evaluates_as_eager():
    register()
    model = tiny.model("gpt2", boldness=1.0, attn_pdrop=0.1, impl="causalattn")
    ids = batch()
    model.train()
    torch.manual_seed(1)
    a = model(ids).logits
    torch.manual_seed(1)
    b = model(ids).logits
    torch.manual_seed(2)
    c = model(ids).logits
    assert torch.equal(a, b) and not torch.equal(a, c)  # reproducible under manual_seed
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(40):
        torch.manual_seed(100 + step)
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses  # the loss falls
    model.eval()  # dropout off: the same logits as eager
    with torch.no_grad():
        ours = model(ids).logits
        model.set_attn_implementation("eager")
        plain = model(ids).logits
        ref = model.double()(ids).logits
    err = (ours.double() - ref).abs().max().item()
    assert err <= 2 * (plain.double() - ref).abs().max().item() + 1e-5
