"""Probing, the runs: call the function on every probe of a :class:`~.probes.Plan` and keep
what it returned, raw (:class:`Run`), before anything is measured or judged.

The first main probe that runs is the main probe; on it the white-box recorder also runs
(:mod:`.record`: the operations, their ``file:line``, the softmax weights torch code
computed). Then the further probes of the kinds asked for (the judge says which can still
show something new); a probe the function refuses (it raises) is dropped and named.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .callers import Subject
from .probes import Plan, Probe
from .record import record_numpy, record_torch

__all__ = ["Run", "Observations", "observe", "observe_further"]


@dataclass
class Run:
    """What the function returned on one probe: ``outputs`` (value name -> H (B, H, T_q, n)
    float64, for ``probe.values[name]``), its output ``dtype``, the ``weights`` it returned
    or computed (a returned ``(out, A)``, or the softmax the recorder saw; (B, H, T_q, T_k)
    or None), ``O`` with the probe's W_V, W_O (or ``O_error``)."""

    probe: Probe
    outputs: dict = field(default_factory=dict)
    dtype: np.dtype | None = None
    weights: np.ndarray | None = None
    O: np.ndarray | None = None
    O_error: str | None = None


@dataclass
class Observations:
    """Every run: the ``main`` one (None when no main probe ran: ``error`` says why),
    ``further`` in probe order, the names ``dropped``, the recorder's ``events``."""

    main: Run | None
    further: list = field(default_factory=list)
    dropped: list = field(default_factory=list)
    events: list | None = None
    events_error: str | None = None
    error: tuple | None = None  # (probe, exception) of the first main probe that raised

    @property
    def ran(self) -> list[str]:
        return [r.probe.name for r in ([self.main] if self.main else []) + self.further]


def _run(subject: Subject, p: Probe) -> Run:
    """All of a probe's values through the function (V = I first); raises what it raises."""
    run = Run(p)
    with np.errstate(all="ignore"):
        for name, V in p.values.items():
            out = subject.values(p, V)
            run.outputs[name] = out.H
            if name in ("eye", "ones"):
                run.dtype = out.dtype
                run.weights = out.weights if out.weights is not None else run.weights
    return run


def observe(subject: Subject, plan: Plan) -> Observations:
    """The main probe's run (the first of ``plan.main_probes()`` that runs), its output
    projection and the white-box recording; :func:`observe_further` adds the rest."""
    obs = Observations(None)
    for p in plan.main_probes():
        try:
            obs.main = _run(subject, p)
            break
        except MemoryError:
            raise
        except Exception as exc:  # T = d_k next; the first error is the one reported
            obs.error = obs.error or (p, exc)
    if obs.main is None:
        return obs
    main = obs.main
    if main.probe.projection is not None:
        try:
            with np.errstate(all="ignore"):
                main.O = subject.output(main.probe, *main.probe.projection)
        except MemoryError:
            raise
        except Exception as exc:
            main.O_error = f"{type(exc).__name__}: {exc}"
    _record(subject, obs)
    return obs


def observe_further(subject: Subject, plan: Plan, obs: Observations, kinds) -> Observations:
    """Run the further probes of these ``kinds`` (what the judge says can still show
    something new); a group's first probe that runs counts, else it is dropped."""
    for group in plan.further(obs.main.probe):
        if group[0].kind not in kinds:
            continue
        for p in group:
            try:
                obs.further.append(_run(subject, p))
                break
            except MemoryError:
                raise
            except Exception:  # the function refuses this probe: try the next, or drop it
                continue
        else:
            obs.dropped.append(group[0].name)
    return obs


def _record(subject: Subject, obs: Observations) -> None:
    """The white-box pass on the main probe: op events, and torch's softmax weights when the
    function did not return its own. A bonus: it never hides a verdict."""
    p = obs.main.probe
    eye = p.values["eye"]
    try:
        if subject.framework == "torch":
            obs.events = record_torch(lambda: subject.values(p, eye))
            if obs.main.weights is None:
                w = next((e["weights"] for e in obs.events if "weights" in e), None)
                obs.main.weights = w
        else:
            obs.events = record_numpy(lambda wrap: subject.values(p, eye, wrap=wrap))
    except MemoryError:
        raise
    except Exception as exc:
        obs.events_error = f"{type(exc).__name__}: {exc}"
