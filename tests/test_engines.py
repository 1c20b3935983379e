"""The peer engines (reference, sdpa) against each other, and the guarantees they share."""

import pytest
import torch

import causalattn as ca


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"lengths": [7, 3]},
        {"key_padding_mask": torch.tensor([[True] * 7, [True] * 4 + [False] * 3])},
    ],
)
def test_sdpa_and_reference_agree(kw):
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 6, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 6)
    ref = ca.attention(q.double(), k.double(), v.double(), engine="reference", **kw)
    got = ca.attention(q, k, v, engine="sdpa", **kw)
    assert (got.double() - ref).abs().max() < 1e-5


def test_unknown_engine_is_named():
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match="unknown engine 'fast'"):
        ca.attention(q, q, q, engine="fast")


def test_trace_with_heads_reads_mask_axes_by_x_and_refuses_extra_ones():
    import numpy as np

    X = np.random.default_rng(0).normal(size=(4, 6))
    W = np.eye(6)
    with pytest.raises(ValueError, match="mask: with n_heads=2"):
        ca.trace(X, W, W, W, n_heads=2, mask=np.ones((3, 2, 4, 4), bool))
    per_head = np.ones((2, 4, 4), bool)
    per_head[1] = ca.masks.causal(4)
    tr = ca.trace(X, W, W, W, n_heads=2, mask=per_head)  # X has no batch axis: (h, T, T)
    assert tr.A.shape == (2, 4, 4) and tr.A[0, 0, 3] > 0 and tr.A[1, 0, 3] == 0
