"""Checking attention: ``audit`` (arrays, stage by stage) and ``diagnose`` (someone's code).

files     headers first, one budget              inputs    mappings, aliases -> arrays
stages    the audit's stages in order: stage_qkv (Q, K, V, S), stage_mask (M),
          stage_weights (A), stage_out (H, C, O), each a function of the state (state)
report    Check, Report, Diagnosis                faults    the one catalogue
probes    inputs that separate faults             measure   what a function does
callers   the user's code, its layout             record    white-box op recording
diagnose  measure, then name                      runner    worker process, deadline
compare   someone's mask against a Pattern, block by block (compare_masks)
"""

from .audit import audit
from .compare import MaskComparison, MaskDifference, compare_masks
from .diagnose import diagnose
from .faults import CATALOGUE, Fault
from .report import AuditInputError, Check, Diagnosis, Report

__all__ = [
    "audit",
    "diagnose",
    "compare_masks",
    "MaskComparison",
    "MaskDifference",
    "Report",
    "Check",
    "Diagnosis",
    "AuditInputError",
    "CATALOGUE",
    "Fault",
]
