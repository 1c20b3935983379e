"""Checking attention: ``audit`` (arrays, stage by stage) and ``diagnose`` (someone's code).

inputs    mappings, aliases -> arrays (files read by causalattn.io.files)
stages    the audit's stages in order: stage_qkv (Q, K, V, S), stage_mask (M),
          stage_weights (A), stage_out (H, C, O), each a function of the state (state)
faults    the one catalogue (hints, lessons)
diagnose  probe -> measure -> judge -> report:
          probing    probes (Probe, Plan), observe (Runs), callers (Subject), record
          measuring  measure (SliceMeasure, ProbeMeasure)
          judging    judge (Findings, verdict), locate (file:line)
          reporting  report (Finding, Diagnosis, Check, Report), words
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
