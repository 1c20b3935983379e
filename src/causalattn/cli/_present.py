"""How the commands draw masks in the terminal: token-labelled tables (0/-∞ or ✓/·), and
:class:`_MaskView`, what `masks` shows of a batch (every cell, or corners and counts)."""

from __future__ import annotations

import numpy as np
from rich.columns import Columns
from rich.table import Table
from rich.text import Text

from .. import masks as _m
from ._positions import shown


def _mask_table(
    title: str, allowed, rows: list[str], cols: list[str], form: str, row_pos=None, col_pos=None
):
    """A token-labelled mask: rows are queries, columns keys; form 'additive' (0/-∞) or 'check'
    (✓/·).

    ``row_pos`` / ``col_pos`` (0-based, default 0, 1, ...) label a summarized mask's
    corner cells with their positions (shown 1-based); a gap between two shown positions
    gets a ``⋮`` row or a ``…`` column.
    """
    row_pos = list(range(len(rows))) if row_pos is None else list(row_pos)
    col_pos = list(range(len(cols))) if col_pos is None else list(col_pos)
    gap_c = [k for k in range(1, len(col_pos)) if col_pos[k] != col_pos[k - 1] + 1]
    on, off = ("0", "-∞") if form == "additive" else ("✓", "·")
    t = Table(title=title, box=None, pad_edge=False, padding=(0, 1), title_justify="left")
    t.add_column("query \\ key", style="bold", no_wrap=True)
    for k, (j, c) in enumerate(zip(col_pos, cols)):  # Text, not markup: tokens are user data
        if k in gap_c:
            t.add_column("…", justify="center", no_wrap=True)
        t.add_column(Text(f"{shown(j)}\n{c[:5]}"), justify="center", no_wrap=True)
    for k, (i, r) in enumerate(zip(row_pos, rows)):
        if k and i != row_pos[k - 1] + 1:
            t.add_row("⋮", *(["⋮"] * (len(cols) + len(gap_c))))
        cells = [Text(on, style="green") if a else Text(off, style="dim") for a in allowed[k]]
        for g in reversed(gap_c):
            cells.insert(g, Text("…", style="dim"))
        t.add_row(Text(f"{shown(i)} {r}" if len(rows) > 1 else r), *cells)
    return t


def _mask_pair(title: str, allowed, rows, cols, form: str, row_pos=None, col_pos=None) -> list:
    forms = ["additive", "check"] if form == "both" else [form]
    names = {"additive": "M, 0/-∞", "check": "may read, ✓/·"}
    return [
        _mask_table(f"{title}: {names[f]}", allowed, rows, cols, f, row_pos, col_pos) for f in forms
    ]


def _print_tables(console, tables: list) -> None:
    console.print(Columns(tables, padding=(0, 4)) if len(tables) > 1 else tables[0])
    console.print()


# A mask is printed cell by cell when N <= 32 and the batch holds at most 2**16 cells
# (or with --full); otherwise as counts and its first and last _CORNER rows and columns.
_SHOW_N, _SHOW_CELLS, _CORNER, _SHOW_SENTENCES = 32, 2**16, 4, 20


class _MaskView:
    """What `masks` shows of a batch's masks: every cell, or corners and counts."""

    def __init__(self, batch, full: bool):
        B, N = batch.B, batch.N
        self.batch = batch
        self.dense = full or (N <= _SHOW_N and B * N * N <= _SHOW_CELLS)
        k = min(_CORNER, N // 2)
        self.pos = list(range(N)) if self.dense else list(range(k)) + list(range(N - k, N))
        if self.dense:
            return
        # the four corners of every sentence's mask, (B, 2k, 2k), without the N×N rest
        causal = _m.Pattern(causal=True, window=batch.window, chunk=batch.chunk)
        self._corners = np.block(
            [[batch.mask_block(r0, r0 + k, c0, c0 + k) for c0 in (0, N - k)] for r0 in (0, N - k)]
        )
        self._causal = np.block(
            [
                [causal.tile(1, 1, N, N, r0, r0 + k, c0, c0 + k)[0, 0] for c0 in (0, N - k)]
                for r0 in (0, N - k)
            ]
        )
        self._counts = batch.mask_counts()
        self._causal_counts = _m.counts(np.array([N]), N, window=batch.window, chunk=batch.chunk)

    def causal(self):
        return self.batch.causal_mask if self.dense else self._causal

    def combined(self, b: int):
        return self.batch.sentence_mask(b) if self.dense else self._corners[b]

    def key_padding(self, b: int):
        return self.batch.key_padding_mask[b][self.pos]

    def counts(self, b: int | None) -> dict:
        c = self._causal_counts if b is None else self._counts
        return {k: int(v[0 if b is None else b]) for k, v in c.items()}

    def to_json(self, b: int | None):
        cells = self.causal() if b is None else self.combined(b)
        if self.dense:
            return cells
        N = self.batch.N
        pos = shown(self.pos)
        return {
            "shape": [N, N],
            "summarized": True,
            "rows": pos,
            "cols": pos,
            "cells": cells,
            **self.counts(b),
        }

    def note(self, b: int | None) -> str:
        if self.dense:
            return ""
        c = self.counts(b)
        blocked = ", ".join(f"{v:,} blocked ({k})" for k, v in c.items() if k != "readable")
        return (
            f"{c['readable']:,} readable, {blocked}; first and last {len(self.pos) // 2} "
            "rows and columns shown (--full for every cell)"
        )
