"""Name the bug in someone else's attention: probes, a catalogue of faulty variants, op recording.

``diagnose(fn)`` runs ``fn`` on probe inputs built to separate faults (distinct scales,
T ≠ d_k and T = d_k, large scores, padding, fp16) and compares its outputs with the
reference and with every faulty variant in :data:`CATALOGUE` — each variant is the
reference pipeline (:mod:`causalattn.masks`, :func:`causalattn.reference.softmax_last`)
with one stage changed. The answer names the matching fault (or ``None``: "no known
fault: matches the reference") and its stage; when no single fault fits, pairs are
tried and the earliest fault in dependency order is named. A white-box pass records the
operations — a ``TorchFunctionMode`` for torch, an ndarray subclass for NumPy: the
softmax and its axis, the mask op and whether it comes before or after the softmax, the
scale — and points at the user's ``file:line``. When nothing in the catalogue fits, the
softmax weights it recorded (or that the function returned as ``(out, weights)``) go
through :func:`causalattn.audit`, which names the first stage that diverges.

Calling conventions (``signature=``): ``"qkv"`` — ``fn(q, k, v)`` with q, k: ``T×d_k``,
v: ``T×d_v`` (optionally a ``key_padding_mask=`` (B, T) keyword, True = may read, or
``lengths=`` (B,)); ``"x-weights"`` — ``fn(x, w_q, w_k, w_v[, w_o])`` in the seeds'
``X W`` layout, one head; ``"module"`` — an ``nn.Module`` whose ``forward(x)`` takes ``(1, T, d_model)``:
its projection weights are found by name and replaced (on a copy) by probe weights.

``diagnose("path/file.py:name")`` EXECUTES that file, in a subprocess with a timeout, so
a hang or a crash in it is reported, not inherited; ``name`` may be a function, a module
instance, an nn.Module class constructible without arguments, or a function without
arguments that returns one of those. ``diagnose(callable)`` runs in-process.
"""

from __future__ import annotations

import inspect
import itertools
from pathlib import Path

import numpy as np

from .callers import SIGNATURES, _Caller, _discover_signature, _framework, _ModuleAdapter, _pad_kind
from .faults import _BY_ID, _EMPTY_ROW_FAULTS, CATALOGUE
from .probes import _Probe, _probes
from .record import _record, _record_numpy, _whitebox
from .report import Diagnosis
from .runner import _diagnose_path
from .variants import _attend, _distance, _real_rows, _rtol

__all__ = ["diagnose"]


def _candidates(fault_ids):
    yield (), {}
    for f in fault_ids:
        yield (f,), {_BY_ID[f].knob: _BY_ID[f].value}


def _pairs(fault_ids):
    for a, b in itertools.combinations(fault_ids, 2):
        fa, fb = _BY_ID[a], _BY_ID[b]
        if fa.knob != fb.knob:
            yield (a, b), {fa.knob: fa.value, fb.knob: fb.value}


def _safe(fn, *a):
    try:
        with np.errstate(all="ignore"):
            return fn(*a)
    except Exception as exc:  # the variant (or the user's fn) refuses these shapes
        return exc


def diagnose(fn, *, signature: str | None = None, timeout: float = 60.0) -> Diagnosis:
    """Name the fault in ``fn``'s attention (see the module docstring).

    ``fn``: a callable, an ``nn.Module``, or ``"path/file.py:name"`` (a function, a
    module instance or an nn.Module class constructible without arguments) — the path
    form runs in a subprocess killed after ``timeout`` seconds. ``signature``: one of
    ``"qkv"``, ``"x-weights"``, ``"module"``; discovered when None.
    """
    if signature is not None and signature not in SIGNATURES:
        raise ValueError(f"diagnose: signature must be one of {SIGNATURES}, got {signature!r}")
    if isinstance(fn, (str, Path)):
        return _diagnose_path(str(fn), signature, timeout)
    if not callable(fn):
        raise ValueError(f"diagnose: expected a callable, an nn.Module or 'file.py:name', got "
                         f"{type(fn).__name__}")
    return _diagnose_callable(fn, signature)


def _diagnose_callable(fn, signature) -> Diagnosis:
    sig = signature or _discover_signature(fn)
    framework = _framework(fn)
    adapter = None
    if sig == "module":
        adapter = _ModuleAdapter(fn)
        dims = adapter.dims
        pad_kind = None
    else:
        pad_kind = _pad_kind(fn)
        dims = {}
        if sig == "x-weights":
            n = len([p for p in inspect.signature(fn).parameters.values()
                     if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                            p.POSITIONAL_OR_KEYWORD)])
            dims = {"d_model": 4, "hd_k": 4, "hd_v": 4, "d_k": 4, "heads": None,
                    "w_o": n >= 5, "d_out": 4}
    dtype = np.float32 if framework == "torch" else np.float64
    probes = _probes(sig, dims, pad_kind, dtype)
    caller = _Caller(fn, sig, framework, adapter)

    # the input layout: 2-D first, then with unit batch/head axes
    base = probes[0]
    first = None
    for lead in ((0, 1, 2) if sig != "module" else (0,)):
        first = _safe(caller, base, lead)
        if not isinstance(first, BaseException):
            caller.lead = lead
            break
    details = {"signature": sig, "framework": framework, "padding": pad_kind}
    if isinstance(first, BaseException):
        return Diagnosis(None, None, f"the function raised on the first probe ({base.name}): "
                         f"{type(first).__name__}: {first}", status="error", details=details)

    user = {p.name: (first if p is base else _safe(caller, p)) for p in probes}
    dropped = [p.name for p in probes if p.optional and isinstance(user[p.name], BaseException)]
    probes = [p for p in probes if p.name not in dropped]
    if dropped:
        details["dropped probes"] = dropped
    testable = [f.id for f in CATALOGUE if not (f.stage == "O" and not dims.get("w_o"))
                and not (f.knob in ("pad",) and pad_kind is None)]

    cache: dict = {}

    def outputs(knobs):
        key = tuple(sorted(knobs.items()))
        if key not in cache:
            cache[key] = {p.name: _safe(_attend, p, knobs) for p in probes}
        return cache[key]

    def distance(ids, knobs):
        outs = outputs(knobs)
        every_row = not ids or any(i in _EMPTY_ROW_FAULTS for i in ids)
        worst, wild, total = 0.0, 0, 0
        for p in probes:
            c = outs[p.name]
            rows = None
            if not isinstance(c, BaseException):
                rows = np.ones(c.shape[:-1], bool) if every_row else _real_rows(p, c.shape)
            e, w = _distance(user[p.name], c, rows, _rtol(p.dtype))
            worst, wild = max(worst, e), wild + w
            total += 0 if isinstance(c, BaseException) else c.size
        if wild > total / 2:  # a variant that is mostly NaN says nothing about the user's code
            worst = np.inf
        return worst, wild

    ref_out = outputs({})
    untested = []
    for ids, knobs in _candidates(testable):
        if ids and all(_distance(outputs(knobs)[p.name], ref_out[p.name],
                                 np.ones(ref_out[p.name].shape[:-1], bool)
                                 if not isinstance(ref_out[p.name], BaseException) else None,
                                 _rtol(p.dtype))[0] == 0.0 for p in probes):
            untested.append(ids[0])
    untested += [f.id for f in CATALOGUE if f.id not in testable]
    candidates = [i for i in testable if i not in untested]

    fault = None
    also: list[str] = []
    pair = False
    def matches(cands):
        """Matching candidates, exact ones (fewest NaN wildcards) first, then in catalogue order."""
        found = [(distance(ids, kn)[1], n, ids) for n, (ids, kn) in enumerate(cands)
                 if ids and distance(ids, kn)[0] == 0.0]
        found.sort()
        return [ids for w, _, ids in found if w == found[0][0]] if found else []

    if distance((), {})[0] == 0.0:
        status = "clean"
    else:
        status = "fault"
        singles = matches(list(_candidates(candidates)))
        if singles:
            fault, also = singles[0][0], [s[0] for s in singles[1:]]
        else:
            pairs = matches(list(_pairs(candidates)))
            if pairs:
                fault, also, pair = pairs[0][0], [pairs[0][1]], True
            else:
                status = "unknown"

    location, code, facts, events, rec = None, "", {}, [], base
    try:
        # the richest probe the function ran on: padding (every branch taken), else T ≠ d_k
        ran = [p for p in probes if not isinstance(user[p.name], BaseException)]
        rec = next((p for p in ran if p.pad_kind and p.dtype != np.float16),
                   ran[1] if len(ran) > 1 else base)
        events = (_record if framework == "torch" else _record_numpy)(caller, rec)
        location, code, facts = _whitebox(events, fault)
    except Exception as exc:  # recording is a bonus; never let it hide the diagnosis
        facts = {"error": f"{type(exc).__name__}: {exc}"}
    details.update({"whitebox": facts, "code": code, "probes": [p.name for p in probes]})

    if status == "clean":
        msg = "no known fault: matches the reference"
        return Diagnosis(None, None, msg, None, "clean", [], untested, details)
    if status == "unknown":
        A = next((e["weights"] for e in events if "weights" in e), None)
        if A is None and not isinstance(_safe(caller, rec), BaseException):
            A = caller.weights  # the function returned (out, weights)
        check = _audit_weights(A, rec, sig) if A is not None else None
        msg = ("the output differs from the reference and from every catalogued fault (and "
               "every pair of them)")
        if check is not None and check.ok:
            stage = "O" if sig != "qkv" and dims.get("w_o") else "H"
            msg += "; the softmax weights pass the audit, so the divergence is after A"
        elif check is not None:
            stage = check.stage
            msg += f"; the softmax weights fail the audit at {check.stage}: {check.message}"
            msg += f" ({check.hint})" if check.hint else ""
        else:
            stage = _unknown_stage(facts, sig, dims)
        return Diagnosis(None, stage, msg, location, "unknown", [], untested, details)
    f = _BY_ID[fault]
    msg = f"{f.id}: {f.description}"
    if pair:
        msg += f"; together with {also[0]} ({_BY_ID[also[0]].description})"
    elif also:
        msg += f" (these probes cannot tell it from: {', '.join(also)})"
    return Diagnosis(f.id, f.stage, msg, location, "fault", also, untested, details)


def _audit_weights(A, p: _Probe, sig: str):
    """The audit's first failing Check given the weights A the user's softmax produced
    (a passing Check when the audit is clean; None when A cannot be placed)."""
    from .audit import audit

    if sig == "qkv":
        data = {"Q": p.inputs["q"], "K": p.inputs["k"], "V": p.inputs["v"]}
        lead = p.inputs["q"].shape[:-2]
    else:
        data = {"X": p.inputs["x"], "W_q": p.inputs["w_q"], "W_k": p.inputs["w_k"],
                "W_v": p.inputs["w_v"]}
        lead = p.inputs["x"].shape[:-2] + ((p.heads,) if p.heads else ())
        if p.heads:
            data["n_heads"] = p.heads
    T = p.inputs["q" if sig == "qkv" else "x"].shape[-2]
    want = lead + (T, T)
    if A.size != int(np.prod(want)):
        return None
    data["A"] = A.reshape(want)
    if p.pad_kind is not None:
        data[p.pad_kind] = p.pad
    try:
        rep = audit(data)
    except ValueError:
        return None
    return rep.first_failure or rep.checks[-1]


def _unknown_stage(facts: dict, sig: str, dims: dict) -> str:
    if facts.get("softmax over the key axis") is False:
        return "A"
    if facts.get("mask after softmax"):
        return "A"
    if facts.get("mask before softmax") is False:
        return "M"
    return "O" if sig != "qkv" and dims.get("w_o") else "H"


