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
* ``mask`` / ``allowed`` / ``attention_mask``: read by the one reader of masks
  (:mod:`.conventions`): boolean (True = may read), additive (0 / -inf or a large negative
  fill) or 1/0, decided by the values; an ambiguous one (all zeros, values that fit none)
  is refused with the reason, never judged. ``M`` / ``additive_mask`` is additive by name.
* A mapping or file holding only a mask is compared cell by cell with the declared pattern
  (:func:`~.compare.compare_masks`, as the CLI's audit does): the report's one check.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .. import masks as _masks
from .._trace import Trace
from .compare import MaskComparison, compare_lone_mask
from .conventions import MEANING
from .inputs import DEFAULT_MAX_BYTES, _from_mapping, _from_trace, load_arrays
from .report import AuditInputError, Check, Report, check_declared_scale
from .stages import run as _run_stages

if TYPE_CHECKING:
    from ..arrays import ArrayLike

__all__ = ["audit"]


@_masks.takes_pattern
def audit(
    obj: Trace | Mapping[str, ArrayLike] | str | os.PathLike[str],
    *,
    pattern: _masks.Pattern | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    scale: float | None = None,
    **keywords,
) -> Report:
    """Check an attention computation in dependency order (see the module docstring).

    ``obj``: a :class:`Trace`, a mapping of named arrays (NumPy or torch; aliases and
    TransformerLens hook names accepted) or a path to a .npz / .npy / folder of .npy /
    .safetensors file (``max_bytes``: the budget for all its arrays together). The
    pattern (``pattern`` or its keywords) and ``scale`` declare what was meant, as for
    :func:`causalattn.attention` (default: plain causal, 1/√d_k; a Trace brings its own).
    Shapes: one sequence's arrays are T×d (Q, K: T×d_k, V: T×d_v, S and A: T×T), with
    any batch and head axes leading (``(B, H, T, d)``); the pattern arrays are
    :func:`causalattn.attention`'s (``lengths`` (B,), ``key_padding_mask`` (B, T_k)).
    Unusable input raises :class:`AuditInputError` (a ValueError).
    """
    try:
        kw = _masks.keywords_of(pattern, keywords, "audit")
        declared = {k: v for k, v in kw.items() if v is not None and (k, v) != ("causal", True)}
        _masks.Pattern.from_kwargs(where="audit", **declared)
    except ValueError as exc:
        msg = str(exc)
        raise AuditInputError(msg if msg.startswith("audit:") else f"audit: {msg}") from None
    check_declared_scale("audit", scale, AuditInputError)
    if isinstance(obj, (str, Path, Mapping)):  # only a mask: compared cell by cell
        lone = compare_lone_mask(obj, max_bytes, declared)
        if lone is not None:
            return _mask_report(lone)
    if isinstance(obj, Trace):
        inp = _from_trace(obj)
    elif isinstance(obj, (str, Path)):
        data = load_arrays(obj, max_bytes=max_bytes)
        inp = _from_mapping(data)
    elif isinstance(obj, Mapping):
        inp = _from_mapping(obj)
    else:
        raise AuditInputError(
            f"audit: expected a Trace, a mapping of arrays or a path, got {type(obj).__name__}"
        )
    inp.pattern = {**inp.pattern, **declared}
    if scale is not None:
        inp.scale = float(scale)
    try:
        with np.errstate(all="ignore"):  # NaN/inf in the user's arrays are findings, not warnings
            return _run_stages(inp)
    except AuditInputError:
        raise
    except ValueError as exc:  # shapes that do not fit together in a way no check foresaw
        raise AuditInputError(f"audit: the arrays do not fit together ({exc})") from None


def _mask_report(cmp: MaskComparison) -> Report:
    """A lone mask's comparison as a Report: one stage-M check, its first difference as
    evidence (0-based (b, h), query rows and key columns)."""
    evidence: dict = {}
    if cmp.differences and cmp.differences[0].cells:
        b, h, i, j = cmp.differences[0].cells[0]
        evidence = {"index": (b, h), "rows": [i], "cols": [j], "kinds": dict(cmp.kinds)}
    head, *rest = (line.strip() for line in cmp.message.splitlines())
    message = head.rstrip(":") + (": " + "; ".join(rest) if rest else "")
    check = Check("M", "mask is the declared pattern", cmp.ok, message, evidence)
    read_as = MEANING.get(cmp.convention or "", "a BlockMask or mask_mod")
    note = f"a lone mask, read as {read_as}, compared cell by cell with {cmp.expected}"
    return Report([check], given=["mask"], notes=[note])
