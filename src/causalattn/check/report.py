"""Reporting: the audit's Check and Report, diagnose's Finding and Diagnosis (built from the
judge's findings by :func:`.judge.verdict`), the errors for unusable input, the one JSON
converter."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

import numpy as np

from ..io.files import AuditInputError  # noqa: F401  (re-exported: one class for both)
from .faults import BY_ID

STAGE_ORDER = ("X", "Q", "K", "V", "S", "M", "A", "H", "C", "O")
STAGES = ("S", "M", "A", "H", "O")  # diagnose's, in dependency order


def check_declared_scale(who: str, scale, error: type[ValueError] = ValueError) -> None:
    """A declared scale (audit, diagnose): None (1/√d_k) or a finite number > 0."""
    if scale is not None and not (
        isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0
    ):
        raise error(f"{who}: scale must be a finite number > 0, got {scale!r}")


@dataclass
class Check:
    """One check: ``stage`` (X, Q, K, V, S, M, A, H, C, O), what was checked, the verdict,
    ``evidence`` (``index`` of the sequence/head, ``rows``, ``cols``, ``max_err``, ...)
    and a plain-English ``hint`` when it fails."""

    stage: str
    name: str
    ok: bool
    message: str
    evidence: dict = field(default_factory=dict)
    hint: str | None = None
    fault: str | None = None  # the catalogue id (causalattn.check.CATALOGUE) the hint names

    def to_dict(self) -> dict:
        return {
            "stage": self.stage,
            "name": self.name,
            "ok": self.ok,
            "message": self.message,
            "evidence": jsonable(self.evidence),
            "hint": self.hint,
            "fault": self.fault,
        }


@dataclass
class Report:
    """The audit's verdict: ``ok``, ``checks`` in dependency order, ``first_failure``."""

    checks: list[Check]
    given: list[str] = field(default_factory=list)
    recomputed: list[str] = field(default_factory=list)
    empty_rows: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every check passed."""
        return all(c.ok for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        """The checks that failed, in the order they ran."""
        return [c for c in self.checks if not c.ok]

    @property
    def first_failure(self) -> Check | None:
        """The failed check earliest in dependency order (S, M, A, H, O), or None."""
        f = self.failures
        return min(f, key=lambda c: STAGE_ORDER.index(c.stage)) if f else None

    def to_dict(self) -> dict:
        """The report as JSON-ready data (``ok``, ``first_failure``, ``checks``, ...)."""
        ff = self.first_failure
        return {
            "ok": self.ok,
            "first_failure": None if ff is None else ff.to_dict(),
            "checks": [c.to_dict() for c in self.checks],
            "given": self.given,
            "recomputed": self.recomputed,
            "empty_rows": jsonable(self.empty_rows),
            "notes": self.notes,
        }

    def to_json(self, **kw: Any) -> str:
        """:meth:`to_dict` as JSON text; ``kw`` goes to :func:`json.dumps`."""
        return json.dumps(self.to_dict(), **kw)

    def __str__(self) -> str:
        lines = [
            f"audit: {'ok' if self.ok else 'FAILED'}"
            f" (given: {', '.join(self.given) or '-'};"
            f" recomputed: {', '.join(self.recomputed) or '-'})"
        ]
        for c in self.checks:
            lines.append(f"  [{'ok' if c.ok else 'FAIL'}] {c.stage:<2} {c.name}: {c.message}")
            if not c.ok:
                ev = ", ".join(f"{k}={v}" for k, v in jsonable(c.evidence).items())
                if ev:
                    lines.append(f"         evidence: {ev}")
                if c.hint:
                    lines.append(f"         hint: {c.hint}")
        if self.empty_rows:
            lines.append(
                f"  rows with no readable key (zero output, not a failure): "
                f"{_fmt_empty(self.empty_rows)}"
            )
        for n in self.notes:
            lines.append(f"  note: {n}")
        ff = self.first_failure
        if ff is not None:
            lines.append(f"first failure at stage {ff.stage}: {ff.message}")
        return "\n".join(lines)

    def __rich__(self):
        from rich.markup import escape
        from rich.table import Table

        t = Table(title=f"audit: {'[green]ok' if self.ok else '[red]FAILED'}", show_lines=False)
        for col in ("stage", "check", "result", "details"):
            t.add_column(col)
        for c in self.checks:
            details = escape(c.message)
            if not c.ok and c.evidence:
                ev = ", ".join(f"{k}={v}" for k, v in jsonable(c.evidence).items())
                details += f"\n[dim]evidence: {escape(ev)}[/]"
            if not c.ok and c.hint:
                details += f"\n[yellow]hint:[/] {escape(c.hint)}"
            t.add_row(c.stage, escape(c.name), "[green]ok" if c.ok else "[red]FAIL", details)
        if self.empty_rows:
            t.caption = escape(
                "rows with no readable key (zero output, not a failure): "
                + _fmt_empty(self.empty_rows)
            )
        return t


def _fmt_empty(rows: list[dict]) -> str:
    parts = [f"{r['index']}: {r['rows']}" if r["index"] else str(r["rows"]) for r in rows[:4]]
    return "; ".join(parts) + (" ..." if len(rows) > 4 else "")


def jsonable(obj: Any):
    """Plain JSON data: NumPy/torch arrays and scalars -> lists and numbers; non-finite
    floats -> "inf", "-inf", "nan" (JSON has none). The one converter (reports, the CLI)."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if getattr(obj, "dtype", None) is not None and obj.dtype.kind in "biuU":  # no floats
        return obj.tolist()
    if isinstance(obj, (list, tuple, Sequence)) and not isinstance(obj, str):
        return [jsonable(v) for v in obj]
    if hasattr(obj, "tolist") and not isinstance(obj, str):
        return jsonable(obj.tolist())
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    return obj


class Status(str, Enum):
    """A diagnosis' verdict. A str: ``d.status == "clean"`` works."""

    CLEAN = "clean"  # matches the reference on every probe
    FAULT = "fault"  # differs; a catalogued fault is named
    UNKNOWN = "unknown"  # differs; the stage is named, no catalogued fault fits
    ERROR = "error"  # the function raised on the first probe, could not be loaded, or diagnose
    # itself failed after the probes ran (the message says which)
    TIMEOUT = "timeout"  # stopped at the deadline
    CRASHED = "crashed"  # the worker process died (exit, signal, out of memory)

    def __str__(self) -> str:
        return self.value


StatusName = Literal["clean", "fault", "unknown", "error", "timeout", "crashed"]


@dataclass
class Finding:
    """One fault diagnose measured: its ``stage`` (S, M, A, H, O), the catalogue id
    ``fault`` or None, a one-line ``message`` with the measurement (positions 1-based), the
    ``probe`` it was measured on, the ``measurement`` itself (numbers, by name), the query
    ``rows`` affected (0-based) and the (b, h) ``slice`` of the probe."""

    stage: str
    fault: str | None
    message: str
    probe: str = ""
    measurement: dict = field(default_factory=dict)
    rows: tuple = ()
    slice: tuple = ()

    def key(self) -> int:
        return STAGES.index(self.stage) if self.stage in STAGES else len(STAGES)

    @property
    def text(self) -> str:
        """The message led by the catalogue id, when there is one."""
        return f"{self.fault}: {self.message}" if self.fault in BY_ID else self.message

    def to_dict(self) -> dict:
        return {
            "stage": self.stage,
            "fault": self.fault,
            "message": self.message,
            "probe": self.probe,
            "measurement": jsonable(self.measurement),
            "rows": list(self.rows),
            "slice": list(self.slice),
        }

    @classmethod
    def from_dict(cls, d: dict) -> Finding:
        return cls(
            d["stage"],
            d.get("fault"),
            d["message"],
            d.get("probe", ""),
            dict(d.get("measurement") or {}),
            tuple(d.get("rows") or ()),
            tuple(d.get("slice") or ()),
        )


@dataclass
class Diagnosis:
    """What diagnose found.

    ``status``: a :class:`Status`; ``fault``: a catalogue id (``causalattn.check.CATALOGUE``)
    or None; ``stage``: the first stage in dependency order that differs from the reference;
    ``message``: that stage's measurement; ``location``: ``file:line`` in the user's code
    when the white-box pass found it. ``fault``, ``stage`` and ``message`` are the first of
    ``findings``: every distinct fault measured (:class:`Finding`), the main probe's first
    in dependency order, then those further probes show that the main probe does not
    explain; ``also``: their catalogue ids after the first. Measurements of the main probe:
    ``pattern`` — the boolean read pattern (T_q, T_k), True where a query reads the key
    (None when it could not be measured); ``expected`` — the reference's pattern on the same
    probe; ``scale`` — the factor the function applies to Q Kᵀ (None when not measured);
    ``d_k`` — the probe's.
    """

    fault: str | None
    stage: str | None
    message: str
    location: str | None = None
    status: Status = Status.FAULT
    findings: list[Finding] = field(default_factory=list)
    untested: list[str] = field(default_factory=list)  # faults these probes cannot show
    details: dict = field(default_factory=dict)
    pattern: np.ndarray | None = None
    expected: np.ndarray | None = None
    scale: float | None = None
    d_k: int | None = None

    def __post_init__(self):
        self.status = Status(self.status)
        self.findings = [Finding.from_dict(f) if isinstance(f, dict) else f for f in self.findings]
        for name in ("pattern", "expected"):
            v = getattr(self, name)
            if v is not None:
                setattr(self, name, np.asarray(v, dtype=bool))

    @classmethod
    def from_failure(cls, kind: str, message: str) -> Diagnosis:
        """The function could not be measured: a runner failure (timeout, memory, crashed,
        error) as a status."""
        status = {"timeout": Status.TIMEOUT, "error": Status.ERROR}.get(kind, Status.CRASHED)
        return cls(None, None, message, status=status)

    @property
    def also(self) -> list[str]:
        """Catalogue ids of the findings after the first (and, when the first is
        some-heads-only, the fault those heads carry), each once."""
        out = []
        if self.findings and self.findings[0].fault == "some-heads-only":
            inner = self.findings[0].measurement.get("fault")
            out += [inner] if inner else []
        for f in self.findings[1:]:
            if f.fault and f.fault != self.fault and f.fault not in out:
                out.append(f.fault)
        return out

    @property
    def ok(self) -> bool:
        """True when the function was measured and found clean."""
        return self.status == Status.CLEAN

    @property
    def not_run(self) -> bool:
        """The function could not be measured: it raised, timed out or its worker died."""
        return self.status in (Status.ERROR, Status.TIMEOUT, Status.CRASHED)

    def to_dict(self) -> dict:
        """The diagnosis as JSON-ready data (what ``diagnose --json`` prints)."""
        return {
            "fault": self.fault,
            "stage": self.stage,
            "message": self.message,
            "location": self.location,
            "status": self.status.value,
            "findings": [f.to_dict() for f in self.findings],
            "also": self.also,
            "untested": self.untested,
            "details": jsonable(self.details),
            "pattern": None if self.pattern is None else self.pattern.tolist(),
            "expected": None if self.expected is None else self.expected.tolist(),
            "scale": self.scale,
            "d_k": self.d_k,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Diagnosis:
        """The diagnosis back from :meth:`to_dict`'s data (as the isolated worker sends it)."""
        d = dict(d)
        wb = d.get("details", {}).get("whitebox")
        if isinstance(wb, dict):  # JSON made the recorded axes lists; they are tuples
            d["details"] = {
                **d["details"],
                "whitebox": {k: tuple(v) if isinstance(v, list) else v for k, v in wb.items()},
            }
        return cls(
            **{
                k: d[k]
                for k in (
                    "fault",
                    "stage",
                    "message",
                    "location",
                    "status",
                    "findings",
                    "untested",
                    "details",
                    "pattern",
                    "expected",
                    "scale",
                    "d_k",
                )
                if k in d
            }
        )

    def grid(self) -> str:
        """The measured read pattern next to the expected one ('#' reads, '.' does not)."""
        if self.pattern is None or self.expected is None:
            return ""
        P, E = self.pattern, self.expected
        lines = [f"  {'measured':<{2 * P.shape[1] + 3}}expected"]
        for i in range(P.shape[0]):
            row = " ".join("#" if v else "." for v in P[i])
            exp = " ".join("#" if v else "." for v in E[i])
            mark = "   <-" if (P[i] != E[i]).any() else ""
            lines.append(f"  {row}   {exp}{mark}")
        return "\n".join(lines)

    def __str__(self) -> str:
        head = {
            "clean": "clean",
            "fault": f"fault {self.fault} (stage {self.stage})",
            "unknown": f"unknown fault (first diverging stage {self.stage})",
        }.get(self.status.value, self.status.value)
        lines = [f"diagnose: {head}", f"  {self.message}"]
        if self.location:
            lines.append(f"  at {self.location}")
            if self.details.get("code"):
                lines.append(f"     {self.details['code']}")
        for f in self.findings[1:]:  # one line each
            lines.append(f"  also, {f.stage}: {f.text}")
        if self.details.get("mask convention"):
            lines.append(
                f"  fn(q, k, v, mask): the mask passed as {self.details['mask convention']}"
            )
        if self.untested:
            lines.append(f"  not testable with this signature: {', '.join(self.untested)}")
        if self.scale is not None:
            lines.append(f"  measured scale: Q Kᵀ · {self.scale:.4g} (d_k = {self.d_k})")
        if (
            self.pattern is not None
            and self.expected is not None
            and self.pattern.shape == self.expected.shape
            and (self.pattern != self.expected).any()
        ):
            lines.append("  read pattern (rows: queries, columns: keys):")
            lines.append(self.grid())
        for k, v in self.details.get("whitebox", {}).items():
            lines.append(f"  white-box: {k} = {v}")
        return "\n".join(lines)
