"""The judge's scale (S) and normalization (A) findings on hand-made measurement records:
the fitted factor and the size it is named by, and rows that do not sum as a softmax's."""

from __future__ import annotations
