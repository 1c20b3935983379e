"""Pictures of attention: matplotlib heatmaps and the offline HTML explorer.

Heatmaps (need the ``viz`` extra, matplotlib, imported only when a figure is drawn)::

    plot_mask(allowed, tokens)        # allowed / causally blocked / padding blocked
    plot_stage(tr, "A")               # "M", "S", "A" or "norm" (‖A_ij v_j‖), grid of heads
    save(fig, "A.svg")                # PNG or SVG by extension

The explorer (no extra; one self-contained HTML file, no network)::

    write_explorer(tr, "report.html")                     # a Trace, a list of them, or a Batch
    write_explorer(sentence_traces(text.SEED_SENTENCES), "seed.html")
"""

from .explorer import (
    batch_traces,
    explorer_data,
    explorer_fragment,
    explorer_html,
    sentence_names,
    sentence_traces,
    write_explorer,
)
from .heatmaps import plot_mask, plot_stage, save, trace_figures, write_figures
from .kinds import mask_kinds, padding_positions

__all__ = [
    "plot_mask",
    "plot_stage",
    "trace_figures",
    "save",
    "write_figures",
    "mask_kinds",
    "padding_positions",
    "explorer_data",
    "explorer_fragment",
    "explorer_html",
    "write_explorer",
    "batch_traces",
    "sentence_traces",
    "sentence_names",
]
