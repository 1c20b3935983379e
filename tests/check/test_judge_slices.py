"""The judge's per-slice findings on hand-made measurement records: values through the
wrong rows or through Aᵀ, the read pattern against the catalogue's forms, weights that no
softmax gives, lost precision and rows scaled by a factor of their own."""

from __future__ import annotations
