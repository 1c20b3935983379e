"""causalattn.inspect: the head scores on weights whose answers are known by construction."""

from __future__ import annotations

import math

import numpy as np
import pytest

import causalattn as ca
from causalattn import masks
from causalattn.inspect import (
    ROLE_THRESHOLD,
    HeadRole,
    head_roles,
    head_scores,
    repeated_tokens,
    role_of,
)

L = 5
IDS = [1, 10, 11, 12, 13, 14, 10, 11, 12, 13, 14]  # BOS, then 5 tokens twice
T = len(IDS)


def _rows(fn) -> np.ndarray:
    """A T×T causal A whose row i puts all its weight on key fn(i)."""
    A = np.zeros((T, T))
    for i in range(T):
        A[i, fn(i)] = 1.0
    return A


def test_scores_of_heads_built_for_each_role():
    prev = _rows(lambda i: max(i - 1, 0))
    ind = _rows(lambda i: i - L + 1 if i > L else 0)  # second repeat: the token after the copy
    sink = _rows(lambda i: 0)
    itself = _rows(lambda i: i)
    A = np.stack([prev, ind, sink, itself])
    sc = head_scores(A, masks.causal(T), IDS)
    np.testing.assert_allclose(sc["previous_token"], [1, 0.1, 0.1, 0])  # row 1 reads key 0
    np.testing.assert_allclose(sc["induction"], [0, 1, 0, 0])
    np.testing.assert_allclose(sc["first_token"], [2 / T, (1 + L) / T, 1, 1 / T])
    np.testing.assert_allclose(
        sc["mean_distance"],
        [(T - 1) / T, np.mean([0, 1, 2, 3, 4, 5] + [L - 1] * L), np.arange(T).mean(), 0],
    )
    np.testing.assert_allclose(sc["entropy"], 0)
    uniform = masks.causal(T) / masks.causal(T).sum(-1, keepdims=True)
    sc = head_scores(uniform, masks.causal(T), IDS)
    np.testing.assert_allclose(sc["entropy"], np.log(np.arange(1, T + 1)).mean())
    assert math.isnan(head_scores(uniform, masks.causal(T), list(range(T)))["induction"][0])


def test_padding_rows_and_keys_are_left_out():
    """Left padding: the first real token is the sink; rows that read nothing do not count."""
    pad = 2
    allowed = masks.causal(T) & (np.arange(T) >= pad)[None, :] & (np.arange(T) >= pad)[:, None]
    A = np.where(allowed, 1.0, 0.0) * (np.arange(T)[None, :] == pad)
    sc = head_scores(A, allowed, [0, 0] + IDS[: T - pad])
    assert sc["first_token"][0] == 1.0  # every real row reads the first real token only
    assert sc["previous_token"][0] == pytest.approx(1 / (T - pad - 1))  # row pad+1 only


def test_head_roles_of_traces_and_role_names():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(T, 8))
    tr = ca.trace(X, *(rng.normal(size=(8, 8)) for _ in range(3)), n_heads=2)
    tr.tokens = [str(i) for i in IDS]
    roles = head_roles([tr, tr])
    assert [(r.layer, r.head) for r in roles] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    sc = head_scores(tr.A, tr.allowed, IDS)
    assert roles[1].induction == pytest.approx(sc["induction"][1])
    assert roles[1]["entropy"] == roles[1].entropy and roles[1].to_dict()["head"] == 1
    assert (
        role_of({"previous_token": 0.7, "induction": 0.6, "first_token": 0.1}) == "previous-token"
    )
    assert (
        role_of({"previous_token": 0.1, "induction": float("nan"), "first_token": 0.9})
        == "first-token"
    )
    below = ROLE_THRESHOLD - 0.01
    assert role_of({"previous_token": below, "induction": below, "first_token": below}) == ""
    assert isinstance(roles[0], HeadRole)
    with pytest.raises(ValueError, match="no traces"):
        head_roles([])
    with pytest.raises(ValueError, match="item 0 is not a Trace"):
        head_roles([np.zeros((3, 3))])


def test_repeated_tokens():
    ids = repeated_tokens(range(3, 100), n=4, length=6, seed=1, first=1)
    assert ids.shape == (4, 13) and (ids[:, 0] == 1).all()
    assert (ids[:, 1:7] == ids[:, 7:]).all()
    assert all(len(set(row[1:7])) == 6 for row in ids)  # distinct within a repeat
    assert (repeated_tokens(range(3, 100), 4, 6, seed=1, first=1) == ids).all()
    with pytest.raises(ValueError, match="length 6 needs at least 6 distinct tokens"):
        repeated_tokens(range(5), 1, 6)
    with pytest.raises(ValueError, match="n must be a positive integer"):
        repeated_tokens(range(50), 0, 6)
