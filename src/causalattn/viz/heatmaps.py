"""Matplotlib heatmaps of one attention computation, tokens on both axes.

Rows are queries i, columns are keys j, as in the seeds. Figures are built with
``matplotlib.figure.Figure`` directly (the Agg canvas, no pyplot state, no display
needed), and matplotlib is imported only when a figure is drawn: it is the ``viz`` extra.

    fig = plot_mask(batch.mask[3], batch.tokens[3])     # readable / future / padding
    fig = plot_mask(masks.Pattern(window=3), T=8)       # each kind of blocked cell
    fig = plot_patterns({"causal": masks.Pattern(), "window 3": masks.Pattern(window=3)}, 8)
    fig = plot_stage(tr, "A")                           # a grid of heads
    save(fig, "out/A.svg")                              # PNG or SVG by extension
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .. import masks
from .._trace import Trace
from .kinds import (
    KINDS,
    READABLE,
    allowed_2d,
    contribution_norms,
    heads,
    mask_kinds,
    pad_of,
    padding_positions,
    sequences,
    tokens_of,
)

__all__ = [
    "plot_mask",
    "plot_patterns",
    "plot_stage",
    "trace_figures",
    "save",
    "write_figures",
    "STAGE_TITLES",
]

PAD_HATCH = "///"
STAGE_TITLES = {
    "M": "mask M (rows: queries i, columns: keys j)",
    "S": "scores S = Q Kᵀ / √d_k",
    "A": "weights A = softmax_last(S + M): each row sums to 1",
    "norm": "contribution norms ‖A_ij v_j‖",
}
_CMAPS = {"S": "RdBu_r", "A": "Blues", "norm": "Oranges"}
ANNOTATE_MAX_T = 12  # write numbers in the cells up to this many tokens
LABEL_MAX_T = 64  # every token as a tick label up to this many


def _figure(n_panels: int, T: int, cols: int | None = None, side_max: float = 9.0):
    from matplotlib.figure import Figure

    cols = cols or min(n_panels, 4)
    rows = -(-n_panels // cols)
    side = min(side_max, max(3.2, 0.42 * T + 1.6))
    fig = Figure(figsize=(side * cols + 0.8 * cols, side * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax in axes[n_panels:]:
        ax.set_visible(False)
    return fig, axes[:n_panels]


def _label(tok: str) -> str:
    return tok.replace("$", r"\$")  # a token is text, never mathtext


def _ticks(ax, tokens: list[str]) -> None:
    T = len(tokens)
    if T <= LABEL_MAX_T:
        pos = np.arange(T)
        labels = [_label(t) for t in tokens]
    else:
        pos = np.unique(np.linspace(0, T - 1, 9).round().astype(int))
        labels = [str(p + 1) for p in pos]
    ax.set_xticks(pos, labels, rotation=90, fontsize=8 if T > 16 else 9, parse_math=False)
    ax.set_yticks(pos, labels, fontsize=8 if T > 16 else 9, parse_math=False)
    ax.xaxis.tick_top()
    ax.set_xlabel("key j (may be read)")
    ax.set_ylabel("query i")
    ax.tick_params(length=0)


def _hatch(ax, kinds: np.ndarray) -> None:
    """Hatch the hatched kinds (padding), one rectangle per run along a row (few artists)."""
    hatched = np.isin(kinds, [c for c, k in KINDS.items() if k.hatch])
    if kinds.shape[0] > 256 or not hatched.any():
        return
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Rectangle

    rects = []
    for i, row in enumerate(hatched):
        j = 0
        while j < len(row):
            if row[j]:
                k = j
                while k < len(row) and row[k]:
                    k += 1
                rects.append(Rectangle((j - 0.5, i - 0.5), k - j, 1))
                j = k
            else:
                j += 1
    ax.add_collection(
        PatchCollection(rects, facecolor="none", edgecolor="#343a40", hatch=PAD_HATCH, linewidth=0)
    )


def _kind_image(kinds: np.ndarray, muted: bool = False):
    """RGBA image of the kinds; on value panels (muted) readable cells are transparent."""
    from matplotlib.colors import to_rgba

    img = np.zeros(kinds.shape + (4,))
    for code, k in KINDS.items():
        img[kinds == code] = to_rgba(k.muted if muted else k.color)
    if muted:
        img[kinds == READABLE, 3] = 0.0
    return img


def kind_legend(ax, kinds: np.ndarray, ncol: int = 1) -> None:
    """A legend with one entry per kind present in ``kinds`` (readable first)."""
    from matplotlib.patches import Patch

    present = [c for c in KINDS if (kinds == c).any()]
    handles = [
        Patch(
            facecolor=KINDS[c].color,
            edgecolor="#343a40",
            hatch=PAD_HATCH if KINDS[c].hatch else None,
            label=KINDS[c].label,
        )
        for c in present
    ]
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.02),
        ncol=ncol,
        fontsize=8,
        frameon=False,
    )


def _draw_mask(ax, kinds: np.ndarray, tokens: list[str], title: str) -> None:
    T = len(tokens)
    ax.imshow(_kind_image(kinds), interpolation="nearest", aspect="equal")
    _hatch(ax, kinds)
    if T <= ANNOTATE_MAX_T:  # the seed's additive form: 0 where allowed, -∞ where blocked
        for (i, j), k in np.ndenumerate(kinds):
            light = k in (masks.FUTURE, masks.WINDOW, masks.CHUNK, masks.MASK)
            ax.text(
                j,
                i,
                "0" if k == READABLE else "-∞",
                ha="center",
                va="center",
                fontsize=8,
                color="#495057" if light else "white",
            )
    _ticks(ax, tokens)
    ax.set_title(title, fontsize=10)
    kind_legend(ax, kinds)


def _draw_values(
    fig,
    ax,
    stage: str,
    values: np.ndarray,
    allowed: np.ndarray,
    tokens: list[str],
    kinds: np.ndarray,
    title: str,
) -> None:
    T = len(tokens)
    pad = pad_of(kinds)
    ax.imshow(_kind_image(kinds, muted=True), interpolation="nearest", aspect="equal")
    _hatch(ax, kinds)
    shown = np.ma.masked_where(~allowed | ~np.isfinite(values), values)
    if stage == "S":
        lim = float(np.abs(shown).max()) if shown.count() else 1.0
        vmin, vmax = -(lim or 1.0), (lim or 1.0)
    else:
        vmin, vmax = 0.0, (float(shown.max()) if shown.count() else 1.0) or 1.0
    im = ax.imshow(
        shown, cmap=_CMAPS[stage], vmin=vmin, vmax=vmax, interpolation="nearest", aspect="equal"
    )
    fig.colorbar(im, ax=ax, shrink=0.7)
    if T <= ANNOTATE_MAX_T:
        for (i, j), ok in np.ndenumerate(allowed):
            if ok:
                v = values[i, j]
                dark = abs(v) > 0.5 * vmax if stage == "S" else v > 0.55 * vmax
                ax.text(
                    j,
                    i,
                    f"{v:.3f}" if stage != "S" else f"{v:.2f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if dark else "black",
                )
    if stage == "A" and T <= LABEL_MAX_T:  # the softmax axis: Σ_j A_ij on the right of each row
        sums = np.where(allowed, values, 0.0).sum(axis=-1)
        for i, s in enumerate(sums):
            ax.text(
                T - 0.3,
                i,
                f"Σ={s:.3f}" if not pad[i] else "Σ=0 (pad)",
                ha="left",
                va="center",
                fontsize=7,
                color="#495057",
                clip_on=False,
            )
    _ticks(ax, tokens)
    ax.set_title(title, fontsize=10)


def _one_sequence(tr: Trace, seq: int | None):
    seqs = sequences(tr)
    if seq is None:
        if len(seqs) > 1:
            raise ValueError(
                f"viz: the trace holds {len(seqs)} sequences (A is {tr['A'].shape}); "
                "pick one with seq=b"
            )
        seq = 0
    if not 0 <= seq < len(seqs):
        raise ValueError(f"viz: seq={seq} is outside 0..{len(seqs) - 1}")
    return seqs[seq]


def _pattern_T(T, tokens) -> int:
    if T is None and tokens is None:
        raise ValueError("plot_mask: a Pattern needs its length: give T= or tokens=")
    T = len(tokens) if T is None else T
    if isinstance(T, bool) or not isinstance(T, (int, np.integer)) or T < 1:
        raise ValueError(f"plot_mask: T must be a positive integer, got {T!r}")
    return int(T)


def _kinds_of(mask, tokens, pad, T, b):
    """(kinds, T) for a boolean T×T mask or a masks.Pattern."""
    if isinstance(mask, masks.Pattern):
        from .kinds import pattern_kinds

        T = _pattern_T(T, tokens)
        return pattern_kinds(mask, T, b=b), T
    a = np.asarray(mask)
    if a.dtype != np.bool_ or a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(
            "plot_mask: the mask must be a boolean T×T matrix or a masks.Pattern, "
            f"got dtype {a.dtype} and shape {a.shape}"
        )
    T = a.shape[0]
    toks = None if tokens is None else [str(t) for t in tokens]
    if toks is not None and len(toks) != T:
        raise ValueError(f"plot_mask: {len(toks)} tokens for a {T}×{T} mask")
    pad = padding_positions(a, toks) if pad is None else np.asarray(pad, bool)
    return mask_kinds(a, pad), T


def plot_mask(
    mask, tokens=None, *, pad=None, title: str | None = None, T: int | None = None, b: int = 0
):
    """The ``T×T`` mask, each kind of cell in its own style, with a legend of the kinds.

    ``mask`` is a boolean ``T×T`` matrix (True = may read): its blocked cells are padding
    (``pad``, by default the rows with no readable key and any ``<PAD>`` token), future,
    or "by the mask". Or a :class:`causalattn.masks.Pattern`, drawn for sequence ``b`` at
    length ``T`` (or ``len(tokens)``): each blocked cell by its first reason (future,
    window, padding, document, chunk).
    """
    kinds, T = _kinds_of(mask, tokens, pad, T, b)
    toks = [str(i + 1) for i in range(T)] if tokens is None else [str(t) for t in tokens]
    if len(toks) != T:
        raise ValueError(f"plot_mask: {len(toks)} tokens for T = {T}")
    fig, (ax,) = _figure(1, T)
    _draw_mask(ax, kinds, toks, title or STAGE_TITLES["M"])
    return fig


def plot_patterns(patterns: dict, T: int, *, tokens=None, b: int = 0):
    """Several patterns side by side, one panel each, one shared legend of kinds.

    ``patterns`` maps titles to :class:`causalattn.masks.Pattern` (or boolean T×T masks)::

        plot_patterns({"causal": masks.Pattern(), "window 3": masks.Pattern(window=3)}, T=8)
    """
    if not isinstance(patterns, dict) or not patterns:
        raise ValueError("plot_patterns: give a non-empty dict {title: Pattern}")
    toks = [str(i + 1) for i in range(T)] if tokens is None else [str(t) for t in tokens]
    n = len(patterns)
    fig, axes = _figure(n, T, cols=3 if n in (5, 6) else min(n, 4), side_max=4.2)
    every = []
    for ax, (name, pat) in zip(axes, patterns.items()):
        kinds, _ = _kinds_of(pat, toks, None, T, b)
        every.append(kinds)
        ax.imshow(_kind_image(kinds), interpolation="nearest", aspect="equal")
        _hatch(ax, kinds)
        _ticks(ax, toks)
        ax.set_xlabel("")
        ax.set_title(str(name), fontsize=10)
    from matplotlib.patches import Patch

    allk = np.stack(every)
    handles = [
        Patch(
            facecolor=k.color,
            edgecolor="#343a40",
            hatch=PAD_HATCH if k.hatch else None,
            label=k.label,
        )
        for c, k in KINDS.items()
        if (allk == c).any()
    ]
    fig.legend(
        handles=handles,
        loc="outside lower center",
        ncol=min(len(handles), 4),
        fontsize=9,
        frameon=False,
    )
    return fig


def plot_stage(tr: Trace, stage: str = "A", *, seq: int | None = None, head: int | None = None):
    """One stage of a Trace as a heatmap: ``"M"`` (mask), ``"S"``, ``"A"`` or ``"norm"``.

    ``seq`` picks a sequence of a batched trace; ``head`` one head, otherwise every head
    is drawn as a grid (the mask, shared by the heads, as one panel).
    """
    if stage not in STAGE_TITLES:
        raise ValueError(f"plot_stage: stage must be one of {list(STAGE_TITLES)}, got {stage!r}")
    _, one, kinds = _one_sequence(tr, seq)
    hs = heads(one)
    if head is not None:
        if not 0 <= head < len(hs):
            raise ValueError(f"plot_stage: head={head} is outside 0..{len(hs) - 1}")
        hs, labels = [hs[head]], [head]
    else:
        labels = list(range(len(hs)))
    T = kinds.shape[0]
    tokens = tokens_of(one, T)
    if stage == "M":
        fig, (ax,) = _figure(1, T)
        _draw_mask(ax, kinds, tokens, STAGE_TITLES["M"])
        return fig
    fig, axes = _figure(len(hs), T)
    multi = one.n_heads is not None
    for ax, h, lab in zip(axes, hs, labels):
        values = contribution_norms(h) if stage == "norm" else h[stage]
        title = STAGE_TITLES[stage] + (f"\nhead {lab + 1}" if multi else "")
        _draw_values(fig, ax, stage, values, allowed_2d(h), tokens, kinds, title)
    return fig


def trace_figures(tr: Trace, stages=("M", "S", "A", "norm")) -> dict[str, object]:
    """Figures by name: ``{"A": Figure, ...}``, or ``{"seq1_A": ...}`` for several sequences.

    Heads are drawn as a grid in one figure per stage.
    """
    out = {}
    seqs = sequences(tr)
    for b in range(len(seqs)):
        for st in stages:
            out[st if len(seqs) == 1 else f"seq{b + 1}_{st}"] = plot_stage(tr, st, seq=b)
    return out


def save(fig, path) -> Path:
    """Write ``fig`` as PNG or SVG, chosen by the file's extension."""
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in ("png", "svg"):
        raise ValueError(f"save: {path.name}: the extension must be .png or .svg")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format=fmt, dpi=110 if fmt == "png" else None)
    return path


def write_figures(figures: dict[str, object], out_dir, formats=("png",)) -> list[Path]:
    """Save each named figure in ``out_dir`` once per format; returns the paths written."""
    out = Path(out_dir)
    paths = []
    for name, fig in figures.items():
        for fmt in formats:
            paths.append(save(fig, out / f"{name}.{fmt}"))
    return paths
