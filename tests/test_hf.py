"""Hugging Face transformers on causalattn: tiny random models from configs, no downloads.

GPT-2 and Llama (GQA) as before, and the patterns real models pass to the attention
function: Mistral (sliding window), Qwen2 (window on some layers), Gemma 2 (window on
alternate layers + softcap), gpt-oss (sinks + window), Llama 4 text (chunked). Prompts are
longer than every window and chunk (4 tokens).
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import _hf_tiny as tiny  # noqa: E402

from causalattn.engines import contract, make_problem  # noqa: E402
from causalattn.integrations.transformers import (  # noqa: E402
    _accepted,
    attention_forward,
    register,
)
from causalattn.layer import CausalSelfAttention  # noqa: E402

FLOOR = 1e-5
T = 14
NEEDS = {
    "mistral": {"window"},
    "qwen2": {"window"},
    "gemma2": {"window", "softcap"},
    "gpt_oss": {"window", "sinks"},
    "llama4": {"chunk"},
}
NAMES = list(tiny.CONFIGS)


def _skip_unless_engine_takes(name):
    missing = NEEDS.get(name, set()) - _accepted()
    if missing:
        pytest.skip(f"causalattn.attention does not take {sorted(missing)} yet")


@pytest.fixture(scope="module")
def models():
    register()
    tiny.register_eager_safe()
    cache = {}

    def get(name):
        if name not in cache:
            _skip_unless_engine_takes(name)
            model = tiny.model(name)
            cache[name] = (model, copy.deepcopy(model).double())
        return cache[name]

    return get


def padded_batch(pad: str):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, tiny.VOCAB, (3, T), generator=g)
    am = torch.ones(3, T, dtype=torch.long)
    if pad == "right":
        am[1, 9:] = 0
        am[2, 2:] = 0
    elif pad == "left":
        am[1, :5] = 0
        am[2, : T - 1] = 0  # a single real token
    position_ids = (am.cumsum(-1) - 1).clamp(min=0)  # HF's convention for padded batches
    return ids, am, position_ids


def logits(model, impl, ids, am, pos):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(ids, attention_mask=am, position_ids=pos).logits


@pytest.mark.parametrize("pad", ["none", "right", "left"])
@pytest.mark.parametrize("name", NAMES)
def test_logits_match_eager(models, name, pad):
    # (Llama 4 with left padding: HF counts chunks from each row's first real token, the
    # chunk rule from position 0, so that mask is no chunk pattern and runs as a dense mask.)
    model, ref64 = models(name)
    ids, am, pos = padded_batch(pad)
    ours = logits(model, "causalattn", ids, am, pos)
    plain = logits(model, "eager", ids, am, pos)
    ref = logits(ref64, tiny.EAGER_SAFE, ids, am, pos)  # float64 truth (NaN-safe eager)
    assert torch.isfinite(ours).all()  # left-padding query rows read no key: zeros, not NaN
    real = am.bool()
    err = (ours.double() - ref)[real].abs().max().item()
    bound = 2 * (plain.double() - ref)[real].abs().max().item() + FLOOR
    assert err <= bound, f"{name}/{pad}: max|ours - ref64| = {err:.3g} > {bound:.3g}"
    assert ref[real].std() > 0.3  # the comparison is not between near-constant logits


@pytest.mark.parametrize("name", list(tiny.MORE))
def test_more_windowed_families_match_eager(name):
    """Phi-3, Starcoder2 and Qwen3 pass sliding_window too: logits with left padding."""
    if "window" not in _accepted():
        pytest.skip("causalattn.attention does not take window yet")
    register()
    model = tiny.model(name)
    ref64 = copy.deepcopy(model).double()
    ids, am, pos = padded_batch("left")
    ours = logits(model, "causalattn", ids, am, pos)
    plain = logits(model, "eager", ids, am, pos)
    ref = logits(ref64, tiny.register_eager_safe(), ids, am, pos)
    real = am.bool()
    err = (ours.double() - ref)[real].abs().max().item()
    assert err <= 2 * (plain.double() - ref)[real].abs().max().item() + FLOOR, name


def test_windows_bite(models):
    """The windowed models' prompts exceed the window: without it, eager's logits change."""
    for name in ("mistral", "gpt_oss"):
        _skip_unless_engine_takes(name)
        model, _ = models(name)
        ids, am, pos = padded_batch("none")
        windowed = logits(model, "eager", ids, am, pos)
        model.config.sliding_window = 10_000
        try:
            wide = logits(model, "eager", ids, am, pos)
        finally:
            model.config.sliding_window = tiny.WINDOW
        assert (windowed - wide).abs().max() > 1e-2, name


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_matches_eager(models, name):
    model, _ = models(name)
    ids, am, _ = padded_batch("left")
    am[2, : T - 4] = 0
    if name == "llama4":
        am[:] = 1  # see test_logits_match_eager: chunks counted from a row's first token
    out = {}
    for impl in ("eager", "causalattn"):
        model.set_attn_implementation(impl)
        out[impl] = model.generate(
            ids,
            attention_mask=am,
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    assert out["causalattn"].shape == (3, T + 8)
    assert torch.equal(out["causalattn"], out["eager"])


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2"])
def test_greedy_generation_with_a_static_cache(models, name):
    """A StaticCache hands the function all its slots, the empty ones masked: same tokens."""
    model, _ = models(name)
    ids, am, _ = padded_batch("left")
    out = {}
    for impl in ("eager", "causalattn"):
        model.set_attn_implementation(impl)
        out[impl] = model.generate(
            ids,
            attention_mask=am,
            max_new_tokens=5,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
            cache_implementation="static",
        )
    assert torch.equal(out["causalattn"], out["eager"])


def test_packed_sequences_match_eager(models):
    """HF detects packed documents from position_ids restarting at 0 (no mask, no cache)."""
    for name in ("llama", "mistral"):
        if NEEDS.get(name, set()) - _accepted():
            continue
        model, ref64 = models(name)
        ids = torch.randint(3, tiny.VOCAB, (1, T), generator=torch.Generator().manual_seed(4))
        pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1, 2, 3, 4]])
        model.set_attn_implementation("causalattn")
        with torch.no_grad():
            ours = model(ids, position_ids=pos, use_cache=False).logits
        model.set_attn_implementation("eager")
        with torch.no_grad():
            plain = model(ids, position_ids=pos, use_cache=False).logits
        ref64.set_attn_implementation("eager")
        with torch.no_grad():
            ref = ref64(ids, position_ids=pos, use_cache=False).logits
        err = (ours.double() - ref).abs().max().item()
        assert err <= 2 * (plain.double() - ref).abs().max().item() + FLOOR, name
        # documents really separate: the second document's logits differ when run alone
        with torch.no_grad():
            alone = model(ids[:, 6:9], position_ids=pos[:, 6:9]).logits
        assert (alone - plain[:, 6:9]).abs().max() < 1e-4


def test_patterns_read_from_hf():
    """What each model hands the function becomes the expected causalattn pattern."""
    from causalattn.integrations.hf_capture import capture

    want = {
        "gpt2": ("causal", "causal + padding"),
        "llama": ("causal", "causal + padding"),
        "mistral": ("causal + window 4", "causal + window 4 + padding"),
        "gemma2": ("causal + window 4 + softcap 5", "causal + window 4 + padding + softcap 5"),
        "gpt_oss": ("causal + window 4 + sinks", "causal + window 4 + padding + sinks"),
        "llama4": ("causal + chunk 4", "causal + chunk 4 + padding"),
    }
    ids, am, _ = padded_batch("right")
    for name, (plain, padded) in want.items():
        if NEEDS.get(name, set()) - _accepted():
            continue
        model = tiny.model(name)
        (tr,) = capture(model, ids[:1], layers=[0])
        assert tr.received.describe() == plain, name
        (tr,) = capture(model, ids, attention_mask=am, layers=[0])
        assert tr.received.describe() == padded, name


def test_from_config_with_causalattn():
    register()
    model = tiny.model("llama", impl="causalattn")
    assert model.config._attn_implementation == "causalattn"
    ids, _, _ = padded_batch("none")
    with torch.no_grad():
        a = model(ids).logits
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        b = model(ids).logits
    assert (a - b).abs().max() < 1e-4


def test_from_gpt2_attention_equals_hf_module():
    model = tiny.model("gpt2")
    hf = model.transformer.h[1].attn
    layer = CausalSelfAttention.from_gpt2_attention(hf, engine="auto")
    assert torch.equal(layer.W_q, hf.c_attn.weight[:, :32])  # Conv1D is already X @ W
    x = torch.randn(2, 9, 32)
    causal = torch.zeros(9, 9).masked_fill(
        torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf")
    )
    with torch.no_grad():
        want = hf(x, attention_mask=causal[None, None])[0]  # called alone, eager needs the mask
        got = layer(x)
    assert (got - want).abs().max() <= 1e-5 * (1 + want.abs().max())
    # GPT-2's optional 1/(layer_idx + 1) scaling is carried over too
    cfg = tiny.gpt2()
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


def test_any_boolean_mask_runs_exactly():
    """A mask no structured rule reproduces runs as the pattern's dense mask, exactly."""
    if "mask" not in _accepted():
        pytest.skip("causalattn.attention does not take a dense mask yet")
    module = tiny.model("llama").model.layers[0].self_attn
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=g)
    k, v = torch.randn(2, 2, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g)
    allowed = torch.rand(2, 1, 6, 6, generator=g) > 0.4
    allowed[:, :, torch.arange(6), torch.arange(6)] = True
    out, _ = attention_forward(module, q, k, v, allowed, scaling=0.5)
    plain = contract.plain(make_problem(q, k, v, causal=False, mask=allowed, scale=0.5), q.dtype)
    want = plain.transpose(1, 2)
    assert (out - want).abs().max() < 1e-5


def test_refuses_what_it_cannot_do():
    module = tiny.model("llama").model.layers[0].self_attn
    q = torch.randn(1, 4, 5, 8)
    k = v = torch.randn(1, 2, 5, 8)
    bias = torch.randn(1, 1, 5, 5)
    with pytest.raises(ValueError, match="additive bias"):
        attention_forward(module, q, k, v, bias)
    with pytest.raises(ValueError, match=r"attention_mask must be \(B, 1, T_q, T_k\)"):
        attention_forward(module, q, k, v, torch.ones(1, 1, 5, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="position_bias"):
        attention_forward(module, q, k, v, None, position_bias=torch.zeros(1, 4, 5, 5))
    with pytest.raises(ValueError, match=r"s_aux \(sinks\) must be one logit per head"):
        attention_forward(module, q, k, v, None, s_aux=torch.zeros(3))
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        attention_forward(module, q, k, v, None, sliding_window=0)


@pytest.fixture
def received(monkeypatch):
    """Every call of the registered function: (attention_mask, T_q, T_k, pattern, n)."""
    from causalattn.integrations import transformers as integration

    calls = []
    real = integration.pattern_from_hf

    def spy(module, query, key, attention_mask, **kwargs):
        pat, n = real(module, query, key, attention_mask, **kwargs)
        calls.append((attention_mask, query.shape[2], key.shape[2], pat, n))
        return pat, n

    monkeypatch.setattr(integration, "pattern_from_hf", spy)
    return calls


@pytest.mark.parametrize(
    "name,want",
    [("llama", "causal + documents"), ("mistral", "causal + window 4 + documents")],
)
def test_packed_documents_are_read_as_documents_not_a_dense_mask(models, received, name, want):
    """position_ids restarting at 0 become cu_seqlens (the engines skip the blocks between
    documents), not the dense fallback, which gives the same logits."""
    _skip_unless_engine_takes(name)
    model, _ = models(name)
    model.set_attn_implementation("causalattn")
    ids = torch.randint(3, tiny.VOCAB, (1, T), generator=torch.Generator().manual_seed(4))
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1, 2, 3, 4]])
    with torch.no_grad():
        model(ids, position_ids=pos, use_cache=False)
    assert received and all(mask is not None for mask, *_ in received)
    for _, _, _, pat, n in received:
        assert pat.describe() == want and pat.mask is None and n == T
        assert pat.cu_seqlens.tolist() == [0, 6, 9, T]


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_static_cache_generation_without_a_mask_equals_eager(models, received, name):
    """An unpadded prompt and no attention_mask: HF hands the StaticCache prefill no mask
    (queries at positions 0..T_q-1 before empty slots), then masks the decoding steps.
    Same tokens as eager."""
    _skip_unless_engine_takes(name)
    model, _ = models(name)
    ids, _, _ = padded_batch("none")
    out = {}
    for impl in ("eager", "causalattn"):
        model.set_attn_implementation(impl)
        out[impl] = model.generate(
            ids,
            max_new_tokens=5,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
            cache_implementation="static",
        )
    assert out["causalattn"].shape == (3, T + 5)
    assert torch.equal(out["causalattn"], out["eager"])
    prefill = [c for c in received if c[0] is None and 1 < c[1] < c[2]]
    assert prefill, [(m is None, tq, tk) for m, tq, tk, *_ in received]
    for _, T_q, _, pat, n in prefill:
        assert T_q == T and n == T and pat.causal  # the filled slots only
