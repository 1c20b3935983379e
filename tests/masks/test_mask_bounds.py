"""Tile verdicts of a mask_mod by interval arithmetic (causalattn.masks_bounds): sound on
every tile (FULL: every cell True, SKIP: none), tight enough to skip most tiles of a
window plus documents, and None for what the bounds do not follow."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import causalattn as ca
from causalattn import masks_bounds as mb
from causalattn import masks_mod

T_Q, T_K, BQ, BK = 203, 301, 32, 48
doc = torch.repeat_interleave(torch.arange(5), torch.tensor([40, 1, 90, 100, 70]))
flags = torch.arange(301) % 7 == 0


def window_docs(b, h, q, kv):
    return (kv <= q) & (kv > q - 64) & (doc[q] == doc[kv])


def mixed(b, h, q, kv):  # every supported operation at least once
    near = (q - kv).abs() < 20 + 5 * h
    strided = ((kv // 3) % 4 != 1) & (2 * kv - q >= -30)
    return (near | ~(kv >= q) & strided) & ((b == 0) | flags[kv]) | (-(q % 50) > -3)


RULES = {
    "window_docs": window_docs,
    "mixed": mixed,
    "prefix": lambda b, h, q, kv: (kv < 40) | (q >= kv),
    "constant": lambda b, h, q, kv: (q >= 0) & (kv >= 0),
}


@pytest.mark.parametrize("name", list(RULES))
def test_every_verdict_holds_on_every_cell_of_its_tile(name):
    fn = RULES[name]
    qs, ks = 98, 0  # queries at 98.., keys at 0..: T_q < T_k, bottom-right
    v = mb.tile_verdicts(fn, 2, 3, qs, ks, T_Q, T_K, BQ, BK)
    assert v is not None
    cells = masks_mod.evaluate_mask(
        fn, torch, np.arange(2), 3, np.arange(qs, qs + T_Q), np.arange(ks, ks + T_K)
    ).expand(2, 3, T_Q, T_K)
    nq, nk = -(-T_Q // BQ), -(-T_K // BK)
    assert v.shape[2:] == (nq, nk)
    v = v.expand(2, 3, nq, nk)
    for qb in range(nq):
        for kb in range(nk):
            tile = cells[:, :, qb * BQ : qb * BQ + BQ, kb * BK : kb * BK + BK]
            every, some = tile.flatten(2).all(-1), tile.flatten(2).any(-1)
            assert bool(every[v[:, :, qb, kb] == mb.FULL].all()), (qb, kb)
            assert not bool(some[v[:, :, qb, kb] == mb.SKIP].any()), (qb, kb)
    if name == "constant":
        assert bool((v == mb.FULL).all())


def _check_sound(fn, B, H, qs, ks, T_q, T_k, bq, bk):
    v = mb.tile_verdicts(fn, B, H, qs, ks, T_q, T_k, bq, bk)
    assert v is not None
    cells = masks_mod.evaluate_mask(
        fn, torch, np.arange(B), H, np.arange(qs, qs + T_q), np.arange(ks, ks + T_k)
    ).expand(B, H, T_q, T_k)
    nq, nk = -(-T_q // bq), -(-T_k // bk)
    pad = torch.nn.functional.pad(cells, (0, nk * bk - T_k, 0, nq * bq - T_q))
    inside = torch.nn.functional.pad(
        torch.ones(T_q, T_k, dtype=torch.bool), (0, nk * bk - T_k, 0, nq * bq - T_q)
    )
    tiles = pad.view(B, H, nq, bq, nk, bk)
    real = inside.view(nq, bq, nk, bk)
    every = (tiles | ~real).all(5).all(3)
    some = (tiles & real).any(5).any(3)
    v = v.expand(B, H, nq, nk)
    assert bool(every[v == mb.FULL].all()) and not bool(some[v == mb.SKIP].any())
    return v


@pytest.mark.parametrize("c", [-7, -3, -1, 0, 1, 2, 5, 9])
def test_verdicts_hold_at_every_edge_of_small_tiles(c):
    """Small tiles put tile edges on every comparison's boundary: off-by-one bounds fail."""
    rules = [
        lambda b, h, q, kv: q - kv < c,
        lambda b, h, q, kv: q - kv <= c,
        lambda b, h, q, kv: kv > q - c,
        lambda b, h, q, kv: kv >= q + c,
        lambda b, h, q, kv: q + c == kv,
        lambda b, h, q, kv: q != kv - c,
        lambda b, h, q, kv: (q - kv).abs() < abs(c) + 1,
        lambda b, h, q, kv: -kv * 2 + q > c,
        lambda b, h, q, kv: kv * -3 <= c - q,
        lambda b, h, q, kv: (kv // 3) % 4 == (c % 4),
        lambda b, h, q, kv: kv % 5 < abs(c) % 5,
        lambda b, h, q, kv: (q // 4 == kv // 4) | (h == c % 2),
        lambda b, h, q, kv: doc[kv % 300] == doc[q % 300],
        lambda b, h, q, kv: flags[kv] & (q >= kv),
    ]
    for fn in rules:
        for bq, bk in ((3, 5), (4, 4), (7, 2)):
            _check_sound(fn, 1, 2, 11, 3, 37, 45, bq, bk)


def test_a_window_with_documents_leaves_few_tiles_to_evaluate():
    v = mb.tile_verdicts(window_docs, 1, 1, 0, 0, 301, 301, 32, 48)
    assert int((v == mb.UNKNOWN).sum()) < 0.5 * v.numel()
    assert int((v == mb.FULL).sum()) > 0


@pytest.mark.parametrize(
    "fn",
    [
        lambda b, h, q, kv: q.float() > kv,  # a method the bounds do not follow
        lambda b, h, q, kv: torch.where(q > kv, True, False),  # a torch function
        lambda b, h, q, kv: doc[q - 500] == 0,  # an index out of range (torch wraps)
        lambda b, h, q, kv: (q > kv) if bool(q > 0) else q < kv,  # Python control flow
        lambda b, h, q, kv: q * 0.5 > kv,  # floats
        lambda b, h, q, kv: q - kv,  # not booleans
    ],
    ids=["method", "torch-function", "out-of-range", "control-flow", "float", "int"],
)
def test_what_the_bounds_do_not_follow_gives_no_verdicts(fn):
    assert mb.tile_verdicts(fn, 1, 1, 0, 0, 64, 64, 16, 16) is None


def test_a_rule_without_verdicts_still_runs_right_on_cpp():
    from causalattn.engines import cpp

    if cpp.unavailable():
        pytest.skip("no native engine here")

    def float_window(b, h, q, kv):
        return ((q - kv).float() < 30.5) & (kv <= q)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 150, 8, generator=g) for _ in range(3))
    got = ca.attention(q, k, v, engine="cpp", mask_mod=float_window)
    want = ca.attention(q, k, v, engine="reference", mask_mod=float_window)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
