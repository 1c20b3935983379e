"""masks: causal (square and bottom-right), padding, combine (AND), additive view."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from causalattn import masks
from causalattn.reference import softmax_last


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
