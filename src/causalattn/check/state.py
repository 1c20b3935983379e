"""The audit's state: the arrays (given and recomputed), their precisions, the mask R and
the checks so far. Every stage function takes it as ``st``."""

from __future__ import annotations

import numpy as np

from .inputs import _Inputs
from .report import Check

# The catalogued fault each of the audit's hints describes (stage, words of the hint).
_HINT_FAULTS = (
    ("k-not-transposed", "S", "not transposed"),
    ("missing-scale", "S", "scale is missing"),
    ("scale-by-dk", "S", "divided by d_k"),
    ("no-mask", "M", "no causal mask"),
    ("anti-causal-mask", "M", "anti-causal"),
    ("diagonal-blocked", "M", "diagonal is blocked"),
    ("padding-ignored", "M", "padding mask was not applied"),
    ("softmax-query-axis", "A", "query axis"),
    ("softmax-all-entries", "A", "all entries"),
    ("mask-after-softmax", "A", "after softmax"),
    ("mask-after-softmax", "A", "after the softmax"),
    ("unstable-softmax", "A", "overflow exp"),
    ("nan-on-empty-rows", "A", "makes softmax NaN"),
    ("output-projection-missing", "O", "projection is missing"),
    ("output-projection-transposed", "O", "projection is transposed"),
)


class AuditState:
    """What the stages share; ``add`` records a check, ``recompute`` a derived stage."""

    def __init__(self, inp: _Inputs):
        self.inp = inp
        self.arrays = dict(inp.arrays)  # stage name -> array (given, then recomputed)
        self.eps = dict(inp.eps)
        self.given = [
            s
            for s in (
                "X",
                "W_q",
                "W_k",
                "W_v",
                "Q",
                "K",
                "V",
                "S",
                "M",
                "Z",
                "A",
                "H",
                "C",
                "W_o",
                "O",
            )
            if s in self.arrays
        ]
        self.recomputed: list[str] = []
        self.checks: list[Check] = []
        self.empty_rows: list[dict] = []
        self.notes = list(inp.notes)
        self.n_heads = inp.n_heads
        self.allowed: np.ndarray | None = None  # the dense bool (..., T_q, T_k); True = may read
        self.pending = None  # (Q Kᵀ, expected scale, d_k) when S must be read back from A

    def add(self, stage, name, ok, message, evidence=None, hint=None):
        fault = None
        if hint and not ok:
            fault = next(
                (fid for fid, st, key in _HINT_FAULTS if st == stage and key in hint), None
            )
            if fault and not hint.startswith(fault):
                hint = f"{fault}: {hint}"
        self.checks.append(Check(stage, name, bool(ok), message, evidence or {}, hint, fault))
        return ok

    def recompute(self, stage, value, *from_stages):
        self.arrays[stage] = value
        self.eps[stage] = max((self.eps.get(s, 0.0) for s in from_stages), default=0.0)
        self.recomputed.append(stage)

    def failures_in(self, stage):
        return [c for c in self.checks if c.stage == stage and not c.ok]
