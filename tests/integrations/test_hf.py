"""Hugging Face transformers on causalattn: tiny random models from configs, no downloads.

GPT-2 and Llama (GQA) as before, and the patterns real models pass to the attention
function: Mistral (sliding window), Qwen2 (window on some layers), Gemma 2 (window on
alternate layers + softcap), gpt-oss (sinks + window), Llama 4 text (chunked). Prompts are
longer than every window and chunk (4 tokens).
"""

from __future__ import annotations

import copy
import types

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
from causalattn.masks import Pattern  # noqa: E402

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
    with pytest.raises(ValueError, match=r"attention_mask must be \(B, 1, T_q, T_k\)"):
        attention_forward(module, q, k, v, torch.ones(1, 1, 5, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="position_bias must be a float tensor broadcastable"):
        attention_forward(
            module, q, k, v, None, position_bias=torch.zeros(1, 4, 5, 5, dtype=torch.long)
        )
    with pytest.raises(ValueError, match=r"bias: shape \(1, 3, 5, 5\) does not broadcast"):
        attention_forward(module, q, k, v, None, position_bias=torch.zeros(1, 3, 5, 5))
    with pytest.raises(ValueError, match=r"^causalattn attention: attention_mask holds NaN$"):
        attention_forward(module, q, k, v, torch.full((1, 1, 5, 5), float("nan")))
    with pytest.raises(ValueError, match=r"s_aux \(sinks\) must be one logit per head"):
        attention_forward(module, q, k, v, None, s_aux=torch.zeros(3))
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        attention_forward(module, q, k, v, None, sliding_window=0)


def _module_eager(module, q, k, v, mask, **kw):
    import sys

    eager = sys.modules[type(module).__module__].eager_attention_forward
    return eager(module, q, k, v, mask, **kw)[0]


def test_additive_float_masks_and_position_bias_go_in_as_bias():
    """An additive float mask (0 / finfo.min plus a bias at readable cells) and a
    position_bias keyword: the eager function's output (no longer refused)."""
    module = tiny.model("llama").model.layers[0].self_attn
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 6, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, 6, 8, generator=g, dtype=torch.float64)
    module = module.double()
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    additive = torch.randn(2, 1, 6, 6, generator=g, dtype=torch.float64)
    additive = additive.masked_fill(~causal, torch.finfo(torch.float64).min)
    out, _ = attention_forward(module, q, k, v, additive, scaling=0.5)
    # llama's eager function repeats the key-value heads itself
    torch.testing.assert_close(out, _module_eager(module, q, k, v, additive, scaling=0.5))
    pb = torch.randn(1, 4, 6, 6, generator=g, dtype=torch.float64)
    zero_mask = torch.zeros(1, 1, 6, 6, dtype=torch.float64).masked_fill(~causal, float("-inf"))
    out, _ = attention_forward(module, q, k, v, zero_mask, scaling=0.5, position_bias=pb)
    want = _module_eager(module, q, k, v, zero_mask + pb, scaling=0.5)
    torch.testing.assert_close(out, want)


def _t5(impl):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.T5Config(
        vocab_size=tiny.VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    m = transformers.T5ForConditionalGeneration(cfg)
    m.set_attn_implementation(impl)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    return m.eval().double()


def test_t5_position_bias_and_padding_through_bias_match_eager_logits_and_generation(monkeypatch):
    """T5 hands its relative position bias (and the padding as an additive float mask) to
    the attention function: encoder, decoder and cross attention through causalattn's
    bias, the same logits and the same greedy generation as eager."""
    from causalattn.integrations import hf_attention as integ

    name = integ.register()
    eager, ours = _t5("eager"), _t5(name)
    calls = []
    real = integ.attention
    import functools

    @functools.wraps(real)  # the same signature: the integration reads what it accepts
    def counted(*a, **kw):
        calls.append(kw)
        return real(*a, **kw)

    monkeypatch.setattr(integ, "attention", counted)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, tiny.VOCAB, (2, 11), generator=g)
    am = torch.ones(2, 11, dtype=torch.long)
    am[1, 8:] = 0  # the second row padded
    dec = torch.randint(3, tiny.VOCAB, (2, 7), generator=g)
    with torch.no_grad():
        want = eager(input_ids=ids, attention_mask=am, decoder_input_ids=dec).logits
        got = ours(input_ids=ids, attention_mask=am, decoder_input_ids=dec).logits
    assert calls and all(c.get("bias") is not None for c in calls)  # every layer took a bias
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
    ge = eager.generate(input_ids=ids, attention_mask=am, max_new_tokens=8, do_sample=False)
    gc = ours.generate(input_ids=ids, attention_mask=am, max_new_tokens=8, do_sample=False)
    assert torch.equal(ge, gc)


@pytest.fixture
def received(monkeypatch):
    """Every call of the registered function: (attention_mask, T_q, T_k, pattern, n)."""
    from causalattn.integrations import hf_attention as integration

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


# ---- pattern_from_hf on its own: what each mask HF can hand over becomes -------------------
def _qk(B=2, H=4, T_q=8, T_k=8, H_kv=2):
    return torch.zeros(B, H, T_q, 3), torch.zeros(B, H_kv, T_k, 3)


def _hf_mask(pattern, B, T_q, T_k, H=1):
    """HF's boolean (B, 1, T_q, T_k) mask for a pattern (True = may read)."""
    m = pattern.allowed(B, H, T_q, T_k, like=torch.zeros(()))
    return m.expand(B, H, T_q, T_k).contiguous()


KPM = [[True] * 8, [False] * 3 + [True] * 5]  # HF's padding: keys only (left padding here)


class _Module:
    def __init__(self, is_causal=True, chunk=None, layer_types=None, layer_idx=None):
        self.is_causal = is_causal
        self.layer_idx = layer_idx
        self.config = types.SimpleNamespace(attention_chunk_size=chunk, layer_types=layer_types)


@pytest.mark.parametrize(
    "kw,T_q,T_k,want,n",
    [
        ({}, 8, 8, "causal", 8),
        ({}, 1, 8, "causal", 8),  # a decoding step reads every key
        ({}, 3, 8, "causal", 3),  # a StaticCache prefill: the first T_q slots only
        ({"is_causal": False}, 3, 8, "bidirectional", 8),
        ({"sliding_window": 4}, 8, 8, "causal + window 4", 8),
        ({"sliding_window": 4, "is_causal": False}, 8, 8, "bidirectional", 8),
        ({"softcap": 5.0}, 8, 8, "causal + softcap 5", 8),
        ({"softcap": 0.0}, 8, 8, "causal", 8),  # HF passes 0 for "none"
        ({"s_aux": [0.0] * 4}, 8, 8, "causal + sinks", 8),
    ],
)
def test_no_mask_is_the_plain_pattern_with_keywords(kw, T_q, T_k, want, n):
    from causalattn.integrations.hf_pattern import pattern_from_hf

    if "s_aux" in kw:
        kw = {**kw, "s_aux": torch.tensor(kw["s_aux"])}
    pat, got_n = pattern_from_hf(None, *_qk(T_q=T_q, T_k=T_k), None, **kw)
    assert pat.describe() == want and got_n == n
    assert pat.mask is None and pat.lengths is None and pat.key_padding_mask is None


def test_the_modules_is_causal_is_read_unless_the_call_says():
    from causalattn.integrations.hf_pattern import pattern_from_hf

    q, k = _qk()
    assert not pattern_from_hf(_Module(is_causal=False), q, k, None)[0].causal
    assert pattern_from_hf(_Module(is_causal=False), q, k, None, is_causal=True)[0].causal
    assert not pattern_from_hf(_Module(), q, k, None, is_causal=False)[0].causal
    assert pattern_from_hf(object(), q, k, None)[0].causal  # no is_causal attribute: causal


@pytest.mark.parametrize(
    "truth,B,T_q,T_k,kw,want",
    [
        (Pattern(), 2, 8, 8, {}, {"causal": True}),
        (Pattern(key_padding_mask=KPM), 2, 8, 8, {}, "key_padding_mask"),
        (Pattern(window=3), 1, 8, 8, {"sliding_window": 3}, {"window": 3}),
        (
            Pattern(window=3, key_padding_mask=KPM),
            2,
            8,
            8,
            {"sliding_window": 3},
            "key_padding_mask",
        ),
        (Pattern(cu_seqlens=[0, 3, 5, 8]), 1, 8, 8, {}, {"cu_seqlens": [0, 3, 5, 8]}),
        (
            Pattern(window=2, cu_seqlens=[0, 5, 8]),
            1,
            8,
            8,
            {"sliding_window": 2},
            {"window": 2, "cu_seqlens": [0, 5, 8]},
        ),
        (Pattern(causal=False), 1, 8, 8, {"is_causal": False}, {"causal": False}),
        (Pattern(), 2, 1, 8, {}, {"causal": True}),  # decoding: one query, every key
    ],
)
def test_a_structured_mask_becomes_its_rules_not_a_dense_mask(truth, B, T_q, T_k, kw, want):
    """HF's dense mask is searched for the structured pattern that gives it bit for bit."""
    from causalattn.integrations.hf_pattern import pattern_from_hf

    mask = _hf_mask(truth, B, T_q, T_k)
    pat, n = pattern_from_hf(None, *_qk(B=B, T_q=T_q, T_k=T_k), mask, **kw)
    assert pat.mask is None and n == T_k, pat.describe()
    assert torch.equal(pat.allowed(B, 4, T_q, T_k, like=mask).expand_as(mask), mask)
    if want == "key_padding_mask":
        assert pat.key_padding_mask is not None and "padding" in pat.describe()
    else:
        for name, value in want.items():
            got = getattr(pat, name)
            assert (got.tolist() if hasattr(got, "tolist") else got) == value, name
    assert pat.window == kw.get("sliding_window")


def test_a_static_caches_empty_slots_are_dropped():
    """Keys no query reads at the end (a StaticCache's unfilled slots): n is the filled part."""
    from causalattn.integrations.hf_pattern import pattern_from_hf

    mask = torch.zeros(2, 1, 3, 16, dtype=torch.bool)
    mask[..., :7] = _hf_mask(Pattern(), 2, 3, 7)  # 7 filled slots, the last 3 queries
    mask[1, :, :, :2] = False  # left padding of the second sequence
    pat, n = pattern_from_hf(None, *_qk(T_q=3, T_k=16), mask)
    assert n == 7 and pat.mask is None and pat.key_padding_mask.shape == (2, 7)
    assert torch.equal(pat.allowed(2, 1, 3, 7, like=mask), mask[..., :7])
    mask[0, 0, 2, 12] = True  # one query reads a late slot: all 16 keys count
    pat, n = pattern_from_hf(None, *_qk(T_q=3, T_k=16), mask)
    assert n == 16 and torch.equal(pat.allowed(2, 1, 3, 16, like=mask).expand_as(mask), mask)


@pytest.mark.parametrize("B,H", [(2, 1), (1, 1), (2, 4)])
def test_a_mask_no_rule_gives_is_the_dense_mask_itself(B, H):
    from causalattn.integrations.hf_pattern import pattern_from_hf

    g = torch.Generator().manual_seed(B * 10 + H)
    mask = torch.rand(B, H, 6, 6, generator=g) > 0.5
    mask[..., torch.arange(6), torch.arange(6)] = True
    pat, n = pattern_from_hf(None, *_qk(B=B, T_q=6, T_k=6), mask)
    assert (
        n == 6 and not pat.causal and pat.mask is mask and pat.describe() == "bidirectional + mask"
    )
    docs = _hf_mask(Pattern(cu_seqlens=[0, 2, 6]), 1, 6, 6)
    docs[0, 0, 5, 0] = True  # almost documents: one cell across
    pat, _ = pattern_from_hf(None, *_qk(B=1, T_q=6, T_k=6), docs)
    assert pat.mask is not None and pat.cu_seqlens is None


def test_additive_float_masks_are_read_as_blocked_and_allowed():
    from causalattn.integrations.hf_pattern import pattern_from_hf

    allowed = _hf_mask(Pattern(key_padding_mask=KPM), 2, 8, 8)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for fill in (torch.finfo(dtype).min, float("-inf")):
            additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, fill)
            pat, n = pattern_from_hf(None, *_qk(T_q=8, T_k=8), additive)
            assert pat.mask is None and "padding" in pat.describe()
            assert torch.equal(pat.allowed(2, 1, 8, 8, like=allowed), allowed)


# masks are built in the test, not at collection: a torch op at import starts OpenMP's
# threads, and processes forked from one that did (mutmut's workers) can hang in them
BAD_MASKS = [
    (
        lambda: torch.zeros(2, 1, 8, 8, dtype=torch.int64),
        r"dtype torch.int64; expected bool or float",
    ),
    (
        lambda: torch.ones(2, 8, 8, dtype=torch.bool),
        r"must be \(B, 1, T_q, T_k\) = \(2, 1, 8, 8\), got \(2, 8, 8\)",
    ),
    (lambda: torch.ones(3, 1, 8, 8, dtype=torch.bool), r"got \(3, 1, 8, 8\)"),
    (lambda: torch.ones(2, 3, 8, 8, dtype=torch.bool), r"got \(2, 3, 8, 8\)"),
    (lambda: torch.ones(2, 1, 7, 8, dtype=torch.bool), r"got \(2, 1, 7, 8\)"),
    (lambda: torch.ones(2, 1, 8, 9, dtype=torch.bool), r"got \(2, 1, 8, 9\)"),
]


def _additive(shape, fill):
    """A causal additive mask with ``fill`` above the diagonal."""
    return torch.zeros(shape).masked_fill(torch.ones(shape[-2:], dtype=torch.bool).triu(1), fill)


@pytest.mark.parametrize("make,match", BAD_MASKS)
def test_masks_that_are_not_who_may_read_whom_are_refused(make, match):
    from causalattn.integrations.hf_pattern import pattern_from_hf

    with pytest.raises(ValueError, match=f"^causalattn attention: .*{match}"):
        pattern_from_hf(None, *_qk(T_q=8, T_k=8), make())


@pytest.mark.parametrize("name", ["alibi", "attn_bias"])
def test_score_biases_and_bad_keywords_are_refused_by_name(name):
    """A model's ALiBi tensor and an attn_bias are refused by name (position_bias and
    additive float masks go in as the pattern's bias)."""
    from causalattn.integrations.hf_pattern import REFUSED_KWARGS, SUPPORTED_KWARGS, pattern_from_hf

    assert name in REFUSED_KWARGS and "sliding_window" in SUPPORTED_KWARGS
    assert "position_bias" in SUPPORTED_KWARGS and "position_bias" not in REFUSED_KWARGS
    q, k = _qk()
    with pytest.raises(ValueError, match=f"^causalattn attention: '{name}' \\("):
        pattern_from_hf(None, q, k, None, **{name: torch.zeros(1)})
    assert pattern_from_hf(None, q, k, None, **{name: None})[0].is_plain_causal  # None: absent
    for w in (0, -3):
        with pytest.raises(ValueError, match=f"sliding_window must be >= 1, got {w}$"):
            pattern_from_hf(None, q, k, None, sliding_window=w)
    with pytest.raises(ValueError, match=r"one logit per head, \(H,\) = \(4,\); got \(2, 2\)"):
        pattern_from_hf(None, q, k, None, s_aux=torch.zeros(2, 2))


def test_llama4_chunks_come_from_the_config_on_chunked_layers_only():
    from causalattn.integrations.hf_pattern import _chunk_of, pattern_from_hf

    types_ = ["chunked_attention", "full_attention"]
    assert _chunk_of(_Module(chunk=4, layer_types=types_, layer_idx=0)) == 4
    assert _chunk_of(_Module(chunk=4, layer_types=types_, layer_idx=1)) is None
    assert _chunk_of(_Module(chunk=4, layer_types=types_, layer_idx=5)) == 4  # beyond the list
    assert _chunk_of(_Module(chunk=4)) == 4  # no layer types: every layer
    for c in (None, 0, -2, 4.0, "4"):
        assert _chunk_of(_Module(chunk=c)) is None
    assert _chunk_of(None) is None and _chunk_of(object()) is None
    mask = _hf_mask(Pattern(chunk=4, key_padding_mask=KPM), 2, 8, 8)
    pat, _ = pattern_from_hf(_Module(chunk=4, layer_types=types_, layer_idx=0), *_qk(), mask)
    assert pat.chunk == 4 and pat.mask is None and "padding" in pat.describe()
    plain = _hf_mask(Pattern(key_padding_mask=KPM), 2, 8, 8)  # a layer HF did not chunk
    pat, _ = pattern_from_hf(_Module(chunk=4, layer_types=types_, layer_idx=0), *_qk(), plain)
    assert pat.chunk is None and pat.mask is None


def test_the_structure_of_a_mask_is_found_once_per_tensor():
    """Every layer gets the same mask tensor: its structure is remembered, for that very
    tensor, unchanged (an in-place change is read anew)."""
    from causalattn.integrations import hf_pattern

    q, k = _qk()
    mask = _hf_mask(Pattern(key_padding_mask=KPM), 2, 8, 8)
    calls = []
    real = hf_pattern._structure

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(hf_pattern, "_structure", counting)
        m.setattr(hf_pattern, "_MEMO", hf_pattern._Memo())
        first, _ = hf_pattern.pattern_from_hf(None, q, k, mask)
        n = len(calls)
        assert n >= 1 and first.mask is None
        again, _ = hf_pattern.pattern_from_hf(None, q, k, mask)
        assert len(calls) == n and again.describe() == first.describe()
        hf_pattern.pattern_from_hf(None, q, k, mask.clone())  # an equal but other tensor
        assert len(calls) == 2 * n
        hf_pattern.pattern_from_hf(None, q, k, mask, sliding_window=3)  # other keywords
        assert len(calls) > 2 * n
        before = len(calls)
        mask[0, 0, 2, 5] = True  # changed in place: a future key
        changed, _ = hf_pattern.pattern_from_hf(None, q, k, mask)
        assert len(calls) > before and changed.mask is not None
    memo = hf_pattern._Memo(size=2)
    ts = [torch.zeros(1) for _ in range(3)]
    for i, t in enumerate(ts):
        memo.put(t, ("k", i), i)
    assert memo.get(ts[2], ("k", 2)) == 2 and memo.get(ts[1], ("k", 1)) == 1
    assert memo.get(ts[0], ("k", 0)) is None  # the oldest was let go
    assert memo.get(ts[1], ("k", 2)) is None  # same tensor, other key


def test_two_one_token_documents_and_a_mask_shared_by_the_batch():
    """The smallest packing (two documents of one token, T = 2) is read as documents; one
    token is no packing. A (1, 1, T, T) mask HF shares over a batch of 2 with a key no query
    reads becomes a key padding mask for both rows."""
    from causalattn.integrations.hf_pattern import pattern_from_hf

    two = _hf_mask(Pattern(cu_seqlens=[0, 1, 2]), 1, 2, 2)
    pat, n = pattern_from_hf(None, *_qk(B=1, T_q=2, T_k=2), two)
    assert n == 2 and pat.mask is None and pat.cu_seqlens.tolist() == [0, 1, 2]
    one = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    pat, n = pattern_from_hf(None, *_qk(B=1, T_q=1, T_k=1), one)
    assert n == 1 and pat.is_plain_causal
    hole = [[True] * 3 + [False] + [True] * 4]
    shared = _hf_mask(Pattern(key_padding_mask=hole), 1, 8, 8)  # (1, 1, 8, 8)
    pat, n = pattern_from_hf(None, *_qk(B=2, T_q=8, T_k=8), shared)
    assert n == 8 and pat.mask is None and pat.key_padding_mask.shape == (2, 8)
    assert pat.key_padding_mask.tolist() == hole * 2
    assert torch.equal(pat.allowed(2, 1, 8, 8, like=shared), shared.expand(2, 1, 8, 8))


def test_documents_are_read_off_a_mask_whatever_the_default_device():
    """The positions that index the mask are made on the mask's device."""
    from causalattn.integrations.hf_pattern import pattern_from_hf

    docs = _hf_mask(Pattern(cu_seqlens=[0, 3, 8]), 1, 8, 8)
    q, k = _qk(B=1)
    with torch.device("meta"):
        pat, n = pattern_from_hf(None, q, k, docs)
    assert n == 8 and pat.mask is None and pat.cu_seqlens.tolist() == [0, 3, 8]


def test_the_memo_holds_the_last_four_masks():
    from causalattn.integrations import hf_pattern

    memo = hf_pattern._Memo()
    ts = [torch.zeros(1) for _ in range(5)]
    for i, t in enumerate(ts):
        memo.put(t, ("k", i), i)
    assert [memo.get(t, ("k", i)) for i, t in enumerate(ts)] == [None, 1, 2, 3, 4]


def test_a_mask_no_query_may_read_pads_every_key():
    """No readable cell at all (every row empty): every key is padding, all T_k kept."""
    from causalattn.integrations.hf_pattern import pattern_from_hf

    none = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    pat, n = pattern_from_hf(None, *_qk(B=1, T_q=4, T_k=4), none)
    assert n == 4 and pat.mask is None and pat.key_padding_mask.tolist() == [[False] * 4]
    assert not pat.allowed(1, 1, 4, 4, like=none).any()


def test_documents_are_looked_for_in_one_square_mask_only():
    """A dense mask of fewer queries than keys, every key read by some query, is the mask
    itself (documents need T_q = T_k and one sequence)."""
    from causalattn.integrations.hf_pattern import pattern_from_hf

    g = torch.Generator().manual_seed(4)
    for B in (1, 2):
        mask = torch.rand(B, 1, 3, 8, generator=g) > 0.5
        mask[:, :, 0, :] = True  # every key read
        mask[:, :, 1, 2] = False
        pat, n = pattern_from_hf(None, *_qk(B=B, T_q=3, T_k=8), mask)
        assert n == 8 and pat.mask is mask and not pat.causal


def test_an_additive_mask_is_blocked_at_half_finfo_min_and_below_and_a_bias_above():
    """Blocked: at or below finfo.min / 2 (HF adds finfo.min to masks that may already hold
    one); 0 may read with no bias; any other value is read with that bias added."""
    from causalattn.integrations.hf_pattern import pattern_from_hf

    half = torch.finfo(torch.float32).min / 2
    edge = _additive((1, 1, 8, 8), half)
    pat, _ = pattern_from_hf(None, *_qk(B=1), edge)
    assert pat.is_plain_causal and pat.bias is None
    above = _additive((1, 1, 8, 8), half * 0.8)
    pat, _ = pattern_from_hf(None, *_qk(B=1), above)
    assert pat.mask is not None and bool(torch.as_tensor(pat.mask).all())  # every cell read
    torch.testing.assert_close(torch.as_tensor(pat.bias), above)  # with the mask as its bias
    pat, _ = pattern_from_hf(None, *_qk(T_q=8, T_k=8), torch.full((2, 1, 8, 8), 0.5))
    assert torch.equal(torch.as_tensor(pat.bias), torch.full((2, 1, 8, 8), 0.5))


def test_llama4_chunk_of_one_and_a_layer_just_past_the_types():
    from causalattn.integrations.hf_pattern import _chunk_of

    types_ = ["full_attention", "chunked_attention"]
    assert _chunk_of(_Module(chunk=1)) == 1
    assert _chunk_of(_Module(chunk=4, layer_types=types_, layer_idx=2)) == 4
    assert _chunk_of(_Module(chunk=4, layer_types=types_, layer_idx=1)) == 4
    assert _chunk_of(_Module(chunk=4, layer_types=types_, layer_idx=0)) is None


@pytest.mark.parametrize(
    "name,what",
    [
        ("alibi", "a model's own ALiBi tensor; causalattn takes the slopes"),
        ("attn_bias", "an additive score bias of a layout causalattn does not read"),
    ],
)
def test_a_score_term_it_cannot_read_is_refused_with_the_eager_way_out(name, what):
    from causalattn.integrations.hf_pattern import pattern_from_hf

    with pytest.raises(ValueError) as e:
        pattern_from_hf(None, *_qk(), None, **{name: torch.zeros(1)})
    assert str(e.value) == (
        f"causalattn attention: '{name}' ({what}) is not supported; use attn_implementation='eager'"
    )
    pat, _ = pattern_from_hf(None, *_qk(), None, position_bias=torch.zeros(1))
    assert pat.bias is not None  # position_bias is read, as the pattern's bias


def test_a_window_of_one_and_a_two_token_prefill_into_a_static_cache():
    """sliding_window = 1 is a window (each query reads itself); without a mask, 2 queries
    before 8 keys are a prefill into an empty StaticCache: the first 2 keys only."""
    from causalattn.integrations.hf_pattern import pattern_from_hf

    pat, n = pattern_from_hf(None, *_qk(), None, sliding_window=1)
    assert pat.window == 1 and n == 8
    pat, n = pattern_from_hf(None, *_qk(T_q=2, T_k=8), None)
    assert pat.is_plain_causal and n == 2
    pat, n = pattern_from_hf(None, *_qk(T_q=1, T_k=8), None)  # decoding: every key
    assert pat.is_plain_causal and n == 8


def test_a_position_bias_and_an_additive_mask_s_bias_add_up_in_the_query_s_dtype():
    """pattern_from_hf's bias: position_bias plus the finite cells of an additive float mask,
    in the queries' dtype; over the n keys that are read (a StaticCache prefill drops the rest)."""
    from causalattn.integrations.hf_pattern import pattern_from_hf

    q, k = (t.double() for t in _qk(B=1, H=2, T_q=4, T_k=4, H_kv=2))
    g = torch.Generator().manual_seed(8)
    pb = torch.randn(1, 2, 4, 4, generator=g, dtype=torch.float64)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    extra = torch.randn(1, 1, 4, 4, generator=g)  # float32: a mask of another dtype
    additive = extra.masked_fill(~causal, torch.finfo(torch.float32).min)
    pat, n = pattern_from_hf(None, q, k, additive, position_bias=pb)
    assert n == 4 and pat.bias.dtype == torch.float64
    want = (pb + extra.double()).masked_fill(~causal, 0)
    torch.testing.assert_close(pat.bias.masked_fill(~causal, 0), want, rtol=0, atol=0)
    pat, _ = pattern_from_hf(None, q, k, additive)  # the mask's bias alone, in q's dtype
    assert pat.bias.dtype == torch.float64
    # prefill into an empty StaticCache (no mask, T_q < T_k): the bias over the first T_q keys
    q, k = _qk(B=1, H=2, T_q=3, T_k=8, H_kv=2)
    pb = torch.randn(1, 2, 3, 8, generator=g)
    pat, n = pattern_from_hf(None, q, k, None, position_bias=pb)
    assert n == 3 and torch.equal(pat.bias, pb[..., :3])
    pat, n = pattern_from_hf(None, q, k, None, position_bias=pb[..., :1])  # broadcast keys
    assert n == 3 and torch.equal(pat.bias, pb[..., :1])
    # with a mask: the causal first 2 of 8 slots read (a StaticCache filled to 2)
    q, k = _qk(B=1, H=2, T_q=2, T_k=8, H_kv=2)
    mask = torch.zeros(1, 1, 2, 8, dtype=torch.bool)
    mask[..., :2] = torch.ones(2, 2, dtype=torch.bool).tril()
    pb = torch.randn(1, 2, 2, 8, generator=g)
    pat, n = pattern_from_hf(None, q, k, mask, position_bias=pb)
    assert n == 2 and torch.equal(pat.bias, pb[..., :2])


@pytest.mark.parametrize(
    "bias, got",
    [
        (torch.zeros(4, 4, dtype=torch.int64), "torch.Size([4, 4])"),
        (torch.zeros(1, 1, 1, 4, 4), "torch.Size([1, 1, 1, 4, 4])"),
        ([[0.0]], "<class 'list'>"),
    ],
)
def test_a_position_bias_that_is_no_float_tensor_of_at_most_4_axes_is_refused_naming_it(bias, got):
    from causalattn.integrations.hf_pattern import pattern_from_hf

    q, k = _qk(B=1, H=2, T_q=4, T_k=4, H_kv=2)
    with pytest.raises(ValueError) as err:
        pattern_from_hf(None, q, k, None, position_bias=bias)
    assert str(err.value) == (
        "causalattn attention: position_bias must be a float tensor broadcastable to "
        f"(B, H, T_q, T_k) = (1, 2, 4, 4), got {got}"
    )
    assert pattern_from_hf(None, q, k, None, position_bias=torch.zeros(1, 1, 4, 4))[1] == 4


def test_an_attention_mask_holding_nan_is_refused():
    from causalattn.integrations.hf_pattern import pattern_from_hf

    q, k = _qk(B=1, H=2, T_q=4, T_k=4, H_kv=2)
    mask = torch.zeros(1, 1, 4, 4)
    mask[0, 0, 1, 0] = float("nan")
    with pytest.raises(ValueError) as err:
        pattern_from_hf(None, q, k, mask)
    assert str(err.value) == "causalattn attention: attention_mask holds NaN"
