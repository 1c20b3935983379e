"""Checking attention: ``audit`` (arrays, stage by stage) and ``diagnose`` (someone's code).

files     the one reader of user files          inputs    mappings, aliases -> arrays
stages    the audit's stages in order: stage_qkv (Q, K, V, S), stage_mask (M),
          stage_weights (A), stage_out (H, C, O), each a function of the state (state)
faults    the one catalogue (hints, lessons)     runner    the one isolation runner
diagnose  probe -> measure -> judge -> report:
          probing    probes (Probe, Plan), observe (Runs), callers (Subject), record
          measuring  measure (SliceMeasure, ProbeMeasure)
          judging    judge (Findings), locate (file:line)
          reporting  report (Finding, Diagnosis, Check, Report), words
"""

from .audit import audit
from .diagnose import diagnose
from .faults import CATALOGUE, Fault
from .report import AuditInputError, Check, Diagnosis, Report

__all__ = [
    "audit",
    "diagnose",
    "Report",
    "Check",
    "Diagnosis",
    "AuditInputError",
    "CATALOGUE",
    "Fault",
]
