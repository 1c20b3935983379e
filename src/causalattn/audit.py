"""The in-order audit: check an attention computation stage by stage, as the seed says.

    projections -> scores (shape, 1/√d_k) -> mask -> softmax row sums -> forbidden zeros
    -> finite rows -> H = A V -> Σ_j C[i, j] = H_i -> O = H W_O

``audit(trace | mapping | path)`` returns a :class:`Report`: every check in dependency
order, the first failing stage with its evidence (which sequence/head, rows, columns, how
far off) and a plain-English hint. Missing stages are recomputed from the ones present
when possible (Q from X and W_Q, S from Q and K, A from S and the mask ...), and the
report says which. Rows with no readable key are listed in ``report.empty_rows``, not
failed (their weights and output must be zero, never NaN).

Arrays are ``(..., T, d)`` with any leading batch/head axes, like a :class:`Trace`.
Names in a mapping or file are matched case-insensitively against aliases (see
:data:`ALIASES`); TransformerLens hook names (``blocks.0.attn.hook_q`` ...) are read in
their ``(batch, pos, head, d)`` layout and moved to ours, ``(batch, head, pos, d)``.
Choices where names are ambiguous:

* ``Z`` (upper case, as :meth:`Trace.save` writes it) is our Z = S + M; lower-case
  ``z`` / ``hook_z`` is TransformerLens's per-head output, i.e. our H.
* ``hook_attn_scores`` is Z (TransformerLens masks before that hook); ``scores`` /
  ``attn_scores`` are S (if they carry -inf above the diagonal they are read as Z).
* ``out`` / ``output`` is O when W_O is given, else H. ``hook_result`` (per-head
  outputs after W_O) is summed over heads into O.
* ``mask`` / ``allowed`` / ``attention_mask``: boolean or 0/1 integers mean True = may
  read; floating point means the additive M (0 / -inf or a large negative fill).
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import masks as _masks
from .reference import softmax_last, weighted_values
from .trace import Trace

__all__ = ["audit", "Report", "Check", "AuditInputError", "load_arrays", "ALIASES", "STAGE_ORDER"]

STAGE_ORDER = ("X", "Q", "K", "V", "S", "M", "A", "H", "C", "O")
DEFAULT_MAX_BYTES = 2 * 2**30
BLOCKED_BELOW = -1e4  # an additive M entry at or below this (or -inf) blocks the key
_MAX_LIST = 8  # rows/cols shown as evidence


class AuditInputError(ValueError):
    """The input cannot be audited (unreadable file, wrong ranks, non-numeric data ...)."""


# alias (lower case) -> stage name. TransformerLens names are listed with their hook_ prefix.
ALIASES: dict[str, str] = {
    **{a: "X" for a in ("x", "input", "inputs", "hidden_states", "embeddings")},
    **{a: "W_q" for a in ("w_q", "wq", "w_query", "q_weight")},
    **{a: "W_k" for a in ("w_k", "wk", "w_key", "k_weight")},
    **{a: "W_v" for a in ("w_v", "wv", "w_value", "v_weight")},
    **{a: "W_o" for a in ("w_o", "wo", "w_out", "o_weight")},
    **{a: "Q" for a in ("q", "query", "queries", "hook_q")},
    **{a: "K" for a in ("k", "key", "keys", "hook_k")},
    **{a: "V" for a in ("v", "value", "values", "hook_v")},
    **{a: "S" for a in ("s", "scores", "attn_scores", "scaled_scores")},
    **{a: "Z" for a in ("hook_attn_scores", "masked_scores", "logits")},
    **{a: "M" for a in ("m", "additive_mask", "attn_bias", "bias_mask")},
    **{a: "A" for a in ("a", "weights", "attn_weights", "pattern", "probs", "attn",
                        "attention", "attn_probs", "hook_pattern")},
    **{a: "H" for a in ("h", "z", "hook_z", "heads")},
    **{a: "C" for a in ("c", "contributions")},
    **{a: "O" for a in ("o", "attn_out", "hook_attn_out", "hook_result")},
    **{a: "out?" for a in ("out", "output")},
    **{a: "allowed" for a in ("allowed", "mask", "attention_mask", "attn_mask", "causal_mask")},
    "lengths": "lengths",
    "key_padding_mask": "key_padding_mask",
    "scale": "scale",
    "n_heads": "n_heads",
}
_TL_POS_HEAD = {"hook_q", "hook_k", "hook_v", "hook_z", "hook_result"}  # (batch, pos, head, d)
_META = {"allowed", "lengths", "key_padding_mask", "scale", "n_heads"}


# -- the report --------------------------------------------------------------------------
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


# -- reading inputs ----------------------------------------------------------------------
def _npy_header(fh) -> tuple[tuple[int, ...], np.dtype]:
    version = np.lib.format.read_magic(fh)
    if version == (1, 0):
        shape, _, dtype = np.lib.format.read_array_header_1_0(fh)
    else:
        shape, _, dtype = np.lib.format.read_array_header_2_0(fh)
    return shape, dtype


def _check_size(name: str, shape, dtype, max_bytes: int) -> None:
    if np.dtype(dtype).hasobject:
        raise AuditInputError(f"{name}: holds Python objects (a pickle); only numeric arrays "
                              "are read (allow_pickle=False)")
    n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if n > max_bytes:
        raise AuditInputError(f"{name}: {shape} {np.dtype(dtype)} is {n / 2**30:.2f} GiB, above "
                              f"the limit of {max_bytes / 2**30:.2f} GiB (raise it with max_bytes)")


def load_arrays(path: str | Path, *, max_bytes: int = DEFAULT_MAX_BYTES) -> dict[str, np.ndarray]:
    """Named arrays from a .npz, a .npy, a folder of .npy files or a .safetensors file.

    Nothing is executed (``allow_pickle=False``); arrays above ``max_bytes`` are refused
    before they are read.
    """
    p = Path(path)
    if not p.exists():
        raise AuditInputError(f"{p}: no such file or folder")
    try:
        if p.is_dir():
            files = sorted(p.glob("*.npy"))
            if not files:
                raise AuditInputError(f"{p}: folder holds no .npy files")
            out = {}
            for f in files:
                with open(f, "rb") as fh:
                    _check_size(f.name, *_npy_header(fh), max_bytes)
                out[f.stem] = np.load(f, allow_pickle=False)
            return out
        suffix = p.suffix.lower()
        if suffix == ".npy":
            with open(p, "rb") as fh:
                _check_size(p.name, *_npy_header(fh), max_bytes)
            return {p.stem: np.load(p, allow_pickle=False)}
        if suffix == ".safetensors":
            return _load_safetensors(p, max_bytes)
        with zipfile.ZipFile(p) as zf:
            for info in zf.infolist():
                if info.filename.endswith(".npy"):
                    with zf.open(info) as fh:
                        _check_size(info.filename[:-4], *_npy_header(fh), max_bytes)
        with np.load(p, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    except AuditInputError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as exc:
        raise AuditInputError(f"{p}: cannot be read as named arrays ({type(exc).__name__}: {exc})"
                              ) from None


def _load_safetensors(p: Path, max_bytes: int) -> dict[str, np.ndarray]:
    try:
        from safetensors.numpy import load_file
    except ImportError:
        raise AuditInputError(f"{p}: reading .safetensors needs the 'safetensors' package "
                              "(pip install 'causalattn[hf]')") from None
    with open(p, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        if n <= 0 or n > 100 * 2**20:
            raise AuditInputError(f"{p}: not a .safetensors file (header length {n})")
        header = json.loads(fh.read(n))
    for name, info in header.items():
        if name != "__metadata__":
            lo, hi = info["data_offsets"]
            if hi - lo > max_bytes:
                raise AuditInputError(f"{name}: {hi - lo} bytes is above the limit of {max_bytes}")
    try:
        return load_file(str(p))
    except Exception as exc:  # dtypes NumPy lacks (bf16), corrupt data
        raise AuditInputError(f"{p}: cannot be read ({exc})") from None


def _canon(key: str) -> tuple[str, str, str | None]:
    """key -> (stage or meta name, base alias, layer prefix)."""
    if key in ("Z",):
        return "Z", "Z", None
    if key in ("W_q", "W_k", "W_v", "W_o", "X", "Q", "K", "V", "S", "M", "A", "H", "C", "O"):
        return key, key.lower(), None
    parts = key.split(".")
    base = parts[-1].lower()
    prefix = ".".join(parts[:-1]) or None
    if base in ALIASES:
        return ALIASES[base], base, prefix
    return "", base, prefix


def _to_numpy(name: str, a) -> np.ndarray:
    if type(a).__module__.startswith("torch"):
        a = a.detach().cpu()
        if str(a.dtype) == "torch.bfloat16":
            a = a.float()
        a = a.numpy()
    try:
        arr = np.asarray(a)
    except Exception as exc:
        raise AuditInputError(f"{name}: not an array ({exc})") from None
    if arr.dtype.hasobject or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
        raise AuditInputError(f"{name}: must be a numeric array, got dtype {arr.dtype}")
    if np.issubdtype(arr.dtype, np.complexfloating):
        raise AuditInputError(f"{name}: complex values cannot be attention stages")
    return arr


@dataclass
class _Inputs:
    arrays: dict[str, np.ndarray]  # float64, our layouts
    eps: dict[str, float]  # each stage's source precision
    allowed: np.ndarray | None = None
    lengths: np.ndarray | None = None
    key_padding: np.ndarray | None = None
    scale: float | None = None
    n_heads: int | None = None
    notes: list[str] = field(default_factory=list)


def _eps(dtype: np.dtype) -> float:
    return float(np.finfo(dtype).eps) if np.issubdtype(dtype, np.floating) else 0.0


def _from_mapping(data: Mapping[str, Any]) -> _Inputs:
    raw: dict[str, tuple[np.ndarray, str]] = {}
    notes: list[str] = []
    ignored = []
    layers = {_canon(str(k))[2] for k in data if _canon(str(k))[0] not in ("", *_META)}
    if len(layers - {None}) > 1:
        raise AuditInputError(f"arrays from several layers ({', '.join(sorted(layers - {None}))}); "
                              "audit one layer at a time")
    for key, val in data.items():
        stage, base, prefix = _canon(str(key))
        if not stage:
            ignored.append(str(key))
            continue
        if stage in raw:
            raise AuditInputError(f"{key}: names the same stage ({stage}) as another entry")
        raw[stage] = (_to_numpy(str(key), val), base)
    if ignored:
        notes.append(f"ignored entries: {', '.join(sorted(ignored))}")

    inp = _Inputs(arrays={}, eps={}, notes=notes)
    if "scale" in raw:
        inp.scale = float(np.asarray(raw.pop("scale")[0]).reshape(-1)[0])
    if "n_heads" in raw:
        inp.n_heads = int(np.asarray(raw.pop("n_heads")[0]).reshape(-1)[0])
    if "lengths" in raw:
        inp.lengths = raw.pop("lengths")[0].astype(np.int64)
    if "key_padding_mask" in raw:
        inp.key_padding = raw.pop("key_padding_mask")[0].astype(bool)
    if "allowed" in raw:
        m, _ = raw.pop("allowed")
        if m.dtype == np.bool_ or (np.issubdtype(m.dtype, np.integer) and np.isin(m, (0, 1)).all()):
            inp.allowed = m.astype(bool)
        elif "M" not in raw:
            raw["M"] = (m, "mask")
        else:
            raise AuditInputError("mask: a floating mask is the additive M, but M is also given")
    if "out?" in raw:
        a, base = raw.pop("out?")
        target = "O" if "W_o" in raw else "H"
        if target in raw:
            target = "O" if target == "H" else "H"
        raw[target] = (a, base)
        notes.append(f"'{base}' read as {target} ({'W_O is given' if target == 'O' else 'no W_O'})")

    for stage, (a, base) in raw.items():
        if a.size == 0:
            raise AuditInputError(f"{stage}: '{base}' is empty, shape {a.shape}")
        a64 = a.astype(np.float64)
        if stage.startswith("W_"):
            if a64.ndim == 3:  # TransformerLens (h, d_model, d_head) / W_O (h, d_head, d_model)
                a64 = (a64.reshape(-1, a64.shape[-1]) if stage == "W_o"
                       else np.moveaxis(a64, 0, 1).reshape(a64.shape[1], -1))
                if inp.n_heads is None:
                    inp.n_heads = a.shape[0]
            elif a64.ndim != 2:
                raise AuditInputError(f"{stage}: weights must be 2-D (d_model×d_k), got {a.shape}")
        else:
            need = 3 if stage == "C" else 2
            if a64.ndim < need:
                raise AuditInputError(f"{stage}: needs at least {need} axes (T×d), got {a.shape}")
            if base in _TL_POS_HEAD and a64.ndim == 4:
                a64 = np.moveaxis(a64, -2, -3)  # (batch, pos, head, d) -> (batch, head, pos, d)
                if base == "hook_result":
                    a64 = a64.sum(axis=-3)
                    notes.append("hook_result summed over heads into O")
        if np.isnan(a64).all():
            raise AuditInputError(f"{stage}: every value is NaN; nothing to audit")
        inp.arrays[stage] = a64
        inp.eps[stage] = _eps(a.dtype)
    if not any(s in inp.arrays for s in STAGE_ORDER + ("Z",)) or set(inp.arrays) <= {
        "W_q", "W_k", "W_v", "W_o"
    }:
        raise AuditInputError(
            "no attention stages found; give any of X, Q, K, V, S, M, A, H, O (aliases: "
            "scores, weights/pattern/probs, out/z/output, TransformerLens hook names)")
    return inp


def _from_trace(tr: Trace) -> _Inputs:
    inp = _from_mapping({n: tr[n] for n in tr.names})
    inp.allowed = tr.allowed
    inp.scale = tr.scale
    inp.n_heads = tr.n_heads
    return inp


# -- numerics helpers --------------------------------------------------------------------
def _rtol(*eps: float) -> float:
    return float(min(0.03, max(1e-9, 100 * max(eps, default=0.0))))


def _diff(got: np.ndarray, want: np.ndarray, where: np.ndarray | None = None):
    """(max abs error, magnitude, error map) over ``where``; NaN on either side counts."""
    with np.errstate(invalid="ignore"):
        err = np.abs(got - want)
    bad_nan = np.isnan(got) != np.isnan(want)
    err = np.where(np.isnan(err), np.where(bad_nan, np.inf, 0.0), err)
    if where is not None:
        err = np.where(where, err, 0.0)
    mag = np.abs(np.where(np.isfinite(want), want, 0.0)).max() if want.size else 0.0
    return float(err.max()) if err.size else 0.0, max(1.0, float(mag)), err


def _close(got, want, tol_rel, where=None) -> tuple[bool, float, np.ndarray]:
    e, mag, err = _diff(got, want, where)
    return e <= tol_rel * mag, e, err > tol_rel * mag


def _locate(bad: np.ndarray, lead_ndim: int, with_cols: bool = True) -> dict:
    """Evidence for a boolean map of failures (..., rows[, cols])."""
    idx = np.argwhere(bad)
    if not idx.size:
        return {}
    first = tuple(int(i) for i in idx[0][:lead_ndim])
    sel = idx[(idx[:, :lead_ndim] == first).all(axis=1)] if lead_ndim else idx
    ev: dict = {}
    if lead_ndim:
        ev["index"] = first
        n_slices = len({tuple(r[:lead_ndim]) for r in idx.tolist()})
        if n_slices > 1:
            ev["slices_failing"] = n_slices
    ev["rows"] = sorted({int(r) for r in sel[:, lead_ndim]})[:_MAX_LIST]
    if with_cols and sel.shape[1] > lead_ndim + 1:
        ev["cols"] = sorted({int(c) for c in sel[:, lead_ndim + 1]})[:_MAX_LIST]
    return ev


def _split_heads(Y: np.ndarray, h: int | None) -> np.ndarray:
    if h is None:
        return Y
    *lead, T, hd = Y.shape
    return np.moveaxis(Y.reshape(*lead, T, h, hd // h), -2, -3)


def _merge_heads(Y: np.ndarray) -> np.ndarray:
    """(..., h, T, d) -> (..., T, h·d)."""
    return np.moveaxis(Y, -3, -2).reshape(*Y.shape[:-3], Y.shape[-2], -1)


def _mask_from_additive(M: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(allowed, entries that are neither 0 nor blocked)."""
    blocked = np.isneginf(M) | (M <= BLOCKED_BELOW)
    allowed = M == 0
    return allowed, ~(blocked | allowed)


def _looks_masked(S: np.ndarray) -> bool:
    """True when S already carries a mask (-inf or a large negative fill above the diagonal)."""
    T_q, T_k = S.shape[-2:]
    fut = ~_masks.causal(T_q, T_k) if T_q <= T_k else np.zeros((T_q, T_k), bool)
    return bool(fut.any()) and bool(
        (np.isneginf(S) | (S <= BLOCKED_BELOW))[..., fut].all())


# -- the audit ---------------------------------------------------------------------------
class _Auditor:
    def __init__(self, inp: _Inputs):
        self.inp = inp
        self.a = dict(inp.arrays)
        self.eps = dict(inp.eps)
        self.given = [s for s in ("X", "W_q", "W_k", "W_v", "Q", "K", "V", "S", "M", "Z", "A",
                                  "H", "C", "W_o", "O") if s in self.a]
        self.recomputed: list[str] = []
        self.checks: list[Check] = []
        self.empty_rows: list[dict] = []
        self.notes = list(inp.notes)
        self.h = inp.n_heads
        self.R: np.ndarray | None = None  # allowed, broadcast to (..., T_q, T_k)
        self._pending = None

    def add(self, stage, name, ok, message, evidence=None, hint=None):
        self.checks.append(Check(stage, name, bool(ok), message, evidence or {}, hint))
        return ok

    def recompute(self, stage, value, *from_stages):
        self.a[stage] = value
        self.eps[stage] = max((self.eps.get(s, 0.0) for s in from_stages), default=0.0)
        self.recomputed.append(stage)

    # ---- projections
    def projections(self):
        a = self.a
        X = a.get("X")
        if self.h is None and X is not None:
            for s in ("Q", "K", "V", "A", "S"):
                if s in a and a[s].ndim == X.ndim + 1:
                    self.h = a[s].shape[-3]
                    break
        for s, w in (("Q", "W_q"), ("K", "W_k"), ("V", "W_v")):
            if X is None or w not in a:
                continue
            W = a[w]
            if W.shape[0] != X.shape[-1]:
                self.add(s, f"{s} = X {w}", False,
                         f"X is T×d_model = {X.shape[-2]}×{X.shape[-1]} but {w} is "
                         f"{W.shape[0]}×{W.shape[1]}; its rows must be d_model = {X.shape[-1]}")
                continue
            if self.h is not None and W.shape[1] % self.h:
                self.add(s, f"{s} = X {w}", False,
                         f"{w} has {W.shape[1]} columns, not divisible by {self.h} heads")
                continue
            ref = _split_heads(X @ W, self.h)
            if s not in a:
                self.recompute(s, ref, "X", w)
                continue
            if (self.h is None and a[s].shape[:-1] == ref.shape[:-1]
                    and ref.shape[-1] % a[s].shape[-1] == 0 and ref.shape[-1] > a[s].shape[-1]):
                # one head of a multi-head projection (Trace.select(b, h)): find which
                heads = _split_heads(ref, ref.shape[-1] // a[s].shape[-1])
                tol = _rtol(self.eps[s], self.eps["X"], self.eps[w])
                hit = [j for j in range(heads.shape[-3])
                       if _close(a[s], heads[..., j, :, :], tol)[0]]
                self.add(s, f"{s} = X {w}", bool(hit),
                         f"{s} is head {hit[0]} of X {w}" if hit else
                         f"{s} ({a[s].shape}) is no head of X {w} ({ref.shape})")
                continue
            if a[s].shape != ref.shape:
                self.add(s, f"{s} = X {w}", False,
                         f"{s} has shape {a[s].shape} but X {w} gives {ref.shape}")
                continue
            tol = _rtol(self.eps[s], self.eps["X"], self.eps[w])
            ok, e, bad = _close(a[s], ref, tol)
            lead = ref.ndim - 2
            self.add(s, f"{s} = X {w}", ok,
                     f"max |{s} - X {w}| = {e:.3g}" + ("" if ok else " (too far off)"),
                     None if ok else {**_locate(bad.any(-1), lead, False), "max_err": e},
                     None if ok else f"{s} was not computed as X {w}; check which weight "
                     "was used and whether a bias or a transpose slipped in")
        # sequence lengths agree across Q, K, V, X
        Tk = {s: a[s].shape[-2] for s in ("K", "V") if s in a}
        if X is not None:
            Tk["X"] = X.shape[-2]
        if len(set(Tk.values())) > 1:
            stage = "X" if "X" in Tk else "V"
            self.add(stage, "sequence lengths agree", False,
                     "T differs between " + ", ".join(f"{k}: {v}" for k, v in Tk.items()))

    # ---- scores
    def scores(self):
        a = self.a
        if "S" in a and "Z" not in a and _looks_masked(a["S"]):
            a["Z"] = a.pop("S")
            self.eps["Z"] = self.eps.pop("S")
            self.given = ["Z" if g == "S" else g for g in self.given]
            self.notes.append("the given scores carry the mask already; read as Z = S + M")
        if "S" not in a and "Z" in a and ("Q" not in a or "K" not in a):
            return  # S (at readable entries) is taken from Z in the mask stage
        Q, K = a.get("Q"), a.get("K")
        if Q is None or K is None:
            if "S" in a:
                self._square("S", a["S"])
            return
        d_k = Q.shape[-1]
        c0 = self.inp.scale if self.inp.scale is not None else 1.0 / np.sqrt(d_k)
        if K.shape[-1] != d_k:
            self.add("S", "Q Kᵀ shapes", False,
                     f"Q is T×d_k = {Q.shape[-2]}×{d_k} but K is {K.shape[-2]}×{K.shape[-1]}; "
                     "the inner d_k axes must match")
            return
        try:
            G = Q @ np.swapaxes(K, -1, -2)
        except ValueError:
            self.add("S", "Q Kᵀ shapes", False,
                     f"Q {Q.shape} and K {K.shape}: leading axes do not broadcast")
            return
        if "S" not in a:
            self.recompute("S", G * c0, "Q", "K")
            self._pending = (G, c0, d_k)  # read the scale back from A once the mask is known
            return
        S = a["S"]
        if S.shape[-2:] != G.shape[-2:]:
            hint = None
            if S.shape[-2:] == (Q.shape[-2], K.shape[-1]) and K.shape[-2] == d_k:
                hint = "S is T×d_k: K was not transposed (Q K instead of Q Kᵀ)"
            self.add("S", "S is T×T", False,
                     f"S is {S.shape[-2]}×{S.shape[-1]} but Q Kᵀ is "
                     f"{G.shape[-2]}×{G.shape[-1]} (T_q×T_k)", {"shape": S.shape}, hint)
            return
        try:
            S, G = np.broadcast_arrays(S, G)
        except ValueError:
            self.add("S", "S is T×T", False, f"S is {S.shape} but Q Kᵀ is {G.shape}: the "
                     "batch/head axes do not match", {"shape": S.shape})
            return
        self.add("S", "S is T×T", True, f"S is {S.shape[-2]}×{S.shape[-1]}")
        finite = np.isfinite(S) & (S > BLOCKED_BELOW)
        tol = _rtol(self.eps["S"], self.eps["Q"], self.eps["K"])
        ok, e, bad = _close(S, G * c0, tol, finite)
        if ok:
            self.add("S", "scale 1/√d_k", True, f"S = Q Kᵀ · {c0:.4g} (d_k = {d_k}); "
                     f"max error {e:.3g}")
            return
        cands = [(1.0, "the 1/√d_k scale is missing (S = Q Kᵀ)"),
                 (1.0 / d_k, f"S was divided by d_k = {d_k} instead of √d_k")]
        hint = None
        for c, text in cands:
            if abs(c - c0) > 1e-12 * c0 and _close(S, G * c, tol, finite)[0]:
                hint = text
                break
        if hint is None and K.shape[-2] == d_k:
            try:
                if _close(S, (Q @ K) * c0, tol, finite)[0] or _close(S, Q @ K, tol, finite)[0]:
                    hint = "S = Q K, not Q Kᵀ: K was not transposed (shapes hid it: T = d_k)"
            except ValueError:
                pass
        if hint is None:
            g = G[finite]
            c = float(np.dot(S[finite], g) / max(np.dot(g, g), 1e-300))
            if _close(S, G * c, tol, finite)[0]:
                hint = f"S = Q Kᵀ · {c:.4g}, expected · {c0:.4g} (1/√d_k, d_k = {d_k})"
        self.add("S", "scale 1/√d_k", False,
                 f"S differs from Q Kᵀ/√d_k by up to {e:.3g}",
                 {**_locate(bad, S.ndim - 2), "max_err": e}, hint)

    def _square(self, name, S):
        T_q, T_k = S.shape[-2:]
        ok = T_q <= T_k
        self.add("S", f"{name} is T×T", ok, f"{name} is {T_q}×{T_k}",
                 None if ok else {"shape": S.shape},
                 None if ok else "more query rows than key columns: is it transposed?")

    def _scale_from_weights(self, G, c0, d_k):
        """S is absent: read its scale back from A (log A_ij − log A_ik = S_ij − S_ik)."""
        A = self.a.get("A")
        if A is None or A.shape[-2:] != G.shape[-2:]:
            return
        with np.errstate(divide="ignore", invalid="ignore"):
            L = np.log(A)
        use = np.isfinite(L) & (A > 1e-30)
        if self.R is not None and self.R.shape == A.shape:
            use &= self.R
        Gb = np.broadcast_to(G, A.shape)
        n = use.sum(-1, keepdims=True)
        if (n >= 2).sum() < 2:
            return
        Lc = np.where(use, L - np.where(use, L, 0).sum(-1, keepdims=True) / np.maximum(n, 1), 0)
        Gc = np.where(use, Gb - np.where(use, Gb, 0).sum(-1, keepdims=True) / np.maximum(n, 1), 0)
        gg = float((Gc * Gc).sum())
        if gg < 1e-12:
            return
        c = float((Lc * Gc).sum() / gg)
        resid = float(np.abs(Lc - c * Gc).max())
        spread = float(np.abs(Lc).max())
        if resid > 1e-2 * max(1.0, spread):
            return  # A is not a softmax of any multiple of Q Kᵀ; the A checks will say why
        rel = abs(c / c0 - 1)
        ok = rel < 1e-3
        hint = None
        if not ok:
            if abs(c - 1) < 1e-3:
                hint = "the 1/√d_k scale is missing (softmax of Q Kᵀ)"
            elif abs(c * d_k - 1) < 1e-3:
                hint = f"S was divided by d_k = {d_k} instead of √d_k"
            else:
                hint = f"A is the softmax of Q Kᵀ · {c:.4g}, expected · {c0:.4g}"
        self.add("S", "scale 1/√d_k (read back from A)", ok,
                 f"log A matches Q Kᵀ · {c:.4g}; expected · {c0:.4g}",
                 None if ok else {"factor": c, "expected": c0}, hint)

    # ---- mask
    def mask(self):
        a = self.a
        shape = None
        for s in ("S", "Z", "M", "A"):
            if s in a:
                shape = a[s].shape
                break
        if shape is None:
            if "Q" in a and "K" in a:
                shape = np.broadcast_shapes(a["Q"].shape[:-2], a["K"].shape[:-2]) + (
                    a["Q"].shape[-2], a["K"].shape[-2])
            else:
                return
        T_q, T_k = shape[-2:]
        if T_q > T_k:
            return
        lead = shape[:-2]
        sources: list[tuple[str, np.ndarray]] = []
        if self.inp.allowed is not None:
            sources.append(("declared mask", self._bcast(self.inp.allowed, shape, "mask")))
        if "M" in a:
            M = self._bcast(a["M"], shape, "M")
            R_M, odd = _mask_from_additive(M)
            if odd.any():
                self.add("M", "M is 0 or blocked", False,
                         "M has entries that are neither 0 nor -inf (or a large negative fill)",
                         _locate(odd, len(lead)),
                         "M must be 0 where a key may be read and -inf (or a large negative "
                         "fill) where it may not; a bias belongs in S")
            sources.append(("M", R_M))
        if "Z" in a:
            Z = np.broadcast_to(a["Z"], shape)
            sources.append(("Z", np.isfinite(Z) & (Z > BLOCKED_BELOW)))
            if "S" not in a:
                self.recompute("S", np.where(sources[-1][1], Z, 0.0), "Z")
        if not sources and "A" in a and a["A"].shape == shape:
            sources.append(("A (exact zeros)", self._mask_from_weights(a["A"])))
        if not sources:
            self.R = np.broadcast_to(self._expected_default(T_q, T_k), shape)
            self.recomputed.append("M")
            return
        name0, R = sources[0]
        for name, other in sources[1:]:
            same = R == other
            self.add("M", f"{name} agrees with {name0}", same.all(),
                     f"{name} and {name0} " + ("agree" if same.all() else "disagree"),
                     _locate(~same, len(lead)))
        self.R = R
        if name0 != "M" and "M" not in a:
            self.recomputed.append("M")
        self._structure(R, name0)

    def _expected_default(self, T_q, T_k):
        R = _masks.causal(T_q, T_k)
        if self.inp.lengths is not None:
            L = self.inp.lengths
            R = _masks.combine(R, _masks.key_padding(L, T_k)[:, None, :],
                               _masks.query_padding(L, T_q)[:, :, None])
        if self.inp.key_padding is not None:
            R = _masks.combine(R, self.inp.key_padding[..., None, :])
        return self._fit_lead(R)

    def _fit_lead(self, R):
        # a (B, T, T) mask with a head axis in the stages: insert it
        if self.h is not None and R.ndim == 3:
            R = R[:, None]
        return R

    def _bcast(self, m, shape, name):
        m = np.asarray(m)
        for cand in (m, self._fit_lead(m)):  # as given, or a (B, T, T) mask missing its head axis
            try:
                return np.broadcast_to(cand, shape)
            except ValueError:
                pass
        raise AuditInputError(f"{name}: shape {m.shape} does not broadcast to {shape}")

    def _mask_from_weights(self, A):
        """Blocked = exactly 0, but an isolated zero below the diagonal is read as underflow."""
        T_q, T_k = A.shape[-2:]
        off = T_k - T_q
        # NaN counts as read, except a row that is NaN throughout: softmax of all -inf (0/0)
        R = (A != 0) & ~np.isnan(A).all(-1, keepdims=True)
        causal = _masks.causal(T_q, T_k)
        empty_row = ~R.any(-1, keepdims=True)
        i = np.arange(T_q)[:, None]
        col_pad = ~(R & (np.arange(T_k)[None, :] <= i + off)).any(-2, keepdims=True)
        diag = np.zeros((T_q, T_k), bool)
        diag[np.arange(T_q), np.arange(T_q) + off] = True
        diag_blocked = ~(R & diag).any(axis=(-1, -2), keepdims=True)
        structural = empty_row | col_pad | (diag & diag_blocked)
        return R | (causal & ~structural)

    def _structure(self, R, source):
        """Compare the mask with causal ∧ padding, padding read from the mask itself."""
        shape = R.shape
        T_q, T_k = shape[-2:]
        off = T_k - T_q
        lead = shape[:-2]
        causal = _masks.causal(T_q, T_k)
        declared_pad = None
        if self.inp.lengths is not None or self.inp.key_padding is not None:
            declared_pad = ~np.broadcast_to(self._fit_lead(
                self._expected_default(T_q, T_k)).any(-2), lead + (T_k,))
        bad = np.zeros(shape, bool)
        kinds = set()
        padded = False
        for idx in np.ndindex(*lead) if lead else [()]:
            r = R[idx]
            pad = ~r.any(0) if declared_pad is None else declared_pad[idx]
            padded |= bool(pad.any())
            E = causal & ~pad[None, :]
            pad_query = pad[np.arange(T_q) + off]
            row_ok = (r == E).all(-1) | (pad_query & ((~r.any(-1)) | (r == (causal & ~pad)).all(-1)))
            # a padding query may also read the real keys before it (key-padding-only style)
            row_ok |= pad_query & ~(r & ~causal).any(-1) & ~(r & pad[None, :]).any(-1)
            wrong = (r != E) & ~row_ok[:, None]
            bad[idx] = wrong
            if wrong.any():
                if r.all():
                    kinds.add("none")
                elif (r == causal.T).all() and T_q == T_k:
                    kinds.add("anti")
                elif T_q == T_k and (r == np.tril(np.ones((T_q, T_k), bool), -1)).all():
                    kinds.add("diag")
                elif (r & ~causal).any():
                    kinds.add("future")
                elif declared_pad is not None and (r & pad[None, :] & causal).any():
                    kinds.add("padding")
                else:
                    kinds.add("over")
        ok = not bad.any()
        hints = {
            "none": "no causal mask: every query reads future keys (add M before the softmax)",
            "anti": "the mask is transposed (anti-causal): queries read j >= i instead of j <= i",
            "diag": "the diagonal is blocked (j < i): each token must be able to read itself",
            "future": "some queries read future keys (j > i): the causal mask is wrong",
            "padding": "padding keys are readable: the padding mask was not applied to keys",
            "over": "the mask blocks keys that should be readable (j <= i, not padding)",
        }
        order = ["none", "anti", "diag", "future", "padding", "over"]
        kind = next((k for k in order if k in kinds), None)
        self.add("M", "mask is causal (+ padding)", ok,
                 f"{source}: " + ("0 on and below the diagonal, blocked above"
                                  + (", padding blocked" if declared_pad is not None else
                                     ", padding keys (read by no query) blocked" if padded else "")
                                  if ok else "does not match causal ∧ padding"),
                 None if ok else _locate(bad, len(lead)),
                 None if ok else hints[kind])

    # ---- weights
    def weights(self):
        a = self.a
        R = self.R
        if "A" not in a:
            if "S" in a and R is not None:
                S = np.broadcast_to(a["S"], R.shape)
                with np.errstate(invalid="ignore"):
                    self.recompute("A", softmax_last(np.where(R, S, 0.0), R), "S")
            return
        A = a["A"]
        if "S" in a and a["S"].shape[-2:] != A.shape[-2:]:
            self.add("A", "A has S's shape", False,
                     f"A is {A.shape[-2]}×{A.shape[-1]} but S (Q Kᵀ) is "
                     f"{a['S'].shape[-2]}×{a['S'].shape[-1]} (T_q×T_k)", {"shape": A.shape},
                     "A must be T_q×T_k like the scores: was it transposed or sliced?")
            return
        if R is None:
            T_q, T_k = A.shape[-2:]
            if T_q > T_k:
                self.add("A", "A is T×T", False, f"A is {T_q}×{T_k}: more query rows than keys")
                return
            R = np.broadcast_to(_masks.causal(T_q, T_k), A.shape)
        if R.shape != A.shape:
            self.add("A", "A matches the mask's shape", False,
                     f"A is {A.shape} but the mask/scores are {R.shape}")
            return
        lead = A.ndim - 2
        tol = _rtol(self.eps["A"])
        has_key = R.any(-1)
        finite_row = np.isfinite(A).all(-1)
        # rows with no readable key: listed, and they must be zero (never NaN)
        for idx in np.ndindex(*A.shape[:-2]) if lead else [()]:
            rows = np.flatnonzero(~has_key[idx])
            if rows.size:
                self.empty_rows.append({"index": list(idx), "rows": rows.tolist()})
        sums = np.where(R, A, 0.0).sum(-1)
        row_bad = has_key & finite_row & (np.abs(sums - 1) > tol)
        if row_bad.any():
            hint = self._softmax_hint(A, R, has_key, tol)
            self.add("A", "rows sum to 1", False,
                     f"{int(row_bad.sum())} readable rows do not sum to 1 over their readable "
                     f"columns (e.g. {float(sums[row_bad][0]):.4g})",
                     {**_locate(row_bad, lead, False),
                      "row_sums": np.round(sums[np.nonzero(row_bad)][:_MAX_LIST], 4).tolist()},
                     hint)
        else:
            self.add("A", "rows sum to 1", True, "every readable row sums to 1 over its readable "
                     "columns")
        forb = ~R & has_key[..., None] & (A != 0)
        self.add("A", "forbidden entries exactly 0", not forb.any(),
                 "blocked entries have exactly zero weight" if not forb.any()
                 else f"{int(forb.sum())} blocked entries have nonzero weight "
                 f"(max {float(np.abs(np.where(forb & np.isfinite(A), A, 0)).max()):.3g})",
                 _locate(forb, lead),
                 None if not forb.any() else "the mask must be applied before the softmax, with "
                 "-inf (or a fill whose weight comes out exactly 0)")
        nonfinite = has_key & ~finite_row
        hint = None
        if nonfinite.any():
            S = a.get("S")
            if S is not None and np.abs(np.where(R & np.isfinite(S), S, 0)).max() > 80:
                hint = ("scores this large overflow exp(): subtract the row maximum before "
                        "exponentiating (stable softmax)")
            else:
                hint = "NaN/inf weights in rows that can read a key"
        self.add("A", "readable rows finite", not nonfinite.any(),
                 "every readable row is finite" if not nonfinite.any()
                 else f"{int(nonfinite.sum())} readable rows hold NaN or inf",
                 _locate(nonfinite, lead, False), hint)
        if (~has_key).any():
            empty_bad = ~has_key & (~np.isfinite(A).all(-1) | (A != 0).any(-1))
            self.add("A", "rows with no readable key are zero", not empty_bad.any(),
                     "rows with no readable key have zero weight" if not empty_bad.any()
                     else f"{int(empty_bad.sum())} rows with no readable key are not zero"
                     + (" (NaN)" if np.isnan(A[empty_bad]).any() else ""),
                     _locate(empty_bad, lead, False),
                     None if not empty_bad.any() else
                     "a row whose keys are all blocked must give zero weights; -inf on every "
                     "entry makes softmax NaN (0/0), a finite fill spreads weight over "
                     "forbidden keys")
        if "S" in a and not self.failures_in("A"):
            S = np.broadcast_to(a["S"], A.shape)
            with np.errstate(invalid="ignore"):
                ref = softmax_last(np.where(R, S, 0.0), R)
            ok, e, bad = _close(A, ref, _rtol(self.eps["A"], self.eps.get("S", 0)),
                                has_key[..., None] & R)
            self.add("A", "A = softmax_last(S + M)", ok,
                     f"max |A - softmax(S + M)| = {e:.3g}",
                     None if ok else {**_locate(bad, lead), "max_err": e},
                     None if ok else "A is a distribution per row but not the softmax of these "
                     "scores: check the scale and which scores were used")

    def failures_in(self, stage):
        return [c for c in self.checks if c.stage == stage and not c.ok]

    def _softmax_hint(self, A, R, has_key, tol):
        Af = np.where(np.isfinite(A), A, 0.0)
        col = Af.sum(-2)
        any_read = R.any(-2)
        if any_read.any() and np.all(np.abs(col[any_read] - 1) <= tol * 4):
            return "columns sum to 1, rows do not: softmax ran over the query axis"
        tot = Af.sum(axis=(-1, -2))
        if np.all(np.abs(tot - 1) <= tol * 4):
            return "the whole matrix sums to 1: softmax ran over all entries at once"
        sums = np.where(R, Af, 0).sum(-1)
        if np.all(sums[has_key] <= 1 + tol) and not (~R & (Af != 0)).any():
            S = self.a.get("S")
            if S is not None:
                with np.errstate(invalid="ignore", over="ignore"):
                    full = softmax_last(np.broadcast_to(S, A.shape), np.ones(A.shape, bool))
                if _close(A, np.where(R, full, 0), _rtol(self.eps["A"]) * 4, R)[0]:
                    return ("mask applied after softmax without renormalizing: rows sum to "
                            "less than 1 (the forbidden weight was dropped, not redistributed)")
            return ("rows sum to less than 1 with zeros in the right place: the mask was "
                    "likely applied after the softmax without renormalizing")
        return "rows are not normalized over the key axis"

    # ---- values, contributions, output
    def values(self):
        a = self.a
        R = self.R
        A, V = a.get("A"), a.get("V")
        if "H" in a and A is not None and V is not None and a["H"].ndim == A.ndim - 1 and self.h:
            a["H"] = _split_heads(a["H"], A.shape[-3])  # concatenated heads (..., T, h·d_v)
        if A is None or V is None:
            return
        if R is None or R.shape != A.shape:
            R = np.ones(A.shape, bool)
        try:
            lead = np.broadcast_shapes(A.shape[:-2], V.shape[:-2])
            Hr = weighted_values(np.broadcast_to(A, lead + A.shape[-2:]),
                                 np.broadcast_to(V, lead + V.shape[-2:]),
                                 np.broadcast_to(R, lead + A.shape[-2:]))
        except ValueError:
            self.add("H", "H = A V shapes", False, f"A is {A.shape} but V is {V.shape}; "
                     "A's key axis must match V's T")
            return
        if "H" not in a:
            self.recompute("H", Hr, "A", "V")
            return
        H = a["H"]
        if H.shape != Hr.shape:
            self.add("H", "H = A V", False, f"H has shape {H.shape} but A V is {Hr.shape}")
            return
        has_key = R.any(-1)
        ok, e, bad = _close(H, Hr, _rtol(self.eps["H"], self.eps["A"], self.eps.get("V", 0)),
                            has_key[..., None])
        self.add("H", "H = A V", ok, f"max |H - A V| = {e:.3g}",
                 None if ok else {**_locate(bad.any(-1), H.ndim - 2, False), "max_err": e},
                 None if ok else "H is not A V for these weights and values")
        if (~has_key).any():
            zb = ~has_key & ~(H == 0).all(-1)
            self.add("H", "rows with no readable key are zero", not zb.any(),
                     "zero output on rows with no readable key" if not zb.any()
                     else f"{int(zb.sum())} rows with no readable key are not zero",
                     _locate(zb, H.ndim - 2, False),
                     None if not zb.any() else "a padding query must output zeros, never NaN")

    def contributions(self):
        a = self.a
        if "C" not in a or "H" not in a:
            return
        C, H = a["C"], a["H"]
        if C.shape[:-2] != H.shape[:-1] or C.shape[-1] != H.shape[-1]:
            self.add("C", "Σ_j C[i, j] = H_i", False, f"C is {C.shape} but H is {H.shape} "
                     "(C must be T×T×d_v)")
            return
        ok, e, bad = _close(C.sum(-2), H, _rtol(self.eps["C"], self.eps["H"]))
        self.add("C", "Σ_j C[i, j] = H_i", ok, f"max |Σ_j C[i, j] - H_i| = {e:.3g}",
                 None if ok else {**_locate(bad.any(-1), H.ndim - 2, False), "max_err": e},
                 None if ok else "the contributions do not add up to the output")

    def output(self):
        a = self.a
        if "O" not in a or "H" not in a:
            return
        H, O = a["H"], a["O"]
        Hc = _merge_heads(H) if (self.h and H.ndim >= 3 and H.shape[-3] == self.h
                                 and H.ndim == O.ndim + 1) else H
        if "W_o" not in a:
            return
        W = a["W_o"]
        tol = _rtol(self.eps["O"], self.eps["H"], self.eps["W_o"])
        if Hc.shape[-1] != W.shape[0]:
            self.add("O", "O = H W_O", False, f"H is T×(h·d_v) = {Hc.shape[-2]}×{Hc.shape[-1]} "
                     f"but W_O is {W.shape[0]}×{W.shape[1]}")
            return
        ref = Hc @ W
        if O.shape != ref.shape:
            hint = ("O has H's shape: the output projection is missing"
                    if O.shape == Hc.shape else None)
            self.add("O", "O = H W_O", False, f"O has shape {O.shape} but H W_O is {ref.shape}",
                     {"shape": O.shape}, hint)
            return
        ok, e, bad = _close(O, ref, tol)
        hint = None
        if not ok:
            if W.shape[0] == W.shape[1] and _close(O, Hc @ W.T, tol)[0]:
                hint = "O = H W_Oᵀ: the output projection is transposed"
            elif O.shape == Hc.shape and _close(O, Hc, tol)[0]:
                hint = "O = H: the output projection is missing"
        self.add("O", "O = H W_O", ok, f"max |O - H W_O| = {e:.3g}",
                 None if ok else {**_locate(bad.any(-1), O.ndim - 2, False), "max_err": e}, hint)

    def run(self) -> Report:
        self.projections()
        self.scores()
        self.mask()
        if self._pending is not None:
            self._scale_from_weights(*self._pending)
        self.weights()
        self.values()
        self.contributions()
        self.output()
        order = {s: i for i, s in enumerate(STAGE_ORDER)}
        checks = sorted(self.checks, key=lambda c: order[c.stage])
        return Report(checks, self.given, self.recomputed, self.empty_rows, self.notes)


def audit(obj, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Report:
    """Check an attention computation in dependency order (see the module docstring).

    ``obj``: a :class:`Trace`, a mapping of named arrays (NumPy or torch; aliases and
    TransformerLens hook names accepted) or a path to a .npz / .npy / folder of .npy /
    .safetensors file. Unusable input raises :class:`AuditInputError` (a ValueError).
    """
    if isinstance(obj, Trace):
        inp = _from_trace(obj)
    elif isinstance(obj, (str, Path)):
        data = load_arrays(obj, max_bytes=max_bytes)
        inp = _from_mapping(data)
    elif isinstance(obj, Mapping):
        inp = _from_mapping(obj)
    else:
        raise AuditInputError(f"audit: expected a Trace, a mapping of arrays or a path, got "
                              f"{type(obj).__name__}")
    try:
        with np.errstate(all="ignore"):  # NaN/inf in the user's arrays are findings, not warnings
            return _Auditor(inp).run()
    except AuditInputError:
        raise
    except ValueError as exc:  # shapes that do not fit together in a way no check foresaw
        raise AuditInputError(f"audit: the arrays do not fit together ({exc})") from None

