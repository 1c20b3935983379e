"""Grade a filled-in exercise stage by stage with :func:`causalattn.diagnose`.

    check("attention.py") -> Grade      # runs the file in an isolated worker (io.runner)
    grade_file("attention.py")          # the same in this process
    grade_function(attention)           # a function defined here (a notebook cell)

The learner's function is placed inside the reference pipeline (the stages it does not
cover are the library's: :mod:`causalattn.masks`, :func:`causalattn.matrix_form.softmax_last`),
so the composite is an ordinary attention function that ``diagnose`` probes and compares
with its catalogue of faults. Before that, one call on a small input checks the shape the
function returns against :func:`causalattn.shapes.shape_table`. A :class:`Grade` lists
every stage of the exercise (right / wrong / not graded yet), names the first wrong one with
a hint, and for the mask shows the learner's M against the expected one. Never a solution.

Exit codes (``Grade.exit_code``): 0 every stage right, 1 a stage is wrong, 2 the file could
not run (it does not load, raises, or does not finish within the timeout).

The file is read by the one reader of user files (:func:`causalattn.io.files.read_source`)
and, in ``check``, executed in the one isolation runner (:mod:`causalattn.io.runner`): a
session of its own killed whole at the end, a deadline that the inner ``diagnose`` honours,
capped memory and output.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import numpy as np

from .. import masks
from ..check.callers import exec_source, framework
from ..check.diagnose import diagnose
from ..check.faults import CATALOGUE
from ..io import runner
from ..io.files import read_source
from ..matrix_form import softmax_last
from ..shapes import shape_table
from .exercises import EXERCISES, MARK, Exercise

__all__ = [
    "Grade",
    "check",
    "grade_file",
    "grade_function",
    "grade_namespace",
    "STAGE_NAMES",
    "HINTS",
]

STAGE_NAMES = {
    "shape": "the shape of what it returns",
    "S": "scores S = Q Kᵀ / √d_k",
    "M": "mask M (0 readable, -∞ blocked)",
    "A": "weights A = softmax_last(S + M)",
    "H": "output H = A V",
    "O": "O = [H_0 … H_{h-1}] W_O",
    "heads": "every head the same way",
}

# One hint per catalogued fault, the catalogue's lesson: where to look, never what to write.
HINTS = {f.id: f.lesson for f in CATALOGUE}
_STAGE_HINTS = {
    "shape": "Write the shapes of every intermediate next to the code, in the seed's "
    "notation (T×d_k, T×T, ...), and compare with the docstring.",
    "S": "Check S by hand on a tiny case: S[i, j] = q_i · k_j / √d_k.",
    "M": "Print your M for T = 4 and length = 3 and compare it cell by cell with the rule in "
    "the docstring.",
    "A": "Each row of A must sum to 1 over the readable keys and be exactly 0 at -∞ entries.",
    "H": "h_i = Σ_j A_ij v_j: a T×T by T×d_v product.",
    "O": "Check the head split (which columns belong to head n), the order of the heads "
    "side by side, then the product with W_O.",
    "heads": "Compare the heads: what does your code do differently for one of them?",
}


_FINITE_FILL = (
    "Your M holds values other than 0 and -∞ (the '?' cells). A finite fill "
    "still leaves weight where large scores overcome it, and a padding query's row "
    "of equal finite values spreads its weight instead of reading nothing."
)


@dataclass(repr=False)
class Grade:
    """The grade of one file: ``status`` right | wrong | error; ``stages`` one dict per
    stage of the exercise (stage, name, status right | wrong | not graded); ``stage``: the
    first wrong one; ``pattern``: the learner's M against the expected one (mask stage);
    ``also``: every further fault diagnose measured (stage, fault, message, hint)."""

    file: str
    exercise: str | None
    status: str
    message: str
    framework: str | None = None
    stage: str | None = None
    fault: str | None = None
    hint: str | None = None
    stages: list = field(default_factory=list)
    location: str | None = None
    pattern: dict | None = None
    diagnosis: dict | None = None
    also: list = field(default_factory=list)  # the further faults measured: stage, fault, ...

    @property
    def exit_code(self) -> int:
        return {"right": 0, "wrong": 1}.get(self.status, 2)

    @property
    def ok(self) -> bool:
        return self.status == "right"

    def to_dict(self) -> dict:
        return {**asdict(self), "exit_code": self.exit_code}

    @classmethod
    def from_dict(cls, d: dict) -> Grade:
        return cls(**{k: v for k, v in d.items() if k != "exit_code"})

    def __repr__(self) -> str:  # a notebook shows the grade itself
        return str(self)

    def __str__(self) -> str:
        mark = {"right": "✓", "wrong": "✗", "not graded": "·"}
        lines = [f"exercise {self.exercise or '?'} ({self.file}): {self.status}"]
        for st in self.stages:
            lines.append(
                f"  {mark.get(st['status'], '?')} {st['stage']:<5} {st['name']:<36} {st['status']}"
            )
        lines.append(f"  {self.message}")
        if self.location:
            lines.append(f"  at {self.location}")
        if self.pattern:
            lines.append(f"  {self.pattern['what']}: yours | expected")
            for a, b in zip(self.pattern["measured"], self.pattern["expected"]):
                lines.append(
                    f"    {' '.join(f'{c:>2}' for c in a)}   |   {' '.join(f'{c:>2}' for c in b)}"
                )
        if self.hint:
            lines.append(f"  hint: {self.hint}")
        for a in self.also:
            lines.append(f"  also wrong, stage {a['stage']}: {a['message']}")
        return "\n".join(lines)


# -- calling the learner's function ------------------------------------------------------------
class _Learner:
    """The learner's function, called with float64 arrays of its framework; NumPy back."""

    def __init__(self, fn, framework: str, ex: Exercise):
        self.fn, self.framework, self.ex = fn, framework, ex

    def _in(self, a):
        a = np.array(a, dtype=np.float64)
        if self.framework == "torch":
            import torch

            return torch.from_numpy(a)
        return a

    def __call__(self, *arrays, ints=()):
        out = self.fn(*(self._in(a) for a in arrays), *ints)
        if type(out).__module__.startswith("torch"):
            out = out.detach().cpu().double().numpy()
        try:
            arr = np.asarray(out, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"{self.ex.function}() returned {type(out).__name__}, not an array "
                f"of numbers ({exc})"
            ) from None
        return arr

    def checked(self, shape, *arrays, ints=()):
        out = self(*arrays, ints=ints)
        if out.shape != tuple(shape):
            raise ValueError(
                f"{self.ex.function}() returned shape {out.shape}, expected "
                f"{'×'.join(map(str, shape))}"
            )
        return out


def _rows(lengths, T: int, B: int):
    return [T] * B if lengths is None else [int(L) for L in np.asarray(lengths).ravel()]


def _padded(T: int, L: int) -> np.ndarray:
    """T×T: causal, the first L positions real (the seed's right padding), from the one M."""
    return np.asarray(masks.Pattern(lengths=[L]).allowed(1, 1, T, T))[0, 0]


def _float64_only(a) -> None:
    """The learner's stage runs in float64; half-precision probes (optional in diagnose) are
    declined, since a float64 stage cannot show their rounding."""
    if np.asarray(a).dtype == np.float16:
        raise ValueError("learn: the exercises run in float64, not float16")


def _composite(ex: Exercise, user: _Learner):
    """An attention function for diagnose: the learner's stage inside the reference."""

    def scores_ref(q, k):
        return q @ k.T / np.sqrt(q.shape[-1])

    if ex.name == "scores":

        def attention(q, k, v):
            _float64_only(q)
            T = q.shape[-2]
            S = user.checked((T, T), q, k)
            allowed = masks.causal(T)
            return softmax_last(np.where(allowed, S, -np.inf), allowed) @ np.asarray(v, float)

        return attention

    if ex.name in ("mask", "softmax"):

        def attention(q, k, v, lengths=None):
            _float64_only(q)
            q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
            one = q.ndim == 2
            q, k, v = (a[None] if one else a for a in (q, k, v))
            T = q.shape[-2]
            out = []
            for b, L in enumerate(_rows(lengths, T, q.shape[0])):
                S = scores_ref(q[b], k[b])
                if ex.name == "mask":
                    M = user.checked((T, T), ints=(T, L))
                    with np.errstate(invalid="ignore"):
                        Z = S + M
                    A = softmax_last(Z, Z != -np.inf)  # -∞ blocks; a row of -∞ reads nothing
                else:
                    allowed = _padded(T, L)
                    A = user.checked((T, T), np.where(allowed, S, -np.inf))
                out.append(A @ v[b])
            H = np.stack(out)
            return H[0] if one else H

        return attention

    if ex.name == "attention":  # the learner's own function: diagnose records its lines too
        return user.fn

    import torch

    class MultiHead(torch.nn.Module):
        """Holds W_Q, W_K, W_V, W_O (X W layout) so diagnose can set its probe weights."""

        n_heads = 2

        def __init__(self, d_model=8):
            super().__init__()
            for name in ("w_q", "w_k", "w_v", "w_o"):
                setattr(
                    self,
                    name,
                    torch.nn.Parameter(
                        torch.zeros(d_model, d_model, dtype=torch.float64), requires_grad=False
                    ),
                )

        def forward(self, x):
            W = [getattr(self, n).detach().cpu().numpy() for n in ("w_q", "w_k", "w_v", "w_o")]
            xs = x.detach().cpu().double().numpy()
            O = np.stack(
                [
                    user.checked(xs[b].shape, xs[b], *W, ints=(self.n_heads,))
                    for b in range(xs.shape[0])
                ]
            )
            return torch.from_numpy(O).to(x.dtype)

    return MultiHead()


# -- the shape check: one small call before diagnose ---------------------------------------------
def _shape_probe(ex: Exercise):
    """(arguments, ints, expected shape) from the seeds' table, T = 5."""
    rng = np.random.default_rng(7)
    T, d_k, d_v, L = 5, 3, 2, 3
    rows = {r.symbol: r.shape for r in shape_table(T, d_k, 1, d_k, d_v)}
    if ex.name == "scores":
        return [rng.normal(size=(T, d_k)) for _ in range(2)], (), rows["QKᵀ"]
    if ex.name == "mask":
        return [], (T, L), rows["M"]
    if ex.name == "softmax":
        allowed = masks.causal(T)
        return [np.where(allowed, rng.normal(size=(T, T)), -np.inf)], (), rows["A"]
    if ex.name == "attention":
        return [rng.normal(size=(T, n)) for n in (d_k, d_k, d_v)], (), rows["H"]
    h, D = 2, 6
    rows = {r.symbol: r.shape for r in shape_table(T, D, h)}
    O = (T, rows["W_O"][1])
    ws = [rng.normal(size=rows[s]) for s in ("W_Q", "W_K", "W_V", "W_O")]
    return [rng.normal(size=(T, D)), *ws], (h,), O


def _mask_picture(user: _Learner, T: int = 6, L: int = 4) -> dict | None:
    """The learner's M against the expected one (0 / -∞; '?' for anything else)."""
    try:
        M = user(ints=(T, L))
    except Exception:
        return None
    want = masks.additive(_padded(T, L))

    def cells(a):  # the learner's own values: anything but 0 / -∞ is shown as '?'
        return [["0" if x == 0 else "-∞" if x == -np.inf else "?" for x in row] for row in a]

    if M.shape != want.shape or np.array_equal(M, want):
        return None
    return {
        "what": f"M for T = {T}, length = {L} ('?': neither 0 nor -∞)",
        "measured": cells(M),
        "expected": cells(want),
    }


def _cells(allowed) -> list[list[str]]:
    """A boolean pattern in the seed's additive view: 0 where read, -∞ where not."""
    return [["0" if a else "-∞" for a in row] for row in np.asarray(allowed, bool)]


def _read_picture(d) -> dict | None:
    """diagnose's measured read pattern against the reference's, when it measured one and
    they differ (``Diagnosis.pattern`` / ``.expected``)."""
    P, E = getattr(d, "pattern", None), getattr(d, "expected", None)
    if P is None or E is None:
        return None
    P, E = np.asarray(P, bool), np.asarray(E, bool)
    if P.ndim != 2 or P.shape != E.shape or np.array_equal(P, E):
        return None
    return {
        "what": f"M as your code reads it (measured, T = {P.shape[0]})",
        "measured": _cells(P),
        "expected": _cells(E),
    }


# -- grading ------------------------------------------------------------------------------------
def _find_exercise(ns: dict, path: str, exercise: str | None, source: bytes | None) -> Exercise:
    if exercise is not None:
        if exercise not in EXERCISES:
            raise ValueError(
                f"learn: unknown exercise {exercise!r}; choose one of {list(EXERCISES)}"
            )
        return EXERCISES[exercise]
    if source is None:  # (grade_namespace called on its own: the file, by the one reader)
        try:
            source = read_source(path)
        except ValueError:
            source = b""
    first = source.decode("utf-8", "replace").splitlines()[:1]
    if first and first[0].startswith(MARK):
        name = first[0][len(MARK) :].split()[0] if first[0][len(MARK) :].split() else ""
        if name in EXERCISES:
            return EXERCISES[name]
    found = [ex for ex in EXERCISES.values() if callable(ns.get(ex.function))]
    if len(found) == 1:
        return found[0]
    raise ValueError(
        f"learn: cannot tell which exercise {path} is (no '{MARK} NAME' first "
        f"line, and {len(found)} of the functions {list(EXERCISES)}); pass "
        "--exercise NAME"
    )


def _in_file(location: str | None, path: str) -> bool:
    """Whether diagnose's ``file:line`` points into the learner's file (not the grader's)."""
    if not location or ":" not in location:
        return False
    return Path(location.rsplit(":", 1)[0]).resolve() == Path(path).resolve()


def _stages(ex: Exercise, wrong: str | None, known: bool) -> list[dict]:
    """Every stage right, or: before the wrong one right (known fault) or unconfirmed. A
    stage diagnose names outside the exercise's list (e.g. "heads") gets a row of its own,
    the others none confirmed."""
    order = ("shape",) + ex.stages
    if wrong is not None and wrong not in order:
        order, known = order + (wrong,), False
    out, seen = [], False
    for st in order:
        if wrong is None:
            status = "right"
        elif st == wrong:
            status, seen = "wrong", True
        elif seen:
            status = "not graded"
        else:
            status = "right" if known or st == "shape" else "not graded"
        out.append({"stage": st, "name": STAGE_NAMES.get(st, st), "status": status})
    return out


def _error(path, ex, message, framework=None) -> Grade:
    return Grade(str(path), ex.name if ex else None, "error", message, framework)


def _wrong_shape(path, ex, message, framework, diagnosis=None) -> Grade:
    """Wrong at the shape check (a wrong shape, or a call that raised)."""
    return Grade(
        path,
        ex.name,
        "wrong",
        message,
        framework,
        "shape",
        None,
        _STAGE_HINTS["shape"],
        _stages(ex, "shape", True),
        diagnosis=diagnosis,
    )


def grade_namespace(
    ns: dict,
    path: str | Path,
    exercise: str | None = None,
    timeout: float = 60.0,
    *,
    source: bytes | None = None,
) -> Grade:
    """Grade the exercise whose module globals are ``ns`` (loaded from ``path``, whose
    ``source`` names the exercise on its first line); ``timeout``: seconds for diagnose's
    worker (inside ``check``, what is left of its own)."""
    path = str(path)
    try:
        ex = _find_exercise(ns, path, exercise, source)
    except ValueError as exc:
        return _error(path, None, str(exc))
    fn = ns.get(ex.function)
    if not callable(fn):
        return _error(path, ex, f"{path} defines no function {ex.function}()")
    fw = framework(fn)
    user = _Learner(fn, fw, ex)

    # one call on a small T ≠ d_k input: its shape (a crash here may still be a known fault)
    args, ints, want = _shape_probe(ex)
    raised = None
    try:
        with np.errstate(all="ignore"):
            got = user(*args, ints=ints)
    except MemoryError:  # not the learner's mistake to grade: the runner reports it
        raise
    except NotImplementedError:
        return _error(
            path,
            ex,
            f"{ex.function}() is not written yet (it raises "
            "NotImplementedError): fill it in, then check again",
            fw,
        )
    except Exception as exc:
        raised = f"{ex.function}() raised {type(exc).__name__}: {exc}"
    if raised is None and got.shape != tuple(want):
        msg = (
            f"{ex.function}() returned shape {'×'.join(map(str, got.shape)) or 'a scalar'} "
            f"for T = 5, d_k = 3, d_v = 2; expected {'×'.join(map(str, want))}"
        )
        return _wrong_shape(path, ex, msg, fw)

    try:
        d = diagnose(_composite(ex, user), timeout=timeout)
    except ValueError as exc:
        return _error(path, ex, f"diagnose: {exc}", fw)
    dd = d.to_dict()
    if d.not_run:
        return Grade(path, ex.name, "error", raised or d.message, fw, diagnosis=dd)
    if raised is not None and d.status != "fault":
        return _wrong_shape(path, ex, f"{raised} (on T = 5, d_k = 3, d_v = 2)", fw, dd)
    if d.ok:
        return Grade(
            path,
            ex.name,
            "right",
            "every stage matches the reference on every probe",
            fw,
            stages=_stages(ex, None, True),
            diagnosis=dd,
        )
    first, *rest = d.findings or [None]
    stage = _exercise_stage(ex, d.stage)
    known = d.status == "fault"
    hint = _hint(first.fault if first is not None else None, stage) if known else None
    msg = (
        f"stage {stage} is wrong: {d.message}"
        if known
        else f"stage {stage} looks wrong: the output matches neither the reference nor any "
        f"catalogued mistake ({d.message})"
    )
    location = d.location if _in_file(d.location, path) else None
    pattern = _mask_picture(user) if stage == "M" and ex.name == "mask" else _read_picture(d)
    cells = [c for row in (pattern or {}).get("measured", []) for c in row]
    if ex.name == "mask" and "?" in cells and "-∞" not in cells:
        hint = _FINITE_FILL  # measured in their M: only finite fills, whatever diagnose matched
    hint = hint or _STAGE_HINTS.get(stage, _STAGE_HINTS["shape"])
    also = [  # every further fault diagnose measured, at the exercise's stage, with its lesson
        {
            "stage": _exercise_stage(ex, f.stage),
            "fault": f.fault,
            "message": f.text,
            "hint": _hint(f.fault, _exercise_stage(ex, f.stage)),
        }
        for f in rest
    ]
    return Grade(
        path,
        ex.name,
        "wrong",
        msg,
        fw,
        stage,
        d.fault if known else None,
        hint,
        _stages(ex, stage, known),
        location,
        pattern,
        dd,
        also,
    )


def _exercise_stage(ex: Exercise, stage: str | None) -> str:
    """The exercise's stage a diagnosed stage falls in."""
    if stage in ex.stages:
        return stage
    if len(ex.stages) == 1:  # the rest of the pipeline is the library's: the learner's stage
        return ex.stages[0]
    if stage in ("H", "O"):
        return ex.stages[-1]
    return stage or ex.stages[0]  # e.g. "heads": a row of its own


def _hint(fault: str | None, stage: str) -> str:
    """The catalogue's lesson for a fault, else the stage's own hint."""
    return HINTS.get(fault) or _STAGE_HINTS.get(stage, _STAGE_HINTS["shape"])


def grade_function(fn, exercise: str | None = None) -> Grade:
    """Grade a function defined in this process (a notebook cell), with no timeout:
    ``grade_function(attention)``; the exercise is the function's name unless given."""
    name = exercise or getattr(fn, "__name__", "")
    if name not in EXERCISES or not callable(fn):
        raise ValueError(
            f"learn: cannot tell which exercise {fn!r} is; name it "
            f"(exercise=...) as one of {list(EXERCISES)}"
        )
    code = getattr(fn, "__code__", None)
    where = code.co_filename if code is not None else "<function>"
    return grade_namespace({EXERCISES[name].function: fn}, where, name)


def grade_file(path: str | Path, exercise: str | None = None, timeout: float = 60.0) -> Grade:
    """Load ``path`` (EXECUTES it) and grade it, in this process."""
    try:
        source = read_source(path)
    except ValueError as exc:
        return _error(path, None, str(exc))
    return _grade_source(str(path), source, exercise, timeout)


def _grade_source(path: str, source: bytes, exercise: str | None, timeout: float) -> Grade:
    try:
        ns = exec_source(path, source, "__learner__", keep=False)
    except BaseException as exc:  # a syntax error, an import, even sys.exit in the file
        if isinstance(exc, KeyboardInterrupt):
            raise
        return _error(path, None, f"{path} does not run: {type(exc).__name__}: {exc}")
    return grade_namespace(ns, path, exercise, timeout, source=source)


def _grade_job(path: str, source: bytes, exercise: str | None, timeout: float) -> dict:
    """In the worker: the grade, as a dict."""
    return _grade_source(path, source, exercise, timeout).to_dict()


def check(
    path: str | Path,
    exercise: str | None = None,
    timeout: float = 60.0,
    max_memory: int = runner.DEFAULT_MAX_MEMORY,
) -> Grade:
    """Grade ``path`` in the isolation runner (the file is EXECUTED there): stopped after
    ``timeout`` seconds, its memory capped at ``max_memory`` bytes, whatever it starts
    killed at the end; a hang or a crash becomes a grade (status "error"), not ours."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ValueError(f"learn: timeout must be a positive number of seconds, got {timeout!r}")
    if not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"learn: timeout must be a positive number of seconds, got {timeout!r}")
    if isinstance(max_memory, bool) or not isinstance(max_memory, int) or max_memory <= 0:
        raise ValueError(f"learn: max_memory must be a number of bytes > 0, got {max_memory!r}")
    try:
        source = read_source(path)
    except ValueError as exc:
        return _error(path, None, str(exc))
    try:  # compiling runs nothing: a syntax error needs no worker
        compile(source, str(path), "exec")
    except (SyntaxError, ValueError) as exc:
        return _error(path, None, f"{path} does not run: {type(exc).__name__}: {exc}")
    job = partial(_grade_job, str(path), source, exercise, float(timeout))
    out = runner.run(job, timeout=timeout, max_memory=max_memory, what=str(path), fresh=True)
    if isinstance(out, runner.Failure):
        return _error(path, None, out.message)
    return Grade.from_dict(out)
