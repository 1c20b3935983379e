"""The kept block table of a mask_mod (causalattn.masks_table): made once, kept across
calls of the keyword form, extended for a longer T_k, remade when a tensor or a field it
reads changes; create_block_mask as FlexAttention's; bad mask_mods named with the engine."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import flex_attention as fx

import causalattn as ca
from causalattn import masks, masks_table

ENGINES = ("tiled", "cpp")


def _qkv(T_q=200, T_k=300, B=2, H=4, H_kv=2, d=16):
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(B, H, T_q, d, generator=g),
        torch.randn(B, H_kv, T_k, d, generator=g),
        torch.randn(B, H_kv, T_k, d, generator=g),
    )


def _tables(fn):
    return [t for t, _ in masks_table._KEPT.get(fn, {}).values()]


@pytest.mark.parametrize("engine", ENGINES)
def test_the_keyword_form_keeps_its_table_across_calls(engine):
    doc = torch.arange(300) // 70

    def docs(b, h, q, kv):
        return doc[q] == doc[kv]

    q, k, v = _qkv()
    first = ca.attention(q, k, v, mask_mod=docs, engine=engine)
    (table,) = _tables(docs)
    n = table.evaluated
    assert n > 0
    again = ca.attention(q, k, v, mask_mod=docs, engine=engine)  # a new Pattern, same table
    assert table.evaluated == n and torch.equal(first, again)
    want = ca.attention(q, k, v, engine="reference", mask_mod=docs)
    torch.testing.assert_close(first, want.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("engine", ENGINES)
def test_an_inplace_write_to_a_captured_tensor_remakes_the_table(engine):
    doc = torch.arange(300) // 70

    def docs(b, h, q, kv):
        return doc[q] == doc[kv]

    q, k, v = _qkv()
    ca.attention(q, k, v, mask_mod=docs, engine=engine)
    doc[:150] = 0  # a version bump: the old table no longer says what docs says
    got = ca.attention(q, k, v, mask_mod=docs, engine=engine)
    assert len(_tables(docs)) == 2
    want = ca.attention(q, k, v, engine="reference", mask_mod=docs)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)


class _Config:  # a plain object a rule reads its setting from
    def __init__(self, window):
        self.window = window


@pytest.mark.parametrize("engine", ENGINES)
def test_a_changed_field_of_an_object_the_rule_reads_remakes_the_table(engine):
    """A rule reading a field of a plain object (a config) or of an object two steps away:
    after the field changes, the next call reads the new rule, not the kept table."""
    cfg = _Config(8)
    deep = {"cfg": _Config(8)}

    def near(b, h, q, kv):
        return q - kv < cfg.window

    def far(b, h, q, kv):
        return q - kv < deep["cfg"].window

    q, k, v = _qkv()
    for rule, holder in ((near, cfg), (far, deep["cfg"])):
        ca.attention(q, k, v, mask_mod=rule, engine=engine)
        holder.window = 40
        got = ca.attention(q, k, v, mask_mod=rule, engine=engine)
        assert len(_tables(rule)) == 2
        want = ca.attention(q, k, v, engine="reference", mask_mod=rule)
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)


def test_a_longer_sequence_extends_the_table():
    def near(b, h, q, kv):
        return (q - kv).abs() < 50

    pt = masks.Pattern(causal=False, mask_mod=near)
    pt.block_table(256, 256, block_size=64)
    (table,) = _tables(near)
    n = table.evaluated
    assert n == 256 * 256
    t = pt.block_table(320, 320, block_size=64)  # one more row and column of tiles
    assert table.evaluated - n == 320 * 320 - 256 * 256
    kinds = t["kinds"][0, 0]
    assert kinds.shape == (5, 5) and int(kinds[4, 0]) == 0 and int(kinds[4, 4]) >= 3
    assert t["nbytes"] == kinds.numel() * 4 + t["tile_masks"].numel()


def test_create_block_mask_is_flex_attentions():
    def window(b, h, q, kv):
        return (q >= kv) & (q - kv < 40) & (h != 1)

    ours = masks.create_block_mask(window, None, 3, 200, 300, BLOCK_SIZE=64)
    theirs = fx.create_block_mask(window, None, 3, 200, 300, device="cpu", BLOCK_SIZE=64)
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    q, k, v = _qkv(H=3, H_kv=3)
    want = fx.flex_attention(q, k, v, block_mask=theirs)
    mod = masks.Pattern.from_block_mask(ours).mask_mod
    assert masks.Pattern.from_block_mask(ours).mask_mod is mod  # one per BlockMask
    for engine in ("reference", "tiled", "cpp"):
        got = ca.attention(q, k, v, causal=False, mask_mod=mod, engine=engine)
        torch.testing.assert_close(got.float(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="create_block_mask: BLOCK_SIZE"):
        masks.create_block_mask(window, None, None, 10, 10, BLOCK_SIZE=0)


def test_an_impure_mask_mod_is_caught_when_the_table_is_made():
    def impure(b, h, q, kv):  # pure on the first 16 cells the check reads, not beyond
        return (q < 16) | (torch.rand(q.shape[2], kv.shape[3]) > 0.5)

    q, k, v = _qkv(T_q=300)
    with pytest.raises(
        ValueError, match=r"mask_mod: impure answered differently .* \(engine 'cpp'\)"
    ):
        ca.attention(q, k, v, mask_mod=impure, engine="cpp")


@pytest.mark.parametrize(
    "fn,match",
    [
        (lambda b, h, q, kv: (q - kv).float(), "returned Tensor .* it must return booleans"),
        (lambda b, h, q, kv: torch.ones(3, 5, dtype=torch.bool), "returned shape \\(3, 5\\)"),
        (lambda b, h, q, kv: 1 / 0, "raised ZeroDivisionError"),
    ],
    ids=["float", "shape", "raises"],
)
@pytest.mark.parametrize("engine", ("reference", "tiled", "cpp"))
def test_bad_mask_mods_name_the_argument_and_the_engine(fn, match, engine):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=f"mask_mod: lambda {match}.*\\(engine '{engine}'\\)"):
        ca.attention(q, k, v, mask_mod=fn, engine=engine)


@pytest.mark.parametrize(
    "fn,match",
    [
        (lambda s, b, h, q, kv: s.sum(-1), "returned shape"),
        (lambda s, b, h, q, kv: 3.0, "returned float, not an array"),
        (lambda s, b, h, q, kv: s > 0, "returned dtype torch.bool"),
    ],
    ids=["shape", "non-tensor", "non-float"],
)
@pytest.mark.parametrize("engine", ("reference", "tiled"))
def test_bad_score_mods_name_the_argument_and_the_engine(fn, match, engine):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=f"score_mod: lambda {match}"):
        ca.attention(q, k, v, score_mod=fn, engine=engine)
