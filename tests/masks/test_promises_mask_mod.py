"""What causalattn.masks_mod promises a user, pinned from its docstrings: the tile tables of
a dense mask AND a mask_mod (``Pattern.block_table``: each tile's kind, each partial tile's
cells, identical ones stored once, unreached tiles 0), FlexAttention's BlockMask of a rule
that reads h (``to_block_mask`` equals ``create_block_mask``), a tile's kind over blocks
larger than one evaluation (``Pattern.block_kind``), the names of combined rules
(``and_masks`` / ``or_masks``), the cells an impure rule's error names, and the native
engine on a dense mask with several batch rows AND a mask_mod."""

from __future__ import annotations

import itertools
import sys
import types

import numpy as np
import pytest
import torch

import causalattn as ca
from causalattn import masks_mod
from causalattn.engines import cpp
from causalattn.masks import MASK_MOD, Pattern, and_masks, or_masks

F64 = torch.float64


def _qkv(B=2, H=2, T=12, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, T, d, generator=g, dtype=F64) for _ in range(3))


# ---- the tile table of a dense mask AND a mask_mod (Pattern.block_table) ---------------------
def _check_table(pt, B, H, T_q, T_k, bs):
    """Pattern.block_table against the dense M of the mask and the mask_mod alone: every tile
    some row's interval reaches has the kind its cells say (0 none readable, 1 all, 3 + n
    partial through tile_masks[n], whose cells are the tile's); a tile outside every row's
    interval is 0; the partial tiles are stored once each. Returns the table."""
    table = pt.block_table(T_q, T_k, B=B, H=H, block_size=bs)
    kinds, tiles = table["kinds"], table["tile_masks"]
    nq, nk = -(-T_q // bs), -(-T_k // bs)
    assert kinds.dtype == torch.int32 and kinds.ndim == 4 and kinds.shape[2:] == (nq, nk)
    assert tiles.dtype == torch.bool and tiles.ndim == 3 and tiles.shape[1:] == (bs, bs)
    kinds = kinds.expand(B, H, nq, nk)
    only = Pattern(  # the mask and the mask_mod, placed as pt places them, no other rule
        causal=False,
        mask=pt.mask,
        mask_mod=pt.mask_mod,
        q_start=pt.query_start(T_q, T_k),
        k_start=pt.k_start,
    )
    M = np.broadcast_to(only.allowed(B, H, T_q, T_k), (B, H, T_q, T_k))
    lo, hi = (np.broadcast_to(x, (B, T_q)) for x in pt.row_ranges(T_q, T_k))
    hull_lo, hull_hi = [], []
    for qi in range(nq):
        q0, q1 = qi * bs, min(T_q, qi * bs + bs)
        live = lo[:, q0:q1] < hi[:, q0:q1]
        hull_lo.append(lo[:, q0:q1][live].min() if live.any() else T_k)
        hull_hi.append(hi[:, q0:q1][live].max() if live.any() else 0)
    for b, h, qi, ki in itertools.product(range(B), range(H), range(nq), range(nk)):
        q0, q1 = qi * bs, min(T_q, qi * bs + bs)
        k0, k1 = ki * bs, min(T_k, ki * bs + bs)
        kind = int(kinds[b, h, qi, ki])
        where = (b, h, qi, ki)
        if k1 <= hull_lo[qi] or k0 >= hull_hi[qi]:  # no row of the block reaches it
            assert kind == 0, where
            continue
        reached = (lo[:, q0:q1] < k1) & (hi[:, q0:q1] > k0) & (lo[:, q0:q1] < hi[:, q0:q1])
        if not reached.any():
            continue  # between the rows' intervals: evaluated or not, never read
        cells = M[b, h, q0:q1, k0:k1]
        if cells.all():
            assert kind == 1, where
        elif not cells.any():
            assert kind == 0, where
        else:
            assert 3 <= kind < 3 + tiles.shape[0], (where, kind)
            assert np.array_equal(tiles[kind - 3, : q1 - q0, : k1 - k0].numpy(), cells), where
    partial = {int(k) for k in kinds.unique() if k >= 3}
    assert partial == set(range(3, 3 + len(partial)))  # tile masks numbered from 0 in turn
    flat = tiles[: len(partial)].reshape(len(partial), bs * bs)
    assert len({bytes(t.numpy()) for t in flat}) == len(partial)  # each stored once
    return table


def _dense(*shape, seed=0, p=0.5):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) > p


def test_block_table_of_a_dense_mask_alone_is_the_masks_tiles():
    """A 2-D mask and a 3-D (per-head) mask with no mask_mod: the table is the mask's, one
    row for the batch (the mask does not differ by row), edge tiles cut at T."""
    for mask, H in ((_dense(10, 10), 2), (_dense(2, 10, 10, seed=1), 2)):
        t = _check_table(Pattern(causal=False, mask=mask), 3, H, 10, 10, 4)
        assert t["kinds"].shape[0] == 1
        assert t["kinds"].shape[1] == (H if mask.ndim == 3 else 1)
        assert t["block_size"] == (4, 4) and t["seq_lengths"] == (10, 10)


def test_block_table_keeps_unreached_tiles_zero_and_reads_the_rest():
    """The keyword rules are the kernels' intervals: a window leaves the early key tiles 0
    (several key tiles evaluated at once, from a tile past the first), the tiles it reaches
    get the mask's kinds; the last row and key tiles are cut at T = 10."""
    mask = _dense(10, 10, seed=2, p=0.3)
    _check_table(Pattern(window=3, mask=mask), 1, 1, 10, 10, 4)
    _check_table(Pattern(window=5, causal=False, mask=mask), 1, 1, 10, 10, 4)
    mask[:, :4] = True  # full tiles where the window reaches them too
    _check_table(Pattern(window=6, mask=mask), 1, 1, 10, 10, 4)


def test_block_table_padding_rows_and_queries_before_the_keys_read_nothing():
    """A query block of padding rows only (lengths) and one placed before every key
    (q_start < k_start, causal) reach no key: their tiles are 0 though the mask allows all,
    and the blocks after them are still filled."""
    ones = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    t = _check_table(Pattern(lengths=[3], mask=ones), 1, 1, 6, 6, 4)
    assert t["kinds"][0, 0].tolist() == [[1, 0], [0, 0]]  # keys 4, 5: no live row reaches
    ones = torch.ones(8, 8, dtype=torch.bool)
    t = _check_table(Pattern(q_start=0, k_start=4, mask=ones), 1, 1, 8, 8, 4)
    assert t["kinds"][0, 0].tolist() == [[0, 0], [1, 0]]


def test_block_table_tiles_past_every_rows_interval_are_zero_beside_padding_rows():
    """Causal, lengths [3, 8]: queries 0..3 read keys 0..3 at most (query 3 of row 0 is
    padding and reads nothing), so the key tile 4..7 of that block is reached by no row."""
    ones = torch.ones(8, 8, dtype=torch.bool)
    for pt in (
        Pattern(lengths=[3, 8], mask=ones),
        Pattern(lengths=[3, 8], mask=ones, mask_mod=lambda b, h, q, kv: kv >= 0),
    ):
        kinds = pt.block_table(8, 8, B=2, block_size=4)["kinds"]
        assert bool((kinds[:, :, 0, 1] == 0).all()), kinds


def test_block_table_with_a_mask_mod_per_head_and_row():
    """mask AND mask_mod, the rule reading b and h: a tile that head 0 cannot read at all
    is 0 for head 0 even where head 1 reads part of it; several distinct partial tiles."""

    def rule(b, h, q_idx, kv_idx):
        return ((h == 0) & (kv_idx < 4)) | ((h == 1) & ((kv_idx + b) % 3 != 0))

    mask = _dense(2, 1, 12, 12, seed=3, p=0.2)
    t = _check_table(Pattern(causal=False, mask=mask, mask_mod=rule), 2, 2, 12, 12, 4)
    assert t["kinds"].shape == (2, 2, 3, 3)
    assert int((t["kinds"] >= 4).sum()) > 0  # more than one distinct partial tile
    _check_table(Pattern(window=5, mask=mask, mask_mod=rule), 2, 2, 12, 12, 4)


def test_block_table_without_partial_tiles_keeps_at_most_one_placeholder():
    """Every reached tile full or empty: no tile mask is pointed at, and the table stores
    at most one all-False (bq, bk) placeholder (its nbytes stays the kinds' and one tile's)."""
    for pt in (
        Pattern(causal=False, mask=torch.ones(8, 8, dtype=torch.bool)),
        Pattern(
            causal=False,
            mask=torch.ones(8, 8, dtype=torch.bool),
            mask_mod=lambda b, h, q, kv: kv < 4,
        ),
    ):
        t = _check_table(pt, 1, 1, 8, 8, 4)
        tiles = t["tile_masks"]
        assert int(t["kinds"].max()) <= 1
        assert tiles.dtype == torch.bool and tiles.shape[1:] == (4, 4)
        assert tiles.shape[0] <= 1 and not bool(tiles.any())
        assert t["nbytes"] <= t["kinds"].numel() * 4 + 16


def test_native_engine_dense_mask_per_batch_row_and_a_mask_mod():
    """engine="cpp" reads a dense mask that differs by batch row AND a mask_mod as one tile
    table: the reference's output, forward and backward."""
    if cpp.unavailable():  # asked here, not at import: the other tests never build it
        pytest.skip(cpp.unavailable())
    B, H, T = 3, 2, 12
    q, k, v = (x.requires_grad_() for x in _qkv(B=B, H=H, T=T))
    mask = _dense(B, 1, T, T, seed=4, p=0.3)

    def rule(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx + b + h) % 4 != 0

    outs = {}
    for engine in ("reference", "cpp"):
        o = ca.attention(q, k, v, engine=engine, window=7, mask=mask, mask_mod=rule)
        outs[engine] = (o, *torch.autograd.grad(o.square().sum(), (q, k, v)))
    for a, b in zip(outs["cpp"], outs["reference"]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    again = ca.attention(q, k, v, engine="cpp", pattern=Pattern(window=7, mask=mask, mask_mod=rule))
    torch.testing.assert_close(again, outs["reference"][0], rtol=0, atol=1e-12)


# ---- FlexAttention's BlockMask of a rule that reads h -----------------------------------------
def test_to_block_mask_per_head_is_flexs_create_block_mask():
    """A rule whose heads differ block by block (head 0 reads keys < 8: whole blocks; head 1
    every other key: partial blocks): each head's full, partial and absent blocks are
    create_block_mask's, as sets of key blocks."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")

    def rule(b, h, q_idx, kv_idx):
        return ((h == 0) & (kv_idx < 8)) | ((h == 1) & (kv_idx % 2 == 0))

    pt = Pattern(causal=False, mask_mod=rule)
    ours = pt.to_block_mask(16, 16, block_size=4, H=2)
    theirs = flex.create_block_mask(
        pt.to_mask_mod(16, 16), 1, 2, 16, 16, device="cpu", BLOCK_SIZE=4
    )

    def blocks(num, idx):
        num, idx = num.expand(1, 2, 4), idx.expand(1, 2, 4, idx.shape[-1])
        return [[sorted(idx[0, h, i, : num[0, h, i]].tolist()) for i in range(4)] for h in range(2)]

    assert blocks(ours.full_kv_num_blocks, ours.full_kv_indices) == blocks(
        theirs.full_kv_num_blocks, theirs.full_kv_indices
    )
    assert blocks(ours.kv_num_blocks, ours.kv_indices) == blocks(
        theirs.kv_num_blocks, theirs.kv_indices
    )
    assert blocks(ours.full_kv_num_blocks, ours.full_kv_indices)[0][0] == [0, 1]
    assert blocks(ours.kv_num_blocks, ours.kv_indices)[1][0] == [0, 1, 2, 3]


# ---- a tile's kind over blocks of more cells than one evaluation -------------------------------
@pytest.mark.parametrize(
    "rule,want",
    [
        (lambda b, h, q, kv: q >= 0, "full"),
        (lambda b, h, q, kv: q < 512, "partial"),  # the first half of the rows only
        (lambda b, h, q, kv: q >= 512, "partial"),  # the second half only
        (lambda b, h, q, kv: q < 0, "skip"),
    ],
    ids=["all", "first-half", "second-half", "none"],
)
def test_block_kind_of_a_block_evaluated_in_several_pieces(rule, want):
    """1024 queries × 512 keys: more cells than one evaluation (TILE_CELLS), so the block
    is read in pieces; its kind is the whole block's."""
    assert 1024 * 512 > masks_mod.TILE_CELLS
    pt = Pattern(causal=False, mask_mod=rule)
    assert pt.block_kind(0, 0, 1024, 0, 512, 1024, 1024) == want


def test_block_kind_of_one_query_over_more_keys_than_one_evaluation():
    """One query row over more keys than TILE_CELLS (a long context): read in pieces."""
    T = masks_mod.TILE_CELLS + 1000
    assert (
        Pattern(causal=False, mask_mod=lambda b, h, q, kv: kv < 5).block_kind(0, 0, 1, 0, T, 1, T)
        == "partial"
    )
    assert Pattern(mask_mod=lambda b, h, q, kv: kv >= 0).block_kind(0, 0, 1, 0, T, 1, T) == "full"


# ---- and_masks / or_masks: their names ----------------------------------------------------------
def test_combined_rules_are_named_by_the_combinator_and_each_rule_in_order():
    """and_masks / or_masks name their rule after the combinator and every rule, in order:
    the name the pattern's description and the blocked reason show."""

    def near(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() < 3

    def sink(b, h, q_idx, kv_idx):
        return kv_idx == 0

    assert and_masks(near, sink).__name__ == "and(near, sink)"
    assert or_masks(sink, near).__name__ == "or(sink, near)"
    assert or_masks(near, lambda b, h, q, kv: q >= kv).__name__ == "or(near, lambda)"
    pt = Pattern(causal=False, mask_mod=or_masks(near, sink))
    assert pt.describe() == "bidirectional + mask_mod or(near, sink)"
    assert pt.reason_name(MASK_MOD) == "or(near, sink)"


# ---- an impure rule's error names the cells it was asked about ----------------------------------
def _flip():
    calls = []

    def flips(b, h, q_idx, kv_idx):  # answers the opposite on every other call: impure
        calls.append(1)
        out = kv_idx <= q_idx
        return out if len(calls) % 2 else ~out

    return flips


def test_an_impure_rule_is_named_with_the_cells_it_was_asked_about():
    with pytest.raises(ValueError) as e:
        masks_mod.evaluate_mask(
            _flip(), torch, [0, 1], 2, np.arange(3, 8), np.arange(0, 6), twice=True
        )
    msg = str(e.value)
    assert "mask_mod: flips answered differently on a second evaluation" in msg
    assert "b 0..1, q_idx 3..7, kv_idx 0..5" in msg
    with pytest.raises(ValueError) as e:  # one cell each: first and last the same
        masks_mod.evaluate_mask(_flip(), np, [1], 1, [4], torch.tensor([2]), twice=True)
    assert "b 1..1, q_idx 4..4, kv_idx 2..2" in str(e.value)
    with pytest.raises(ValueError) as e:  # positions as a row of any shape: read in order
        masks_mod.evaluate_mask(_flip(), torch, [0], 1, np.arange(3, 8)[None], [0, 1], twice=True)
    assert "b 0..0, q_idx 3..7, kv_idx 0..1" in str(e.value)


def test_an_impure_rule_over_no_keys_says_so():
    """An empty key range: the rule answers in two shapes, and the error says no keys."""
    calls = []

    def shifty(b, h, q_idx, kv_idx):
        calls.append(1)
        return kv_idx <= q_idx if len(calls) % 2 else torch.ones((1, 1, 1, 1), dtype=torch.bool)

    with pytest.raises(ValueError, match=r"b 0\.\.0, q_idx 2\.\.3, kv_idx none\)"):
        masks_mod.evaluate_mask(shifty, torch, [0], 1, [2, 3], np.arange(0), twice=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_impure_rule_on_the_gpu_is_named_with_its_cells():
    pos = torch.arange(3, 8, device="cuda")
    with pytest.raises(ValueError, match=r"b 0\.\.0, q_idx 3\.\.7, kv_idx 0\.\.5"):
        masks_mod.evaluate_mask(
            _flip(), torch, [0], 1, pos, torch.arange(6, device="cuda"), dev=pos.device, twice=True
        )


# ---- tile_kinds: the whole pattern's kind per tile ----------------------------------------------
def _kinds_of(A, bq, bk):
    """0 / 1 / 2 (none / all / some readable) per (bq × bk) tile of a dense (B, H, T_q, T_k)."""
    B, H, T_q, T_k = A.shape
    out = np.zeros((B, H, -(-T_q // bq), -(-T_k // bk)), dtype=np.int8)
    for qi, ki in itertools.product(range(out.shape[2]), range(out.shape[3])):
        t = A[:, :, qi * bq : qi * bq + bq, ki * bk : ki * bk + bk]
        out[:, :, qi, ki] = np.where(t.all((2, 3)), 1, np.where(t.any((2, 3)), 2, 0))
    return out


@pytest.mark.parametrize(
    "kw,B,H,shape",
    [
        ({"window": 3}, 3, 2, (1, 1)),  # the same for every row and head: one of each
        ({"lengths": [10, 5], "window": 4}, 2, 2, (2, 1)),  # rows differ
        ({"causal": False, "mask_mod": lambda b, h, q, kv: (kv - q) % (h + 2) == 0}, 1, 2, (1, 2)),
        ({"prefix_lengths": [6, 2], "mask_mod": lambda b, h, q, kv: kv != 3 * h}, 2, 2, (2, 2)),
    ],
    ids=["window", "lengths", "per-head", "prefix-per-row-and-head"],
)
def test_tile_kinds_are_each_tiles_kind(kw, B, H, shape):
    """tile_kinds: NumPy int8 (B', H', ceil(T_q/bq), ceil(T_k/bk)), B' and H' 1 where the
    pattern does not differ, each tile's kind of the whole pattern (edge tiles cut at T)."""
    pt = Pattern(**kw)
    kinds = masks_mod.tile_kinds(pt, B, H, 10, 10, 4, 3)
    assert isinstance(kinds, np.ndarray) and kinds.dtype == np.int8
    assert kinds.shape == (*shape, 3, 4)
    A = np.broadcast_to(pt.allowed(B, H, 10, 10), (B, H, 10, 10))
    assert np.array_equal(np.broadcast_to(kinds, (B, H, 3, 4)), _kinds_of(A, 4, 3))


# ---- to_block_mask: FlexAttention's create_block_mask, its arguments ---------------------------
def test_to_block_mask_takes_create_block_masks_arguments():
    """block_size 128 by default, any size >= 1; B, H as create_block_mask's (H=None: one
    head for all); device= where its tensors live; partial blocks read through its
    mask_mod on FlexAttention's indices, T_q < T_k bottom-right."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    pt = Pattern(window=5)
    assert pt.to_block_mask(300, 300).BLOCK_SIZE == (128, 128)
    assert masks_mod.to_block_mask(pt, 300, 300).BLOCK_SIZE == (128, 128)  # the module's too
    one = pt.to_block_mask(6, 6, block_size=1)
    assert one.BLOCK_SIZE == (1, 1)
    assert torch.equal(one.to_dense()[0, 0].bool(), torch.as_tensor(pt.allowed(1, 1, 6, 6))[0, 0])
    with pytest.raises(ValueError, match=r"to_block_mask: block_size must be >= 1, got 0"):
        pt.to_block_mask(6, 6, block_size=0)
    assert pt.to_block_mask(8, 8, block_size=4, device="meta").kv_num_blocks.device.type == "meta"

    def rule(b, h, q_idx, kv_idx):  # reads b and h
        return (kv_idx <= q_idx) & ((kv_idx + b + h) % 3 != 0)

    pr = Pattern(causal=False, mask_mod=rule)
    for B, H in ((2, None), (None, 2), (2, 3)):
        ours = pr.to_block_mask(12, 12, block_size=4, B=B, H=H)
        theirs = flex.create_block_mask(
            pr.to_mask_mod(12, 12), B, H, 12, 12, device="cpu", BLOCK_SIZE=4
        )
        assert ours.BLOCK_SIZE == (4, 4)
        assert ours.kv_num_blocks.shape == theirs.kv_num_blocks.shape, (B, H)
        assert torch.equal(ours.to_dense(), theirs.to_dense()), (B, H)
        back = Pattern.from_block_mask(ours)
        Bn, Hn = B or 1, H or 1
        assert np.array_equal(
            np.broadcast_to(back.allowed(Bn, Hn, 12, 12), (Bn, Hn, 12, 12)),
            np.broadcast_to(pr.allowed(Bn, Hn, 12, 12), (Bn, Hn, 12, 12)),
        )
    # T_q < T_k: the queries are the last positions; the BlockMask's cells are the pattern's
    dense = _dense(6, 10, seed=5, p=0.2)
    pm = Pattern(window=6, mask=dense)
    bm = pm.to_block_mask(6, 10, block_size=4)
    assert np.array_equal(Pattern.from_block_mask(bm).allowed(1, 1, 6, 10), pm.allowed(1, 1, 6, 10))
    q_idx, kv_idx = torch.arange(8).view(1, 1, 8, 1), torch.arange(12).view(1, 1, 1, 12)
    got = bm.mask_mod(
        torch.zeros(1, 1, 1, 1, dtype=torch.long),
        torch.zeros(1, 1, 1, 1, dtype=torch.long),
        q_idx,
        kv_idx,
    )
    want = torch.zeros(8, 12, dtype=torch.bool)  # the padding of whole blocks reads nothing
    want[:6, :10] = torch.as_tensor(pm.allowed(1, 1, 6, 10))[0, 0]
    assert torch.equal(got.expand(1, 1, 8, 12)[0, 0], want)


# ---- to_mask_mod: positions, or FlexAttention's indices of a placed problem ---------------------
def _idx(rows, cols):
    z = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    return z, z, torch.as_tensor(rows).view(1, 1, -1, 1), torch.as_tensor(cols).view(1, 1, 1, -1)


def test_to_mask_mod_reads_positions_or_a_placed_problems_indices():
    """Placed (q_start=6, k_start=4): without T_q, T_k the mask_mod's q_idx, kv_idx are
    positions; with them, FlexAttention's indices of this problem (query i at 6 + i, key j
    at 4 + j); cells past T_q or T_k (FlexAttention's block padding) read nothing."""
    dense = _dense(5, 7, seed=6, p=0.2)
    pt = Pattern(window=3, mask=dense, q_start=6, k_start=4)
    A = torch.as_tensor(pt.allowed(1, 1, 5, 7))[0, 0]
    indices = pt.to_mask_mod(5, 7)(*_idx(torch.arange(8), torch.arange(9)))
    want = torch.zeros(8, 9, dtype=torch.bool)
    want[:5, :7] = A
    assert torch.equal(indices.expand(1, 1, 8, 9)[0, 0], want)
    rules = Pattern(window=3, chunk=4, q_start=6, k_start=4)  # no dense mask: positions
    at = rules.to_mask_mod()(*_idx(torch.arange(6, 11), torch.arange(4, 11)))
    assert torch.equal(
        at.expand(1, 1, 5, 7)[0, 0], torch.as_tensor(rules.allowed(1, 1, 5, 7))[0, 0]
    )


def test_to_mask_mod_is_named_after_the_pattern():
    """Its name (the blocked reason, describe) says the pattern in one identifier."""
    name = Pattern(window=3, chunk=8).to_mask_mod().__name__
    assert name == "causalattn_causal_window3_chunk8" and name.isidentifier()
    assert Pattern(mask_mod=Pattern(window=3).to_mask_mod()).describe() == (
        "causal + mask_mod causalattn_causal_window3"
    )


# ---- Pattern.from_block_mask: a BlockMask as a mask_mod ----------------------------------------
def test_a_blockmask_as_a_mask_mod_per_row_and_head_on_numpy_and_torch():
    """A BlockMask whose blocks differ by batch row and by head: its mask_mod reads each
    (b, h)'s blocks, called with torch or NumPy index arrays alike."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")

    def rule(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < 2 + 3 * b + 5 * h)

    bm = flex.create_block_mask(rule, 2, 2, 16, 16, device="cpu", BLOCK_SIZE=4)
    mod = Pattern.from_block_mask(bm).mask_mod
    want = rule(
        *(
            torch.arange(n).view(*s)
            for n, s in (
                (2, (2, 1, 1, 1)),
                (2, (1, 2, 1, 1)),
                (16, (1, 1, 16, 1)),
                (16, (1, 1, 1, 16)),
            )
        )
    )
    want = want.expand(2, 2, 16, 16)
    A = Pattern.from_block_mask(bm).allowed(2, 2, 16, 16)
    assert np.array_equal(np.broadcast_to(A, (2, 2, 16, 16)), want.numpy())
    b, h = np.arange(2).reshape(2, 1, 1, 1), np.arange(2).reshape(1, 2, 1, 1)
    q, kv = np.arange(16).reshape(1, 1, 16, 1), np.arange(16).reshape(1, 1, 1, 16)
    got = mod(b, h, q, kv)
    assert np.array_equal(np.broadcast_to(np.asarray(got), (2, 2, 16, 16)), want.numpy())
    got_t = mod(*(torch.as_tensor(x) for x in (b, h, q, kv)))
    assert torch.equal(got_t.expand(2, 2, 16, 16), want)


def test_a_blockmasks_mask_mod_reads_nothing_outside_its_own_lengths():
    """Asked about any position (before the first query or key, past the last, beyond its
    padded blocks), a BlockMask's mask_mod answers False outside its own (T_q, T_k) and the
    BlockMask's cells inside (queries bottom-right: position = index + T_k - T_q)."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")

    def rule(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + 4) & ((q_idx + kv_idx + h) % 5 != 0)

    cases = [
        (flex.create_block_mask(rule, None, 2, 12, 16, device="cpu", BLOCK_SIZE=4), 12, 16, 2),
        (Pattern(causal=False).to_block_mask(1, 1, block_size=1), 1, 1, 1),
        (Pattern(window=2).to_block_mask(1, 5, block_size=1), 1, 5, 1),
    ]
    for bm, T_q, T_k, H in cases:
        mod = Pattern.from_block_mask(bm).mask_mod
        inside = torch.as_tensor(Pattern.from_block_mask(bm).allowed(1, H, T_q, T_k))
        pos = torch.arange(-24, 40)  # query positions (index + T_k - T_q), key positions
        got = mod(
            torch.zeros(1, 1, 1, 1, dtype=torch.long),
            torch.arange(H).view(1, H, 1, 1),
            pos.view(1, 1, -1, 1),
            pos.view(1, 1, 1, -1),
        )
        got = got.expand(1, H, 64, 64)
        qs = 24 + T_k - T_q  # where query index 0 sits in pos
        want = torch.zeros(1, H, 64, 64, dtype=torch.bool)
        want[:, :, qs : qs + T_q, 24 : 24 + T_k] = inside
        assert torch.equal(got, want), (T_q, T_k)


def test_to_block_mask_holds_create_block_masks_own_tensors():
    """Over many key blocks, to_block_mask's four block lists are create_block_mask's,
    entry for entry: int32 counts, and per query block the chosen key blocks first in
    ascending order, then the others in ascending order."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    for pt, T_q, T_k in ((Pattern(window=9), 40, 200), (Pattern(causal=True), 96, 96)):
        ours = pt.to_block_mask(T_q, T_k, block_size=4)
        theirs = flex.create_block_mask(
            pt.to_mask_mod(T_q, T_k), None, None, T_q, T_k, device="cpu", BLOCK_SIZE=4
        )
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            a, b = getattr(ours, name), getattr(theirs, name)
            assert a.dtype == b.dtype == torch.int32, name
            assert torch.equal(a, b), (name, T_q, T_k)


@pytest.mark.parametrize("block_size", [(4, 8), (8, 4)])
def test_a_blockmask_of_unequal_query_and_key_blocks_is_read_cell_by_cell(block_size):
    """A BlockMask whose query blocks and key blocks differ in size (create_block_mask's
    BLOCK_SIZE=(Q, KV)): its mask_mod's cells are the rule's, each head its own."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")

    def rule(b, h, q_idx, kv_idx):  # partial blocks everywhere below the diagonal
        return (kv_idx <= q_idx) & ((q_idx - kv_idx) % (3 + h) != 1)

    T = 40
    bm = flex.create_block_mask(rule, None, 2, T, T, device="cpu", BLOCK_SIZE=block_size)
    back = Pattern.from_block_mask(bm)
    h = torch.arange(2).view(1, 2, 1, 1)
    want = rule(0, h, torch.arange(T).view(1, 1, T, 1), torch.arange(T).view(1, 1, 1, T))
    got = np.broadcast_to(back.allowed(1, 2, T, T), (1, 2, T, T))
    assert np.array_equal(got, want.expand(1, 2, T, T).numpy())


def test_from_block_mask_names_its_argument_or_a_missing_flexattention(monkeypatch):
    """Not a BlockMask: one ValueError naming what was given. A torch without FlexAttention:
    one ValueError saying so. A BlockMask's mask_mod is named after its own rule."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    for bad, kind in (([1, 2], "list"), ("causal", "str"), (None, "NoneType")):
        with pytest.raises(ValueError) as e:
            Pattern.from_block_mask(bad)
        assert str(e.value) == (
            f"from_block_mask: expected a torch.nn.attention.flex_attention.BlockMask, got {kind}"
        )

    def near(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < 3

    bm = flex.create_block_mask(near, None, None, 8, 8, device="cpu", BLOCK_SIZE=4)
    assert Pattern.from_block_mask(bm).mask_mod.__name__ == "BlockMask[near]"
    assert "BlockMask[near]" in Pattern.from_block_mask(bm).describe()
    monkeypatch.setitem(sys.modules, "torch.nn.attention.flex_attention", None)
    with pytest.raises(ValueError, match=r"^from_block_mask: FlexAttention is not available \("):
        Pattern.from_block_mask(bm)


# ---- score_mod: NumPy and torch scores, what it returns, its name ----------------------------
_S = np.random.default_rng(0).standard_normal((1, 2, 3, 4))
_WANT = np.tanh(_S) * 2 + np.arange(2).reshape(1, 2, 1, 1)


def test_numpy_scores_and_a_score_mod_written_for_torch_give_numpy_scores():
    """NumPy scores and a rule written for torch (it is called again on torch tensors): the
    result is NumPy, of the scores' dtype, with the rule's values."""
    with_torch = Pattern(score_mod=lambda s, b, h, qi, kj: torch.tanh(s) * 2 + h)
    got = with_torch.modify_scores(_S)
    assert isinstance(got, np.ndarray) and got.dtype == np.float64
    np.testing.assert_allclose(got, _WANT, rtol=1e-12)  # torch's tanh, not NumPy's


def test_torch_scores_and_a_score_mod_answering_in_numpy_keep_the_scores_dtype():
    """Torch scores and a rule that answers in NumPy: a tensor of the scores' dtype (float64
    stays float64), with the rule's values."""
    S, want = _S, _WANT

    def in_numpy(s, b, h, qi, kj):
        s = np.asarray(s)
        return np.tanh(s) * 2 + h.numpy().astype(s.dtype)

    with_numpy = Pattern(score_mod=in_numpy)
    for dtype in (torch.float64, torch.float32):
        got = with_numpy.modify_scores(torch.from_numpy(S).to(dtype))
        assert isinstance(got, torch.Tensor) and got.dtype == dtype
        tol = 1e-6 if dtype == torch.float32 else 0
        np.testing.assert_allclose(got.numpy(), want, rtol=tol, atol=tol)


def test_what_a_score_mod_returns_is_refused_in_full_words():
    S = torch.zeros(1, 2, 3, 4, dtype=F64)
    b, h, q, k = masks_mod.indices(torch, np.arange(1), 2, np.arange(3), np.arange(4))

    def refused(fn):
        with pytest.raises(ValueError) as e:
            masks_mod.apply_score_mod(fn, S, b, h, q, k)
        return str(e.value)

    shaped = types.SimpleNamespace(shape=S.shape)  # a shape and no dtype: not an array
    assert refused(lambda s, b, h, qi, kj: shaped) == (
        "score_mod: lambda returned SimpleNamespace, not an array, for scores of shape "
        "(1, 2, 3, 4); it "
        "must return the scores changed elementwise, e.g. score + bias[h, q_idx - kv_idx]"
    )
    assert refused(lambda s, b, h, qi, kj: s[..., :2]) == (
        "score_mod: lambda returned shape (1, 2, 3, 2) for scores of shape (1, 2, 3, 4); it "
        "must return the scores' shape (change each score elementwise, e.g. "
        "score + bias[h, q_idx - kv_idx])"
    )


class _Scaled:  # a callable object: no __name__ of its own
    def __call__(self, s, b, h, q, k):
        return s * 2


def test_a_rule_is_named_by_its_function_its_partials_function_or_its_class():
    import functools

    def near(b, h, q, k):
        return q - k < 2

    assert masks_mod.name_of(near) == "near"
    assert masks_mod.name_of(lambda b, h, q, k: q >= k) == "lambda"
    assert masks_mod.name_of(functools.partial(near)) == "near"
    assert masks_mod.name_of(_Scaled()) == "_Scaled"
    assert masks_mod.name_of(functools.partial(_Scaled())) == "_Scaled"
    S = torch.zeros(1, 1, 2, 2, dtype=F64)
    idx = masks_mod.indices(torch, np.arange(1), 1, np.arange(2), np.arange(2))
    with pytest.raises(ValueError, match=r"^score_mod: near raised TypeError"):
        masks_mod.apply_score_mod(functools.partial(near), S, *idx)  # 5 arguments for 4


# ---- purity is sampled: which evaluations are made twice --------------------------------------
class _Counted:
    def __init__(self):
        self.calls = 0

    def rule(self, b, h, q, k):
        self.calls += 1
        return q >= k


class _Slotted:  # a callable that takes no weak reference
    __slots__ = ("calls",)

    def __init__(self):
        self.calls = 0

    def __call__(self, b, h, q, k):
        self.calls += 1
        return q >= k


def test_a_rule_is_evaluated_twice_on_its_1st_2nd_4th_8th_evaluation_and_larger_blocks():
    """A rule's 1st, 2nd, 4th, 8th, ... evaluation, and one of a block at least twice as
    large as any before, is made twice; the others once. A bound method counts as its
    function (a new one is made at each attribute read); a rule that takes no weak reference
    is evaluated twice every time."""

    def evaluate(fn, rows=4, cols=4):
        masks_mod.evaluate_mask(fn, torch, np.arange(1), 1, np.arange(rows), np.arange(cols))

    counted = _Counted()

    def rule(b, h, q, k):
        return counted.rule(b, h, q, k)

    for _ in range(9):
        evaluate(rule)
    assert counted.calls == 9 + 4  # the 1st, 2nd, 4th and 8th twice
    evaluate(rule, 8, 4)  # twice the largest block: twice
    assert counted.calls == 15
    evaluate(rule, 12, 4)  # larger, but not twice as large, and the 11th: once
    assert counted.calls == 16
    counted = _Counted()
    for _ in range(9):
        evaluate(counted.rule)  # a new bound method at each read, the same function
    assert counted.calls == 13
    slotted = _Slotted()
    for _ in range(3):
        evaluate(slotted)
    assert slotted.calls == 6


def test_a_rule_reads_int64_indices_or_the_dtype_it_is_evaluated_in():
    """evaluate_mask's index tensors, shaped (nb,1,1,1), (1,H,1,1), (1,1,rows,1), (1,1,1,cols),
    are int64 in NumPy and torch, whatever integer arrays the rows and positions come as, or
    the dtype asked for (the block tables ask for FlexAttention's int32)."""
    seen = []

    def rule(b, h, q, k):
        seen.append(tuple(str(x.dtype).replace("torch.", "") for x in (b, h, q, k)))
        shapes = [tuple(x.shape) for x in (b, h, q, k)]
        assert shapes == [(2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 3, 1), (1, 1, 1, 3)], shapes
        return q >= k

    rows, pos = np.arange(2, dtype=np.int32), np.arange(3, dtype=np.int32)
    for xp, dtype, want in (
        (np, None, "int64"),
        (torch, None, "int64"),
        (torch, torch.int32, "int32"),
    ):
        seen.clear()
        masks_mod.evaluate_mask(rule, xp, rows, 2, pos, pos, None, dtype)
        assert seen and all(d == (want,) * 4 for d in seen), (xp.__name__, dtype, seen)


def test_tile_kinds_evaluates_no_tile_before_a_query_blocks_key_range():
    """tile_kinds asks the rule only about the key tiles a query block's key range reaches:
    with a window of 4, no call for queries from q reads a key tile before (q - 3)'s."""
    calls = []

    def rule(b, h, q, k):
        calls.append((int(q.min()), int(k.min())))
        return (q - k) % 3 != 1

    pt = Pattern(window=4, mask_mod=rule)
    kinds = masks_mod.tile_kinds(pt, 1, 1, 64, 64, 8, 8)
    assert kinds.shape == (1, 1, 8, 8) and calls
    for q_min, k_min in calls:
        assert k_min >= max(0, q_min - 3) // 8 * 8, (q_min, k_min)
