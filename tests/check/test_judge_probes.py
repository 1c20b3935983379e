"""The judge's per-probe findings on hand-made measurement records (determinism, linearity
in V, the width of V, the output projection, large scores, long fp16 rows), findings merged
by head, what a further probe adds to the main one, what the probes that ran cannot show,
and the verdict."""

from __future__ import annotations
