"""The audit's stages in dependency order: each a function of the audit state."""

from __future__ import annotations

from .inputs import _Inputs
from .report import STAGE_ORDER, AuditInputError, Report
from .stage_mask import mask
from .stage_out import contributions, output, values
from .stage_qkv import projections, scale_from_weights, scores
from .stage_weights import weights
from .state import AuditState

__all__ = ["run"]


def run(inp: _Inputs) -> Report:
    """Every check, in the seed's dependency order, over the given (and recomputed) stages."""
    st = AuditState(inp)
    projections(st)
    scores(st)
    mask(st)
    if (
        st.pending is not None
    ):  # S was recomputed: read its scale back from A, now the mask is known
        scale_from_weights(st, *st.pending)
    weights(st)
    values(st)
    contributions(st)
    output(st)
    if not st.checks:
        raise AuditInputError(
            f"nothing to check: given {', '.join(st.given)}, every later stage would be "
            "computed from them; give at least one computed stage (S, M, A, H, C or O) "
            "to check, or X with W_Q, W_K, W_V and Q, K or V"
        )
    order = {s: i for i, s in enumerate(STAGE_ORDER)}
    checks = sorted(st.checks, key=lambda c: order[c.stage])
    return Report(checks, st.given, st.recomputed, st.empty_rows, st.notes)
