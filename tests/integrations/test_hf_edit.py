"""ablate() and patch() through the attention function: equal to editing a head's output by
hand before the layer's output projection, in two families; the model restored exactly."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import _hf_tiny as tiny  # noqa: E402

from causalattn.integrations.hf_taps import projection  # noqa: E402
from causalattn.integrations.transformers import ablate, capture, patch  # noqa: E402

T, D_V = 12, 8  # the tiny models' head size is 8
IDS = torch.randint(3, tiny.VOCAB, (2, T), generator=torch.Generator().manual_seed(0))
SOURCE = torch.randint(3, tiny.VOCAB, (2, T), generator=torch.Generator().manual_seed(1))


def _proj(model, layer):
    return projection(model.get_submodule(_attention_name(model, layer)))


def _attention_name(model, layer):
    return {"gpt2": f"transformer.h.{layer}.attn", "llama": f"model.layers.{layer}.self_attn"}[
        model.config.model_type
    ]


def _by_hand(model, layer, head, fill, ids=IDS):
    """Logits with head `head` of `layer` replaced by fill(its columns) at the projection's
    input (B, T, H·d_v), the eager model otherwise."""
    cols = slice(head * D_V, (head + 1) * D_V)

    def pre(mod, args):
        x = args[0].clone()
        x[..., cols] = fill(x[..., cols])
        return (x,)

    handle = _proj(model, layer).register_forward_pre_hook(pre)
    try:
        with torch.no_grad():
            return model(ids).logits
    finally:
        handle.remove()


def _projection_input(model, layer, ids):
    seen = []
    handle = _proj(model, layer).register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        handle.remove()
    return seen[0]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_ablate_zero_and_mean_equal_the_head_set_by_hand(name):
    model = tiny.model(name)
    with torch.no_grad():
        plain = model(IDS).logits
    for how in ("zero", "mean"):
        with ablate(model, heads=[(1, 2)], how=how), torch.no_grad():
            ours = model(IDS).logits
        if how == "zero":
            want = _by_hand(model, 1, 2, torch.zeros_like)
        else:
            mean = _projection_input(model, 1, IDS)[..., 2 * D_V : 3 * D_V].mean(dim=(0, 1))
            want = _by_hand(model, 1, 2, lambda x, m=mean: m.expand_as(x))
        assert (ours - want).abs().max() < 1e-4, how
        assert (want - plain).abs().max() > 1e-2  # the head mattered: the test can fail
    with ablate(model, heads=[(0, 0), (1, 3)]), torch.no_grad():
        both = model(IDS).logits
    handle = _proj(model, 0).register_forward_pre_hook(
        lambda m, a: (torch.cat([torch.zeros_like(a[0][..., :D_V]), a[0][..., D_V:]], -1),)
    )
    try:
        want = _by_hand(model, 1, 3, torch.zeros_like)
    finally:
        handle.remove()
    assert (both - want).abs().max() < 1e-4


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_patch_equals_the_heads_output_from_the_source_run(name):
    model = tiny.model(name)
    with patch(model, SOURCE, heads=[(1, 1)]), torch.no_grad():
        ours = model(IDS).logits
    src = _projection_input(model, 1, SOURCE)[..., D_V : 2 * D_V]
    want = _by_hand(model, 1, 1, lambda x: src)
    assert (ours - want).abs().max() < 1e-4
    with patch(model, IDS, heads=[(1, 1)]), torch.no_grad():  # patched from itself: no change
        same = model(IDS).logits
    with torch.no_grad():
        assert (same - model(IDS).logits).abs().max() < 1e-4
    with patch(model, SOURCE[:1], heads=[(0, 0)]), torch.no_grad():  # one source, two runs
        model(IDS)
    with pytest.raises(ValueError, match=r"patch: layer 0 is called with \(B, T_q\) = \(2, 5\)"):
        with patch(model, SOURCE, heads=[(0, 0)]), torch.no_grad():
            model(IDS[:, :5])


def _state(model):
    return {
        "impl": model.config._attn_implementation,
        "training": model.training,
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
        "attributes": {n: sorted(vars(m)) for n, m in model.named_modules()},
        "hooks": sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()),
    }


def _same(a, b):
    assert a["impl"] == b["impl"] and a["training"] == b["training"]
    assert a["attributes"] == b["attributes"] and a["hooks"] == b["hooks"]
    assert a["weights"].keys() == b["weights"].keys()
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])


def test_nested_and_raising_contexts_restore_the_model_exactly():
    model = tiny.model("llama")
    before = _state(model)
    with torch.no_grad():
        plain = model(IDS).logits
    with ablate(model, heads=[(0, 1)]), torch.no_grad():
        one = model(IDS).logits
        with ablate(model, heads=[(1, 0)], how="mean"), patch(model, SOURCE, heads=[(1, 3)]):
            inner = model(IDS).logits
            traces = capture(model, IDS)  # capture inside: what the model computes there
        assert model.config._attn_implementation == "causalattn-tap"
        assert (model(IDS).logits - one).abs().max() < 1e-6  # the inner ones left, cleanly
    assert (inner - one).abs().max() > 1e-3 and len(traces) == 2
    _same(before, _state(model))
    with pytest.raises(RuntimeError, match="inside"):
        with ablate(model, heads=[(0, 1)]), patch(model, SOURCE, heads=[(1, 1)]):
            raise RuntimeError("inside")
    _same(before, _state(model))
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, plain)  # eager again, bit for bit
    ctx = ablate(model, heads=[(0, 0)])
    with ctx, pytest.raises(ValueError, match="already entered"):
        ctx.__enter__()
    _same(before, _state(model))


def test_bad_input():
    model = tiny.model("gpt2")
    with pytest.raises(
        ValueError, match=r"ablate: heads: layer 2 is out of range; the model has 2"
    ):
        ablate(model, heads=[(2, 0)])
    with pytest.raises(
        ValueError, match=r"head 4 of layer 1 is out of range; the model has 4 heads"
    ):
        ablate(model, heads=[(1, 4)])
    with pytest.raises(ValueError, match="layer -1 is out of range"):
        ablate(model, heads=[(-1, 0)])
    with pytest.raises(ValueError, match=r"pairs of integers \(0-based\), got \(1, 2, 3\)"):
        ablate(model, heads=[(1, 2, 3)])
    with pytest.raises(ValueError, match="pairs of integers"):
        ablate(model, heads=[(True, 0)])
    with pytest.raises(ValueError, match="heads is empty"):
        ablate(model, heads=[])
    with pytest.raises(ValueError, match="heads must be a list of"):
        ablate(model, heads=5)
    with pytest.raises(ValueError, match="how must be 'zero' or 'mean', got 'max'"):
        ablate(model, heads=[(0, 0)], how="max")
    with pytest.raises(ValueError, match=r"patch: heads: layer 3 is out of range"):
        patch(model, SOURCE, heads=[(3, 0)])
    with pytest.raises(ValueError, match="patch: source_ids must be integer token ids"):
        patch(model, torch.ones(1, 4), heads=[(0, 0)])
    with pytest.raises(ValueError, match="patch: source_ids is empty"):
        patch(model, torch.zeros(1, 0, dtype=torch.long), heads=[(0, 0)])
    assert model.config._attn_implementation == "eager"


def test_a_family_with_its_own_attention_code_is_refused():
    """Falcon: transformers keeps its own attention there; no registered function sees it."""
    cfg = transformers.FalconConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4
    )
    model = transformers.FalconForCausalLM(cfg).eval()
    impl = model.config._attn_implementation
    for call in (
        lambda: ablate(model, heads=[(0, 0)]),
        lambda: patch(model, IDS % 64, heads=[(0, 0)]),
        lambda: capture(model, IDS % 64),
    ):
        with pytest.raises(
            ValueError, match=r"FalconForCausalLM \(falcon\) keeps its own attention"
        ):
            call()
    assert model.config._attn_implementation == impl  # refused before anything changed
