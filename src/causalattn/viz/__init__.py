"""Pictures of attention: matplotlib heatmaps and the offline HTML explorer.

Heatmaps (need the ``viz`` extra, matplotlib, imported only when a figure is drawn)::

    plot_mask(allowed, tokens)        # readable / future / padding (each kind with a legend)
    plot_mask(masks.Pattern(window=3), T=8)           # a pattern: future, window, padding...
    plot_patterns({"causal": Pattern(), "window 3": Pattern(window=3)}, T=8)  # side by side
    plot_stage(tr, "A")               # "M", "S", "A" or "norm" (‖A_ij v_j‖), grid of heads
    save(fig, "A.svg")                # PNG or SVG by extension

The explorer (no extra; one self-contained HTML file, no network)::

    write_explorer(tr, "report.html")                     # a Trace, a list of them, or a Batch
    write_explorer(sentence_traces(text.SEED_SENTENCES), "seed.html")
"""

from .explorer import explorer_data, explorer_fragment, explorer_html, write_explorer
from .heatmaps import plot_mask, plot_patterns, plot_stage, save, trace_figures, write_figures
from .kinds import KINDS, mask_kinds, padding_positions, pattern_kinds, trace_kinds
from .notebook import register as _register_notebook_display
from .sentences import batch_traces, sentence_names, sentence_traces

_register_notebook_display()

__all__ = [
    "plot_mask",
    "plot_patterns",
    "plot_stage",
    "trace_figures",
    "save",
    "write_figures",
    "KINDS",
    "mask_kinds",
    "pattern_kinds",
    "trace_kinds",
    "padding_positions",
    "explorer_data",
    "explorer_fragment",
    "explorer_html",
    "write_explorer",
    "batch_traces",
    "sentence_traces",
    "sentence_names",
]
