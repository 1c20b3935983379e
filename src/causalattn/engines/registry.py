"""The engines, as objects in one registry, and the frozen record of what a call asks them.

:class:`Features` holds plain values only (device, dtype, head sizes, heads, lengths, which
pattern tensors are present, the scalar keywords, dropout, lse, gradients): hashable, so a
choice made for it is cached, and a constant while tracing. Each :class:`Engine` answers
:meth:`Engine.refusal` for a Features record — "" when it runs such a call, else the reason
— without building a problem or importing a module that cannot run on the device (the
Triton engine is never imported to learn that it does not run on the CPU).

An engine is a module satisfying :mod:`causalattn.engines.contract`; a new one is one entry
in :data:`ENGINES` (and one row in ``tests/engines/test_engine_contract.py``).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import torch

from .._internals.torch import constant_result
from ..masks import CALLABLES, PATTERN_KEYWORDS

# the pattern's tensors, in the operators' argument order (after q, k, v): Pattern's order
SCALARS = ("causal", "window", "chunk", "softcap")
TENSORS = tuple(n for n in PATTERN_KEYWORDS if n not in SCALARS + CALLABLES)
# the pattern tensors that may be learned (gradients flow to them when they require one)
LEARNED = ("sinks", "alibi_slopes", "bias", "rel_bias")
KINDS = ("causal", "full", "padded", "packed", "decode", "masked")


@dataclass(frozen=True)
class Features:
    """What a call asks an engine: plain values only (see the module doc)."""

    device: str  # "cpu", "cuda", "meta", ...
    dtype: str  # "float32", "bfloat16", ...
    d_k: int
    d_v: int
    H_q: int
    H_kv: int
    T_q: int | None  # None while tracing a symbolic length (the choice is then by T ranges)
    T_k: int | None
    present: tuple[str, ...] = ()  # the pattern tensors given (names from TENSORS)
    causal: bool = True
    window: int | None = None
    chunk: int | None = None
    softcap: float | None = None
    dropout: bool = False
    lse: bool = False
    grad: bool = False
    decode: bool = False  # T_q < T_k: the queries are the last positions of the keys
    mask_mod: bool = False  # a user's rule (Pattern.mask_mod)
    score_mod: bool = False  # a user's function of the scores (Pattern.score_mod)
    learned: tuple[str, ...] = ()  # LEARNED tensors that require a gradient ("captured":
    # tensors a score_mod reads)
    score_mod_why: str = ""  # why the score_mod has no traced program ("" when it has one,
    # causalattn.engines.score_program): the native kernels run only a traced one

    @property
    def kind(self) -> str:
        """The mask kind, one of :data:`KINDS`: what the timing tables are indexed by."""
        p = set(self.present)
        if p - {"lengths", "key_padding_mask", "cu_seqlens"} or self.dropout:
            return "masked"
        if self.mask_mod or self.score_mod:
            return "masked"
        if self.window is not None or self.chunk is not None or self.softcap is not None:
            return "masked"
        if "cu_seqlens" in p:
            return "packed"
        if p:
            return "padded"
        if self.decode:
            return "decode"
        return "causal" if self.causal else "full"

    @property
    def d(self) -> int:
        return max(self.d_k, self.d_v)


@dataclass(frozen=True)
class Engine:
    """One engine: its name, its module, the devices it runs on and what it computes.

    ``raw``: it has raw passes (``fwd``/``bwd``/``sinks_grad``, :class:`contract.BlockKernels`)
    and runs inside the operators without autograd; the others run under autograd there.
    ``lse``: it returns the log-sum-exp. The module's own ``refusal(features) -> str`` says
    what else it cannot run (dtypes, head sizes, modifiers), once the device fits."""

    name: str
    module: str
    devices: tuple[str, ...]  # device types; "*" for any
    raw: bool = False
    lse: bool = True

    def load(self):
        """The engine's module; ValueError naming it when it cannot be imported here."""
        try:
            return importlib.import_module(self.module)
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ValueError(
                f"attention: engine {self.name!r} is not available here ({exc})"
            ) from exc

    def refusal(self, f: Features) -> str:
        """Why this engine does not run a call with features ``f`` ("" when it does)."""
        return _refusal(self.name, f)


ENGINES: dict[str, Engine] = {
    e.name: e
    for e in (
        Engine("reference", "causalattn.engines.exact", ("*",)),  # float64, every pattern
        Engine("sdpa", "causalattn.engines.sdpa", ("*",), lse=False),
        Engine("tiled", "causalattn.engines.tiled", ("cpu",), raw=True),
        Engine("cpp", "causalattn.engines.cpp", ("cpu",), raw=True),
        Engine("triton", "causalattn.engines.triton", ("cuda", "cpu"), raw=True),
    )
}


def engine(name: str) -> Engine:
    """The registry's entry; ValueError listing the names for an unknown one."""
    e = ENGINES.get(name)
    if e is None:
        raise ValueError(f"attention: unknown engine {name!r}; choose from {['auto', *ENGINES]}")
    return e


@functools.lru_cache(maxsize=1024)
def _refusal(name: str, f: Features) -> str:
    e = ENGINES[name]
    if "*" not in e.devices and f.device not in e.devices and f.device != "meta":
        return f"engine {name!r}: runs on {' or '.join(e.devices)} tensors, not {f.device}"
    if f.lse and not e.lse:
        return (
            f"engine {name!r}: return_lse: it does not return the log-sum-exp; use 'cpp' or 'tiled'"
        )
    try:
        mod = e.load()
    except ValueError as exc:
        return str(exc)
    fn = getattr(mod, "refusal", None)
    return fn(f) if fn is not None else ""


@constant_result
def refusal(name: str, f: Features) -> str:
    """Why engine ``name`` does not run a call with features ``f`` ("" when it does): a
    constant while tracing. Unknown names raise."""
    engine(name)
    return _refusal(name, f)


def feature_values(
    q,
    k,
    v,
    *,
    tensors: dict,
    causal=True,
    window=None,
    chunk=None,
    softcap=None,
    dropout_p=0.0,
    lse=False,
    grad=False,
    mask_mod=None,
    score_mod=None,
    captured=(),
) -> tuple:
    """The fields of a call's :class:`Features`, as a tuple of plain values: what traced code
    hands to the constant functions that choose. While tracing, a symbolic length is None
    (the choice then comes as T ranges, :func:`causalattn.engines.auto.ladder_of`); head
    sizes and counts are specialized."""
    tracing = torch.compiler.is_compiling()

    def size(n, exact: bool):
        # int() of a traced size specializes it (a guard on that size); lengths are left out
        return int(n) if exact or not tracing else None

    T_q, T_k = q.shape[2], k.shape[2]
    decode = True if T_q < T_k else False  # noqa: SIM210 - an `if` on a traced size is a guard
    return (
        q.device.type,
        str(q.dtype).replace("torch.", ""),
        size(q.shape[-1], True),
        size(v.shape[-1], True),
        size(q.shape[1], True),
        size(k.shape[1], True),
        size(T_q, False),
        size(T_k, False),
        tuple(n for n in TENSORS if tensors.get(n) is not None),
        bool(causal),
        window,
        chunk,
        None if softcap is None else float(softcap),
        bool(dropout_p),
        bool(lse),
        bool(grad),
        decode,
        mask_mod is not None,
        score_mod is not None,
        _learned(tensors, captured) if grad else (),
        _program_why(score_mod, tracing),
    )


def _program_why(score_mod, tracing: bool) -> str:
    """Why ``score_mod`` has no program the native kernels run ("" when it has, or none)."""
    if score_mod is None:
        return ""
    if tracing:  # inside torch.compile the function is not traced again: the tiled engine
        return "a score_mod under torch.compile"
    from .score_program import refused

    return refused(score_mod)


def _learned(tensors: dict, captured) -> tuple[str, ...]:
    """The LEARNED tensors that require a gradient, and "captured" for a score_mod's."""
    out = tuple(
        n for n in LEARNED if isinstance(tensors.get(n), torch.Tensor) and tensors[n].requires_grad
    )
    return out + (("captured",) if captured else ())


def features(q, k, v, **kw) -> Features:
    """The Features of a call (eager code; traced code keeps :func:`feature_values`)."""
    return Features(*feature_values(q, k, v, **kw))


@constant_result
def refusal_of(name: str, values: tuple) -> str:
    """:func:`refusal` for :func:`feature_values`: a constant while tracing."""
    return refusal(name, Features(*values))


def of_problem(p, return_lse: bool = False, grad: bool | None = None) -> Features:
    """The Features of a built :class:`~causalattn.engines.problem.Problem`."""
    pt = p.pattern
    if grad is None:
        grad = torch.is_grad_enabled() and (
            bool(captured_of(pt.score_mod))
            or any(
                isinstance(t, torch.Tensor) and t.requires_grad
                for t in (p.q, p.k, p.v, *(getattr(pt, n) for n in LEARNED))
            )
        )
    captured = captured_of(pt.score_mod) if grad else ()
    return features(
        p.q,
        p.k,
        p.v,
        tensors={n: getattr(pt, n) for n in TENSORS},
        causal=pt.causal,
        window=pt.window,
        chunk=pt.chunk,
        softcap=pt.softcap,
        dropout_p=p.dropout_p,
        lse=return_lse,
        grad=grad,
        mask_mod=pt.mask_mod,
        score_mod=pt.score_mod,
        captured=captured,
    )


def captured_of(score_mod) -> list:
    """The tensors a score_mod reads that require a gradient (none without one)."""
    if score_mod is None:
        return []
    from ..masks_mod import captured_tensors

    return captured_tensors(score_mod)
