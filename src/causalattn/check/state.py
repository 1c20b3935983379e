"""The audit's state: the arrays (given and recomputed), their precisions, the mask R and
the checks so far. Every stage function takes it as ``st``."""

from __future__ import annotations

import numpy as np

from .inputs import _Inputs
from .report import Check


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

    def add(self, stage, name, ok, message, evidence=None, hint=None, fault=None):
        """Record a check; ``fault``: the catalogue id a failing check's hint describes
        (given by the stage that measured it, never read back from the hint's words)."""
        fault = None if ok else fault
        if fault and hint and not hint.startswith(fault):
            hint = f"{fault}: {hint}"
        self.checks.append(Check(stage, name, bool(ok), message, evidence or {}, hint, fault))
        return ok

    def recompute(self, stage, value, *from_stages):
        self.arrays[stage] = value
        self.eps[stage] = max((self.eps.get(s, 0.0) for s in from_stages), default=0.0)
        self.recomputed.append(stage)

    def failures_in(self, stage):
        return [c for c in self.checks if c.stage == stage and not c.ok]
