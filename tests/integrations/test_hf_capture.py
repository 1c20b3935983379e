"""capture(): per-layer Traces of tiny random Hugging Face models equal eager's weights."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import _hf_tiny as tiny  # noqa: E402

import causalattn as ca  # noqa: E402
from causalattn.integrations import hf_capture  # noqa: E402
from causalattn.integrations.transformers import _accepted, capture  # noqa: E402

FLOOR = 1e-6
T = 14  # longer than the windows and chunks (4) of the tiny models
NEEDS = {
    "mistral": {"window"},
    "qwen2": {"window"},
    "gemma2": {"window", "softcap"},
    "gpt_oss": {"window", "sinks"},
    "llama4": {"chunk"},
}


def _model(name):
    missing = NEEDS.get(name, set()) - _accepted()
    if missing:
        pytest.skip(f"causalattn.attention does not take {sorted(missing)} yet")
    return tiny.model(name)


@pytest.fixture(scope="module")
def tok():
    return tiny.tokenizer()


def batch(pad: str):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, tiny.VOCAB, (2, T), generator=g)
    am = torch.ones(2, T, dtype=torch.long)
    if pad == "right":
        am[1, 9:] = 0
    elif pad == "left":
        am[1, :5] = 0
    return ids, am


def eager_attentions(model, ids, am):
    model.set_attn_implementation(tiny.register_eager_safe())
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    try:
        with torch.no_grad():
            out = model(ids, attention_mask=am, position_ids=pos, output_attentions=True)
    finally:
        model.set_attn_implementation("eager")
    return out.attentions


@pytest.mark.parametrize("pad", ["none", "left", "right"])
@pytest.mark.parametrize("name", list(tiny.CONFIGS))
def test_capture_equals_eager_weights(name, pad):
    model = _model(name)
    ids, am = batch(pad)
    traces = capture(model, ids, attention_mask=am)
    plain = eager_attentions(model, ids, am)
    ref = eager_attentions(copy.deepcopy(model).double(), ids, am)
    n_layers = model.config.num_hidden_layers
    assert [tr.layer for tr in traces] == list(range(n_layers))
    real = am.bool()[:, None, :, None].expand(-1, plain[0].shape[1], -1, T)  # real query rows
    for tr, a32, a64 in zip(traces, plain, ref):
        assert tr.A.shape == tuple(a32.shape)  # (B, H, T, T): GQA expanded to every head
        ours = torch.from_numpy(tr.A).double()
        err = (ours - a64)[real].abs().max().item()
        bound = 2 * (a32.double() - a64)[real].abs().max().item() + FLOOR
        assert err <= bound, f"{name}/{pad} layer {tr.layer}: {err:.3g} > {bound:.3g}"
        assert (a64[real] > 0.6).any()  # weights far from uniform: a wrong mask would show
        blocked = ~torch.from_numpy(np.broadcast_to(tr.allowed, tr.A.shape).copy())
        assert (ours[blocked] == 0).all()  # forbidden entries exactly zero


def test_capture_kinds_of_pattern():
    """The layers' patterns are read right: windows where the config puts them."""
    names = {
        "mistral": ["causal + window 4"] * 2,
        "qwen2": ["causal", "causal + window 4", "causal + window 4"],
        "gemma2": ["causal + window 4 + softcap 5", "causal + softcap 5"],
        "gpt_oss": ["causal + window 4 + sinks", "causal + sinks"],
        "llama4": ["causal + chunk 4"] * 3 + ["causal"],
    }
    for name, want in names.items():
        if NEEDS[name] - _accepted():
            continue
        traces = capture(tiny.model(name), torch.arange(3, 3 + T)[None])
        assert [tr.received.describe() for tr in traces] == want, name
        assert [tr.pattern.describe() for tr in traces] == want, name


def test_trace_contents_and_tokens(tok):
    model = tiny.model("llama")
    text = "The cat sat on the mat."
    ids = tok(text, return_tensors="pt")["input_ids"]
    (tr,) = capture(model, ids, layers=[-1], tokenizer=tok)
    n = ids.shape[1]
    assert tr.layer == 1 and tr.n_heads == 4
    assert tr.names == ["Q", "K", "V", "S", "M", "Z", "A", "H", "C", "W_o", "O"]
    assert tr.Q.shape == (4, n, 8) and tr.K.shape == (4, n, 8)  # 2 KV heads -> 4
    assert np.array_equal(tr.K[0], tr.K[1]) and not np.array_equal(tr.K[1], tr.K[2])
    assert tr.O.shape == (n, 32) and tr.W_o.shape == (32, 32)
    assert "".join(tr.tokens) == text  # readable: 'Ġ' shown as a space
    assert " cat" in tr.tokens
    assert tr.A.dtype == np.float32
    # the four quantities of the seed, for a real layer
    ex = tr.select(2).explain(3)
    np.testing.assert_allclose(ex.h, tr.H[2, 3], rtol=1e-5, atol=1e-6)
    report = ca.audit(tr)
    assert report.ok, str(report)


def test_memory_keeps_only_linear_arrays():
    model = tiny.model("gpt2")
    ids = torch.randint(3, tiny.VOCAB, (1, 48), generator=torch.Generator().manual_seed(0))
    traces = capture(model, ids)
    for tr in traces:
        kept = tr._rec
        arrays = [kept.Q, kept.K, kept.V, kept.H, kept.O, kept.W_o]
        assert all(a.dtype == np.float32 for a in arrays)
        assert all(a.shape[-2] != a.shape[-1] or a is kept.W_o for a in arrays)  # no T×T kept
        assert sum(a.nbytes for a in arrays) == 4 * (4 * 4 * 48 * 8 + 48 * 32 + 32 * 32)
    a0 = traces[0].A
    assert np.shares_memory(traces[0].A, a0)  # a layer's stages are computed once while read
    assert traces[1].A.shape == a0.shape
    assert not np.shares_memory(traces[0].A, a0)  # ... and only the last layer read keeps them
    np.testing.assert_array_equal(traces[0].A, a0)


def test_hostile_token_is_text(tok):
    model = tiny.model("gpt2")
    text = '<script>alert(1)</script> & "quotes"'
    ids = tok(text, return_tensors="pt")["input_ids"]
    (tr,) = capture(model, ids, layers=0, tokenizer=tok)
    assert "".join(tr.tokens) == text


@pytest.mark.parametrize("name", list(tiny.CONFIGS))
def test_audit_passes_every_layer(name):
    """Windows, softcap, sinks and chunks are audited against each layer's declared pattern.
    (Llama 4 runs unpadded here: HF counts its chunks from each row's first real token,
    which no Pattern declares, and the audit reads a dense declared mask as causal.)"""
    model = _model(name)
    ids, am = batch("none" if name == "llama4" else "left")
    for tr in capture(model, ids, attention_mask=am):
        report = ca.audit(tr)
        assert report.ok, f"layer {tr.layer}: {report.first_failure}"


def _first_failures(model, ids):
    return [
        (tr.layer, None if ca.audit(tr).ok else ca.audit(tr).first_failure.stage)
        for tr in capture(model, ids)
    ]


def test_dropped_mask_fails_at_that_layer_stage_m(monkeypatch):
    model = tiny.model("llama")
    attn = model.model.layers[1].self_attn
    forward = attn.forward

    def no_mask(*args, **kwargs):  # the layer's attention is handed no mask, not causal
        kwargs["attention_mask"] = None
        return forward(*args, **kwargs)

    monkeypatch.setattr(attn, "forward", no_mask)
    monkeypatch.setattr(attn, "is_causal", False)
    ids = torch.arange(3, 3 + T)[None]
    assert _first_failures(model, ids) == [(0, None), (1, "M")]


def _softmax_down_columns(Z):
    """The softmax over the query axis (a bug), blocked cells still exactly 0."""
    blocked = np.isneginf(Z)
    Zf = np.where(blocked, -1e300, Z)
    E = np.exp(Zf - Zf.max(-2, keepdims=True))
    return np.where(blocked, 0.0, E / E.sum(-2, keepdims=True))


def test_softmax_over_queries_fails_at_that_layer_stage_a(monkeypatch):
    stages = hf_capture.CapturedTrace._stages

    def broken(self):
        st = stages(self)
        if self.layer == 1:
            st["A"] = _softmax_down_columns(st["Z"])
        return st

    monkeypatch.setattr(hf_capture.CapturedTrace, "_stages", broken)
    model = tiny.model("gpt2")
    ids = torch.arange(3, 3 + T)[None]
    assert _first_failures(model, ids) == [(0, None), (1, "A")]
    report = ca.audit(capture(model, ids, layers=[1])[0])
    assert "query axis" in report.first_failure.hint


def test_bad_input():
    model = tiny.model("gpt2")
    ids = torch.arange(3, 13)[None]
    with pytest.raises(ValueError, match="layer 2 is out of range; the model has 2 layers"):
        capture(model, ids, layers=[2])
    with pytest.raises(ValueError, match="layer -3 is out of range"):
        capture(model, ids, layers=[-3])
    with pytest.raises(ValueError, match="layers is empty"):
        capture(model, ids, layers=[])
    with pytest.raises(ValueError, match="input_ids is empty"):
        capture(model, torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="T = 65 tokens but the model's context is 64"):
        capture(model, torch.ones(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="integer token ids"):
        capture(model, torch.ones(1, 5))
    with pytest.raises(ValueError, match=r"attention_mask must be \(B, T\)"):
        capture(model, ids, attention_mask=torch.ones(1, 4))
    assert model.config._attn_implementation == "eager"  # switched back after each run


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_model_audits_ok(dtype):
    """A bf16/fp16 model's recorded layers run in float32 and are rounded on the way back:
    the trace holds the float32 results, so the audit's float32 tolerance is the right one."""
    model = tiny.model("gpt2").to(dtype)
    ids = torch.arange(3, 3 + T)[None]
    for tr in capture(model, ids):
        assert ca.audit(tr).ok, tr.layer
    assert next(model.parameters()).dtype == dtype
