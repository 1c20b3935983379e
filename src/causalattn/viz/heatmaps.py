"""Matplotlib heatmaps of one attention computation, tokens on both axes.

Rows are queries i, columns are keys j, as in the seeds. Figures are built with
``matplotlib.figure.Figure`` directly (the Agg canvas, no pyplot state, no display
needed), and matplotlib is imported only when a figure is drawn: it is the ``viz`` extra.

    fig = plot_mask(batch.mask[3], batch.tokens[3])     # allowed / causal / padding
    fig = plot_stage(tr, "A")                           # a grid of heads
    save(fig, "out/A.svg")                              # PNG or SVG by extension
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..trace import Trace
from .kinds import (
    ALLOWED,
    CAUSAL,
    KIND_NAMES,
    PADDING,
    allowed_2d,
    contribution_norms,
    heads,
    mask_kinds,
    padding_positions,
    sequences,
    tokens_of,
)

__all__ = ["plot_mask", "plot_stage", "trace_figures", "save", "write_figures", "STAGE_TITLES"]

# Three mask styles: a solid colour, a light grey, and a dark grey with hatching.
KIND_COLORS = {ALLOWED: "#2f9e44", CAUSAL: "#e9ecef", PADDING: "#6c757d"}
BLOCKED_COLORS = {CAUSAL: "#dfe2e6", PADDING: "#8f979e"}  # under S, A and norm heatmaps
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


def _figure(n_panels: int, T: int, cols: int | None = None):
    from matplotlib.figure import Figure

    cols = cols or min(n_panels, 4)
    rows = -(-n_panels // cols)
    side = min(9.0, max(3.2, 0.42 * T + 1.6))
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


def _hatch_padding(ax, kinds: np.ndarray) -> None:
    """Hatch padding cells, one rectangle per run along a row (few artists, even for big T)."""
    if kinds.shape[0] > 256 or not (kinds == PADDING).any():
        return
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Rectangle

    rects = []
    for i, row in enumerate(kinds == PADDING):
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


def _kind_image(kinds: np.ndarray, colors: dict[int, str], allowed_alpha: float = 1.0):
    from matplotlib.colors import to_rgba

    img = np.zeros(kinds.shape + (4,))
    for k, c in colors.items():
        img[kinds == k] = to_rgba(c)
    if ALLOWED not in colors:
        img[kinds == ALLOWED, 3] = 0.0
    return img


def _draw_mask(ax, allowed: np.ndarray, tokens: list[str], pad: np.ndarray, title: str) -> None:
    from matplotlib.patches import Patch

    kinds = mask_kinds(allowed, pad)
    T = len(tokens)
    ax.imshow(_kind_image(kinds, KIND_COLORS), interpolation="nearest", aspect="equal")
    _hatch_padding(ax, kinds)
    if T <= ANNOTATE_MAX_T:  # the seed's additive form: 0 where allowed, -∞ where blocked
        for (i, j), k in np.ndenumerate(kinds):
            ax.text(j, i, "0" if k == ALLOWED else "-∞", ha="center", va="center", fontsize=8,
                    color="white" if k != CAUSAL else "#495057")
    _ticks(ax, tokens)
    ax.set_title(title, fontsize=10)
    handles = [
        Patch(facecolor=KIND_COLORS[k], edgecolor="#343a40",
              hatch=PAD_HATCH if k == PADDING else None, label=KIND_NAMES[k])
        for k in (ALLOWED, CAUSAL, PADDING)
    ]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=1,
              fontsize=8, frameon=False)


def _draw_values(fig, ax, stage: str, values: np.ndarray, allowed: np.ndarray,
                 tokens: list[str], pad: np.ndarray, title: str) -> None:
    kinds = mask_kinds(allowed, pad)
    T = len(tokens)
    ax.imshow(_kind_image(kinds, BLOCKED_COLORS), interpolation="nearest", aspect="equal")
    _hatch_padding(ax, kinds)
    shown = np.ma.masked_where(~allowed | ~np.isfinite(values), values)
    if stage == "S":
        lim = float(np.abs(shown).max()) if shown.count() else 1.0
        vmin, vmax = -(lim or 1.0), (lim or 1.0)
    else:
        vmin, vmax = 0.0, (float(shown.max()) if shown.count() else 1.0) or 1.0
    im = ax.imshow(shown, cmap=_CMAPS[stage], vmin=vmin, vmax=vmax, interpolation="nearest",
                   aspect="equal")
    fig.colorbar(im, ax=ax, shrink=0.7)
    if T <= ANNOTATE_MAX_T:
        for (i, j), ok in np.ndenumerate(allowed):
            if ok:
                v = values[i, j]
                dark = abs(v) > 0.5 * vmax if stage == "S" else v > 0.55 * vmax
                ax.text(j, i, f"{v:.3f}" if stage != "S" else f"{v:.2f}", ha="center",
                        va="center", fontsize=7, color="white" if dark else "black")
    if stage == "A" and T <= LABEL_MAX_T:  # the softmax axis: Σ_j A_ij on the right of each row
        sums = np.where(allowed, values, 0.0).sum(axis=-1)
        for i, s in enumerate(sums):
            ax.text(T - 0.3, i, f"Σ={s:.3f}" if not pad[i] else "Σ=0 (pad)", ha="left",
                    va="center", fontsize=7, color="#495057", clip_on=False)
    _ticks(ax, tokens)
    ax.set_title(title, fontsize=10)


def _one_sequence(tr: Trace, seq: int | None) -> Trace:
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
    return seqs[seq][1]


def plot_mask(allowed, tokens=None, *, pad=None, title: str | None = None):
    """The ``T×T`` mask in three styles: allowed, causally blocked, padding blocked.

    ``allowed`` is boolean (True = may read). ``pad`` marks padding positions; by default
    they are the query rows with no readable key and any ``<PAD>`` token.
    """
    a = np.asarray(allowed)
    if a.dtype != np.bool_ or a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(
            f"plot_mask: the mask must be a boolean T×T matrix, got dtype {a.dtype} and shape {a.shape}"
        )
    T = a.shape[0]
    toks = [str(i + 1) for i in range(T)] if tokens is None else [str(t) for t in tokens]
    if len(toks) != T:
        raise ValueError(f"plot_mask: {len(toks)} tokens for a {T}×{T} mask")
    pad = padding_positions(a, toks if tokens is not None else None) if pad is None else np.asarray(pad, bool)
    fig, (ax,) = _figure(1, T)
    _draw_mask(ax, a, toks, pad, title or STAGE_TITLES["M"])
    return fig


def plot_stage(tr: Trace, stage: str = "A", *, seq: int | None = None, head: int | None = None):
    """One stage of a Trace as a heatmap: ``"M"`` (mask), ``"S"``, ``"A"`` or ``"norm"``.

    ``seq`` picks a sequence of a batched trace; ``head`` one head, otherwise every head
    is drawn as a grid (the mask, shared by the heads, as one panel).
    """
    if stage not in STAGE_TITLES:
        raise ValueError(f"plot_stage: stage must be one of {list(STAGE_TITLES)}, got {stage!r}")
    one = _one_sequence(tr, seq)
    hs = heads(one)
    if head is not None:
        if not 0 <= head < len(hs):
            raise ValueError(f"plot_stage: head={head} is outside 0..{len(hs) - 1}")
        hs, labels = [hs[head]], [head]
    else:
        labels = list(range(len(hs)))
    allowed = allowed_2d(hs[0])
    T = allowed.shape[0]
    tokens = tokens_of(one, T)
    pad = padding_positions(allowed, one.tokens if one.tokens is not None and len(one.tokens) == T else None)
    if stage == "M":
        fig, (ax,) = _figure(1, T)
        _draw_mask(ax, allowed, tokens, pad, STAGE_TITLES["M"])
        return fig
    fig, axes = _figure(len(hs), T)
    multi = one.n_heads is not None
    for ax, h, lab in zip(axes, hs, labels):
        values = contribution_norms(h) if stage == "norm" else h[stage]
        title = STAGE_TITLES[stage] + (f"\nhead {lab + 1}" if multi else "")
        _draw_values(fig, ax, stage, values, allowed_2d(h), tokens, pad, title)
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
