"""masks: causal (square and bottom-right), padding, combine (AND), additive view."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from causalattn import masks
from causalattn.matrix_form import softmax_last


def test_causal_square_is_the_lower_triangle():
    m = masks.causal(4)
    assert m.dtype == np.bool_
    assert m.astype(int).tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert masks.causal(1).tolist() == [[True]]
    assert masks.causal(0).shape == (0, 0)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 9), st.integers(0, 6))
def test_causal_bottom_right_alignment(T_q, extra):
    T_k = T_q + extra
    m = masks.causal(T_q, T_k)
    assert m.shape == (T_q, T_k)
    for i in range(T_q):  # query i is absolute position i + extra: reads keys 0..i+extra
        assert m[i].tolist() == [j <= i + extra for j in range(T_k)]
    # the last query reads every key; the square case is the T_k×T_k mask's last T_q rows
    assert m[-1].all()
    np.testing.assert_array_equal(m, masks.causal(T_k)[extra:])


def test_causal_errors():
    with pytest.raises(ValueError, match="T_q=3 queries but only T_k=2 keys"):
        masks.causal(3, 2)
    with pytest.raises(ValueError, match="T_q must be an integer"):
        masks.causal(2.0)
    with pytest.raises(ValueError, match="T_q must be >= 0"):
        masks.causal(-1)


def test_padding_masks():
    kp = masks.key_padding(np.array([3, 1, 0]), 3)
    assert kp.astype(int).tolist() == [[1, 1, 1], [1, 0, 0], [0, 0, 0]]
    np.testing.assert_array_equal(masks.query_padding([3, 1, 0], 3), kp)
    with pytest.raises(ValueError, match="lengths must lie in \\[0, T=3\\]"):
        masks.key_padding([4], 3)
    with pytest.raises(ValueError, match="1-D integer array"):
        masks.key_padding([[1]], 3)
    with pytest.raises(ValueError, match="1-D integer array"):
        masks.query_padding([1.5], 3)


def test_combine_is_logical_and_with_broadcasting():
    T = 4
    lengths = np.array([4, 2])
    m = masks.combine(
        masks.causal(T)[None],
        masks.key_padding(lengths, T)[:, None, :],
        masks.query_padding(lengths, T)[:, :, None],
    )
    assert m.shape == (2, T, T)
    np.testing.assert_array_equal(m[0], masks.causal(T))
    assert m[1].astype(int).tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    # torch masks combine the same way
    t = masks.combine(torch.from_numpy(masks.causal(T)), torch.tensor([True, True, False, True]))
    np.testing.assert_array_equal(t.numpy(), masks.causal(T) & np.array([1, 1, 0, 1], bool))


def test_combine_errors():
    with pytest.raises(ValueError, match="at least one mask"):
        masks.combine()
    with pytest.raises(ValueError, match="must be boolean"):
        masks.combine(masks.causal(2), np.ones((2, 2)))
    with pytest.raises(ValueError, match=r"shapes \(2, 2\) and \(3,\) do not broadcast"):
        masks.combine(masks.causal(2), np.ones(3, bool))
    with pytest.raises(ValueError, match="not mixed"):
        masks.combine(masks.causal(2), torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="must be boolean"):
        masks.combine(torch.ones(2, 2), torch.ones(2, 2))
    with pytest.raises(ValueError, match="do not broadcast"):
        masks.combine(torch.ones(2, 2, dtype=torch.bool), torch.ones(3, dtype=torch.bool))


def test_additive_is_the_seeds_M():
    M = masks.additive(masks.causal(3))
    assert M.dtype == np.float64
    assert M[np.tril_indices(3)].tolist() == [0.0] * 6
    assert np.isneginf(M[np.triu_indices(3, 1)]).all()


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_finite_fill_never_overflows_and_gives_zero_weight(dtype):
    # Two blocked masks combined by AND, then made additive once: the fill stays finfo.min
    # (adding two finite minimums would overflow to -inf).
    a, b = masks.causal(4), masks.key_padding([2], 4)[0]
    M = masks.additive(masks.combine(a, b), fill="finite", dtype=dtype)
    assert M.dtype == dtype and np.isfinite(M).all()
    assert set(np.unique(M).tolist()) == {0.0, float(np.finfo(dtype).min)}
    Z = np.zeros((4, 4)) + M.astype(np.float64)
    A = softmax_last(Z, masks.combine(a, b))
    assert np.all(A[~masks.combine(a, b)] == 0.0)


def test_additive_errors():
    with pytest.raises(ValueError, match="must be boolean"):
        masks.additive(np.ones((2, 2)))
    with pytest.raises(ValueError, match="fill must be"):
        masks.additive(masks.causal(2), fill="min")
    with pytest.raises(ValueError, match="dtype must be floating"):
        masks.additive(masks.causal(2), dtype=np.int32)


def test_pattern_keywords_are_the_patterns_rule_fields_in_order():
    """The one keyword list: Pattern's fields less the placement (q_start, k_start)."""
    import dataclasses

    names = tuple(f.name for f in dataclasses.fields(masks.Pattern))
    assert names[: len(masks.PATTERN_KEYWORDS)] == masks.PATTERN_KEYWORDS
    assert names[len(masks.PATTERN_KEYWORDS) :] == ("q_start", "k_start")


def test_check_lengths_names_the_caller_the_batch_size_and_the_bound():
    """The one lengths check: int64 (B,) back, else a ValueError from ``what`` naming (B,)."""
    for lengths in ([2, 0, 3], (2, 0, 3), np.array([2, 0, 3], np.int32), torch.tensor([2, 0, 3])):
        got = masks.check_lengths(lengths, 3, "ring_attention", B=3)
        assert got.dtype == np.int64 and got.tolist() == [2, 0, 3]
    with pytest.raises(ValueError, match=r"^ring_attention: lengths must be a 1-D integer array "):
        masks.check_lengths([1, 2], 3, "ring_attention", B=3)
    with pytest.raises(ValueError, match=r"array \(B,\) = \(3,\), got shape \(2,\) and dtype int"):
        masks.check_lengths([1, 2], 3, "ring_attention", B=3)
    with pytest.raises(ValueError, match=r"array \(B,\), got shape \(1, 1\) and dtype int"):
        masks.check_lengths([[1]], 3, "layer")
    with pytest.raises(ValueError, match=r"dtype bool"):
        masks.check_lengths(np.array([True]), 3, "layer")
    with pytest.raises(ValueError, match=r"^ring: lengths must lie in \[0, T=4\] \(T = 2·2\), got"):
        masks.check_lengths([5], 4, "ring", note=" (T = 2·2)")
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, T=4\], got \[-1\]"):
        masks.check_lengths(torch.tensor([-1]), 4, "layer")
    assert masks.check_lengths([4, 0], 4, "layer").tolist() == [4, 0]  # both ends included
    assert masks.check_lengths(np.zeros(0, np.int64), 4, "layer").shape == (0,)


def test_padding_masks_say_which_mask_was_asked_for():
    with pytest.raises(ValueError, match=r"^key padding mask: lengths must lie in \[0, T=3\]"):
        masks.key_padding([4], 3)
    with pytest.raises(ValueError, match=r"^query padding mask: lengths must lie in \[0, T=3\]"):
        masks.query_padding([4], 3)
    with pytest.raises(ValueError, match=r"mask: T must be >= 0"):
        masks.key_padding([0], -1)
    assert masks.key_padding(np.zeros(0, np.int64), 2).shape == (0, 2)
    assert masks.query_padding(np.array([2, 0]), 4).tolist() == [[1, 1, 0, 0], [0, 0, 0, 0]]


def test_shapes_in_messages_are_written_as_python_tuples():
    assert masks.shape_str(np.zeros((2, 5))) == "(2, 5)"
    assert masks.shape_str(torch.zeros(3)) == "(3,)"
    assert masks.shape_str(np.zeros(())) == "()"


def test_causal_errors_name_the_axis_and_what_was_given():
    with pytest.raises(ValueError, match=r"^mask: T_k must be >= 0, got -1$"):
        masks.causal(2, -1)
    with pytest.raises(ValueError, match=r"^mask: T_k must be an integer, got float$"):
        masks.causal(2, 1.5)
    with pytest.raises(ValueError, match=r"^mask: T_q must be an integer, got bool$"):
        masks.causal(True)
    with pytest.raises(ValueError, match=r"with bottom-right alignment T_q must be <= T_k$"):
        masks.causal(3, 2)


def test_combine_reads_lists_as_numpy_and_says_what_is_wrong():
    got = masks.combine([[True, False], [True, True]], np.array([True, True]))
    assert isinstance(got, np.ndarray) and got.tolist() == [[True, False], [True, True]]
    with pytest.raises(ValueError, match=r"^combine: at least one mask is required$"):
        masks.combine()
    with pytest.raises(ValueError, match=r"^combine: masks must be all NumPy or all torch, not"):
        masks.combine(masks.causal(2), torch.ones(2, 2, dtype=torch.bool))


# every refusal of Pattern(...) in full: (keywords, the message)
REFUSED_AT_CONSTRUCTION = [
    (dict(causal=None), "mask: causal must be True or False, got None"),
    (dict(q_start=True), "mask: q_start must be a non-negative integer, got True"),
    (dict(q_start=1.5), "mask: q_start must be a non-negative integer, got 1.5"),
    (dict(k_start=-1), "mask: k_start must be a non-negative integer, got -1"),
    (dict(window=0), "mask: window must be >= 1, got 0"),
    (dict(window=2.5), "mask: window must be a positive integer, got 2.5"),
    (dict(chunk=0), "mask: chunk must be >= 1, got 0"),
    (dict(chunk="2"), "mask: chunk must be a positive integer, got '2'"),
    (dict(lengths=[-1] + [0] * 9), "mask: lengths must be >= 0, got [-1, 0, 0, 0, 0, 0, 0, 0]"),
    (
        dict(prefix_lengths=[1.5]),
        "mask: prefix_lengths must be a 1-D integer array, got shape (1,) and dtype float64",
    ),
    (
        dict(cu_seqlens=[1, 2]),
        "cu_seqlens: must have >= 2 entries, start at 0 and never decrease; got [1, 2]",
    ),
    (
        dict(cu_seqlens=[0]),
        "cu_seqlens: must have >= 2 entries, start at 0 and never decrease; got [0]",
    ),
    (
        dict(cu_seqlens=[0, 2, 1, 3, 4, 5, 6, 7, 8, 9]),
        "cu_seqlens: must have >= 2 entries, "
        "start at 0 and never decrease; got [0, 2, 1, 3, 4, 5, 6, 7]",
    ),
    (
        dict(cu_seqlens=[0, 2], lengths=[2]),
        "cu_seqlens: give either packed sequences or lengths/key_padding_mask, not both",
    ),
    (
        dict(cu_seqlens=[0, 2], mask=np.ones((2, 2), bool)),
        "cu_seqlens: a dense mask and packed sequences contradict; give the document rule "
        "inside the mask, or cu_seqlens alone",
    ),
    (
        dict(cu_seqlens=[0, 2], prefix_lengths=[1]),
        "cu_seqlens: prefix_lengths per packed document is not supported",
    ),
    (
        dict(key_padding_mask=np.ones((2, 2), np.int64)),
        "mask: key_padding_mask must be boolean (True = may read) with 2 axes, got shape "
        "(2, 2) and dtype int64",
    ),
    (
        dict(mask=np.ones(3, bool)),
        "mask: mask must be boolean (True = may read) with 2 or 3 or 4 axes, got shape (3,) "
        "and dtype bool",
    ),
    (
        dict(mask_mod=3),
        "mask: mask_mod must be a function (mask_mod(b, h, q_idx, kv_idx) -> bool), got int",
    ),
    (
        dict(score_mod="s"),
        "mask: score_mod must be a function (score_mod(score, b, h, q_idx, kv_idx) -> score), "
        "got str",
    ),
    (
        dict(rel_bias=np.zeros(3)),
        "mask: rel_bias must be a real array with 2 axes, got shape (3,) and dtype float64",
    ),
    (
        dict(alibi_slopes=np.zeros((1, 1, 1), np.float32)),
        "mask: alibi_slopes must be a real array with 1 or 2 axes, got shape (1, 1, 1) and "
        "dtype float64",
    ),
    (
        dict(bias=np.zeros((1, 1, 1, 1, 1))),
        "bias: must be a float array broadcastable to (B, H, T_q, T_k) (at most 4 axes), got "
        "shape (1, 1, 1, 1, 1) and dtype float64",
    ),
    (
        dict(bias=np.zeros((2, 2), np.int64)),
        "bias: must be a float array broadcastable to (B, H, T_q, T_k) (at most 4 axes), got "
        "shape (2, 2) and dtype int64",
    ),
    (dict(softcap=True), "mask: softcap must be a positive number, got True"),
    (dict(softcap="x"), "mask: softcap must be a positive number, got 'x'"),
    (dict(softcap=0), "mask: softcap must be finite and > 0, got 0"),
    (dict(softcap=float("nan")), "mask: softcap must be finite and > 0, got nan"),
]


@pytest.mark.parametrize("kw,msg", REFUSED_AT_CONSTRUCTION)
def test_every_refusal_of_a_pattern_names_its_argument_in_full(kw, msg):
    with pytest.raises(ValueError) as err:
        masks.Pattern(**kw)
    assert str(err.value) == msg


B9 = [0] * 8  # with one more: nine batch rows, of which messages show the first eight

# every refusal of Pattern.check(B, H, T_q, T_k) in full: (keywords, shapes, the message)
REFUSED_BY_THE_PROBLEM = [
    (
        dict(),
        (1, 1, 4, 3),
        "mask: T_q=4 queries but only T_k=3 keys; queries are the last T_q positions, so "
        "T_q must be <= T_k",
    ),
    (
        dict(prefix_lengths=[1, 2]),
        (1, 1, 3, 3),
        "prefix_lengths: expected shape (B,) = (1,), got (2,)",
    ),
    (dict(lengths=[1, 2]), (1, 1, 3, 3), "lengths: expected shape (B,) = (1,), got (2,)"),
    (
        dict(lengths=[4, *B9]),
        (9, 1, 3, 3),
        "lengths: each must lie in [0, T_k=3], got [4, 0, 0, 0, 0, 0, 0, 0]",
    ),
    (
        dict(prefix_lengths=[3] * 9, lengths=[2] * 9),
        (9, 1, 3, 3),
        "prefix_lengths: each must lie in [0, length]; got prefix [3, 3, 3, 3, 3, 3, 3, 3] "
        "for lengths [2, 2, 2, 2, 2, 2, 2, 2]",
    ),
    (
        dict(key_padding_mask=np.ones((1, 4), bool)),
        (1, 1, 3, 3),
        "key_padding_mask: expected a bool array (B, T_k) = (1, 3), True = may read; got "
        "shape (1, 4)",
    ),
    (dict(cu_seqlens=[0, 5]), (1, 1, 3, 3), "cu_seqlens: must end at T=3; got [0, 5]"),
    (dict(cu_seqlens=[0, 2]), (1, 1, 3, 3), "cu_seqlens: must end at T=3; got [0, 2]"),
    (
        dict(cu_seqlens=list(range(10))),
        (1, 1, 3, 3),
        "cu_seqlens: must end at T=3; got [0, 1, 2, 3, 4, 5, 6, 7]",
    ),
    # placed blocks: the documents must reach the block's last key (4 + 4) or query (8 + 4)
    (
        dict(cu_seqlens=[0, 4, 6], q_start=0, k_start=4),
        (1, 1, 2, 4),
        "cu_seqlens: must reach this block's end, 8; got [0, 4, 6]",
    ),
    (
        dict(cu_seqlens=[0, 6], q_start=8),
        (1, 1, 4, 4),
        "cu_seqlens: must reach this block's end, 12; got [0, 6]",
    ),
    (
        dict(cu_seqlens=[0, 3]),
        (2, 1, 3, 3),
        "cu_seqlens: packed sequences need B = 1 and T_q = T_k; got B=2, T_q=3, T_k=3",
    ),
    (
        dict(cu_seqlens=[0, 3]),
        (1, 1, 2, 3),
        "cu_seqlens: packed sequences need B = 1 and T_q = T_k; got B=1, T_q=2, T_k=3",
    ),
    (
        dict(mask=np.ones((2, 1, 3, 3), bool)),
        (3, 1, 3, 3),
        "mask: expected a bool array (B|1, H|1, T_q, T_k) with B=3, H=1, T_q=3, T_k=3; got "
        "shape (2, 1, 3, 3)",
    ),
    (
        dict(mask=np.ones((1, 2, 3, 3), bool)),
        (1, 3, 3, 3),
        "mask: expected a bool array (B|1, H|1, T_q, T_k) with B=1, H=3, T_q=3, T_k=3; got "
        "shape (1, 2, 3, 3)",
    ),
    (
        dict(mask=np.ones((3, 4), bool)),
        (1, 1, 3, 3),
        "mask: expected a bool array (B|1, H|1, T_q, T_k) with B=1, H=1, T_q=3, T_k=3; got "
        "shape (3, 4)",
    ),
    (
        dict(alibi_slopes=[0.1]),
        (1, 2, 3, 3),
        "alibi_slopes: expected shape (H,) = (2,) or (B, H) = (1, 2), got (1,)",
    ),
    (
        dict(sinks=[0.0, 1.0]),
        (1, 3, 3, 3),
        "sinks: expected one logit per head, shape (H,) = (3,), got (2,)",
    ),
]
for _shape, _dims in [
    ((2, 1, 3, 3), (3, 1, 3, 3)),
    ((1, 2, 1, 1), (1, 3, 3, 3)),
    ((1, 1, 4, 1), (1, 1, 3, 3)),
    ((1, 1, 1, 4), (1, 1, 3, 3)),
]:
    REFUSED_BY_THE_PROBLEM.append(
        (
            dict(bias=np.zeros(_shape)),
            _dims,
            f"bias: shape {_shape} does not broadcast to (B, H, T_q, T_k) = {_dims}; give "
            "(B|1, H|1, T_q|1, T_k|1)",
        )
    )


@pytest.mark.parametrize("kw,shapes,msg", REFUSED_BY_THE_PROBLEM)
def test_every_refusal_by_the_problems_shapes_names_them_in_full(kw, shapes, msg):
    pat = masks.Pattern(**kw)
    with pytest.raises(ValueError) as err:
        pat.check(*shapes)
    assert str(err.value) == msg


# rel_bias (H, w): w odd and (w - 1) / 2 >= the largest |j - pos(i)| of the block
# (keywords, (B, H, T_q, T_k), the reach); one wider each side fits, one narrower does not
REL_BIAS_REACH = [
    (dict(), (1, 2, 4, 4), 3),
    (dict(), (1, 1, 1, 1), 0),
    (dict(), (1, 1, 2, 5), 4),  # bottom-right queries 3, 4 against keys 0..4
    (dict(q_start=8, k_start=4), (1, 1, 4, 8), 7),  # queries after the keys: i - j reaches 7
    (dict(q_start=0, k_start=4), (1, 1, 2, 4), 7),  # keys after the queries: j - i reaches 7
]


@pytest.mark.parametrize("kw,shapes,reach", REL_BIAS_REACH)
def test_rel_bias_must_be_odd_and_reach_every_offset_of_the_block(kw, shapes, reach):
    B, H, T_q, T_k = shapes
    for w in (2 * reach + 1, 2 * reach + 3):
        masks.Pattern(rel_bias=np.zeros((H, w)), **kw).check(*shapes)
    bad = [(H, 2 * reach + 2), (H + 1, 2 * reach + 1)] + ([(H, 2 * reach - 1)] if reach else [])
    for shape in bad:
        with pytest.raises(ValueError) as err:
            masks.Pattern(rel_bias=np.zeros(shape), **kw).check(*shapes)
        assert str(err.value) == (
            f"rel_bias: expected (H, 2·T−1) = ({H}, {2 * reach + 1}) or wider (odd, centred on "
            f"j = pos(i)), got {shape}"
        )


def test_a_pattern_keeps_its_arguments_in_one_form():
    """causal a bool, window and chunk ints, the integer vectors int64 NumPy, the dense masks
    NumPy unless given as torch (kept), the real arrays float64 NumPy unless torch, softcap a
    float."""
    pat = masks.Pattern(
        causal=np.bool_(True),
        window=np.int64(3),
        chunk=np.int32(2),
        lengths=[2, 3],
        prefix_lengths=(1, 0),
        key_padding_mask=[[True, False, True], [True, True, True]],
        mask=[[True, False, True]] * 3,
        alibi_slopes=np.float32([0.5]),
        rel_bias=[[1, 2, 3]],
        bias=[[0.5]],
        softcap=np.float32(2.0),
    )
    assert type(pat.causal) is bool and type(pat.window) is int and type(pat.chunk) is int
    assert (pat.window, pat.chunk) == (3, 2)
    for name in ("lengths", "prefix_lengths"):
        assert isinstance(getattr(pat, name), np.ndarray) and getattr(pat, name).dtype == np.int64
    assert isinstance(pat.key_padding_mask, np.ndarray) and pat.key_padding_mask.dtype == bool
    assert isinstance(pat.mask, np.ndarray) and pat.mask.shape == (3, 3)
    for name in ("alibi_slopes", "rel_bias"):
        assert isinstance(getattr(pat, name), np.ndarray) and getattr(pat, name).dtype == np.float64
    assert pat.alibi_slopes.tolist() == [0.5] and pat.rel_bias.tolist() == [[1.0, 2.0, 3.0]]
    assert isinstance(pat.bias, np.ndarray) and pat.bias.tolist() == [[0.5]]
    assert type(pat.softcap) is float and pat.softcap == 2.0
    assert masks.Pattern(softcap=0.5).softcap == 0.5  # any positive cap, below 1 too
    assert masks.Pattern(bias=np.zeros((1, 1, 1, 1))).bias.shape == (1, 1, 1, 1)  # 4 axes fit
    assert masks.Pattern(bias=np.zeros(2, np.float32)).bias.dtype == np.float32  # any float
    t_mask, t_bias = torch.ones(3, 3, dtype=torch.bool), torch.zeros(1, 1, 3, 3)
    kept = masks.Pattern(
        mask=t_mask, key_padding_mask=torch.ones(1, 3, dtype=torch.bool), bias=t_bias
    )
    assert kept.mask is t_mask and kept.bias is t_bias
    assert torch.is_tensor(kept.key_padding_mask)
    cu = masks.Pattern(cu_seqlens=np.array([0, 2, 3], np.int32)).cu_seqlens
    assert cu.dtype == np.int64 and cu.tolist() == [0, 2, 3]


def test_default_scale_is_one_over_root_d_k_and_one_for_an_empty_head():
    assert masks.default_scale(4) == 0.5
    assert masks.default_scale(2) == 1.0 / np.sqrt(2.0)
    assert masks.default_scale(0) == 1.0
    assert type(masks.default_scale(9)) is float


class _Judged:
    """A mask_mod that says (as a BlockMask's does) whether it fits the problem."""

    def __init__(self, why):
        self.why, self.asked = why, []

    def __call__(self, b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def mismatch(self, B, H, T_q, T_k):
        self.asked.append((B, H, T_q, T_k))
        return self.why


def test_check_asks_a_mask_mod_that_can_say_whether_it_fits():
    fits = _Judged("")
    masks.Pattern(mask_mod=fits).check(2, 3, 4, 5)
    assert fits.asked == [(2, 3, 4, 5)]
    with pytest.raises(ValueError) as err:
        masks.Pattern(mask_mod=_Judged("mask_mod: built for another length")).check(1, 1, 2, 2)
    assert str(err.value) == "mask_mod: built for another length"


class _Flip:
    """Not a function of its indices: every call answers the other way."""

    __name__ = "flip"

    def __init__(self):
        self.n = 0

    def __call__(self, b, h, q_idx, kv_idx):
        self.n += 1
        return (kv_idx <= q_idx) ^ bool(self.n % 2)


@pytest.mark.parametrize(
    "kw,shapes,block",
    [
        (dict(), (2, 1, 4, 5), "b 0..1, q_idx 1..4, kv_idx 0..4"),
        (dict(), (1, 1, 1, 1), "b 0..0, q_idx 0..0, kv_idx 0..0"),
        (dict(), (1, 2, 20, 20), "b 0..0, q_idx 0..15, kv_idx 0..15"),  # one 16 × 16 block
        (dict(q_start=8, k_start=4), (3, 1, 4, 8), "b 0..2, q_idx 8..11, kv_idx 4..11"),
    ],
)
def test_a_mask_mod_that_answers_twice_differently_is_refused_naming_the_block(kw, shapes, block):
    """check calls the mask_mod twice on the first (at most 16 × 16) block of positions."""
    with pytest.raises(ValueError) as err:
        masks.Pattern(mask_mod=_Flip(), **kw).check(*shapes)
    msg = str(err.value)
    assert msg.startswith("mask_mod: flip answered differently on a second evaluation"), msg
    assert msg.endswith(
        f": {block}); it must be a pure function of b, h, q_idx, kv_idx and the tensors it reads"
    ), msg


def test_check_runs_a_pure_mask_mod_and_score_mod_on_the_problems_first_block():
    """A pure mask_mod and a score_mod that returns the score's shape pass check; the
    score_mod sees float64 scores of one block, with every index tensor given."""
    seen = []

    def score_mod(score, b, h, q_idx, kv_idx):
        seen.append((score.dtype, tuple(score.shape), b.shape, h.shape, q_idx.shape, kv_idx.shape))
        return score + (q_idx - kv_idx) * 0.5 + b + h

    masks.Pattern(mask_mod=lambda b, h, q_idx, kv_idx: kv_idx <= q_idx).check(2, 3, 4, 5)
    masks.Pattern(score_mod=score_mod).check(2, 3, 4, 5)
    assert seen and seen[0][0] == torch.float64 and seen[0][1] == (2, 3, 4, 5)
    assert seen[0][2:] == (
        torch.Size([2, 1, 1, 1]),
        torch.Size([1, 3, 1, 1]),
        torch.Size([1, 1, 4, 1]),
        torch.Size([1, 1, 1, 5]),
    )


@pytest.mark.parametrize(
    "kw,shapes",
    [
        (dict(prefix_lengths=[3]), (1, 1, 3, 3)),  # a prefix of the whole sequence
        (dict(lengths=[3, 0], prefix_lengths=[3, 0]), (2, 1, 3, 3)),
        (dict(cu_seqlens=[0, 1, 3]), (1, 1, 3, 3)),
        (dict(cu_seqlens=[0, 4, 8], q_start=0, k_start=4), (1, 1, 2, 4)),  # reaches its end
        (dict(key_padding_mask=np.ones((2, 3), bool)), (2, 1, 2, 3)),
        (dict(mask=np.ones((2, 1, 3, 3), bool)), (2, 4, 3, 3)),
        (dict(mask=np.ones((1, 4, 3, 3), bool)), (2, 4, 3, 3)),
        (dict(alibi_slopes=[0.1, 0.2]), (3, 2, 3, 3)),
        (dict(alibi_slopes=np.ones((3, 2))), (3, 2, 3, 3)),
        (dict(sinks=[0.0, 1.0]), (3, 2, 3, 3)),
        (dict(bias=np.zeros((3, 1, 1, 3))), (3, 2, 3, 3)),
        (dict(), (1, 1, 0, 0)),
    ],
)
def test_what_fits_the_problem_passes_check(kw, shapes):
    masks.Pattern(**kw).check(*shapes)


@pytest.mark.parametrize("name", ["lengths", "prefix_lengths"])
@pytest.mark.parametrize("empty", [[], (), np.array([]), np.array([], np.int32)])
def test_an_empty_list_of_sequences_is_a_batch_of_none(name, empty):
    p = masks.Pattern(**{name: empty})
    assert getattr(p, name).dtype == np.int64 and getattr(p, name).shape == (0,)
    assert p.reasons(0, 1, 3, 3).shape == (0, 1, 3, 3)
    with pytest.raises(ValueError) as e:
        masks.Pattern(**{name: np.zeros((0, 2))})
    assert str(e.value) == (
        f"mask: {name} must be a 1-D integer array, got shape (0, 2) and dtype float64"
    )
    with pytest.raises(ValueError) as e:
        masks.Pattern(cu_seqlens=empty)
    assert str(e.value).startswith("cu_seqlens: must have >= 2 entries")
    got = masks.check_lengths(empty, 4, "ring_attention", B=0)
    assert got.dtype == np.int64 and got.shape == (0,)
    with pytest.raises(ValueError) as e:
        masks.check_lengths(empty, 4, "ring_attention", B=1)
    assert str(e.value) == (
        "ring_attention: lengths must be a 1-D integer array (B,) = (1,), got shape (0,) and "
        "dtype int64"
    )
