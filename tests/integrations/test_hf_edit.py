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


def _two_heads_in_layer_1(model):
    """Llama's layer 1 cut to query heads 0 and 2 (one per key head; the config still
    says 4), as pruning heads leaves a layer."""
    from transformers.pytorch_utils import prune_linear_layer

    attn = model.get_submodule(_attention_name(model, 1))
    keep = torch.cat([torch.arange(h * D_V, (h + 1) * D_V) for h in (0, 2)])
    attn.q_proj = prune_linear_layer(attn.q_proj, keep, dim=0)
    attn.o_proj = prune_linear_layer(attn.o_proj, keep, dim=1)
    attn.num_key_value_groups = 1
    return model


def test_a_head_past_a_layers_own_count_is_refused_naming_it():
    """Layer 1 with 2 heads: head 2 of layer 1 passes the model's range, not the layer's."""
    model = _two_heads_in_layer_1(tiny.model("llama"))
    for heads in ([(1, 2)], [(0, 3), (1, 3)]):
        with pytest.raises(ValueError) as err:
            with ablate(model, heads=heads), torch.no_grad():
                model(IDS)
        assert str(err.value) == f"ablate: heads: layer 1 has 2 heads, not {heads[-1][1] + 1}"
    with ablate(model, heads=[(1, 1)]), torch.no_grad():  # the last one it has: runs
        model(IDS)


def test_patch_reads_the_source_with_its_attention_mask():
    """A left-padded source (row 1: 4 pads): the heads' outputs patched in are those of the
    source run with its mask (at the real tokens: a pad's row reads nothing, which the eager
    model and the attention function fill differently); a wrong shape is refused."""
    model = tiny.model("llama")
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :4] = 0
    seen = []
    handle = _proj(model, 1).register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    try:
        with torch.no_grad():
            model(SOURCE, attention_mask=mask)
    finally:
        handle.remove()
    src = seen[0][..., D_V : 2 * D_V]
    assert (src - _projection_input(model, 1, SOURCE)[..., D_V : 2 * D_V]).abs().max() > 1e-2
    want = _by_hand(model, 1, 1, lambda x: src)
    for given in (mask, mask.bool()):
        with patch(model, SOURCE, heads=[(1, 1)], attention_mask=given), torch.no_grad():
            ours = model(IDS).logits
        assert (ours[0] - want[0]).abs().max() < 1e-4
        assert (ours[1, 4:] - want[1, 4:]).abs().max() < 1e-4
    with pytest.raises(ValueError, match=r"patch: attention_mask must be \(B, T\) = \(2, 12\)"):
        patch(model, SOURCE, heads=[(1, 1)], attention_mask=mask[:, :5])


def test_a_run_unlike_the_source_is_refused_with_both_shapes():
    model = tiny.model("gpt2")
    with pytest.raises(ValueError) as err:
        with patch(model, SOURCE, heads=[(1, 0)]), torch.no_grad():
            model(IDS[:1, :7])
    assert str(err.value) == (
        "patch: layer 1 is called with (B, T_q) = (1, 7) but source_ids gave (2, 12); patch "
        "runs of the source's length and batch (or a source of one sequence), whole (no KV "
        "cache)"
    )
