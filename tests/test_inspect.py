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


def _softmax_rows(S, allowed):
    """Weights ``(..., T, T)``: the softmax of S over each row's readable keys (0 elsewhere;
    a row that reads nothing is all 0)."""
    e = np.where(allowed, np.exp(S - S.max(-1, keepdims=True)), 0.0)
    return e / np.maximum(e.sum(-1, keepdims=True), 1e-300)


def test_the_scores_of_a_batch_are_the_mean_over_its_sequences():
    """Two sequences (B = 2) of 3 heads (H ≠ B) with as many counted rows each: every score
    of the batch is the mean of the two sequences' own; (T, T), (h, T, T) and (1, h, T, T)
    weights give the same scores."""
    rng = np.random.default_rng(1)
    A = _softmax_rows(rng.normal(size=(2, 3, T, T)) * 3, masks.causal(T))
    ids = np.array([IDS, [i + 100 for i in IDS]])  # the same repeats, other tokens
    batch = head_scores(A, masks.causal(T), ids)
    one = [head_scores(A[b], masks.causal(T), ids[b]) for b in range(2)]
    for k, v in batch.items():
        assert v.shape == (3,) and np.isfinite(v).all(), k
        np.testing.assert_allclose(v, (one[0][k] + one[1][k]) / 2, err_msg=k)
        assert not np.allclose(one[0][k], one[1][k]), k  # the two sequences differ
    for h in range(3):
        alone = head_scores(A[0, h], masks.causal(T), IDS)
        for k in batch:
            assert alone[k].shape == (1,) and alone[k][0] == pytest.approx(one[0][k][h]), k
    four = head_scores(A[:1], masks.causal(T)[None, None], [IDS])
    for k in batch:
        np.testing.assert_allclose(four[k], one[0][k], err_msg=k)


def test_a_score_defined_on_one_row_only_is_that_rows_value():
    """T = 2: only row 1 may read a previous key, and only its token has an earlier copy."""
    A = np.array([[1.0, 0.0], [0.25, 0.75]])
    sc = head_scores(A, masks.causal(2), ids=[7, 7])
    assert sc["previous_token"][0] == 0.25  # A[1, 0]
    assert sc["induction"][0] == 0.75  # A[1, 0 + 1]: the token after its copy (itself here)


def test_a_one_token_trace_has_scores_where_they_are_defined_and_nan_elsewhere():
    """T = 1 (one query, one key): no previous token, no earlier copy, all weight on key 0."""
    sc = head_scores(np.ones((1, 1)), masks.causal(1), ids=[7])
    assert math.isnan(sc["previous_token"][0]) and math.isnan(sc["induction"][0])
    assert (sc["first_token"][0], sc["mean_distance"][0], sc["entropy"][0]) == (1.0, 0.0, 0.0)


def test_rows_that_read_no_key_do_not_count_and_the_first_readable_key_is_the_sink():
    """A mask where row i reads keys j < i only: row 0 reads nothing (left out of every
    score), no row reads key T - 1; each row spreads its weight evenly."""
    n = 6
    allowed = np.tril(np.ones((n, n), bool), -1)
    A = _softmax_rows(np.zeros((n, n)), allowed)
    sc = head_scores(A, allowed)
    i = np.arange(1, n)  # the rows that read a key: row i reads i keys, 1/i each
    assert sc["first_token"][0] == pytest.approx(np.mean(1 / i))
    assert sc["previous_token"][0] == pytest.approx(np.mean(1 / i))
    assert sc["mean_distance"][0] == pytest.approx(np.mean((i + 1) / 2))  # 1..i back
    assert sc["entropy"][0] == pytest.approx(np.mean(np.log(i)))
    assert math.isnan(sc["induction"][0])  # no ids


def test_each_sequence_has_its_own_first_key():
    """Left padding of 0 and 2 tokens in one batch: a head on each sequence's first real
    token is a sink head of score 1, whatever the other sequence's padding."""
    pads = [0, 2]
    keep = np.stack([np.arange(T) >= p for p in pads])  # (B, T)
    allowed = masks.causal(T) & keep[:, None, None, :] & keep[:, None, :, None]
    A = np.zeros((2, 1, T, T))
    for b, p in enumerate(pads):
        A[b, 0, p:, p] = 1.0
    sc = head_scores(A, allowed)
    assert sc["first_token"][0] == 1.0
    assert sc["mean_distance"][0] == pytest.approx(
        np.mean([i - p for p in pads for i in range(p, T)])
    )


def test_induction_counts_a_row_only_where_the_key_after_its_copy_is_readable():
    """A window of 3 keys: row 2 ("a" again) may read key 1, the token after its copy;
    row 7 ("c" again) may not read key 4. Only row 2 counts."""
    ids = ["a", "b", "a", "c", "d", "e", "f", "c"]
    n = len(ids)
    q, k = np.arange(n)[:, None], np.arange(n)[None, :]
    window = (k <= q) & (k > q - 3)
    A = np.where(window, 1.0, 0.0) * (k == q)  # each row on itself ...
    A[2] = [0, 0.6, 0.4, 0, 0, 0, 0, 0]  # ... but row 2, 0.6 on key 1
    assert head_scores(A, window, ids)["induction"][0] == pytest.approx(0.6)
    # left padding: the first keys unreadable, the key after a copy readable
    pad = ["<pad>", "<pad>", "a", "b", "a"]
    allowed = masks.causal(5) & (np.arange(5) >= 2)[None, :] & (np.arange(5) >= 2)[:, None]
    A = np.zeros((5, 5))
    A[2:, 2] = 1.0
    A[4] = [0, 0, 0.2, 0.8, 0]
    assert head_scores(A, allowed, pad)["induction"][0] == pytest.approx(0.8)


def test_one_row_of_ids_serves_every_sequence_and_another_count_is_refused():
    rng = np.random.default_rng(2)
    A = _softmax_rows(rng.normal(size=(2, 1, T, T)) * 3, masks.causal(T))
    shared = head_scores(A, masks.causal(T), IDS)["induction"]
    assert shared == pytest.approx(head_scores(A, masks.causal(T), [IDS, IDS])["induction"])
    with pytest.raises(ValueError) as e:
        head_scores(A, masks.causal(T), [IDS] * 3)
    assert str(e.value) == f"head_scores: ids are (3, {T}) but A has B = 2 sequences"


def test_a_role_is_the_largest_role_score_from_the_threshold_on():
    """Only the three role scores compete (mean_distance and entropy are not roles); a
    score of exactly ROLE_THRESHOLD gives the role; no finite role score, no role."""
    five = {"previous_token": 0.6, "induction": 0.2, "first_token": 0.1}
    assert role_of({**five, "mean_distance": 7.0, "entropy": 3.0}) == "previous-token"
    at = {"previous_token": 0.1, "induction": ROLE_THRESHOLD, "first_token": 0.2}
    assert role_of(at) == "induction"
    nan = float("nan")
    assert role_of({"previous_token": nan, "induction": nan, "first_token": nan}) == ""
    assert role_of({"previous_token": nan, "entropy": 3.0}) == ""


def test_head_roles_reads_a_captured_traces_layer_and_ids():
    """A captured trace names its layer and carries its token ids: the ids (not the token
    strings, which may print alike) find the earlier copies; one Trace alone is a list of
    one."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(T, 8))
    tr = ca.trace(X, *(rng.normal(size=(8, 8)) for _ in range(3)), n_heads=2)
    tr.tokens = ["?"] * T  # every token prints alike: as strings, every one repeats
    tr.ids = np.array(IDS)
    tr.layer = 5
    roles = head_roles(tr)
    assert [(r.layer, r.head) for r in roles] == [(5, 0), (5, 1)]
    by_ids = head_scores(tr.A, tr.allowed, IDS)["induction"]
    assert [r.induction for r in roles] == pytest.approx(by_ids)
    assert not np.allclose(by_ids, head_scores(tr.A, tr.allowed, tr.tokens)["induction"])
    assert [r.role for r in roles] == [role_of(r.to_dict()) for r in roles]
    no_weights = ca.Trace({"X": X})
    with pytest.raises(ValueError, match="item 0 is not a Trace with weights A"):
        head_roles([no_weights])


def test_the_scores_are_computed_in_float64_whatever_the_weights_dtype():
    """float32 weights (a captured bf16/fp16 model's) score exactly as the same numbers in
    float64 do: float64 sums, not float32 ones."""
    rng = np.random.default_rng(3)
    A = _softmax_rows(rng.normal(size=(2, T, T)) * 3, masks.causal(T)).astype(np.float32)
    want = head_scores(A.astype(np.float64), masks.causal(T), IDS)
    got = head_scores(A, masks.causal(T), IDS)
    for k in want:
        assert got[k].dtype == np.float64, k
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_tokens_repeat_only_when_they_are_equal_as_python_values():
    """Tokens of mixed kinds compare as themselves: 1 and "1" are two tokens, not a repeat."""
    A = masks.causal(4) / masks.causal(4).sum(-1, keepdims=True)
    assert math.isnan(head_scores(A, ids=[1, "1", 2, "2"])["induction"][0])
    assert head_scores(A, ids=[1, "1", 1, "2"])["induction"][0] == pytest.approx(1 / 3)


def test_head_roles_scores_each_trace_with_the_mask_it_was_computed_with():
    """A trace of a 3-key window: the key after each copy (5 back) is outside it, so no row
    counts and induction is NaN (read as if every key were readable, it would be 0)."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(T, 8))
    tr = ca.trace(X, *(rng.normal(size=(8, 8)) for _ in range(3)), n_heads=2, window=3)
    tr.ids = np.array(IDS)
    roles = head_roles([tr])
    assert all(math.isnan(r.induction) for r in roles)
    np.testing.assert_array_equal(head_scores(tr.A, None, IDS)["induction"], 0.0)
    masked = head_scores(tr.A, tr.allowed, IDS)
    for k in ("previous_token", "first_token", "mean_distance", "entropy"):
        assert [r[k] for r in roles] == pytest.approx(masked[k]), k


def test_head_roles_refuses_no_traces_in_words():
    with pytest.raises(ValueError) as e:
        head_roles([])
    assert str(e.value) == "head_roles: no traces; give the traces of a model's layers"


def test_repeated_tokens_without_a_seed_is_seed_0_and_may_use_the_whole_vocabulary():
    assert (repeated_tokens(range(3, 40), 3, 5) == repeated_tokens(range(3, 40), 3, 5, 0)).all()
    assert not (repeated_tokens(range(3, 40), 3, 5, 1) == repeated_tokens(range(3, 40), 3, 5)).all()
    ids = repeated_tokens(range(6), 2, 6)  # every token of the vocabulary, in each repeat
    assert ids.shape == (2, 12) and all(sorted(row[:6]) == list(range(6)) for row in ids)


def test_repeated_tokens_are_int64_distinct_within_a_repeat_and_counts_are_checked():
    ids = repeated_tokens(np.arange(20, dtype=np.int32), 50, 10)  # ids of a narrower dtype
    assert ids.dtype == np.int64 and ids.shape == (50, 20)
    assert all(len(set(row[:10])) == 10 for row in ids)  # drawn without replacement
    for kw, name in [({"n": True}, "n"), ({"length": 0}, "length"), ({"length": 2.0}, "length")]:
        args = {"n": 2, "length": 3, **kw}
        with pytest.raises(ValueError) as e:
            repeated_tokens(range(20), **args)
        assert str(e.value) == (
            f"repeated_tokens: {name} must be a positive integer, got {kw[name]!r}"
        )
