"""A mask_mod on the native engine as the keyword kernel's inputs (causalattn.masks_rows):
per-row intervals, and tile bits only where the rule has holes inside them. A rule that
is an interval per row runs the keyword path bit for bit; any other rule matches the
reference; the form is made once and remade when the rule's tensors change."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import causalattn as ca
from causalattn import masks_rows, masks_table
from causalattn.engines import cpp
from causalattn.masks import Pattern

pytestmark = pytest.mark.skipif(bool(cpp.unavailable()), reason="no native engine here")


def _qkv(B=2, H=4, H_kv=2, T_q=301, T_k=437, d=16, grad=False):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T_q, d, generator=g)
    k, v = (torch.randn(B, H_kv, T_k, d, generator=g) for _ in range(2))
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def _window_docs(T, w=64):
    cu = [0, 90, 91, 250, T]
    doc = torch.repeat_interleave(torch.arange(4), torch.tensor(np.diff(cu)))

    def window_documents(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx > q_idx - w) & (doc[q_idx] == doc[kv_idx])

    return {"window": w, "cu_seqlens": cu, "causal": True}, window_documents


def _forms(fn):
    return [f for t, _ in masks_table._KEPT.get(fn, {}).values() for f in t.forms.values()]


def test_an_interval_rule_runs_the_keyword_path_bit_for_bit():
    T = 437
    kw, fn = _window_docs(T)
    q, k, v = _qkv(B=1, T_q=T, T_k=T, grad=True)
    ours = ca.attention(q, k, v, engine="cpp", causal=False, mask_mod=fn)
    theirs = ca.attention(q, k, v, engine="cpp", **kw)
    assert torch.equal(ours, theirs)
    dout = torch.randn_like(ours)
    g1 = torch.autograd.grad(ours, (q, k, v), dout)
    g2 = torch.autograd.grad(theirs, (q, k, v), dout)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    ((lo, hi, kinds, tile_masks, nbytes),) = _forms(fn)  # one form, forward and backward
    (table,) = [t for t, _ in masks_table._KEPT[fn].values()]
    assert 0 < table.evaluated < T * T / 2  # the bounded tiles were not evaluated
    want_lo, want_hi = Pattern(**kw).row_ranges(T, T)
    readable = want_hi > want_lo
    assert kinds is None and tile_masks is None and nbytes == 16 * T
    assert np.array_equal(lo.numpy()[readable], want_lo[readable])
    assert np.array_equal(hi.numpy()[readable], want_hi[readable])


@pytest.mark.parametrize("bounded", [True, False], ids=["bounded", "every-cell"])
def test_a_rule_with_holes_reads_bits_only_in_tiles_with_holes(bounded):
    """A window OR every 50th key (several intervals per row), another key for head 1:
    B = 2, GQA, T_q < T_k, T not a multiple of any block; forward and gradients. Bounded
    tile by tile (causalattn.masks_bounds) or not (a float: every cell evaluated)."""

    def strided(b, h, q_idx, kv_idx):
        near = (kv_idx <= q_idx) & (q_idx - kv_idx < 40)
        if not bounded:
            near = near & (q_idx.float() >= 0)
        return near | ((kv_idx % 50 == 0) & (kv_idx <= q_idx)) | ((h == 1) & (kv_idx == 3))

    q, k, v = _qkv(grad=True)
    ours = ca.attention(q, k, v, engine="cpp", causal=False, mask_mod=strided)
    want = ca.attention(q, k, v, engine="reference", causal=False, mask_mod=strided)
    torch.testing.assert_close(ours, want.float(), rtol=1e-5, atol=1e-5)
    dout = torch.randn_like(ours)
    g1 = torch.autograd.grad(ours, (q, k, v), dout)
    g2 = torch.autograd.grad(want, (q, k, v), dout.to(want.dtype))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b.float(), rtol=1e-4, atol=1e-5)
    ((lo, hi, kinds, tile_masks, _),) = _forms(strided)
    partial = kinds >= masks_rows._mod.PARTIAL_TILE
    assert kinds.shape[1] == 4 and bool(partial.any())  # heads differ: per-head kinds
    assert bool((kinds == masks_rows._mod.FULL).any())  # the window's inside: no bits read
    assert tile_masks.shape[0] <= int(partial.sum())  # distinct tiles stored once


def test_the_form_is_kept_and_remade_when_a_captured_tensor_changes():
    T = 300
    doc = torch.arange(T) // 70

    def docs(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    q, k, v = _qkv(T_q=T, T_k=T)
    first = ca.attention(q, k, v, engine="cpp", mask_mod=docs)
    (table,) = [t for t, _ in masks_table._KEPT[docs].values()]
    n = table.evaluated
    again = ca.attention(q, k, v, engine="cpp", mask_mod=docs)  # a new Pattern, same form
    assert n > 0 and table.evaluated == n and torch.equal(first, again)
    doc[:150] = 0  # an in-place write: the old form no longer says what docs says
    got = ca.attention(q, k, v, engine="cpp", mask_mod=docs)
    want = ca.attention(q, k, v, engine="reference", mask_mod=docs)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, first)


@pytest.mark.parametrize("T_q", [1, 5, 300])
def test_per_batch_keywords_and_a_mask_mod_match_the_reference(T_q):
    """lengths (per batch row) AND a rule reading b: the form's intervals per batch row;
    decoding-sized T_q too (the kernel's key-split path)."""

    def odd_rows_skip_evens(b, h, q_idx, kv_idx):
        return (b == 0) | (kv_idx % 2 == 1)

    q, k, v = _qkv(T_q=T_q)
    kw = {"lengths": [437, 200], "causal": True}
    got = ca.attention(q, k, v, engine="cpp", mask_mod=odd_rows_skip_evens, **kw)
    want = ca.attention(q, k, v, engine="reference", mask_mod=odd_rows_skip_evens, **kw)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
