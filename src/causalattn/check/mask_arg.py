"""Diagnose's ``fn(q, k, v, mask)``: the convention the function reads its mask in.

The mask is the probe's pattern (the declared one, (…, T_q, T_k) in q's layout), written
in each convention of the one reader (:mod:`.conventions`: bool, additive 0 / -inf, 1/0).
The main probe runs once per convention with V = I, which returns the weights A; the
convention under which the function reads only the keys the mask allows, each row summing
to 1, is the one its use implies (``masked_fill(mask == 0, -inf)`` reads bool and 1/0;
``scores + mask`` reads additive; SDPA's ``attn_mask`` reads bool and additive). The first
such in the order of :data:`~.conventions.CONVENTIONS` is passed to every probe; when none
gives masked attention the closest is assumed, and the diagnosis says so (its findings
then name what the function does wrong under it).
"""

from __future__ import annotations

import numpy as np

from .callers import Subject
from .conventions import CONVENTIONS, MEANING
from .probes import Plan, eye

__all__ = ["choose"]

TOL = 1e-3  # weight on a blocked key, or a row sum's error, still read as masked attention


def _miss(subject: Subject, plan: Plan) -> dict:
    """convention -> how far its weights are from masked attention (max over the weight on
    blocked keys and the row sums' error; inf for NaN), None where the function raised."""
    miss: dict = {}
    for p in plan.main_probes():  # the main probe, or T = d_k for code that only runs there
        for c in CONVENTIONS:
            subject.mask_convention = c
            subject.layouts.clear()
            try:
                with np.errstate(all="ignore"):
                    A = subject.values(p, eye(p.T_k)).H  # (B, H, T_q, T_k) = the weights
            except MemoryError:
                raise
            except Exception:  # noqa: BLE001 - this convention does not run: the next
                miss[c] = None
                continue
            E = p.allowed()
            reads = E.any(-1)
            leak = np.abs(np.where(E, 0.0, A)).max(initial=0.0)
            sums = np.abs(A.sum(-1) - 1.0)[reads].max(initial=0.0)
            miss[c] = float(np.nan_to_num(max(leak, sums), nan=np.inf))
        if any(v is not None for v in miss.values()):
            return miss
    return miss


def choose(subject: Subject, plan: Plan) -> str:
    """Set ``subject.mask_convention`` to the convention ``fn(q, k, v, mask)`` implies
    (see the module doc); return the sentence the diagnosis states (``details``)."""
    fw = subject.framework
    miss = _miss(subject, plan)
    subject.layouts.clear()
    subject.framework = fw  # the probes find their layout again, as without a mask
    ran = {c: m for c, m in miss.items() if m is not None}
    masked = [c for c in CONVENTIONS if c in ran and ran[c] <= TOL]
    if masked:
        pick = masked[0]
        note = MEANING[pick]
        if len(masked) > 1:
            note += f"; {', '.join(masked[1:])} would read the same"
    elif ran:
        pick = min(ran, key=ran.get)
        note = (
            f"{MEANING[pick]}, assumed: under no convention ({', '.join(ran)}) did it give "
            "masked attention; this one came closest"
        )
    else:
        pick = CONVENTIONS[0]
        note = f"{MEANING[pick]}, assumed: it raised under every convention"
    subject.mask_convention = pick
    return note
