"""The one M (causalattn.masks.Pattern) against a cell-by-cell statement of each rule."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from causalattn import masks
from causalattn.masks import Pattern


def brute(
    B,
    H,
    T_q,
    T_k,
    *,
    causal=True,
    window=None,
    chunk=None,
    lengths=None,
    kpm=None,
    cu=None,
    prefix=None,
    mask=None,
):
    """Cell by cell, in plain Python: the rules exactly as the module doc states them."""
    out = np.zeros((B, H, T_q, T_k), bool)
    for b in range(B):
        for h in range(H):
            for i in range(T_q):
                p = i + T_k - T_q
                for j in range(T_k):
                    if cu is not None:
                        dq = max(d for d in range(len(cu) - 1) if cu[d] <= p and p < cu[d + 1])
                        dk = max(d for d in range(len(cu) - 1) if cu[d] <= j and j < cu[d + 1])
                        if dq != dk:
                            continue
                        base = cu[dq]
                    else:
                        base = 0
                    ok = True
                    if causal and j > p:
                        ok = False
                    if window is not None and j <= p - window:
                        ok = False
                    if chunk is not None and (j - base) // chunk != (p - base) // chunk:
                        ok = False
                    if prefix is not None and j < prefix[b] and p < prefix[b]:
                        ok = True
                    if lengths is not None and not (j < lengths[b] and p < lengths[b]):
                        ok = False
                    if kpm is not None and not kpm[b][j]:
                        ok = False
                    if (
                        mask is not None
                        and not mask[
                            b if mask.shape[0] > 1 else 0, h if mask.shape[1] > 1 else 0, i, j
                        ]
                    ):
                        ok = False
                    out[b, h, i, j] = ok
    return out


@st.composite
def patterns(draw):
    B = draw(st.integers(1, 3))
    H = draw(st.integers(1, 2))
    T_k = draw(st.integers(1, 12))
    T_q = draw(st.integers(1, T_k))
    kw = {"causal": draw(st.booleans())}
    if draw(st.booleans()):
        kw["window"] = draw(st.integers(1, 6))
    if draw(st.booleans()):
        kw["chunk"] = draw(st.integers(1, 5))
    use_cu = B == 1 and T_q == T_k and draw(st.booleans())
    if use_cu:
        cuts = sorted(draw(st.lists(st.integers(0, T_k), max_size=3)))
        kw["cu_seqlens"] = [0, *cuts, T_k]
    else:
        if draw(st.booleans()):
            kw["lengths"] = draw(st.lists(st.integers(0, T_k), min_size=B, max_size=B))
        if draw(st.booleans()):
            kw["key_padding_mask"] = np.array(
                draw(
                    st.lists(
                        st.lists(st.booleans(), min_size=T_k, max_size=T_k), min_size=B, max_size=B
                    )
                )
            )
        if draw(st.booleans()):
            top = kw.get("lengths", [T_k] * B)
            kw["prefix_lengths"] = [draw(st.integers(0, t)) for t in top]
        if draw(st.booleans()):
            bb, hh = draw(st.sampled_from([1, B])), draw(st.sampled_from([1, H]))
            kw["mask"] = np.array(
                draw(
                    st.lists(
                        st.booleans(), min_size=bb * hh * T_q * T_k, max_size=bb * hh * T_q * T_k
                    )
                )
            ).reshape(bb, hh, T_q, T_k)
    return B, H, T_q, T_k, kw


def _brute_kw(kw):
    return dict(
        causal=kw["causal"],
        window=kw.get("window"),
        chunk=kw.get("chunk"),
        lengths=kw.get("lengths"),
        kpm=kw.get("key_padding_mask"),
        cu=kw.get("cu_seqlens"),
        prefix=kw.get("prefix_lengths"),
        mask=kw.get("mask"),
    )


@settings(max_examples=150, deadline=None)
@given(patterns())
def test_every_form_of_M_agrees_with_the_rules_cell_by_cell(case):
    B, H, T_q, T_k, kw = case
    pat = Pattern(**kw)
    want = brute(B, H, T_q, T_k, **_brute_kw(kw))
    got = np.broadcast_to(pat.allowed(B, H, T_q, T_k), want.shape)
    assert (got == want).all()
    t = pat.allowed(B, H, T_q, T_k, like=torch.zeros(1)).numpy()
    assert (np.broadcast_to(t, want.shape) == want).all()
    assert (np.broadcast_to(pat.reasons(B, H, T_q, T_k) == 0, want.shape) == want).all()
    # key_range covers every readable key of the block; block_kind agrees with the cells
    for b in range(B):
        for q0 in range(0, T_q, 3):
            q1 = min(T_q, q0 + 3)
            lo, hi = pat.key_range(b, q0, q1, T_q, T_k)
            cols = np.flatnonzero(want[b, :, q0:q1].any(axis=(0, 1)))
            if cols.size:
                assert lo <= cols[0] and cols[-1] < hi
            for k0 in range(0, T_k, 4):
                k1 = min(T_k, k0 + 4)
                cells = want[b, :, q0:q1, k0:k1]
                kind = pat.block_kind(b, q0, q1, k0, k1, T_q, T_k, H=H)
                assert kind == ("full" if cells.all() else "partial" if cells.any() else "skip")


def test_reasons_name_why_a_cell_is_blocked():
    pat = Pattern(window=2, lengths=[3])
    r = pat.reasons(1, 1, 4, 4)[0, 0]
    names = [[masks.REASONS[c] for c in row] for row in r]
    assert names[0] == ["readable", "future", "future", "padding"]
    assert names[2] == ["window", "readable", "readable", "padding"]
    assert names[3] == ["padding"] * 4
    assert r.dtype == np.uint8
    docs = Pattern(cu_seqlens=[0, 2, 4]).reasons(1, 1, 4, 4)[0, 0]
    assert masks.REASONS[docs[2, 0]] == "document" and masks.REASONS[docs[1, 3]] == "document"


def test_modifiers_softcap_then_alibi():
    S = np.array([[[[0.0, 5.0], [100.0, -3.0]]]])
    pat = Pattern(softcap=10.0, alibi_slopes=[0.5])
    out = pat.modify_scores(S)
    expect = 10 * np.tanh(S / 10) - 0.5 * np.abs(np.subtract.outer(np.arange(2), np.arange(2)))
    assert np.allclose(out, expect)
    tout = pat.modify_scores(torch.tensor(S))
    assert np.allclose(tout.numpy(), expect)


def test_dropout_pattern_is_a_function_of_global_positions():
    from causalattn import dropout

    full = dropout.keep_mask(
        7,
        3,
        torch.arange(2)[:, None],
        torch.arange(3)[None, :],
        torch.arange(64),
        torch.arange(64),
        0.25,
    )
    assert full.shape == (2, 3, 64, 64)
    part = dropout.keep_mask(7, 3, 1, 2, torch.arange(10, 20), torch.arange(30, 50), 0.25)
    assert torch.equal(part, full[1, 2, 10:20, 30:50])
    n = full.numel()
    dropped = (~full).sum().item() / n  # binomial: 4 standard deviations
    assert abs(dropped - 0.25) < 4 * (0.25 * 0.75 / n) ** 0.5
    assert not torch.equal(
        full,
        dropout.keep_mask(
            8,
            3,
            torch.arange(2)[:, None],
            torch.arange(3)[None, :],
            torch.arange(64),
            torch.arange(64),
            0.25,
        ),
    )
    assert dropout.keep_mask(1, 1, 0, 0, torch.arange(5), torch.arange(5), 0.0).all()
    with pytest.raises(ValueError, match="dropout_p"):
        dropout.check_p(1.5)
    with pytest.raises(ValueError, match="dropout_p"):
        dropout.check_p("0.1")


@settings(max_examples=80, deadline=None)
@given(patterns(), st.data())
def test_a_placed_block_of_queries_and_keys_reads_as_the_whole_sequence_does(case, data):
    """Ring attention's block pairs: queries qa:qb against keys ka:kb, in global positions."""
    B, H, _, T, kw = case
    kw.pop("mask", None)
    whole = Pattern(**kw).allowed(B, H, T, T)
    qa = data.draw(st.integers(0, T - 1))
    qb = data.draw(st.integers(qa + 1, T))
    ka = data.draw(st.integers(0, T - 1))
    kb = data.draw(st.integers(ka + 1, T))
    if kw.get("key_padding_mask") is not None:
        kw["key_padding_mask"] = kw["key_padding_mask"][:, ka:kb]
    pat = Pattern(**kw, q_start=qa, k_start=ka)
    part = np.broadcast_to(pat.allowed(B, H, qb - qa, kb - ka), (B, 1, qb - qa, kb - ka))
    assert (part == np.broadcast_to(whole, (B, 1, T, T))[:, :, qa:qb, ka:kb]).all()
    for b in range(B):
        lo, hi = pat.key_range(b, 0, qb - qa, qb - qa, kb - ka)
        cols = np.flatnonzero(part[b].any(axis=(0, 1)))
        if cols.size:
            assert lo <= cols[0] and cols[-1] < hi


@settings(max_examples=120, deadline=None)
@given(patterns())
def test_row_ranges_with_key_padding_and_mask_anded_in_are_the_rules_cell_by_cell(case):
    """The kernels' per-row key intervals [lo, hi): every rule but key_padding_mask and mask
    leaves one interval per row; the intervals never move back along the rows, and a row
    that reads nothing is empty (padding rows at T_k)."""
    B, H, T_q, T_k, kw = case
    pat = Pattern(**kw)
    lo, hi = pat.row_ranges(T_q, T_k)
    n = B if (kw.get("lengths") is not None or kw.get("prefix_lengths") is not None) else 1
    assert lo.shape == hi.shape == (n, T_q) and lo.dtype == hi.dtype == np.int64
    j = np.arange(T_k)
    interval = (j >= lo[..., None]) & (j < hi[..., None])  # (n, T_q, T_k)
    want = brute(B, H, T_q, T_k, **{**_brute_kw(kw), "kpm": None, "mask": None})[:, 0]
    assert (np.broadcast_to(interval, want.shape) == want).all()
    assert (lo <= hi).all() and (hi <= T_k).all() and (lo >= 0).all()
    assert (np.diff(lo, axis=1) >= 0).all() and (np.diff(hi, axis=1) >= 0).all()
    if kw.get("lengths") is not None:
        pos = np.arange(T_q) + T_k - T_q
        padding = pos[None, :] >= np.asarray(kw["lengths"])[:, None]
        assert (lo[padding] == T_k).all() and (hi[padding] == T_k).all()


def test_row_ranges_of_a_placed_block_are_its_own_key_indices():
    """Ring block pair: queries at global 8..11 against keys at global 4..11."""
    lo, hi = Pattern(window=3, q_start=8, k_start=4).row_ranges(4, 8)
    assert lo.tolist() == [[2, 3, 4, 5]] and hi.tolist() == [[5, 6, 7, 8]]
    lo, hi = Pattern(chunk=4, q_start=8, k_start=4).row_ranges(4, 8)
    assert lo.tolist() == [[4, 4, 4, 4]] and hi.tolist() == [[5, 6, 7, 8]]
    lo, hi = Pattern(prefix_lengths=[10], q_start=8, k_start=4).row_ranges(4, 8)
    assert lo.tolist() == [[0, 0, 0, 0]] and hi.tolist() == [[6, 6, 7, 8]]


@pytest.mark.parametrize("rule", [{}, {"window": 3}, {"chunk": 4}])
def test_counts_are_the_cells_of_each_kind(rule):
    """masks.counts (O(B·T) from the row ranges) against the dense reasons, per sequence."""
    T, lengths = 9, [9, 5, 0, 1]
    got = masks.counts(lengths, T, **rule)
    reasons = Pattern(lengths=lengths, **rule).reasons(len(lengths), 1, T, T)[:, 0]
    kinds = ["readable", "future", "padding"] + [k for k in ("window", "chunk") if k in rule]
    assert sorted(got) == sorted(kinds)
    for kind in kinds:
        code = next(c for c, name in masks.REASONS.items() if name == kind)
        assert got[kind].tolist() == (reasons == code).sum(axis=(1, 2)).tolist(), kind
    assert all(got[k].dtype == np.int64 for k in kinds)


def test_alibi_slopes_are_the_papers_geometric_sequences():
    """H a power of two: 2^(-8h/H), h = 1..H; otherwise the next lower power of two's slopes,
    then every other slope of the next higher one."""
    assert masks.alibi_slopes(1).tolist() == [2.0**-8]
    assert masks.alibi_slopes(4).tolist() == [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8]
    assert masks.alibi_slopes(8).tolist() == [2.0**-h for h in range(1, 9)]
    six = [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]  # 4, then 8's odd ones
    assert masks.alibi_slopes(6).tolist() == six
    assert masks.alibi_slopes(6).dtype == np.float64
    with pytest.raises(ValueError, match="n_heads must be >= 1"):
        masks.alibi_slopes(0)


def _alibi_by_hand(S, slopes, qpos, kpos):
    """S[b, h, i, j] - slope[b|., h]·|qpos[i] - kpos[j]|, cell by cell (the module doc)."""
    out = np.array(S, dtype=np.float64)
    sl = np.asarray(slopes, dtype=np.float64)
    for b, h, i, j in np.ndindex(*out.shape):
        s = sl[h] if sl.ndim == 1 else sl[b, h]
        out[b, h, i, j] -= s * abs(qpos[i] - kpos[j])
    return out


@pytest.mark.parametrize("xp", ["numpy", "torch"])
@pytest.mark.parametrize(
    "placement",
    [{}, {"q_start": 10, "k_start": 4}, {"k_start": 3}],
    ids=["bottom-right", "placed", "keys-placed"],
)
def test_alibi_of_a_tile_uses_the_global_positions_of_its_rows_and_columns(xp, placement):
    """A tile (queries q0:q0+2, keys k0:k0+3) of a T_q×T_k problem: ALiBi's distance is
    |pos(i) - j| in global positions, with T_q/T_k given (not the tile's own size)."""
    T_q, T_k, q0, k0 = 5, 7, 2, 1
    pat = Pattern(alibi_slopes=[0.5, 0.25, 2.0], **placement)
    S = np.arange(2 * 3 * 2 * 3, dtype=np.float32).reshape(2, 3, 2, 3)
    qs = pat.query_start(T_q, T_k)
    qpos, kpos = qs + q0 + np.arange(2), pat.k_start + k0 + np.arange(3)
    want = _alibi_by_hand(S, [0.5, 0.25, 2.0], qpos, kpos)
    got = pat.modify_scores(S if xp == "numpy" else torch.tensor(S), q0=q0, k0=k0, T_q=T_q, T_k=T_k)
    assert type(got) is type(S if xp == "numpy" else torch.tensor(S))
    got = np.asarray(got)
    assert got.dtype == np.float32  # S's dtype is kept
    np.testing.assert_allclose(got, want, rtol=1e-6)
    if not placement:  # T_q/T_k default to S's own last axes (a whole problem)
        whole = pat.modify_scores(S if xp == "numpy" else torch.tensor(S))
        square = _alibi_by_hand(S, [0.5, 0.25, 2.0], 1 + np.arange(2), np.arange(3))
        np.testing.assert_allclose(np.asarray(whole), square, rtol=1e-6)


@pytest.mark.parametrize("xp", ["numpy", "torch"])
def test_per_sequence_alibi_slopes_follow_the_batch_rows_asked_for(xp):
    slopes = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])  # (B, H)
    S = np.zeros((2, 2, 2, 2))
    conv = (lambda a: a) if xp == "numpy" else torch.tensor
    pat = Pattern(alibi_slopes=conv(slopes))
    rows = np.arange(2)
    got = np.asarray(pat.modify_scores(conv(S), batch=[2, 0]))
    np.testing.assert_allclose(got, _alibi_by_hand(S, slopes[[2, 0]], rows, rows))
    full = np.zeros((3, 2, 2, 2))
    np.testing.assert_allclose(
        np.asarray(pat.modify_scores(conv(full))), _alibi_by_hand(full, slopes, rows, rows)
    )
    # per-head slopes ignore batch: every sequence gets the same
    heads = Pattern(alibi_slopes=conv(np.array([1.0, 2.0])))
    np.testing.assert_allclose(
        np.asarray(heads.modify_scores(conv(S), batch=[1, 0])),
        _alibi_by_hand(S, [1.0, 2.0], rows, rows),
    )


def test_score_modifiers_keep_torch_autograd_and_the_device():
    """Engines differentiate through the modifiers: softcap's gradient is 1 - tanh²(S/c)."""
    S = torch.tensor([[[[0.0, 5.0], [20.0, -3.0]]]], dtype=torch.float64, requires_grad=True)
    out = Pattern(softcap=10.0, alibi_slopes=torch.tensor([0.5])).modify_scores(S)
    out.sum().backward()
    assert torch.allclose(S.grad, 1 - torch.tanh(S.detach() / 10) ** 2)
    meta = torch.empty(1, 2, 3, 3, device="meta", dtype=torch.float16)
    got = Pattern(softcap=5.0, alibi_slopes=[0.5, 1.0]).modify_scores(meta)
    assert got.device.type == "meta" and got.shape == meta.shape and got.dtype == torch.float16


@settings(max_examples=100, deadline=None)
@given(patterns())
def test_key_range_is_the_tightest_interval_without_a_dense_mask(case):
    """Without key_padding_mask and mask every rule leaves an interval per query row, so a
    block's key range is exactly the hull of the keys its rows read (nothing wasted). (A
    block reaching into a prefix drops the chunk bound: without causality that can be wider.)"""
    B, H, T_q, T_k, kw = case
    kw.pop("mask", None)
    kw.pop("key_padding_mask", None)
    if "prefix_lengths" in kw and "chunk" in kw and not kw["causal"]:
        kw.pop("chunk")
    pat = Pattern(**kw)
    want = brute(B, H, T_q, T_k, **_brute_kw(kw))
    for b in range(B):
        assert pat.key_range(b, 2, 2, T_q, T_k) == (0, 0)  # an empty block reads nothing
        for q0 in range(T_q):
            for q1 in range(q0 + 1, min(T_q, q0 + 4) + 1):
                cols = np.flatnonzero(want[b, 0, q0:q1].any(axis=0))
                hull = (int(cols[0]), int(cols[-1]) + 1) if cols.size else (0, 0)
                assert pat.key_range(b, q0, q1, T_q, T_k) == hull, (b, q0, q1)


def test_slopes_and_sinks_are_checked_and_kept():
    learned = torch.nn.Parameter(torch.tensor([0.5, -1.0]))
    assert Pattern(sinks=learned).sinks is learned  # a learned parameter is kept as is
    ints = Pattern(alibi_slopes=[1, 2]).alibi_slopes
    assert ints.dtype == np.float64 and ints.tolist() == [1.0, 2.0]
    assert Pattern(sinks=torch.empty(2, device="meta")).sinks.device.type == "meta"
    for bad, msg in [
        (dict(alibi_slopes=torch.tensor([0.5, float("nan")])), "alibi_slopes must be finite"),
        (dict(sinks=torch.tensor([float("inf")])), "sinks must be finite"),
        (
            dict(alibi_slopes=[0.5, float("nan")]),
            "^mask: alibi_slopes must be finite, got non-finite entries$",
        ),
        (
            dict(rel_bias=np.array([[0.0, np.inf, 1.0]])),
            "^mask: rel_bias must be finite, got non-finite entries$",
        ),
        (dict(sinks=torch.tensor([1, 2])), "sinks must be a real array"),
        (dict(sinks=[True, False]), "sinks must be a real array"),
        (dict(sinks=["a"]), "sinks must be a real array"),
        (
            dict(alibi_slopes=np.zeros((1, 1, 1))),
            r"^mask: alibi_slopes must be a real array with 1 or 2 axes, got shape \(1, 1, 1\) "
            r"and dtype float64$",
        ),
        (dict(sinks=torch.zeros(2, 2)), r"sinks must be a real array with 1 axes, got shape \(2, "),
    ]:
        with pytest.raises(ValueError, match=msg):
            Pattern(**bad)


@pytest.mark.parametrize("rule", [{}, {"chunk": 2}, {"window": 3}, {"causal": False, "chunk": 3}])
def test_key_range_of_packed_documents_is_the_tightest_interval(rule):
    """Documents [0, 3), [3, 3) (empty), [3, 7), [7, 12): a block of queries reads only
    inside the documents it spans, chunks counted from each document's start."""
    cu = [0, 3, 3, 7, 12]
    pat = Pattern(cu_seqlens=cu, **rule)
    want = brute(
        1,
        1,
        12,
        12,
        cu=cu,
        causal=rule.get("causal", True),
        **{k: v for k, v in rule.items() if k != "causal"},
    )[0, 0]
    for q0 in range(12):
        for q1 in range(q0 + 1, min(12, q0 + 4) + 1):
            cols = np.flatnonzero(want[q0:q1].any(axis=0))
            assert pat.key_range(0, q0, q1, 12, 12) == (int(cols[0]), int(cols[-1]) + 1), (q0, q1)


@pytest.mark.parametrize(
    "shape,per_batch,per_head,dense",
    [
        ((5, 6), False, False, (1, 1, 5, 6)),
        ((1, 5, 6), False, False, (1, 1, 5, 6)),
        ((3, 5, 6), False, True, (1, 3, 5, 6)),  # 3-D is (H, T_q, T_k): heads, not batch rows
        ((1, 1, 5, 6), False, False, (1, 1, 5, 6)),
        ((2, 1, 5, 6), True, False, (2, 1, 5, 6)),
        ((1, 3, 5, 6), False, True, (1, 3, 5, 6)),
        ((2, 3, 5, 6), True, True, (2, 3, 5, 6)),
    ],
)
@pytest.mark.parametrize("xp", ["numpy", "torch"])
def test_a_dense_masks_axes_say_whether_it_differs_by_batch_row_or_head(
    shape, per_batch, per_head, dense, xp
):
    """mask (T_q, T_k), (H|1, T_q, T_k) or (B|1, H|1, T_q, T_k): per_batch reads only a 4-D
    mask's first axis, per_head the axis third from the end; the dense forms follow."""
    m = np.random.default_rng(1).random(shape) > 0.4
    pat = Pattern(causal=False, mask=m if xp == "numpy" else torch.from_numpy(m))
    assert (pat.per_batch, pat.per_head) == (per_batch, per_head)
    got = pat.allowed(2, 3, 5, 6)
    assert tuple(got.shape) == dense and pat.reasons(2, 3, 5, 6).shape == dense
    assert np.array_equal(np.asarray(got), m.reshape(dense))  # the mask itself, 4-D
    assert Pattern(causal=False, mask=m, lengths=[5, 6]).per_batch  # lengths: always per row


@pytest.mark.parametrize("rule", [{}, {"chunk": 2}, {"window": 3}, {"causal": False, "chunk": 3}])
def test_row_ranges_of_packed_documents_are_the_rules_row_by_row(rule):
    """Documents [0, 3), [3, 3) (empty), [3, 7), [7, 12): each row's interval stays inside
    its own document, chunks counted from the document's start."""
    cu = [0, 3, 3, 7, 12]
    lo, hi = Pattern(cu_seqlens=cu, **rule).row_ranges(12, 12)
    rules = {k: v for k, v in rule.items() if k != "causal"}
    want = brute(1, 1, 12, 12, cu=cu, causal=rule.get("causal", True), **rules)[0, 0]
    j = np.arange(12)
    assert ((j >= lo[0][:, None]) & (j < hi[0][:, None]) == want).all()


# placed blocks whose rules leave a row or a whole block nothing: (pattern, T_q, T_k)
NOTHING_TO_READ = [
    (dict(q_start=0, k_start=8), 4, 4),  # every key in the queries' future
    (dict(window=2, q_start=8, k_start=0), 2, 4),  # every key before the window
    (dict(window=2, q_start=5, k_start=0), 1, 4),  # the window starts just past the keys
]


@pytest.mark.parametrize("kw,T_q,T_k", NOTHING_TO_READ)
def test_a_block_that_reads_nothing_has_empty_ranges_inside_its_keys(kw, T_q, T_k):
    """row_ranges gives such a row lo = hi within [0, T_k]; key_range gives the block (0, 0),
    never an interval that is empty only by lo >= hi."""
    pat = Pattern(**kw)
    want = np.broadcast_to(pat.allowed(1, 1, T_q, T_k), (1, 1, T_q, T_k))[0, 0]
    lo, hi = pat.row_ranges(T_q, T_k)
    assert (0 <= lo).all() and (lo <= hi).all() and (hi <= T_k).all()
    j = np.arange(T_k)
    assert ((j >= lo[0][:, None]) & (j < hi[0][:, None]) == want).all()
    empty = [i for i in range(T_q) if not want[i].any()]
    assert empty and all(lo[0, i] == hi[0, i] for i in empty)
    assert pat.key_range(0, empty[0], empty[-1] + 1, T_q, T_k) == (0, 0)


def test_key_range_of_a_placed_block_is_in_its_own_key_indices():
    """Queries at global 8, 9 against keys at global 4..11 (causal): keys 4..9, local 0..6."""
    assert Pattern(q_start=8, k_start=4).key_range(0, 0, 2, 4, 8) == (0, 6)
    assert Pattern(window=3, q_start=8, k_start=4).key_range(0, 0, 2, 4, 8) == (2, 6)


def test_key_range_is_the_hull_of_the_readable_keys_of_key_padding_and_a_dense_mask():
    """key_padding_mask and a 2-D or 3-D mask bound the range to their readable columns
    (local, also for a placed block); a row of the batch with no readable key is (0, 0)."""
    kpm = np.array([[0, 1, 1, 0, 1, 0], [0, 0, 0, 0, 0, 0]], bool)
    pat = Pattern(causal=False, key_padding_mask=kpm)
    assert pat.key_range(0, 0, 2, 2, 6) == (1, 5)
    assert pat.key_range(1, 0, 2, 2, 6) == (0, 0)
    m = np.zeros((4, 8), bool)
    m[0, 2] = m[1, 5] = True  # rows 2, 3 read nothing
    per_row = np.stack([np.zeros_like(m), m])[:, None]  # (2, 1, 4, 8): row 0 reads nothing
    assert Pattern(causal=False, mask=per_row).key_range(1, 0, 2, 4, 8) == (2, 6)
    assert Pattern(causal=False, mask=per_row).key_range(0, 0, 2, 4, 8) == (0, 0)
    for mask in (m, m[None], torch.from_numpy(m)):
        for placement in ({}, {"q_start": 0, "k_start": 4}):
            pat = Pattern(causal=False, mask=mask, **placement)
            assert pat.key_range(0, 0, 2, 4, 8) == (2, 6)
            assert pat.key_range(0, 1, 2, 4, 8) == (5, 6)
            assert pat.key_range(0, 2, 4, 4, 8) == (0, 0)


def _reads_head_and_row(b, h, q_idx, kv_idx):
    """Causal; head 1 also drops the diagonal; batch row 1 reads nothing before key 2."""
    return (kv_idx <= q_idx) & ((h == 0) | (kv_idx < q_idx)) & ((b == 0) | (kv_idx >= 2))


def _causal_mod(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def test_a_mask_mod_is_asked_about_every_head_and_row_of_the_problem():
    """allowed and reasons (B', H, T_q, T_k): a mask_mod may read b and h, so B' = B even for
    one that does not; "mask_mod" names the cells it alone blocks."""
    B, H, T = 2, 2, 5
    want = np.zeros((B, H, T, T), bool)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                for j in range(T):
                    want[b, h, i, j] = _reads_head_and_row(b, h, i, j)
    pat = Pattern(causal=False, mask_mod=_reads_head_and_row)
    assert np.array_equal(pat.allowed(B, H, T, T), want)
    r = pat.reasons(B, H, T, T)
    mask_code = next(c for c, n in masks.REASONS.items() if n == "mask_mod")
    assert np.array_equal(r, np.where(want, 0, mask_code))
    assert pat.allowed(B, H, T, T, like=torch.zeros(1)).numpy().tolist() == want.tolist()
    plain = Pattern(causal=False, mask_mod=_causal_mod)
    assert plain.reasons(B, H, T, T).shape[0] == B


def test_block_kind_with_a_mask_mod_reads_the_row_and_the_heads_asked_for():
    """Each tile's kind from the cells of batch row b, heads 0..H-1 (H=1: head 0 only)."""
    B, H, T = 2, 2, 6
    pat = Pattern(causal=False, mask_mod=_reads_head_and_row)
    cells = pat.allowed(B, H, T, T)
    for b in range(B):
        for heads in (1, 2):
            for q0, q1, k0, k1 in [(0, 2, 0, 2), (2, 4, 0, 2), (3, 6, 2, 4), (0, 3, 3, 6)]:
                c = cells[b, :heads, q0:q1, k0:k1]
                kind = "full" if c.all() else "partial" if c.any() else "skip"
                args = (b, q0, q1, k0, k1, T, T)
                got = pat.block_kind(*args, H=heads) if heads > 1 else pat.block_kind(*args)
                assert got == kind, (b, heads, q0, q1, k0, k1)


def test_block_kind_skips_a_tile_outside_the_key_range_without_asking_the_mask_mod():
    """Tiles that end at the range's start, start at its end, lie beyond it or meet an empty
    range are "skip" with no call to the mask_mod; one inside the range asks it."""
    calls = []

    def mod(b, h, q_idx, kv_idx):
        calls.append(1)
        return kv_idx <= q_idx

    pat = Pattern(window=3, mask_mod=mod)
    T = 16
    assert pat.key_range(0, 8, 10, T, T) == (6, 10)
    calls.clear()
    for k0, k1 in [(4, 6), (0, 5), (10, 12), (11, 16)]:
        assert pat.block_kind(0, 8, 10, k0, k1, T, T) == "skip", (k0, k1)
    lo, hi = Pattern(window=2, q_start=5, k_start=0, mask_mod=mod).key_range(0, 0, 1, 1, 4)
    assert (lo, hi) == (0, 0)
    assert Pattern(window=2, q_start=5, k_start=0, mask_mod=mod).block_kind(0, 0, 1, 0, 4, 1, 4)
    assert calls == []
    assert pat.block_kind(0, 8, 10, 6, 10, T, T) == "partial" and calls


@pytest.mark.parametrize(
    "kw,B",
    [(kw, B) for kw in ({}, {"window": 2}, {"mask_mod": _causal_mod}) for B in (0, 1, 2)]
    + [({"lengths": [3, 1]}, 2)],
)
def test_reasons_and_allowed_have_one_shape(kw, B):
    """A pattern that is not per batch has one batch row (B' = 1, for an empty batch too)."""
    pat = Pattern(**kw)
    want = (B if pat.per_batch else 1, 1, 3, 3)
    assert pat.allowed(B, 1, 3, 3).shape == pat.reasons(B, 1, 3, 3).shape == want


def test_block_kind_asks_a_mask_mod_about_a_few_tiles_at_a_time():
    """Never the whole block: each call covers at most masks_mod.TILE_CELLS cells."""
    from causalattn.masks_mod import TILE_CELLS

    cells = []

    def mod(b, h, q_idx, kv_idx):
        cells.append(q_idx.shape[-2] * kv_idx.shape[-1])
        return kv_idx <= q_idx

    T = 1024
    pat = Pattern(causal=False, mask_mod=mod)
    cells.clear()
    assert pat.block_kind(0, 0, T, 0, T // 2, T, T) == "partial"
    assert cells and max(cells) <= TILE_CELLS < T * T // 2


def _user_modified_by_hand(S, kw, T_q, T_k, q_start=None, k_start=0):
    """rel_bias, bias, then score_mod, cell by cell, on the whole (B, H, T_q, T_k)."""
    out = S.copy()
    qs = k_start + T_k - T_q if q_start is None else q_start
    B, H = S.shape[:2]
    for b in range(B):
        for h in range(H):
            for i in range(T_q):
                for j in range(T_k):
                    p, k = i + qs, j + k_start
                    s = out[b, h, i, j]
                    if "rel_bias" in kw:
                        r = kw["rel_bias"]
                        s += r[h, (r.shape[1] - 1) // 2 + k - p]
                    if "bias" in kw:
                        bias = kw["bias"]
                        s += bias[
                            b if bias.shape[0] > 1 else 0, h, i if bias.shape[2] > 1 else 0, j
                        ]
                    if "score_mod" in kw:
                        s = kw["score_mod"](s, b, h, p, k)
                    out[b, h, i, j] = s
    return out


def _score_mod(score, b, h, q_idx, kv_idx):
    return score * (1 + h) + 0.25 * (q_idx - kv_idx) - b


USER_MODS = [
    {"rel_bias": np.arange(2 * 11, dtype=float).reshape(2, 11) / 7},
    {"bias": np.arange(3 * 2 * 4 * 6, dtype=float).reshape(3, 2, 4, 6) / 9},
    {"bias": np.linspace(-1, 1, 2 * 6).reshape(1, 2, 1, 6)},  # broadcast over b and rows
    {"score_mod": _score_mod},
    {
        "rel_bias": np.linspace(0, 1, 2 * 11).reshape(2, 11),
        "bias": np.linspace(1, 2, 3 * 2 * 4 * 6).reshape(3, 2, 4, 6),
        "score_mod": _score_mod,
    },
]


@pytest.mark.parametrize("xp", ["numpy", "torch"])
@pytest.mark.parametrize("placement", [{}, {"q_start": 5, "k_start": 1}])
@pytest.mark.parametrize("kw", USER_MODS)
def test_user_score_modifiers_of_a_tile_are_those_of_the_whole_by_hand(kw, placement, xp):
    """modify_scores with rel_bias, bias and score_mod (alone and together): the whole S cell
    by cell, and each tile (q0, k0, batch rows) its own part of it."""
    B, H, T_q, T_k = 3, 2, 4, 6
    S = np.random.default_rng(5).standard_normal((B, H, T_q, T_k))
    want = _user_modified_by_hand(S, kw, T_q, T_k, **placement)
    pat = Pattern(causal=False, **kw, **placement)

    def run(S_part, *args, **kwargs):
        got = pat.modify_scores(
            torch.from_numpy(S_part) if xp == "torch" else S_part, *args, **kwargs
        )
        assert (xp == "torch") == torch.is_tensor(got)
        return np.asarray(got)

    assert np.allclose(run(S), want, atol=1e-12)
    for rows, q0, q1, k0, k1 in [([2], 1, 3, 2, 5), ([0, 2], 3, 4, 0, 6), ([1], 0, 4, 5, 6)]:
        part = np.ascontiguousarray(S[rows][:, :, q0:q1, k0:k1])
        got = run(part, q0, k0, T_q, T_k, batch=rows)
        assert np.allclose(got, want[rows][:, :, q0:q1, k0:k1], atol=1e-12), (rows, q0, k0)


def test_counts_refuses_by_name():
    with pytest.raises(ValueError) as err:
        masks.counts([1], -1, window=2)
    assert str(err.value) == "mask: T must be >= 0, got -1"
    with pytest.raises(ValueError) as err:
        masks.counts([5, 1], 3, chunk=2)
    assert str(err.value) == "mask counts: lengths must lie in [0, T=3], got [5, 1]"


def test_describe_names_every_rule_in_order():
    assert Pattern().describe() == "causal"
    assert Pattern(causal=False).describe() == "bidirectional"
    everything = Pattern(
        window=3,
        chunk=4,
        prefix_lengths=[1],
        lengths=[4],
        mask=np.ones((4, 4), bool),
        mask_mod=_causal_mod,
        softcap=2.5,
        alibi_slopes=[0.5],
        sinks=[0.0],
        rel_bias=np.zeros((1, 7)),
        bias=np.zeros((1, 1, 4, 4)),
        score_mod=_score_mod,
    )
    assert everything.describe() == (
        "causal + window 3 + chunk 4 + prefix + padding + mask + mask_mod _causal_mod + "
        "softcap 2.5 + ALiBi + sinks + relative bias + bias + score_mod _score_mod"
    )
    assert Pattern(key_padding_mask=np.ones((1, 2), bool)).describe() == "causal + padding"
    assert Pattern(cu_seqlens=[0, 2, 4]).describe() == "causal + documents"


def test_only_keeps_the_named_score_modifiers_and_every_rule():
    full = Pattern(
        window=2,
        softcap=3.0,
        alibi_slopes=[0.5],
        rel_bias=np.zeros((1, 3)),
        bias=np.zeros((1, 1, 2, 2)),
        score_mod=_score_mod,
    )
    kept = full.only("alibi_slopes", "bias")
    assert kept.window == 2 and kept.softcap is None and kept.rel_bias is None
    assert kept.score_mod is None and kept.alibi_slopes is not None and kept.bias is not None
    assert full.only().describe() == "causal + window 2"
    assert full.only("softcap", "rel_bias", "score_mod").describe() == (
        "causal + window 2 + softcap 3 + relative bias + score_mod _score_mod"
    )


def test_batch_size_is_what_the_per_sequence_data_says():
    assert Pattern().batch_size() == 1
    assert Pattern(lengths=[1, 2, 3]).batch_size() == 3
    assert Pattern(prefix_lengths=[1, 2]).batch_size() == 2
    assert Pattern(key_padding_mask=np.ones((4, 3), bool)).batch_size() == 4


def test_a_reasons_name_is_the_mask_mods_own_for_its_code():
    mask_mod = next(c for c, n in masks.REASONS.items() if n == "mask_mod")
    future = next(c for c, n in masks.REASONS.items() if n == "future")
    assert Pattern(mask_mod=_causal_mod).reason_name(mask_mod) == "_causal_mod"
    assert Pattern().reason_name(mask_mod) == "mask_mod"
    assert Pattern(mask_mod=_causal_mod).reason_name(np.uint8(future)) == "future"


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"window": 2, "lengths": [5, 3]},
        {"chunk": 2, "prefix_lengths": [2, 0], "causal": False},
        {"key_padding_mask": np.array([[1, 1, 0, 1, 1], [0, 1, 1, 1, 1]], bool)},
        {"mask": np.random.default_rng(3).random((2, 3, 4, 5)) > 0.3},
        {"mask": np.random.default_rng(4).random((3, 4, 5)) > 0.3, "window": 3},
        {"mask_mod": _reads_head_and_row, "lengths": [4, 5]},
        {"mask": np.random.default_rng(5).random((2, 1, 4, 5)) > 0.3},  # one head for three
        {"mask": np.random.default_rng(6).random((2, 4, 5)) > 0.3, "H": 2},
    ],
)
def test_to_mask_mod_is_the_dense_mask_pointwise(kw):
    """FlexAttention's indices (q_idx 0..T_q-1, queries bottom-right): every cell of
    to_mask_mod's answer is allowed()'s, through rules_at."""
    kw = dict(kw)
    B, H, T_q, T_k = 2, kw.pop("H", 3), 4, 5
    pat = Pattern(**kw)
    mod = pat.to_mask_mod(T_q, T_k)
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    q = torch.arange(T_q).view(1, 1, T_q, 1)
    kv = torch.arange(T_k).view(1, 1, 1, T_k)
    got = torch.broadcast_to(mod(b, h, q, kv), (B, H, T_q, T_k)).numpy()
    want = np.broadcast_to(pat.allowed(B, H, T_q, T_k), (B, H, T_q, T_k))
    assert (got == want).all()


@pytest.mark.parametrize("shape", [(5, 7), (3, 5, 7), (2, 1, 5, 7)])
@pytest.mark.parametrize("blocks", [(2, 3), (5, 7), (4, 8)])
def test_mask_tile_kinds_are_each_tiles_cells_of_the_dense_mask(shape, blocks):
    """0 nothing allowed, 1 everything, 2 partly, per (block_q × block_k) tile of the dense
    mask alone, cut at T_q, T_k; int8 torch (B', H', ceil(T_q/bq), ceil(T_k/bk))."""
    m = np.random.default_rng(sum(shape)).random(shape) > 0.5
    m[..., :2, :3] = True  # a full tile at (0, 0) for the smaller blocks
    m[..., 4:, :] = False
    for mask in (m, torch.from_numpy(m)):
        pat = Pattern(causal=False, window=2, mask=mask)  # the rules beside it do not count
        kinds = pat.mask_tile_kinds(*blocks, like=torch.zeros(1))
        m4 = m.reshape((1,) * (4 - m.ndim) + m.shape)
        bq, bk = blocks
        n_q, n_k = -(-5 // bq), -(-7 // bk)
        assert kinds.dtype == torch.int8 and tuple(kinds.shape) == (*m4.shape[:2], n_q, n_k)
        for x in range(n_q):
            for y in range(n_k):
                cells = m4[:, :, x * bq : (x + 1) * bq, y * bk : (y + 1) * bk]
                want = np.where(cells.all((2, 3)), 1, np.where(cells.any((2, 3)), 2, 0))
                assert kinds[:, :, x, y].tolist() == want.tolist(), (x, y)
    assert Pattern(window=2).mask_tile_kinds(2, 2) is None
    kinds = Pattern(mask=np.ones((3, 4), bool)).mask_tile_kinds(2, 2)  # no like=: the CPU
    assert kinds.device.type == "cpu" and kinds.tolist() == [[[[1, 1], [1, 1]]]]


def test_extra_tile_is_the_dense_mask_and_the_mask_mod_alone():
    """For kernels that apply the intervals and the key padding themselves: the dense mask
    AND the mask_mod of the tile (placed as the pattern is), torch bool on the CPU."""
    m = np.random.default_rng(8).random((2, 1, 4, 6)) > 0.3
    pat = Pattern(window=2, lengths=[3, 4], mask=m, mask_mod=_reads_head_and_row)
    B, H, T_q, T_k = 2, 2, 4, 6
    want = np.zeros((B, H, T_q, T_k), bool)
    qs = T_k - T_q
    for b in range(B):
        for h in range(H):
            for i in range(T_q):
                for j in range(T_k):
                    want[b, h, i, j] = m[b, 0, i, j] and _reads_head_and_row(b, h, i + qs, j)
    for q0, q1, k0, k1 in [(0, 4, 0, 6), (1, 3, 2, 5)]:
        got = pat.extra_tile(B, H, T_q, T_k, q0, q1, k0, k1)
        assert torch.is_tensor(got) and got.device.type == "cpu"
        got = torch.broadcast_to(got, (B, H, q1 - q0, k1 - k0)).numpy()
        assert (got == want[:, :, q0:q1, k0:k1]).all(), (q0, k0)
    placed = Pattern(mask_mod=_causal_mod, q_start=6, k_start=4)
    assert placed.extra_tile(1, 1, 2, 3, 0, 2, 0, 3)[0, 0].tolist() == [[True] * 3, [True] * 3]
    late = Pattern(mask_mod=_causal_mod, q_start=0, k_start=4)
    assert not late.extra_tile(1, 1, 2, 3, 0, 2, 0, 3).any()
    everything = Pattern(mask=np.ones((3, 3), bool))  # causal, but the rules are not its part
    assert everything.extra_tile(1, 1, 3, 3, 0, 3, 0, 3).all()


@pytest.mark.parametrize("xp", ["numpy", "torch"])
def test_user_modifiers_keep_the_scores_dtype_and_a_bias_its_gradient(xp):
    """A float64 bias and rel_bias on float32 scores give float32; a torch bias that needs a
    gradient gets it through modify_scores."""
    S = np.zeros((1, 1, 2, 3), np.float32)
    S = torch.from_numpy(S) if xp == "torch" else S
    for kw in ({"bias": np.ones((1, 1, 2, 3))}, {"rel_bias": np.ones((1, 5))}):
        assert Pattern(causal=False, **kw).modify_scores(S).dtype == S.dtype
    if xp == "torch":
        bias = torch.zeros(1, 1, 2, 3, requires_grad=True)
        Pattern(causal=False, bias=bias).modify_scores(S).sum().backward()
        assert bias.grad is not None and bias.grad.tolist() == [[[[1.0] * 3] * 2]]


@pytest.mark.parametrize(
    "shape", [(2, 1, 4, 1), (2, 2, 2, 6), (1, 1, 4, 2), (4, 6), (6,)]
)  # a batch axis of 2, query or key axes of 1 or 2, fewer than 4 axes
def test_a_bias_tile_is_its_broadcast_part(shape):
    B, H, T_q, T_k = 2, 2, 4, 6
    bias = np.random.default_rng(2).standard_normal(shape)
    if shape[-2:] == (2, 6):
        T_q = 2
    if shape[-1] == 2:
        T_k = 2
    pat = Pattern(causal=False, bias=bias)
    full = np.broadcast_to(bias.reshape((1,) * (4 - bias.ndim) + shape), (B, H, T_q, T_k))
    S = np.zeros((B, H, T_q, T_k))
    for rows, q0, k0 in [([1], 1, 1), ([0, 1], 0, 0), ([0], T_q - 1, T_k - 1)]:
        part = S[rows][:, :, q0:, k0:]
        got = pat.modify_scores(part, q0, k0, T_q, T_k, batch=rows)
        assert np.array_equal(np.broadcast_to(got, part.shape), full[rows][:, :, q0:, k0:])


@pytest.mark.parametrize("rule", [{"chunk": 2}, {"chunk": 3, "causal": False}, {"window": 2}])
def test_packed_documents_count_chunks_from_each_documents_start(rule):
    """allowed() of documents [0, 3), [3, 7), [7, 12) against the rules cell by cell."""
    cu = [0, 3, 7, 12]
    rules = {k: v for k, v in rule.items() if k != "causal"}
    want = brute(1, 1, 12, 12, cu=cu, causal=rule.get("causal", True), **rules)
    got = Pattern(cu_seqlens=cu, **rule).allowed(1, 1, 12, 12)
    assert np.array_equal(np.broadcast_to(got, want.shape), want)


def test_a_tile_of_chosen_batch_rows_reads_their_own_mask_rows_and_keeps_the_array_kind():
    m = np.zeros((2, 1, 3, 4), bool)
    m[1] = True
    pat = Pattern(causal=False, mask=m)
    assert pat.tile(2, 1, 3, 4, batch=[1]).all() and not pat.tile(2, 1, 3, 4, batch=[0]).any()
    assert pat.tile(2, 1, 3, 4, batch=[1]).shape == (1, 1, 3, 4)
    assert isinstance(pat.allowed(2, 1, 3, 4, like=np.zeros(1)), np.ndarray)
    assert torch.is_tensor(pat.allowed(2, 1, 3, 4, like=torch.zeros(1)))
