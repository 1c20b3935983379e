"""audit, stage S without S: the scale read back from A (log A_ij − log A_ik = c·(G_ij − G_ik),
G = Q Kᵀ), the fault it names, and when it declines to read; and S given without Q and K
(only its T×T shape can be checked)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from causalattn import masks
from causalattn.check import audit

T, D_K = 5, 3
C0 = 1 / np.sqrt(D_K)
READ_BACK = "scale 1/√d_k (read back from A)"


@pytest.fixture(scope="module")
def qk():
    rng = np.random.default_rng(0)
    return rng.normal(size=(T, D_K)), rng.normal(size=(T, D_K)), rng.normal(size=(T, T))


def _softmax(Z):
    E = np.exp(Z - Z.max(-1, keepdims=True))
    return E / E.sum(-1, keepdims=True)


def _causal_A(Q, K, c, noise=0.0):
    """A = softmax_last(c · Q Kᵀ + noise + M), M causal: (..., T, T)."""
    T_ = Q.shape[-2]
    allowed = masks.causal(T_, T_)
    return _softmax(np.where(allowed, c * (Q @ np.swapaxes(K, -1, -2)) + noise, -np.inf))


def _read_back(rep):
    return [c for c in rep.checks if c.name == READ_BACK]


def test_the_declared_scale_is_read_back_and_passes(qk):
    Q, K, _ = qk
    (chk,) = _read_back(audit({"Q": Q, "K": K, "A": _causal_A(Q, K, C0)}))
    assert (chk.stage, chk.ok) == ("S", True)
    assert chk.message == f"log A matches Q Kᵀ · {C0:.4g}; expected · {C0:.4g}"
    assert chk.evidence == {} and chk.hint is None and chk.fault is None


@pytest.mark.parametrize(
    "c, fault, hint",
    [
        (1.0, "missing-scale", "missing-scale: the 1/√d_k scale is missing (softmax of Q Kᵀ)"),
        (1 / D_K, "scale-by-dk", f"scale-by-dk: S was divided by d_k = {D_K} instead of √d_k"),
        (0.3, None, f"A is the softmax of Q Kᵀ · 0.3, expected · {C0:.4g}"),
        (-1.0, None, f"A is the softmax of Q Kᵀ · -1, expected · {C0:.4g}"),
        (-1 / D_K, None, f"A is the softmax of Q Kᵀ · {-1 / D_K:.4g}, expected · {C0:.4g}"),
        (2.0, None, f"A is the softmax of Q Kᵀ · 2, expected · {C0:.4g}"),
        (2 / D_K, None, f"A is the softmax of Q Kᵀ · {2 / D_K:.4g}, expected · {C0:.4g}"),
    ],
)
def test_a_wrong_scale_read_back_names_its_fault(qk, c, fault, hint):
    """A missing 1/√d_k and a division by d_k have catalogue ids; any other factor is
    named by its value."""
    Q, K, _ = qk
    rep = audit({"Q": Q, "K": K, "A": _causal_A(Q, K, c)})
    (chk,) = _read_back(rep)
    assert (chk.stage, chk.ok, chk.fault, chk.hint) == ("S", False, fault, hint)
    assert chk.message == f"log A matches Q Kᵀ · {c:.4g}; expected · {C0:.4g}"
    assert chk.evidence.keys() == {"factor", "expected"}
    assert chk.evidence["factor"] == pytest.approx(c, rel=1e-9)
    assert chk.evidence["expected"] == pytest.approx(C0, rel=1e-12)
    assert not rep.ok


def test_the_scale_is_read_per_head(qk):
    """(H, T, T) weights: the means are taken along each row's keys, not across heads."""
    rng = np.random.default_rng(1)
    Q, K = rng.normal(size=(2, T, D_K)), rng.normal(size=(2, T, D_K))
    Q[1] *= 3.0  # the heads differ in size, so a mean across heads would not fit
    (chk,) = _read_back(audit({"Q": Q, "K": K, "A": _causal_A(Q, K, C0)}))
    assert chk.ok, chk.message


@pytest.mark.parametrize("T_, read", [(2, False), (3, True)])
def test_the_scale_needs_two_rows_with_two_readable_keys(qk, T_, read):
    """Causal T = 2 has one row with two keys (row 0 reads one): nothing to fit. T = 3 has two."""
    Q, K, _ = qk
    Q, K = Q[:T_], K[:T_]
    assert len(_read_back(audit({"Q": Q, "K": K, "A": _causal_A(Q, K, C0)}))) == int(read)


def test_small_scores_are_still_read(qk):
    """Q Kᵀ of tiny vectors (Σ G_c² ≪ 1 but not 0) still fits."""
    Q, K, _ = qk
    Q, K = 0.05 * Q, 0.05 * K
    (chk,) = _read_back(audit({"Q": Q, "K": K, "A": _causal_A(Q, K, C0)}))
    assert chk.ok, chk.message


def test_weights_on_forbidden_keys_do_not_spoil_the_read_back(qk):
    """The fit reads only the keys the pattern allows; a leak is stage M's to report."""
    Q, K, _ = qk
    A = _causal_A(Q, K, C0)
    A[0, 1], A[1, 3], A[2, 4] = 0.05, 0.2, 0.01
    rep = audit({"Q": Q, "K": K, "A": A})
    (chk,) = _read_back(rep)
    assert chk.ok, chk.message
    assert rep.first_failure.stage == "M"


@pytest.mark.parametrize("w, read", [(1e-30, True), (1.0000001e-30, False)])
def test_weights_at_or_below_1e30_are_not_read(qk, w, read):
    """A weight ≤ 1e-30 is underflow, not evidence: planting an inconsistent one there leaves
    the fit alone; just above it, the fit is spoilt and the audit declines to read."""
    Q, K, _ = qk
    A = _causal_A(Q, K, C0)
    A[T - 1, 0] = w
    got = _read_back(audit({"Q": Q, "K": K, "A": A}))
    assert [c.ok for c in got] == ([True] if read else [])


def test_a_row_with_one_readable_key_adds_nothing_to_the_fit(qk):
    """Row 0 reads one key: centred, its log weight is 0 whatever the weight (here 0.5,
    which stage A reports), so the scale is still read exactly."""
    Q, K, _ = qk
    A = _causal_A(Q, K, C0)
    A[0, 0] = 0.5
    (chk,) = _read_back(audit({"Q": Q, "K": K, "A": A}))
    assert chk.ok and chk.message == f"log A matches Q Kᵀ · {C0:.4g}; expected · {C0:.4g}"


@pytest.mark.parametrize(
    "size, read",
    [
        (1.0, True),  # spread ≈ 1.8: a residual of ≈ 1.4e-2 is within 1e-2 · spread
        (0.5, False),  # spread ≈ 0.46: the same residual is over 1e-2 · max(1, spread)
    ],
)
def test_the_fit_declines_when_log_a_is_no_multiple_of_q_k(qk, size, read):
    """log A may depart from c·G by 1 % of its spread (or of 1, whichever is larger)."""
    Q, K, N = qk
    Q, K = size * Q, size * K
    A = _causal_A(Q, K, C0, noise=0.0075 * N)
    assert len(_read_back(audit({"Q": Q, "K": K, "A": A}))) == int(read)


def test_reading_the_scale_back_warns_of_nothing(qk):
    """log of the zero (masked) and negative weights is taken quietly: their findings are
    stage A's and M's, not a NumPy RuntimeWarning."""
    Q, K, _ = qk
    A = _causal_A(Q, K, C0)
    A[0, 3] = -1e-3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (chk,) = _read_back(audit({"Q": Q, "K": K, "A": A}))
    assert chk.ok


def test_weights_with_a_head_axis_are_read_back_against_one_q_k(qk):
    """A (2, T, T) over one Q Kᵀ (T, T): the last two axes are compared, the head axis
    broadcast."""
    Q, K, _ = qk
    A = np.broadcast_to(_causal_A(Q, K, C0), (2, T, T))
    assert [c.ok for c in _read_back(audit({"Q": Q, "K": K, "A": A}))] == [True]


@pytest.mark.parametrize("shape, ok", [((4, 4), True), ((4, 6), True), ((6, 4), False)])
def test_s_without_q_and_k_is_checked_for_its_shape_only(shape, ok):
    S = np.random.default_rng(2).normal(size=shape)
    rep = audit({"S": S})
    (chk,) = [c for c in rep.checks if c.name == "S is T×T"]
    assert (chk.stage, chk.ok, chk.message) == ("S", ok, f"S is {shape[0]}×{shape[1]}")
    if ok:
        assert chk.evidence == {} and chk.hint is None
    else:
        assert chk.evidence == {"shape": shape}
        assert chk.hint == "more query rows than key columns: is it transposed?"


def test_more_query_rows_than_keys_still_reads_the_scale_back(qk):
    """T_q > T_k: no mask is derived (stage A refuses the shape), the fit reads every key."""
    Q, K, _ = qk
    K = K[:3]
    rep = audit({"Q": Q, "K": K, "A": _softmax(C0 * Q @ K.T)})
    assert [c.ok for c in _read_back(rep)] == [True]
    assert (rep.first_failure.stage, rep.first_failure.name) == ("A", "A is T×T")


@pytest.mark.parametrize("given", ["Z", "S"])
@pytest.mark.parametrize(
    "change, ok, hint",
    [
        (lambda Z: Z, True, None),
        (lambda Z: 2 * Z, False, f"S = Q Kᵀ · {2 * C0:.4g}, expected · {C0:.4g} (1/√d_k, d_k = 3)"),
        (lambda Z: Z + 1, False, None),
    ],
)
def test_masked_scores_given_with_q_and_k_are_checked_against_q_k(qk, given, change, ok, hint):
    """Z = S + M (or an S that already carries the mask, read as Z): its readable entries are
    S's, so they are compared with Q Kᵀ·scale like an unmasked S, not only read for the mask."""
    Q, K, _ = qk
    Z = np.where(masks.causal(T, T), C0 * Q @ K.T, -np.inf)
    rep = audit({"Q": Q, "K": K, given: change(Z)})
    (chk,) = [c for c in rep.checks if c.name == "scale 1/√d_k"]
    assert (chk.stage, chk.ok, chk.hint) == ("S", ok, hint)
    assert chk.message.startswith("S (Z's readable entries) ")
    assert rep.ok is ok
