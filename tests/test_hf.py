"""Hugging Face transformers on causalattn: GPT-2 and Llama (GQA) from small configs, no downloads."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from causalattn.integrations.transformers import attention_forward, register  # noqa: E402
from causalattn.layer import CausalSelfAttention  # noqa: E402

FLOOR = 1e-5
VOCAB, T = 97, 12


def gpt2_config():
    return transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=1, eos_token_id=2,
    )


def llama_config():
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2,
    )


CONFIGS = {"gpt2": gpt2_config, "llama": llama_config}


@pytest.fixture(scope="module")
def models():
    register()
    out = {}
    for name, cfg in CONFIGS.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg(), attn_implementation="eager").eval()
        with torch.no_grad():  # bolder weights than the 0.02 init, so attention is not near-uniform
            for p in model.parameters():
                if p.dim() == 2:
                    p.mul_(8.0)
        ref64 = copy.deepcopy(model).double()
        out[name] = (model, ref64)
    return out


def padded_batch(pad: str):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (3, T), generator=g)
    am = torch.ones(3, T, dtype=torch.long)
    if pad == "right":
        am[1, 7:] = 0
        am[2, 2:] = 0
    elif pad == "left":
        am[1, :5] = 0
        am[2, :T - 1] = 0  # a single real token
    position_ids = (am.cumsum(-1) - 1).clamp(min=0)  # HF's convention for padded batches
    return ids, am, position_ids


def logits(model, impl, ids, am, pos):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(ids, attention_mask=am, position_ids=pos).logits


@pytest.mark.parametrize("pad", ["none", "right", "left"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_eager(models, name, pad):
    model, ref64 = models[name]
    ids, am, pos = padded_batch(pad)
    ours = logits(model, "causalattn", ids, am, pos)
    plain = logits(model, "eager", ids, am, pos)
    # ref64: SDPA in float64 (eager in float64 overflows finfo.min + score to -inf on fully
    # masked left-padding rows and spreads NaN; SDPA does not)
    ref = logits(ref64, "sdpa", ids, am, pos)
    assert torch.isfinite(ours).all()  # left-padding query rows read no key: zeros, not NaN
    real = am.bool()
    err = (ours.double() - ref)[real].abs().max().item()
    bound = 2 * (plain.double() - ref)[real].abs().max().item() + FLOOR
    assert err <= bound, f"{name}/{pad}: max|ours - ref64| = {err:.3g} > {bound:.3g}"
    assert ref[real].std() > 0.3  # the comparison is not between near-constant logits


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generation_matches_eager(models, name):
    model, _ = models[name]
    ids, am, _ = padded_batch("left")
    am[2, :T - 4] = 0
    out = {}
    for impl in ("eager", "causalattn"):
        model.set_attn_implementation(impl)
        out[impl] = model.generate(
            ids, attention_mask=am, max_new_tokens=8, do_sample=False, pad_token_id=0,
            eos_token_id=None,
        )
    assert out["causalattn"].shape == (3, T + 8)
    assert torch.equal(out["causalattn"], out["eager"])


def test_from_config_with_causalattn():
    register()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(llama_config(), attn_implementation="causalattn")
    assert model.config._attn_implementation == "causalattn"
    ids, am, pos = padded_batch("none")
    with torch.no_grad():
        a = model(ids).logits
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        b = model(ids).logits
    assert (a - b).abs().max() < 1e-4


def test_from_gpt2_attention_equals_hf_module(models):
    model, _ = models["gpt2"]
    model.set_attn_implementation("eager")
    hf = model.transformer.h[1].attn
    layer = CausalSelfAttention.from_gpt2_attention(hf, engine="auto")
    assert torch.equal(layer.W_q, hf.c_attn.weight[:, :32])  # Conv1D is already X @ W
    x = torch.randn(2, 9, 32)
    causal = torch.zeros(9, 9).masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
    with torch.no_grad():
        want = hf(x, attention_mask=causal[None, None])[0]  # called alone, eager needs the mask
        got = layer(x)
    assert (got - want).abs().max() <= 1e-5 * (1 + want.abs().max())
    # GPT-2's optional 1/(layer_idx + 1) scaling is carried over too
    cfg = gpt2_config()
    cfg.scale_attn_by_inverse_layer_idx = True
    cfg._attn_implementation = "eager"
    torch.manual_seed(3)
    hf3 = transformers.models.gpt2.modeling_gpt2.GPT2Attention(cfg, layer_idx=2).eval()
    with torch.no_grad():
        hf3.c_attn.weight.mul_(20.0)  # large scores, so a wrong scale shows
        want = hf3(x, attention_mask=causal[None, None])[0]
        got = CausalSelfAttention.from_gpt2_attention(hf3)(x)
    assert (got - want).abs().max() <= 1e-5 * (1 + want.abs().max())
    with pytest.raises(ValueError, match="from_gpt2_attention: expected a GPT-2"):
        CausalSelfAttention.from_gpt2_attention(torch.nn.Linear(2, 2))


def test_refuses_masks_it_cannot_express(models):
    module = models["llama"][0].model.layers[0].self_attn
    q = torch.randn(1, 4, 5, 8)
    k = v = torch.randn(1, 2, 5, 8)
    window = torch.tril(torch.ones(5, 5, dtype=torch.bool)) & ~torch.tril(torch.ones(5, 5, dtype=torch.bool), -3)
    with pytest.raises(ValueError, match="not causal .* plus key padding"):
        attention_forward(module, q, k, v, window[None, None])
    bias = torch.randn(1, 1, 5, 5)
    with pytest.raises(ValueError, match="additive bias"):
        attention_forward(module, q, k, v, bias)
    with pytest.raises(ValueError, match=r"attention_mask must be \(B, 1, T_q, T_k\)"):
        attention_forward(module, q, k, v, torch.ones(1, 1, 5, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="dropout"):
        attention_forward(module, q, k, v, None, dropout=0.1)
