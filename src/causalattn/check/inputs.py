"""Reading what the audit is given: files (.npz, .npy, folders, .safetensors), mappings,
aliases and TransformerLens hook names -> arrays in our layouts."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .._trace import Trace
from ..io.files import open_arrays
from . import conventions
from .report import STAGE_ORDER, AuditInputError

DEFAULT_MAX_BYTES = 2 * 2**30

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
    **{
        a: "A"
        for a in (
            "a",
            "weights",
            "attn_weights",
            "pattern",
            "probs",
            "attn",
            "attention",
            "attn_probs",
            "hook_pattern",
        )
    },
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


# -- reading inputs ----------------------------------------------------------------------
def load_arrays(path: str | Path, *, max_bytes: int = DEFAULT_MAX_BYTES) -> dict[str, np.ndarray]:
    """Named arrays from a .npz, a .npy, a folder of .npy files or a .safetensors file.

    Every header is read first (:mod:`.files`): only numeric arrays, ``max_bytes`` for all
    of them together, and declared shapes that fit together (a T×T stage must match the T
    of Q, K, V or X); only then are the arrays read. Nothing is executed.
    """
    f = open_arrays(path, max_bytes)
    _check_declared_shapes(f.path, f.headers)
    return f.read()


def _check_declared_shapes(p, headers: dict) -> None:
    """Refuse, before reading, T×T stages whose sizes are not the sequence lengths of the
    Q, K, V or X next to them (e.g. an A of 16000×16000 next to a q of 8×2)."""
    T, square = set(), {}
    for name, (shape, _) in headers.items():
        stage = _canon(name)[0]
        if stage in ("Q", "K", "V", "X") and len(shape) >= 2:
            T.add(shape[-2])
        elif stage in ("S", "Z", "M", "A") and len(shape) >= 2:
            square[name] = shape
    for name, shape in square.items():
        if T and not {shape[-2], shape[-1]} <= T:
            raise AuditInputError(
                f"{p}: {name!r} is declared {shape[-2]}×{shape[-1]} but the sequences of Q, K, V "
                f"or X have T in {sorted(T)}; refused before reading"
            )


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
    pattern: dict = field(default_factory=dict)  # the declared Pattern's keywords


def _scalar_scale(a: np.ndarray) -> float:
    if a.size != 1 or a.dtype == np.bool_:
        raise AuditInputError(f"scale: must be one number, got shape {a.shape}")
    c = float(a.reshape(-1)[0])
    if not math.isfinite(c) or c <= 0:
        raise AuditInputError(f"scale: must be a finite number > 0 (the factor on Q Kᵀ), got {c:g}")
    return c


def _positive_int(name: str, a: np.ndarray) -> int:
    v = a.reshape(-1)
    if a.size != 1 or not np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_ or v[0] < 1:
        raise AuditInputError(f"{name}: must be one integer >= 1, got {v.tolist()[:4]} ({a.dtype})")
    return int(v[0])


def _eps(dtype: np.dtype) -> float:
    return float(np.finfo(dtype).eps) if np.issubdtype(dtype, np.floating) else 0.0


def _from_mapping(data: Mapping[str, Any]) -> _Inputs:
    raw: dict[str, tuple[np.ndarray, str]] = {}
    notes: list[str] = []
    ignored = []
    layers = {_canon(str(k))[2] for k in data if _canon(str(k))[0] not in ("", *_META)}
    if len(layers - {None}) > 1:
        raise AuditInputError(
            f"arrays from several layers ({', '.join(sorted(layers - {None}))}); "
            "audit one layer at a time"
        )
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
        inp.scale = _scalar_scale(raw.pop("scale")[0])
    if "n_heads" in raw:
        inp.n_heads = _positive_int("n_heads", raw.pop("n_heads")[0])
    if "lengths" in raw:
        L = raw.pop("lengths")[0]
        if L.ndim != 1 or L.dtype == np.bool_ or not np.issubdtype(L.dtype, np.integer):
            raise AuditInputError(
                f"lengths: must be a 1-D integer array (B,), got shape "
                f"{L.shape} and dtype {L.dtype}"
            )
        if (L < 0).any():
            raise AuditInputError(f"lengths: must be >= 0, got {L.tolist()[:8]}")
        inp.lengths = L.astype(np.int64)
    if "key_padding_mask" in raw:
        key_padding = raw.pop("key_padding_mask")[0]
        if key_padding.ndim != 2 or not (
            key_padding.dtype == np.bool_
            or (np.issubdtype(key_padding.dtype, np.integer) and np.isin(key_padding, (0, 1)).all())
        ):
            raise AuditInputError(
                f"key_padding_mask: must be (B, T_k) booleans (True = may "
                f"read), got shape {key_padding.shape} and dtype {key_padding.dtype}"
            )
        inp.key_padding = key_padding.astype(bool)
    if "allowed" in raw:  # bool, additive or 1/0: the one reader says which, or refuses
        m, base = raw.pop("allowed")
        try:
            inp.allowed = np.asarray(conventions.decide(m, base).allowed)
        except ValueError as exc:
            raise AuditInputError(str(exc)) from None
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
                a64 = (
                    a64.reshape(-1, a64.shape[-1])
                    if stage == "W_o"
                    else np.moveaxis(a64, 0, 1).reshape(a64.shape[1], -1)
                )
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
        "W_q",
        "W_k",
        "W_v",
        "W_o",
    }:
        raise AuditInputError(
            "no attention stages found; give any of X, Q, K, V, S, M, A, H, O (aliases: "
            "scores, weights/pattern/probs, out/z/output, TransformerLens hook names)"
        )
    return inp


def _from_trace(tr: Trace) -> _Inputs:
    inp = _from_mapping(
        {n: tr[n] for n in tr.names if n in STAGE_ORDER or n in ("W_q", "W_k", "W_v", "W_o", "Z")}
    )
    inp.allowed = tr.allowed
    inp.scale = tr.scale
    inp.n_heads = tr.n_heads
    pat = getattr(tr, "pattern", None)
    if pat is not None and (pat.causal or pat.describe() != "bidirectional"):
        # (a trace made with an explicit mask= says "bidirectional": its mask is the rule)
        inp.pattern = {
            f.name: getattr(pat, f.name)
            for f in dataclasses.fields(pat)
            if getattr(pat, f.name) is not None and f.name not in ("q_start", "k_start", "mask")
        }
    return inp
