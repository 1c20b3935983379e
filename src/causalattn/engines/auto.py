"""``engine="auto"``: the engine expected fastest for a call, from its :class:`Features`.

CPU: the native engine (``cpp``) wherever it is built and runs the call (with a backward and
T_k <= ``SDPA_GRAD_T``, SDPA where it runs the call) — it is measured the fastest on every
shape of ``causalattn bench`` (docs/design.md's tables), so no timing table measured on
another machine decides (``causalattn bench shape 1,4,256,64``, paired on 2 cores: cpp 1.44x
SDPA's speed at load 7, 1.6-1.7x with one thread each; past load 10 both engines' 2-thread
calls stall for tens of ms on descheduled threads, cpp more often, which a user's own table
measures). Where it is unavailable (no compiler) the choice between ``tiled`` and ``sdpa``
comes from a table of paired timings measured by ``causalattn bench tune``: the entry of the
same dtype, kind and pass whose (d, T) is nearest on a log scale names the winner. The table
shipped in the
package (``auto_table.json``, with its provenance) is replaced by the user's own,
``auto_table.json`` in platformdirs' user cache directory (on Linux
``$XDG_CACHE_HOME/causalattn``, default ``~/.cache/causalattn``), once
``causalattn bench tune`` has written it; a user's table that measured ``cpp`` decides for
it too. CUDA: the Triton engine's measured ratios (:func:`causalattn.engines.triton.prefers`).

``CAUSALATTN_ENGINE=tiled`` (any engine name) forces what "auto" runs; an explicit
``engine=`` argument always wins over both.

Under torch.compile / torch.export the choice is made at trace time from the Features
(shapes as their example values), a constant: one traced graph runs one engine.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import replace
from pathlib import Path

import platformdirs
import torch

from .._internals.torch import constant_result
from .registry import Features, refusal

ENV = "CAUSALATTN_ENGINE"
PACKAGED = Path(__file__).with_name("auto_table.json")
# up to this T_k a call with a backward runs faster on SDPA than on cpp: cpp's autograd
# wiring costs about 0.2 ms more per call (measured fwd+bwd on 2 cores: T = 8..64 SDPA
# 0.56-0.81x cpp's time, T = 128 even, (4, 12, 128, 64) 1.28x)
SDPA_GRAD_T = 64
PLAIN_KINDS = ("causal", "full", "decode")  # no modifiers, masks or dropout: SDPA's results
FALLBACK = {"cpu": ("cpp", "tiled", "sdpa", "reference"), "cuda": ("triton", "sdpa", "reference")}

_TABLE: dict | None = None


def user_table_path() -> Path:
    """Where ``causalattn bench tune`` writes this machine's table: platformdirs' user cache
    directory for "causalattn" (on Linux ``$XDG_CACHE_HOME/causalattn``, else
    ``~/.cache/causalattn``; on macOS ``~/Library/Caches/causalattn``)."""
    return platformdirs.user_cache_path("causalattn", appauthor=False) / "auto_table.json"


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(data, dict) and isinstance(data.get("entries"), list)
    return data if ok else None


def table(reload: bool = False) -> dict:
    """The table "auto" reads: the user's own if present and readable, else the package's."""
    global _TABLE
    if _TABLE is None or reload:
        user = _read(user_table_path())
        if user is not None:
            user.setdefault("source", str(user_table_path()))
        _TABLE = user or _read(PACKAGED) or {"entries": []}
        _TABLE.setdefault("source", str(PACKAGED))
        _ladder_for.cache_clear()
    return _TABLE


def hint(n) -> int:
    """An int for a possibly symbolic size, without adding a guard."""
    if isinstance(n, int):
        return n
    from torch.fx.experimental.symbolic_shapes import optimization_hint

    return int(optimization_hint(n, fallback=1024))


def _ladder(entries: list[dict], d: int) -> list[tuple[int, str]]:
    """Entries of the head size nearest d (log scale) as [(T_max, winner), ...] by T: each
    measured T wins up to the geometric middle between it and the next one."""
    near = min(abs(math.log2(e["d"]) - math.log2(max(1, d))) for e in entries)
    sel = sorted(
        (e["T"], e["best"])
        for e in entries
        if abs(math.log2(e["d"]) - math.log2(max(1, d))) == near
    )
    out = [(int(math.sqrt(t * t2)), name) for (t, name), (t2, _) in zip(sel, sel[1:])]
    return out + [(2**62, sel[-1][1])]


def table_ladder(f: Features) -> list[tuple[int, str]] | None:
    """The table's winners for these CPU features by T_k, [(T_max, engine), ...] (None when
    it measured nothing like them)."""
    pass_ = "fwd+bwd" if f.grad else "fwd"
    entries = [e for e in table()["entries"] if e.get("device", "cpu") == "cpu"]
    for want_dtype in (f.dtype, "float32"):  # an unmeasured dtype: as fp32
        for want_kind in (f.kind, "causal" if f.kind == "full" else None):
            sel = [
                e
                for e in entries
                if e["dtype"] == want_dtype and e["kind"] == want_kind and e["pass"] == pass_
            ]
            if sel:
                return _ladder(sel, f.d)
    return None


def _measured_cpp() -> bool:
    return any("cpp" in e.get("ms", {}) for e in table()["entries"])


@functools.lru_cache(maxsize=1024)
def _ladder_for(f: Features, eager: bool = True) -> tuple[tuple[int, str], ...]:
    """The engines "auto" runs for these features by T_k: ((T_max, engine), ...); ``eager``
    False (tracing) leaves out the tiny-backward step, a bound that would guard T_k."""
    if f.device == "cuda":
        from . import triton as tr

        if refusal("triton", f):
            return ((2**62, next(n for n in FALLBACK["cuda"] if not refusal(n, f))),)
        if f.lse:
            return ((2**62, "triton"),)
        Ts = [2**i for i in range(21)]  # prefers() by T, as a ladder
        names = ["triton" if tr.prefers(replace(f, T_k=T)) else "sdpa" for T in Ts]
        return tuple(zip(Ts[:-1], names[:-1])) + ((2**62, names[-1]),)
    if f.device != "cpu":  # meta and other devices: any engine computes shapes
        return ((2**62, "tiled"),)
    if not refusal("cpp", f) and not _measured_cpp():
        if eager and f.grad and f.kind in PLAIN_KINDS and not refusal("sdpa", f):
            return ((SDPA_GRAD_T, "sdpa"), (2**62, "cpp"))  # tiny backward: less fixed cost
        return ((2**62, "cpp"),)
    ladder = table_ladder(f) or [(2**62, "tiled")]
    fallback = next((n for n in FALLBACK["cpu"] if not refusal(n, f)), "reference")
    return tuple((t, fallback if refusal(name, f) else name) for t, name in ladder)


def ladder(f: Features) -> tuple[tuple[int, str], ...]:
    """:func:`_ladder_for`, unless ``CAUSALATTN_ENGINE`` forces an engine."""
    forced = os.environ.get(ENV)
    if forced and forced != "auto":
        return ((2**62, forced),)
    return _ladder_for(f, not torch.compiler.is_compiling())


def pick(f: Features) -> str:
    """The engine "auto" runs for a call with features ``f`` (see the module doc)."""
    return next(name for bound, name in ladder(f) if f.T_k is None or f.T_k <= bound)


@constant_result
def ladder_of(values: tuple) -> tuple:
    """:func:`pick` for :func:`~causalattn.engines.registry.feature_values` as T_k ranges,
    ((T_max, engine), ...): a constant while tracing (it reads the environment and files,
    which Dynamo need not see); traced code compares the symbolic T_k with the bounds, so
    a compiled function recompiles only when T_k crosses into another range."""
    return ladder(Features(*values))


@constant_result
def scalar_refusal(causal, window, chunk, softcap) -> str:
    """Pattern's own message for bad scalar keywords ("" when fine): a constant while tracing."""
    try:
        return _cached_scalar_refusal(causal, window, chunk, softcap)
    except TypeError:  # an unhashable argument (a list, ...): Pattern names it
        return _scalar_refusal(causal, window, chunk, softcap)


def _scalar_refusal(causal, window, chunk, softcap) -> str:
    from ..masks import Pattern

    try:
        Pattern(causal=causal, window=window, chunk=chunk, softcap=softcap)
    except ValueError as exc:
        return str(exc)
    return ""


_cached_scalar_refusal = functools.lru_cache(maxsize=256, typed=True)(_scalar_refusal)
