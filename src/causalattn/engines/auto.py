"""``engine="auto"``: the engine measured fastest for a problem like this one.

A problem is described by its features: device, dtype, head size d = max(d_k, d_v), mask
kind (:func:`kind`), T_k, whether gradients are needed and whether the log-sum-exp is
asked for. On the CPU the choice comes from a table of paired timings (tiled against
SDPA) measured by ``causalattn bench --tune``: the entry of the same device, dtype, kind
and pass whose (d, T) is nearest on a log scale names the winner. The table shipped in
the package (``auto_table.json``, with its provenance) is replaced by the user's own,
``$XDG_CACHE_HOME/causalattn/auto_table.json`` (default ``~/.cache/causalattn``), once
``causalattn bench --tune`` has written it. On CUDA the Triton engine's measured ratios
decide (:func:`causalattn.engines.triton.prefers`).

``CAUSALATTN_ENGINE=tiled`` (any engine name) forces what "auto" runs; an explicit
``engine=`` argument always wins over both.

Under torch.compile / torch.export the choice is made at trace time from shapes only;
a symbolic T contributes its example value (no guard), so one traced graph runs one engine.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

import torch

from .problem import constant_result

ENV = "CAUSALATTN_ENGINE"
PACKAGED = Path(__file__).with_name("auto_table.json")
KINDS = ("causal", "full", "padded", "packed", "decode", "masked")

_TABLE: dict | None = None


def user_table_path() -> Path:
    """Where ``causalattn bench --tune`` writes this machine's table (platformdirs' rule)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "causalattn" / "auto_table.json"


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
    return _TABLE


def kind(*, causal: bool, T_q: int, T_k: int, padded: bool, packed: bool, masked: bool) -> str:
    """The mask kind of a problem, one of :data:`KINDS`."""
    if masked:
        return "masked"
    if packed:
        return "packed"
    if padded:
        return "padded"
    if T_q < T_k:
        return "decode"
    return "causal" if causal else "full"


def _hint(n) -> int:
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


def cpu_ladder(dtype: str, kind_: str, d: int, grad: bool) -> list[tuple[int, str]]:
    """The table's winners for these CPU features by T (["tiled"] when nothing was measured)."""
    pass_ = "fwd+bwd" if grad else "fwd"
    entries = [e for e in table()["entries"] if e.get("device", "cpu") == "cpu"]
    for want_dtype in (dtype, "float32"):  # an unmeasured dtype: as fp32
        for want_kind in (kind_, "causal" if kind_ == "full" else None):
            sel = [
                e
                for e in entries
                if e["dtype"] == want_dtype and e["kind"] == want_kind and e["pass"] == pass_
            ]
            if sel:
                return _ladder(sel, d)
    return [(2**62, "tiled")]


def choose_cpu(dtype: str, kind_: str, d: int, T: int, grad: bool) -> str:
    """The table's winner for these CPU features at T_k = T."""
    return next(name for bound, name in cpu_ladder(dtype, kind_, d, grad) if T <= bound)


def pick(q, k, v, *, kind_: str, grad: bool, ask: dict, no_lse=("sdpa",)) -> str:
    """The engine "auto" runs for q, k, v with these features (see the module doc);
    ``ask``: the plain features :func:`refusal` takes.

    T_k may be symbolic: torch.export (non-strict) reads its example value, which adds no
    guard; under Dynamo the comparisons with the table's T boundaries become guards, so a
    compiled function recompiles only when T crosses into another measured range.
    """
    d = max(q.shape[-1], v.shape[-1])
    T = k.shape[2]
    if not torch.compiler.is_dynamo_compiling():
        d, T = _hint(d), _hint(T)
    ladder = choose(str(q.device), int(d), kind_, grad, tuple(no_lse), **ask)
    for bound, name in ladder[:-1]:
        if T <= bound:
            return name
    return ladder[-1][1]


FEATURES = (
    "dtype",
    "d_k",
    "d_v",
    "H_q",
    "H_kv",
    "present",
    "causal",
    "window",
    "chunk",
    "softcap",
    "dropout_p",
    "lse",
)


@constant_result
def choose(device: str, d: int, kind_: str, grad: bool, no_lse: tuple, **ask) -> list:
    """[(T_max, engine), ...] for plain features: a constant while tracing (it reads the
    environment and files, which Dynamo need not see)."""
    forced = os.environ.get(ENV)
    if forced and forced != "auto":
        return [(2**62, forced)]
    return _choose(device, d, kind_, grad, no_lse, tuple(ask[n] for n in FEATURES), id(table()))


@functools.lru_cache(maxsize=256)
def _choose(device, d, kind_, grad, no_lse, feats, _table_id) -> list:
    ask = dict(zip(FEATURES, feats))
    lse = ask["lse"]
    dev = torch.device(device)
    if dev.type == "cuda":
        try:
            from . import triton as tr
        except ImportError:  # pragma: no cover
            tr = None
        if tr is None or not tr.available() or _refusal(device, "triton", feats):
            return [(2**62, "reference" if lse else "sdpa")]
        if lse:
            return [(2**62, "triton")]
        Ts = [2**i for i in range(0, 21)]  # prefers() by T, as a ladder
        names = ["triton" if tr.prefers(_dummy(device, feats, T)) else "sdpa" for T in Ts]
        return [(T, n) for T, n in zip(Ts[:-1], names[:-1])] + [(2**62, names[-1])]
    if dev.type != "cpu":  # meta and other devices: any engine computes shapes
        return [(2**62, "tiled")]
    ladder = cpu_ladder(ask["dtype"], kind_, d, grad)
    return [(t, "tiled" if lse and name in no_lse else name) for t, name in ladder]


_DUMMY = {  # one readable cell (B = T = 1) for each pattern tensor: presence is what counts
    "lengths": lambda H: [1],
    "key_padding_mask": lambda H: [[True]],
    "cu_seqlens": lambda H: [0, 1],
    "prefix_lengths": lambda H: [1],
    "mask": lambda H: [[True]],
    "alibi_slopes": lambda H: [0.0] * H,
    "sinks": lambda H: [0.0] * H,
}


def _dummy(device: str, feats: tuple, T: int = 1):
    """A Problem with these features: q, v on ``device`` (one row), k (T_k = T) on meta;
    the pattern with the same fields present. None when the keywords contradict."""
    import numpy as np

    from ..masks import Pattern
    from .problem import Problem

    a = dict(zip(FEATURES, feats))
    dt = getattr(torch, a["dtype"])
    q = torch.empty(1, a["H_q"], 1, a["d_k"], dtype=dt, device=device)
    k = torch.empty(1, a["H_kv"], T, a["d_k"], dtype=dt, device="meta")
    v = torch.empty(1, a["H_kv"], 1, a["d_v"], dtype=dt, device=device)
    try:
        pat = Pattern(
            causal=a["causal"],
            window=a["window"],
            chunk=a["chunk"],
            softcap=a["softcap"],
            **{n: np.asarray(_DUMMY[n](a["H_q"])) for n in a["present"]},
        )
    except ValueError:
        return None
    seed = (0, 0) if a["dropout_p"] else None
    return Problem(q, k, v, 1.0, pat, a["dropout_p"], seed)


@functools.lru_cache(maxsize=256)
def _refusal(device: str, name: str, feats: tuple) -> str:
    from .ops import refusal as _engine_refusal

    p = _dummy(device, feats)
    if p is None:
        return ""  # contradictory keywords: the operator names them
    return _engine_refusal(name, p, dict(zip(FEATURES, feats))["lse"])


@constant_result
def refusal(name: str, device: str, **ask) -> str:
    """Why engine ``name`` does not run a problem with these features ("" when it does):
    its ``supports()`` asked about a one-row problem with the same pattern fields present
    (a constant while tracing; the real problem is checked again inside the operator)."""
    return _refusal(device, name, tuple(ask[n] for n in FEATURES))


@constant_result
def scalar_refusal(causal, window, chunk, softcap) -> str:
    """Pattern's own message for bad scalar keywords ("" when fine): a constant while tracing."""
    from ..masks import Pattern

    try:
        Pattern(causal=causal, window=window, chunk=chunk, softcap=softcap)
    except ValueError as exc:
        return str(exc)
    return ""
