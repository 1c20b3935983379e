"""Options that several commands share, each defined once: the declared pattern (audit,
diagnose), --max-memory (diagnose, learn --check), --scale."""

from __future__ import annotations

from typing import Annotated

import typer

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


def _declared(
    window, chunk, lengths, prefix_lengths, softcap, sinks, alibi_slopes, bidirectional
) -> dict:
    """The pattern keywords of causalattn.attention, from the audit/diagnose options."""
    kw = {
        "causal": not bidirectional,
        "window": window,
        "chunk": chunk,
        "softcap": softcap,
        "lengths": _numbers(lengths, "--lengths", int),
        "prefix_lengths": _numbers(prefix_lengths, "--prefix-lengths", int),
        "sinks": _numbers(sinks, "--sinks"),
        "alibi_slopes": _numbers(alibi_slopes, "--alibi-slopes"),
    }
    return {k: v for k, v in kw.items() if v is not None}


_PATTERN_HELP = "The declared pattern, as for causalattn.attention (default: plain causal)."

# The options that declare a pattern, one definition for audit and diagnose (the keywords
# of causalattn.attention; _declared turns them into those keywords).
_Window = Annotated[int, typer.Option("--window", help="Sliding window w: " + _PATTERN_HELP)]
_Chunk = Annotated[int, typer.Option("--chunk", help="Chunks of c positions.")]
_Lengths = Annotated[str, typer.Option("--lengths", help="Sequence lengths, e.g. 6,3.")]
_PrefixLengths = Annotated[str, typer.Option("--prefix-lengths", help="Bidirectional prefixes.")]
_Softcap = Annotated[float, typer.Option("--softcap", help="Scores capped as c·tanh(S/c).")]
_Sinks = Annotated[str, typer.Option("--sinks", help="One sink logit per head, e.g. 0.5,0.1.")]
_AlibiSlopes = Annotated[str, typer.Option("--alibi-slopes", help="One ALiBi slope per head.")]
_Bidirectional = Annotated[bool, typer.Option("--bidirectional", help="No causal rule.")]
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
