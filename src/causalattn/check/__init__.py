"""Checking attention: ``audit`` (arrays, stage by stage) and ``diagnose`` (someone's code).

    inputs    files, mappings, aliases -> arrays      report    Check, Report, Diagnosis
    stages    the audit's checks in dependency order  faults    the one catalogue
    probes    inputs that separate faults             measure   what a function does
    record    white-box op recording                  runner    subprocess with a deadline
"""

from .audit import audit
from .diagnose import diagnose
from .faults import CATALOGUE, Fault
from .report import AuditInputError, Check, Diagnosis, Report

__all__ = ["audit", "diagnose", "Report", "Check", "Diagnosis", "AuditInputError", "CATALOGUE",
           "Fault"]
