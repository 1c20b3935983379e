"""Options that several commands share, each defined once: the declared pattern (audit,
diagnose: generated from :data:`causalattn.masks.PATTERN_KEYWORDS`), --max-memory
(diagnose, learn --check), --scale."""

from __future__ import annotations

import inspect
from typing import Annotated

import typer

from .. import masks
from ..io import runner
from ._app import _fail


def _numbers(text: str | None, name: str, kind=float):
    """'0.5,0.25' -> [0.5, 0.25]; None stays None."""
    if text is None:
        return None
    try:
        return [kind(t) for t in text.split(",") if t.strip()]
    except ValueError:
        _fail(f"{name}: expected comma-separated {kind.__name__}s, got {text!r}")


# How the CLI spells the pattern keywords it can express: each of masks.PATTERN_KEYWORDS is
# an option --name-with-dashes (causal: --causal/--bidirectional) unless it is an array of
# more than one axis or a function, which only the Python API takes. The option's type
# follows Pattern's field (bool, int, float; a 1-D array as comma-separated numbers).
_VECTORS = {"lengths": int, "cu_seqlens": int, "prefix_lengths": int, "sinks": float}
_VECTORS["alibi_slopes"] = float
NOT_ON_CLI = ("key_padding_mask", "mask", "mask_mod", "bias", "rel_bias", "score_mod")
_HELP = {
    "causal": "The causal rule (--bidirectional: none).",
    "window": "Sliding window w: each query reads its last w positions.",
    "chunk": "Chunks of c positions.",
    "lengths": "Sequence lengths, e.g. 6,3.",
    "cu_seqlens": "Packed documents' cumulative lengths, e.g. 0,4,9.",
    "prefix_lengths": "Bidirectional prefixes, e.g. 2,3.",
    "softcap": "Scores capped as c·tanh(S/c).",
    "sinks": "One sink logit per head, e.g. 0.5,0.1.",
    "alibi_slopes": "One ALiBi slope per head.",
}
_PATTERN_HELP = " The declared pattern, as for causalattn.attention (default: plain causal)."


def _pattern_option(name: str) -> inspect.Parameter:
    field = masks.DEFAULTS[name]
    kind = _VECTORS.get(name) and str
    kind = kind or {"causal": bool, "softcap": float}.get(name, int)
    flags = ("--causal/--bidirectional",) if name == "causal" else ("--" + name.replace("_", "-"),)
    help_ = _HELP.get(name, name) + (_PATTERN_HELP if name == "causal" else "")
    ann = Annotated[kind, typer.Option(*flags, help=help_)]
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=field, annotation=ann)


CLI_PATTERN = tuple(n for n in masks.PATTERN_KEYWORDS if n not in NOT_ON_CLI)


def pattern_options(fn):
    """Give a command the pattern options (:data:`CLI_PATTERN`, from the one list): ``fn``
    declares ``**keywords`` where they arrive, and reads them with :func:`_declared`."""
    sig = inspect.signature(fn, eval_str=True)  # typer reads the signature as it is set
    params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    opts = [_pattern_option(n) for n in CLI_PATTERN]
    fn.__signature__ = sig.replace(parameters=params + opts)
    fn.__annotations__ = {**fn.__annotations__, **{p.name: p.annotation for p in opts}}
    fn.__annotations__.pop("keywords", None)
    return fn


def _declared(keywords: dict) -> dict:
    """The pattern keywords of causalattn.attention, from the pattern options (those set)."""
    kw = {}
    for name, value in keywords.items():
        if name in _VECTORS:
            value = _numbers(value, "--" + name.replace("_", "-"), _VECTORS[name])
        if value is not None and value is not masks.DEFAULTS[name]:
            kw[name] = value
    return kw


# code causalattn runs (diagnose FILE, learn --check) runs in the isolation runner
_MaxMemory = Annotated[
    str,
    typer.Option(
        "--max-memory",
        help="Memory the code may take beyond its start: bytes, or 512M, 2G (default: 4G, "
        "or a quarter of a smaller machine's memory).",
    ),
]


def _memory_bytes(text: str | None) -> int:
    """--max-memory: a number of bytes, or one with a K/M/G suffix (powers of 1024)."""
    if text is None:
        return runner.DEFAULT_MAX_MEMORY
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(t[-1:], 1)
    digits = t[:-1] if mult > 1 else t
    if not digits.isdigit() or int(digits) <= 0:
        _fail(f"--max-memory must be a number of bytes > 0 (or 512M, 2G), got {text!r}")
    return int(digits) * mult


_Scale = Annotated[float, typer.Option("--scale", help="The scale on Q Kᵀ (default 1/√d_k).")]
