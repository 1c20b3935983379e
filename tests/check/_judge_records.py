"""Hand-made measurement records for the judge's tests: what a function did on a probe,
written down without running it. A d_k = 3 probe of T = 6 tokens, causal, its reference
weights uniform over each row's keys."""

from __future__ import annotations

import math

import numpy as np

from causalattn.check.measure import ProbeMeasure, SliceMeasure

T = 6
C0 = 1 / math.sqrt(3)  # the declared scale of a d_k = 3 probe
CAUSAL = np.tril(np.ones((T, T), bool))
REF = CAUSAL / CAUSAL.sum(-1, keepdims=True)  # uniform weights over each row's keys


def _slice(A, *, ref=REF, allowed=CAUSAL, index=(0, 0), mode="rows", fit=(C0, 0.0), **kw):
    read = (np.abs(A) > 0) | np.isnan(A)
    return SliceMeasure(index, A, ref, allowed, read, mode, fit, **kw)


def _probe(*slices, kind="main", probe=None, H=1, **kw) -> ProbeMeasure:
    T_q, T_k = slices[0].A.shape if slices else (T, T)
    base = dict(T_q=T_q, T_k=T_k, d_k=3, B=1, H=H, dtype="float64", scale0=C0, tol=1e-12)
    return ProbeMeasure(probe or f"{kind} probe", kind, **{**base, **kw}, slices=slices)


def _renorm(A):
    s = A.sum(-1, keepdims=True)
    return np.where(s > 0, A / np.where(s > 0, s, 1), 0.0)


def _bare(stage, fault=None, measurement=None, **more):
    """A hand-made Finding with no message: its stage, fault and measurement."""
    from causalattn.check.report import Finding

    return Finding(stage, fault, "", measurement={**(measurement or {}), **more})
