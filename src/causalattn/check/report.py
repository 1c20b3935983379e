"""The audit's report model: Check, Report (and the errors for unusable input)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

STAGE_ORDER = ("X", "Q", "K", "V", "S", "M", "A", "H", "C", "O")


class AuditInputError(ValueError):
    """The input cannot be audited (unreadable file, wrong ranks, non-numeric data ...)."""




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

    def to_dict(self) -> dict:
        return {"stage": self.stage, "name": self.name, "ok": self.ok, "message": self.message,
                "evidence": _jsonable(self.evidence), "hint": self.hint}


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
        return all(c.ok for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    @property
    def first_failure(self) -> Check | None:
        f = self.failures
        return min(f, key=lambda c: STAGE_ORDER.index(c.stage)) if f else None

    def to_dict(self) -> dict:
        ff = self.first_failure
        return {
            "ok": self.ok,
            "first_failure": None if ff is None else ff.to_dict(),
            "checks": [c.to_dict() for c in self.checks],
            "given": self.given,
            "recomputed": self.recomputed,
            "empty_rows": _jsonable(self.empty_rows),
            "notes": self.notes,
        }

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    def __str__(self) -> str:
        lines = [f"audit: {'ok' if self.ok else 'FAILED'}"
                 f" (given: {', '.join(self.given) or '-'};"
                 f" recomputed: {', '.join(self.recomputed) or '-'})"]
        for c in self.checks:
            lines.append(f"  [{'ok' if c.ok else 'FAIL'}] {c.stage:<2} {c.name}: {c.message}")
            if not c.ok:
                ev = ", ".join(f"{k}={v}" for k, v in _jsonable(c.evidence).items())
                if ev:
                    lines.append(f"         evidence: {ev}")
                if c.hint:
                    lines.append(f"         hint: {c.hint}")
        if self.empty_rows:
            lines.append(f"  rows with no readable key (zero output, not a failure): "
                         f"{_fmt_empty(self.empty_rows)}")
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
                ev = ", ".join(f"{k}={v}" for k, v in _jsonable(c.evidence).items())
                details += f"\n[dim]evidence: {escape(ev)}[/]"
            if not c.ok and c.hint:
                details += f"\n[yellow]hint:[/] {escape(c.hint)}"
            t.add_row(c.stage, escape(c.name), "[green]ok" if c.ok else "[red]FAIL", details)
        if self.empty_rows:
            t.caption = escape("rows with no readable key (zero output, not a failure): "
                               + _fmt_empty(self.empty_rows))
        return t


def _fmt_empty(rows: list[dict]) -> str:
    parts = [f"{r['index']}: {r['rows']}" if r["index"] else str(r["rows"]) for r in rows[:4]]
    return "; ".join(parts) + (" ..." if len(rows) > 4 else "")


def _jsonable(x: Any):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        v = float(x)
        return v if np.isfinite(v) else str(v)
    if isinstance(x, np.bool_):
        return bool(x)
    return x



@dataclass
class Diagnosis:
    """``fault``: a catalogue id, or None (matches the reference, or nothing fits: see
    ``status``); ``stage``: the first stage that diverges; ``location``: ``file:line`` of
    the user's code (torch white-box pass) when found."""

    fault: str | None
    stage: str | None
    message: str
    location: str | None = None
    status: str = "fault"  # clean | fault | unknown | error | timeout | crashed
    also: list[str] = field(default_factory=list)  # a second fault, or faults that look the same
    untested: list[str] = field(default_factory=list)  # faults these probes cannot tell apart
    details: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "clean"

    def to_dict(self) -> dict:
        return {"fault": self.fault, "stage": self.stage, "message": self.message,
                "location": self.location, "status": self.status, "also": self.also,
                "untested": self.untested, "details": self.details}

    @classmethod
    def from_dict(cls, d: dict) -> Diagnosis:
        return cls(**{k: d[k] for k in ("fault", "stage", "message", "location", "status",
                                        "also", "untested", "details") if k in d})

    def __str__(self) -> str:
        head = {"clean": "clean", "fault": f"fault {self.fault} (stage {self.stage})",
                "unknown": f"unknown fault (first diverging stage {self.stage})"}.get(
            self.status, self.status)
        lines = [f"diagnose: {head}", f"  {self.message}"]
        if self.location:
            lines.append(f"  at {self.location}")
            if self.details.get("code"):
                lines.append(f"     {self.details['code']}")
        if self.also:
            lines.append(f"  also: {', '.join(self.also)}")
        if self.untested:
            lines.append(f"  not testable with this signature: {', '.join(self.untested)}")
        for k, v in self.details.get("whitebox", {}).items():
            lines.append(f"  white-box: {k} = {v}")
        return "\n".join(lines)

