"""Diagnose someone else's attention: measure what it does, then name every stage that
differs from the reference (and the catalogued fault, when one fits).

``diagnose(fn)`` checks its arguments and runs four steps, each a module of its own:

1. probing (:mod:`.probes`, :mod:`.observe`, :mod:`.callers`, :mod:`.record`): the
   function is called on probes — values V = I give its weights A itself, random V, V = 0
   and a wider V its linearity; T ≠ d_k and T = d_k, two heads, T_q < T_k, padding, large
   and all-negative scores, fp16, long fp16 rows — and the white-box recorder sees its ops;
2. measuring (:mod:`.measure`): records of what it did, per probe and per (b, h) slice;
3. judging (:mod:`.judge`, :mod:`.locate`): the records against the declared pattern,
   as findings, the main probe's first in dependency order (S, M, A, H, O); ``file:line``;
4. reporting (:mod:`.report`): the :class:`~.report.Diagnosis`.

What is expected is declared with the keywords of :func:`causalattn.attention`
(``window=``, ``chunk=``, ``softcap=``, ``sinks=`` ...; default plain causal), built by
:class:`causalattn.masks.Pattern` and :mod:`causalattn.matrix_form`; fault ids come from the
one catalogue (:mod:`.faults`).

Calling conventions (``signature=``): ``"qkv"`` — ``fn(q, k, v)``, q, k: ``T×d_k``,
v: ``T×d_v``, or with leading (B, H) axes, optionally taking ``key_padding_mask=`` (B, T)
or ``lengths=`` (B,); ``"qkv-mask"`` — ``fn(q, k, v, mask)``, the mask (…, T_q, T_k) in
q's layout, passed in the convention the function's use implies (bool, additive or 1/0,
found on the main probe by :mod:`.mask_arg`; ``details["mask convention"]`` says which);
``"x-weights"`` — ``fn(x, w_q, w_k, w_v[, w_o])`` in the seeds'
``X W`` layout, one head; ``"module"`` — an ``nn.Module`` whose ``forward(x)`` takes
``(1, T, d_model)``: its projections are found by name and replaced (on a copy).

Isolation (:mod:`.runner`): by default the probes run in a worker process with a deadline
(``timeout``) and a memory cap (``max_memory``), in a session of its own that is killed
whole; ``"path/file.py:name"`` always does (the file is read here, by the one reader of
user files, and executed there). ``isolate=False`` runs a callable in this process.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import masks
from ..io import runner
from . import mask_arg
from .callers import (
    SIGNATURES,
    Subject,
    _discover_signature,
    _ModuleAdapter,
    _pad_kind,
    framework,
    load_target,
    read_target,
    takes_wo,
)
from .faults import BY_ID
from .judge import further_kinds, judge, reads_back, untested, verdict
from .locate import locate
from .measure import measure
from .observe import observe, observe_further
from .probes import Plan
from .report import Diagnosis, Status, check_declared_scale

if TYPE_CHECKING:
    pass

__all__ = ["diagnose", "PATTERN_KEYWORDS"]

# the declared pattern: the keywords of causalattn.attention / masks.Pattern
PATTERN_KEYWORDS = masks.PATTERN_KEYWORDS


@masks.takes_pattern
def diagnose(
    fn: Callable[..., Any] | str,
    *,
    pattern: masks.Pattern | None = None,
    signature: str | None = None,
    timeout: float = 60.0,
    isolate: bool = True,
    scale: float | None = None,
    max_memory: int = runner.DEFAULT_MAX_MEMORY,
    **keywords,
) -> Diagnosis:
    """Measure ``fn``'s attention and name the first stage that differs from the declared one.

    ``fn``: a callable, an ``nn.Module`` or ``"path/file.py:name"`` (a function, a module
    instance, an nn.Module class constructible without arguments, or a function without
    arguments returning one). ``signature``: ``"qkv"``, ``"qkv-mask"``, ``"x-weights"`` or
    ``"module"`` (discovered from the parameters' number and names when None; others are
    refused in one line naming these). The pattern (``pattern`` or its keywords) and
    ``scale`` (default 1/√d_k) declare what ``fn`` should compute, as for
    :func:`causalattn.attention` (``mask_mod`` and ``score_mod`` too: evaluated on every
    probe's shape; ``lengths`` (B,) and
    ``key_padding_mask`` (B, T_k) as there). ``timeout`` (seconds) and
    ``max_memory`` (bytes) bound the worker process (:mod:`.runner`); ``isolate=False``
    runs a callable here.
    """
    if signature is not None and signature not in SIGNATURES:
        raise ValueError(f"diagnose: signature must be one of {SIGNATURES}, got {signature!r}")
    timeout = _check_timeout(timeout)
    kw = masks.keywords_of(pattern, keywords, "diagnose")
    declared = {k: _plain(v) for k, v in kw.items() if v is not None}
    masks.Pattern.from_kwargs(where="diagnose", **declared)  # refuse a bad one here, by name
    if isinstance(fn, (str, Path)):  # a fresh interpreter: the declaration is pickled
        _check_picklable({k: v for k, v in declared.items() if k in masks.CALLABLES})
    check_declared_scale("diagnose", scale)
    if isinstance(max_memory, bool) or not isinstance(max_memory, int) or max_memory <= 0:
        raise ValueError(f"diagnose: max_memory must be a number of bytes > 0, got {max_memory!r}")
    if isinstance(fn, (str, Path)):
        target = read_target(str(fn))  # read here, by the one reader; executed in the worker
        job = partial(_diagnose_target, target, signature, declared, scale)
        return _isolated(job, str(fn), timeout, max_memory, fresh=True)
    if not callable(fn):
        raise ValueError(
            f"diagnose: expected a callable, an nn.Module or 'file.py:name', got "
            f"{type(fn).__name__}"
        )
    if signature is None:
        signature = _discover_signature(fn)  # bad signatures are refused here, not in a worker
    if not isolate:
        return diagnose_here(fn, signature, declared, scale)
    what = getattr(fn, "__qualname__", None) or type(fn).__name__
    job = partial(_diagnose_callable, fn, signature, declared, scale)
    try:
        return _isolated(job, what, timeout, max_memory, fresh=False)
    except ValueError as exc:  # it cannot be sent to a worker (no fork here, no pickle)
        raise ValueError(f"diagnose: {exc}, or pass isolate=False (no timeout)") from None


def _isolated(job, what: str, timeout: float, max_memory: int, fresh: bool) -> Diagnosis:
    """The job's Diagnosis, computed by the isolation runner; its failures as statuses."""
    out = runner.run(job, timeout=timeout, max_memory=max_memory, what=what, fresh=fresh)
    if isinstance(out, runner.Failure):
        return Diagnosis.from_failure(out.kind, out.message)
    return Diagnosis.from_dict(out)


def _diagnose_target(target, signature, declared, scale) -> dict:
    """In the worker: load ``file.py:name`` and diagnose it (a Diagnosis dict)."""
    fn = load_target(target)
    return _diagnose_callable(fn, signature or _discover_signature(fn), declared, scale)


def _diagnose_callable(fn, signature, declared, scale) -> dict:
    return diagnose_here(fn, signature, declared, scale).to_dict()


def _check_timeout(timeout) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ValueError(f"diagnose: timeout must be a number of seconds, got {timeout!r}")
    t = float(timeout)
    if not math.isfinite(t) or t <= 0:
        raise ValueError(f"diagnose: timeout must be a finite number of seconds > 0, got {t:g}")
    return t


def _check_picklable(fns: dict) -> None:
    import pickle

    for name, fn in fns.items():
        try:
            pickle.dumps(fn)
        except Exception as exc:  # noqa: BLE001 - any pickling failure is named
            raise ValueError(
                f"diagnose: the declared {name} cannot travel to the worker interpreter "
                f"({exc}); define it at module level"
            ) from None


def _plain(v):
    """Arrays as NumPy (the declaration travels to a worker process as JSON)."""
    if type(v).__module__.startswith("torch"):
        return v.detach().cpu().numpy()
    return np.asarray(v) if isinstance(v, (list, tuple)) else v


def _declared_heads(declared: dict) -> int | None:
    """The head count declared sinks or ALiBi slopes fix (None when neither is declared)."""
    for k in ("sinks", "alibi_slopes"):
        if k in declared:
            return int(np.asarray(declared[k]).shape[-1])
    return None


def diagnose_here(fn, sig, declared, scale) -> Diagnosis:
    """The diagnosis, in this process: probe, measure, judge, report."""
    fw = framework(fn)
    adapter = _ModuleAdapter(fn, heads=_declared_heads(declared)) if sig == "module" else None
    dims = adapter.dims if adapter else {}
    if adapter and dims["w_o"] and dims["d_out"] < dims["hd_v"]:
        raise ValueError(
            f"diagnose: W_O maps h·d_v = {dims['hd_v']} to d_out = "
            f"{dims['d_out']}; the weights cannot be read back through it"
        )
    pad_kind = _pad_kind(fn) if sig != "module" else None
    has_wo = bool(dims["w_o"]) if adapter else sig == "x-weights" and takes_wo(fn)
    given_sig, sig = sig, "qkv" if sig == "qkv-mask" else sig  # probed as fn(q, k, v)
    subject = Subject(fn, sig, fw, adapter, has_wo)
    dtype = np.float32 if fw == "torch" else np.float64
    if adapter is not None:
        dtype = np.dtype(str(next(fn.parameters()).dtype).replace("torch.", ""))
    plan = Plan(sig, dims, pad_kind, declared, dtype, has_wo)
    details = {
        "signature": given_sig,
        "framework": fw,
        "padding": pad_kind,
        "declared": plan.pattern().describe(),
    }
    if given_sig == "qkv-mask":  # on probes of their own: the plan's stay as they are
        details["mask convention"] = mask_arg.choose(
            subject, Plan(sig, dims, pad_kind, declared, dtype, has_wo)
        )
    obs = observe(subject, plan)  # 1. probing
    if obs.main is None:
        p, exc = obs.error
        return Diagnosis(
            None,
            None,
            f"the function raised on the first probe ({p.name}, "
            f"T×d_k = {p.T_k}×{p.d_k}): {type(exc).__name__}: {exc}",
            status=Status.ERROR,
            details=details,
            d_k=p.d_k,
        )
    try:
        return _judged(subject, plan, obs, scale, declared, details)
    except MemoryError:
        raise
    except Exception as exc:  # past the probes, a failure is diagnose's own: say so
        raise RuntimeError(
            f"diagnose failed after the function ran on its probes ({type(exc).__name__}: "
            f"{exc}): a fault in causalattn's diagnose, not in the function"
        ) from exc


def _judged(subject, plan, obs, scale, declared, details) -> Diagnosis:
    """Steps 2 to 4 on the main probe's run: measure, probe further, judge, report."""
    sig, has_wo, pad_kind = subject.sig, subject.has_wo, plan.pad_kind
    main = measure(obs.main, scale=scale, sig=sig)  # 2. measuring
    observe_further(subject, plan, obs, further_kinds(main))  # (what can still show more)
    measures = [main, *(measure(r, scale=scale, sig=sig) for r in obs.further)]
    d_model = plan.dims["d_model"] if sig != "qkv" else None
    findings = judge(measures, d_model=d_model)  # 3. judging
    details["probes"] = obs.ran
    if obs.dropped:
        details["dropped probes"] = obs.dropped
    located = (None, "", {})
    if findings:
        top = findings[0].fault
        try:
            if obs.events_error is not None:
                raise RuntimeError(obs.events_error)
            located = locate(obs.events or [], top if top in BY_ID else None)
        except Exception as exc:  # the white-box pass is a bonus; never let it hide a verdict
            located = (None, "", {"error": f"{type(exc).__name__}: {exc}"})
    missing = untested(sig, has_wo, pad_kind, declared, obs.ran, obs.main.probe.kind)
    return verdict(  # 4. reporting
        findings,
        measures,
        details=details,
        untested=missing,
        reads_back=reads_back(measures[0]),
        located=located,
    )
