"""``causalattn masks``: token-labelled causal, padding and combined masks for each sentence."""

from __future__ import annotations

from pathlib import Path

import typer

from .. import text
from ._app import (
    _MAX_BYTES_HELP,
    DEFAULT_MAX_BYTES,
    SEQ_LEN,
    _fail,
    _Json,
    _library_errors,
    command_app,
)
from ._figures import _write_pngs
from ._inputs import _encode_quiet, _read_corpus
from ._output import _check_out_dir, _console, _markup_escape, _print_json, _progress
from ._positions import shown
from ._present import _SHOW_N, _SHOW_SENTENCES, _mask_pair, _MaskView, _print_tables

_FORMS = ("both", "additive", "check")


command = command_app()


@command.command("masks")
def masks(
    sentences: list[str] = typer.Argument(None, help="Sentences (default: the seed's four)."),
    file: Path = typer.Option(None, "--file", "-f", help="Corpus file, one sentence a line."),
    max_len: int = typer.Option(None, SEQ_LEN, help="Pad/truncate to this many tokens."),
    form: str = typer.Option("both", "--form", help="both | additive (0/-∞) | check (✓/·)."),
    full: bool = typer.Option(False, "--full", help="Every cell of every mask, however large."),
    png: Path = typer.Option(None, "--png", help="Also draw each sentence's mask into DIR as PNG."),
    max_bytes: int = typer.Option(DEFAULT_MAX_BYTES, "--max-bytes", help=_MAX_BYTES_HELP),
    window: int = typer.Option(None, "--window", help="Each query reads its last W positions."),
    chunk: int = typer.Option(None, "--chunk", help="Each query reads only its own chunk of C."),
    as_json: _Json = False,
) -> None:
    """Token-labelled causal, padding and combined masks for each sentence (large ones summarized).

    --window and --chunk add those rules of the one M (masks.Pattern) to causal AND padding.
    """
    if form not in _FORMS:
        _fail(f"--form must be one of {', '.join(_FORMS)}, got {form!r}")
    if sentences and file is not None:
        _fail("give sentences or --file, not both")
    if png is not None:
        _check_out_dir("--png", png)
    corpus = (
        _read_corpus(file, max_bytes)
        if file is not None
        else (sentences or list(text.SEED_SENTENCES))
    )
    with _library_errors():
        batch = _encode_quiet(
            corpus, max_len=max_len, max_bytes=max_bytes, window=window, chunk=chunk
        )
        if full:  # everything below is dense: refuse now rather than half-way
            text.check_bytes(
                f"--full: the masks (B, N, N) = ({batch.B}, {batch.N}, {batch.N})",
                batch.B * batch.N * batch.N * (60 if as_json else 1),
                max_bytes,
                "drop --full to see them summarized, or raise --max-bytes",
            )
        view = _MaskView(batch, full)
    if png is not None:
        with _library_errors():
            _write_pngs(
                png,
                lambda viz: {
                    f"mask_sentence{shown(b)}": viz.plot_mask(
                        batch.pattern, batch.tokens[b], T=batch.N, b=b
                    )
                    for b in _progress(range(batch.B), "drawing", as_json)
                },
            )
    if as_json:
        _print_json(
            {
                "N": batch.N,
                "pattern": batch.pattern.describe(),
                "vocab": batch.vocab.tokens,
                "causal": view.to_json(None),
                "truncated": shown(batch.truncated),
                "sentences": [
                    {
                        "tokens": batch.tokens[b],
                        "ids": batch.ids[b],
                        "length": batch.lengths[b],
                        "key_padding": batch.key_padding_mask[b]
                        if view.dense
                        else {
                            "shape": [batch.N],
                            "summarized": True,
                            "cols": shown(view.pos),
                            "cells": view.key_padding(b),
                        },
                        "combined": view.to_json(b),
                    }
                    for b in range(batch.B)
                ],
            }
        )
        return
    console = _console()
    longest = batch.tokens[int(batch.lengths.argmax())]
    pos = view.pos
    rules = batch.pattern.describe().replace(" + padding", "")  # "causal + window 3"
    _print_tables(
        console,
        _mask_pair(
            f"{rules} {batch.N}×{batch.N}",
            view.causal(),
            [longest[p] for p in pos],
            [longest[p] for p in pos],
            form,
            pos,
            pos,
        ),
    )
    if view.note(None):
        console.print(view.note(None), style="dim", markup=False)
        console.print()
    listed = batch.B if full else min(batch.B, _SHOW_SENTENCES)
    for b in range(listed):
        toks = batch.tokens[b]
        words = " ".join(toks if full or batch.N <= _SHOW_N else toks[: int(batch.lengths[b])])
        if len(words) > 400 and not full:
            words = words[:400] + " …"
        console.print(
            f"[bold]sentence {shown(b)}[/] ({batch.lengths[b]} tokens): {_markup_escape(words)}"
        )
        labels = [toks[p] for p in pos]
        _print_tables(
            console,
            _mask_pair("key padding", view.key_padding(b)[None], ["keys"], labels, form, [0], pos),
        )
        _print_tables(
            console,
            _mask_pair(
                f"combined ({rules} AND padding)", view.combined(b), labels, labels, form, pos, pos
            ),
        )
        if view.note(b):
            console.print(view.note(b), style="dim", markup=False)
            console.print()
    if listed < batch.B:
        console.print(
            f"… {batch.B - listed:,} more sentences not shown (--full shows every "
            "one; --json lists every one)",
            style="dim",
            markup=False,
        )
