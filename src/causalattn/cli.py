"""The `causalattn` command: a thin shell over the library (typer + rich).

Every command takes ``--json`` for machine-readable output. Positions on the command
line and in its output (text and JSON) are 1-based, as in the chapter (h_1 … h_T); the
Python API is 0-based. Every failure is one ``error: ...`` line on stderr and exit 2
(usage errors too, followed by a hint to ``--help``); nothing prints a traceback.
Commands that would build large arrays refuse past ``--max-bytes`` (1 GiB by default)
with the size they would need.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from typer import _click as click  # the click typer vendors: its exceptions are these
from typer.core import TyperGroup
from typer.exceptions import Abort


class _OneLineErrors(TyperGroup):
    """typer's group, but every failure is one leading ``error: ...`` line and exit 2.

    Usage errors (unknown option, missing argument, bad value) keep click's exit 2 and
    add a ``Try ... --help`` line; anything unexpected becomes ``error: internal error``
    instead of a traceback (``CAUSALATTN_DEBUG=1`` shows the traceback).
    """

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            rv = super().main(
                args=args,
                prog_name=prog_name,
                complete_var=complete_var,
                standalone_mode=False,
                **extra,
            )
        except click.exceptions.NoArgsIsHelpError as exc:
            click.echo(exc.ctx.get_help())
            rv = 2
        except click.exceptions.UsageError as exc:
            click.echo(f"error: {exc.format_message()}", err=True)
            cmd = exc.ctx.command_path if exc.ctx is not None else "causalattn"
            click.echo(f"Try '{cmd} --help' for help.", err=True)
            rv = 2
        except click.exceptions.ClickException as exc:
            click.echo(f"error: {exc.format_message()}", err=True)
            rv = 2
        except Abort as exc:
            cause = exc.__cause__
            if isinstance(cause, KeyboardInterrupt) or cause is None:
                click.echo("error: interrupted", err=True)
                rv = 130
            else:
                click.echo(f"error: unexpected end of input ({type(cause).__name__})", err=True)
                rv = 2
        except BrokenPipeError:  # `causalattn ... | head`: the reader left; say nothing
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (flushed at exit, never read)
            rv = 1
        except MemoryError:
            click.echo("error: out of memory; lower --max-bytes or the input size", err=True)
            rv = 2
        except RecursionError:
            click.echo("error: input nested too deeply", err=True)
            rv = 2
        except Exception as exc:  # a bug: still one line, unless debugging
            if os.environ.get("CAUSALATTN_DEBUG"):
                raise
            msg = str(exc).splitlines()[0] if str(exc) else ""
            click.echo(
                f"error: internal error: {type(exc).__name__}: {msg} (CAUSALATTN_DEBUG=1 "
                "shows the traceback; please report it)",
                err=True,
            )
            rv = 2
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)


app = typer.Typer(
    cls=_OneLineErrors,
    add_completion=False,
    no_args_is_help=True,
    help="Causal self-attention in matrix form: H = softmax_last(Q Kᵀ/√d_k + M) V.",
)

# Arrays past this many bytes are refused (--max-bytes raises it): a 100,000-token
# sentence's N×N float64 stage alone is 80 GB.
DEFAULT_MAX_BYTES = 2**30
_MAX_BYTES_HELP = "Refuse to build arrays larger than this many bytes (default 1 GiB)."
_Json = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]


# -- shared helpers (every command uses them) --------------------------------------------


def _fail(message: str, code: int = 2) -> NoReturn:
    """Print ``error: message`` on stderr and exit with ``code`` (2), no traceback."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


@contextmanager
def _library_errors():
    """Turn the library's ValueError (and file errors) into :func:`_fail`."""
    try:
        yield
    except (ValueError, OSError) as exc:
        _fail(str(exc))
    except MemoryError:
        _fail("out of memory; lower the input size or --max-bytes")


def _print_json(data) -> None:
    from .check.report import jsonable

    typer.echo(json.dumps(jsonable(data), ensure_ascii=False, indent=2))


def _console():
    from rich.console import Console

    return Console(highlight=False)


def _markup_escape(s: str) -> str:
    """Escape rich markup in library text (formulas like ``C[i, j]``, user tokens)."""
    from rich.markup import escape as _escape

    return _escape(s)


def _fmt(a, precision: int = 3) -> str:
    import numpy as np

    return np.array2string(np.asarray(a), precision=precision, suppress_small=True)


def _mask_table(
    title: str, allowed, rows: list[str], cols: list[str], form: str, row_pos=None, col_pos=None
):
    """A token-labelled mask: rows are queries, columns keys; form 'additive' (0/-∞) or 'check'
    (✓/·).

    ``row_pos`` / ``col_pos`` (0-based, default 0, 1, ...) label a summarized mask's
    corner cells with their positions (shown 1-based); a gap between two shown positions
    gets a ``⋮`` row or a ``…`` column.
    """
    from rich.table import Table
    from rich.text import Text

    row_pos = list(range(len(rows))) if row_pos is None else list(row_pos)
    col_pos = list(range(len(cols))) if col_pos is None else list(col_pos)
    gap_c = [k for k in range(1, len(col_pos)) if col_pos[k] != col_pos[k - 1] + 1]
    on, off = ("0", "-∞") if form == "additive" else ("✓", "·")
    t = Table(title=title, box=None, pad_edge=False, padding=(0, 1), title_justify="left")
    t.add_column("query \\ key", style="bold", no_wrap=True)
    for k, (j, c) in enumerate(zip(col_pos, cols)):  # Text, not markup: tokens are user data
        if k in gap_c:
            t.add_column("…", justify="center", no_wrap=True)
        t.add_column(Text(f"{j + 1}\n{c[:5]}"), justify="center", no_wrap=True)
    for k, (i, r) in enumerate(zip(row_pos, rows)):
        if k and i != row_pos[k - 1] + 1:
            t.add_row("⋮", *(["⋮"] * (len(cols) + len(gap_c))))
        cells = [Text(on, style="green") if a else Text(off, style="dim") for a in allowed[k]]
        for g in reversed(gap_c):
            cells.insert(g, Text("…", style="dim"))
        t.add_row(Text(f"{i + 1} {r}" if len(rows) > 1 else r), *cells)
    return t


def _mask_pair(title: str, allowed, rows, cols, form: str, row_pos=None, col_pos=None) -> list:
    forms = ["additive", "check"] if form == "both" else [form]
    names = {"additive": "M, 0/-∞", "check": "may read, ✓/·"}
    return [
        _mask_table(f"{title}: {names[f]}", allowed, rows, cols, f, row_pos, col_pos) for f in forms
    ]


def _print_tables(console, tables: list) -> None:
    from rich.columns import Columns

    console.print(Columns(tables, padding=(0, 4)) if len(tables) > 1 else tables[0])
    console.print()


def _encode_quiet(sentences, max_len=None, max_bytes=DEFAULT_MAX_BYTES, **rules):
    """text.encode, with its truncation warning shown as a note on stderr."""
    from . import text

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch = text.encode(sentences, max_len=max_len, max_bytes=max_bytes, **rules)
    for w in caught:
        typer.echo(f"note: {w.message}", err=True)
    return batch


# -- causalattn shapes ------------------------------------------------------------------


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _si(n: int) -> str:
    """1234567 -> '1.23 M' (decimal prefixes, as FLOP counts are usually quoted)."""
    for div, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.3g} {unit}"
    return str(n)


@app.command()
def shapes(
    seq_len: int = typer.Option(2048, "--seq-len", "-T", help="Sequence length T (N)."),
    d_model: int = typer.Option(1000, "--d-model", help="Model (embedding) width d_model."),
    heads: int = typer.Option(1, "--heads", "-H", help="Number of heads h."),
    d_k: int = typer.Option(None, "--d-k", help="Query/key width per head (default d_model/h)."),
    d_v: int = typer.Option(None, "--d-v", help="Value width per head (default d_k)."),
    as_json: _Json = False,
) -> None:
    """The seed's dimension table for T, d_model and heads, with params, bytes and FLOPs."""
    from .shapes import shape_table

    with _library_errors():
        rows = shape_table(seq_len, d_model, n_heads=heads, d_k=d_k, d_v=d_v)
    by = {r.symbol: r for r in rows}
    dense = by["QKᵀ"].flops + by["H"].flops
    totals = {
        "params": sum(r.params for r in rows),
        "flops": sum(r.flops for r in rows),
        "attention_flops_dense": dense,
        "attention_flops_causal": dense // 2,
    }
    if as_json:
        _print_json(
            {
                "seq_len": seq_len,
                "d_model": d_model,
                "n_heads": heads,
                "rows": [r.to_dict() for r in rows],
                "totals": totals,
            }
        )
        return
    from rich.table import Table

    t = Table(
        title=f"T = {seq_len}, d_model = {d_model}, heads = {heads}", title_justify="left", box=None
    )
    for c in ("Symbol", "Shape", "Params", "fp32", "bf16", "FLOPs"):
        t.add_column(c, no_wrap=True, justify="left" if c in ("Symbol", "Shape") else "right")
    for r in rows:
        t.add_row(
            r.symbol,
            r.notation,
            _si(r.params),
            _human_bytes(r.bytes_fp32),
            _human_bytes(r.bytes_bf16),
            _si(r.flops),
        )
    console = _console()
    console.print(t)
    console.print()
    for r in rows:
        console.print(
            f"[bold]{_markup_escape(r.symbol)}[/] ({r.name}): {_markup_escape(r.explanation)}"
        )
    console.print(
        f"parameters {totals['params']:,}; attention FLOPs (QKᵀ + A V, docs/design.md's 4·H·T²·d): "
        f"dense {_si(dense)}, causal {_si(dense // 2)}; all rows {_si(totals['flops'])}"
    )


# -- causalattn masks -------------------------------------------------------------------

_FORMS = ("both", "additive", "check")


def _read_corpus(path: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> list[str]:
    """The non-blank lines of a UTF-8 corpus file (the one reader: a regular file within
    --max-bytes, checked before it is read)."""
    from .check import AuditInputError
    from .check.files import read_text

    try:
        lines = read_text(path, max_bytes).splitlines()
    except AuditInputError as exc:
        _fail(f"text: cannot read corpus file {exc}")
    corpus = [ln for ln in lines if ln.strip()]
    if not corpus:
        _fail(f"text: the corpus file {path} has no sentences")
    return corpus


# Outputs: the folder that holds an output file must exist (no folder is created for
# -o/--output or --save); --png DIR creates DIR itself, never its parents.
def _check_out_file(flag: str, path: Path) -> None:
    if path.is_dir():
        _fail(f"{flag}: {path} is a folder; give a file name")
    parent = path.parent
    if not parent.is_dir():
        _fail(f"{flag}: the folder {parent} does not exist (create it first)")


def _check_out_dir(flag: str, path: Path) -> None:
    if path.exists() and not path.is_dir():
        _fail(f"{flag}: {path} exists and is not a folder")
    if not path.exists() and not path.parent.is_dir():
        _fail(f"{flag}: the folder {path.parent} does not exist (create it first)")


def _progress(items, description: str, quiet: bool):
    """``items`` with a rich progress bar on stderr when it is a terminal and not --json."""
    if quiet or not sys.stderr.isatty():
        return items
    from rich.console import Console
    from rich.progress import track

    return track(items, description=description, console=Console(stderr=True), transient=True)


def _write_pngs(out_dir: Path, make) -> None:
    """Draw ``make(causalattn.viz)``'s named figures into ``out_dir`` as PNG (needs matplotlib)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        _fail("--png needs matplotlib: pip install 'causalattn[viz]'")
    from . import viz

    _check_out_dir("--png", out_dir)
    try:
        out_dir.mkdir(exist_ok=True)
    except OSError as exc:
        _fail(f"--png: cannot create {out_dir} ({exc.strerror or exc})")
    with _library_errors():
        paths = viz.write_figures(make(viz), out_dir)
    typer.echo(f"wrote {len(paths)} PNG files to {out_dir}", err=True)


# A mask is printed cell by cell when N <= 32 and the batch holds at most 2**16 cells
# (or with --full); otherwise as counts and its first and last _CORNER rows and columns.
_SHOW_N, _SHOW_CELLS, _CORNER, _SHOW_SENTENCES = 32, 2**16, 4, 20


class _MaskView:
    """What `masks` shows of a batch's masks: every cell, or corners and counts."""

    def __init__(self, batch, full: bool):
        import numpy as np

        from . import masks as _m

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
        pos = [p + 1 for p in self.pos]  # 1-based, as everything on the command line
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


@app.command()
def masks(
    sentences: list[str] = typer.Argument(None, help="Sentences (default: the seed's four)."),
    file: Path = typer.Option(None, "--file", "-f", help="Corpus file, one sentence a line."),
    max_len: int = typer.Option(None, "--max-len", help="Pad/truncate to this many tokens."),
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
    from . import text

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
                    f"mask_sentence{b + 1}": viz.plot_mask(
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
                "positions": "1-based",
                "vocab": batch.vocab.tokens,
                "causal": view.to_json(None),
                "truncated": [b + 1 for b in batch.truncated],
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
                            "cols": [p + 1 for p in view.pos],
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
    shown = batch.B if full else min(batch.B, _SHOW_SENTENCES)
    for b in range(shown):
        toks = batch.tokens[b]
        words = " ".join(toks if full or batch.N <= _SHOW_N else toks[: int(batch.lengths[b])])
        if len(words) > 400 and not full:
            words = words[:400] + " …"
        console.print(
            f"[bold]sentence {b + 1}[/] ({batch.lengths[b]} tokens): {_markup_escape(words)}"
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
    if shown < batch.B:
        console.print(
            f"… {batch.B - shown:,} more sentences not shown (--full shows every "
            "one; --json lists every one)",
            style="dim",
            markup=False,
        )


# -- causalattn trace -------------------------------------------------------------------

_CHAPTER = {  # the chapter's four-token example
    "X": [[1, 0], [0, 1], [1, 1], [-1, 1]],
    "W_q": [[1, 0], [0, 1]],
    "W_k": [[1, 0], [0, 1]],
    "W_v": [[1, 1], [1, -1]],
}
_TRACE_KEYS = ("X", "W_q", "W_k", "W_v")
_TRACE_OPTIONAL = ("W_o", "mask", "tokens")


def _load_trace_inputs(path: Path, max_bytes: int) -> dict:
    """X, W_q, W_k, W_v (optional W_o, mask, tokens) from a .npz or .json file, read by the
    one reader (:mod:`causalattn.check.files`: headers first, one budget); the format is
    read off the content, so a .txt holding JSON works; every problem is one ``error:`` line.
    """
    import numpy as np

    from .check import AuditInputError
    from .check.files import read_arrays

    try:
        data = read_arrays(path, max_bytes, formats=("npz", "json"), text=("tokens",))
    except AuditInputError as exc:
        _fail(f"trace input {exc}")
    missing = [k for k in _TRACE_KEYS if k not in data]
    if missing:
        _fail(
            f"trace input {path}: missing {', '.join(missing)}; expected X, W_q, W_k, W_v "
            "(optional W_o, mask, tokens)"
        )
    unknown = sorted(set(data) - set(_TRACE_KEYS) - set(_TRACE_OPTIONAL))
    if unknown:
        _fail(f"trace input {path}: unknown keys {', '.join(unknown)}")
    for k in (*_TRACE_KEYS, "W_o"):  # numbers only, as the reader checked
        arr = data.get(k)
        if arr is not None and arr.size and not np.isfinite(arr).all():
            n = int((~np.isfinite(arr)).sum())
            typer.echo(f"warning: {k} holds {n} non-finite values (NaN or inf)", err=True)
    if "tokens" in data:
        toks = data["tokens"]
        ok = np.ndim(toks) == 1 and toks.dtype.kind != "b"
        if ok:
            toks = toks.tolist()
        X = data["X"]
        if not ok or X.ndim < 1 or len(toks) != X.shape[-2 if X.ndim > 1 else 0]:
            T = X.shape[-2] if X.ndim > 1 else "T"
            _fail(
                f"trace input {path}: tokens must be a list of T = {T} strings, one per row "
                f"of X, got {str(data['tokens'])[:60]}"
            )
        data["tokens"] = [str(t) for t in toks]
    X = data["X"]
    if X.ndim >= 2:  # S, M, Z, A (and C, capped) are T×T float64 per sequence and head
        T, lead = X.shape[-2], int(np.prod(X.shape[:-2]))
        from .text import check_bytes

        with _library_errors():
            check_bytes(
                f"trace: X {X.shape} makes T×T stages that",
                6 * 8 * lead * T * T,
                max_bytes,
                "trace a shorter sequence, or raise --max-bytes",
            )
    return data


def _explain_json(ex) -> dict:
    """Query and keys 1-based, as every position the command line shows."""
    rows = [{**r, "key": r["key"] + 1} for r in ex.rows()]
    return {"query": ex.query + 1, "h": ex.h, "keys": rows}


@app.command("trace")
def trace_cmd(
    input_file: Path = typer.Option(
        None, "--input", "-i", help=".npz or .json with X, W_q, W_k, W_v (optional W_o, mask)."
    ),
    query: int = typer.Option(None, "--query", "-q", help="Explain query i (1-based, as h_i)."),
    save: Path = typer.Option(None, "--save", help="Write the whole trace to FILE.npz."),
    png: Path = typer.Option(
        None, "--png", help="Also draw M, S, A and ‖A_ij v_j‖ into DIR as PNG."
    ),
    max_bytes: int = typer.Option(DEFAULT_MAX_BYTES, "--max-bytes", help=_MAX_BYTES_HELP),
    as_json: _Json = False,
) -> None:
    """Every stage of attention in dependency order (default: the chapter's example)."""
    import numpy as np

    from .reference import trace as run_trace
    from .text import check_bytes

    for flag, out in (("--save", save), ("--png", png)):
        if out is not None:
            (_check_out_dir if flag == "--png" else _check_out_file)(flag, out)
    data = _load_trace_inputs(input_file, max_bytes) if input_file is not None else dict(_CHAPTER)
    with _library_errors():
        tr = run_trace(
            data["X"],
            data["W_q"],
            data["W_k"],
            data["W_v"],
            data.get("W_o"),
            mask=data.get("mask"),
            tokens=data.get("tokens"),
        )
        T = tr.A.shape[-1]
        ex = None
        if query is not None:
            if not 1 <= query <= T:
                _fail(f"--query must be a position 1..{T} (T = {T}), got {query}")
            ex = tr.explain(query - 1)
        if save is not None:
            try:
                tr.save(save)
            except OSError as exc:
                _fail(f"--save: cannot write {save} ({exc.strerror or exc})")
        if as_json:  # about 20 characters a value
            check_bytes(
                "trace --json: the printed stages",
                20 * sum(st.value.size for st in tr),
                max_bytes,
                "use --save for a .npz instead, or raise --max-bytes",
            )
    allowed = np.ones(tr.A.shape, bool) if tr.allowed is None else tr.allowed
    readable = np.broadcast_to(allowed, tr.A.shape).any(-1)  # rows that read a key
    if not np.isfinite(tr.H[readable]).all():
        typer.echo(
            "warning: H holds NaN or inf in rows that read keys: the inputs overflow "
            "float64 (values near 1e308?) or hold NaN/inf",
            err=True,
        )
    if png is not None:
        _write_pngs(png, lambda viz: viz.trace_figures(tr))
    if as_json:
        out = {
            "positions": "1-based",
            "scale": tr.scale,
            "stages": [
                {
                    "name": st.name,
                    "symbol": st.symbol,
                    "formula": st.formula,
                    "notation": st.notation,
                    "shape": list(st.shape),
                    "value": st.value,
                }
                for st in tr
            ],
        }
        if ex is not None:
            out["explain"] = _explain_json(ex)
        _print_json(out)
        return
    console = _console()
    for st in tr:
        console.print(
            f"[bold cyan]{st.symbol}[/]  {_markup_escape(st.formula)}   [dim]{st.notation} = "
            f"{'×'.join(map(str, st.shape))}[/]"
        )
        if st.value.size <= 256:
            console.print(_fmt(st.value), markup=False)
        else:
            console.print(f"({st.value.size} values: see --json or --save)", style="dim")
        console.print()
    if ex is not None:
        console.print(f"[bold]The four quantities for query {query} (h_{query}):[/]")
        console.print(ex.format(base=1), markup=False)
    if save is not None:
        saved = save if save.suffix == ".npz" else save.with_name(save.name + ".npz")  # as np.savez
        console.print(f"saved the trace to {saved}", markup=False)


# -- causalattn demo --------------------------------------------------------------------


def _check_width_options(d_model: int, heads: int) -> None:
    """--d-model and --heads alone (checked before any work, so the error comes first)."""
    if d_model < 1:
        _fail(f"--d-model must be a positive integer, got {d_model}")
    if heads < 1:
        _fail(f"--heads must be a positive integer, got {heads}")
    if d_model % heads:
        _fail(f"--d-model {d_model} must be divisible by --heads {heads} (d_k = d_model / h)")


def _check_widths(batch, d_model: int, heads: int, max_bytes: int) -> int:
    """--d-model and --heads of the seeded random weights: valid, and one sentence's trace
    affordable. Returns the bytes one sentence's trace takes (held until the page is written)."""
    from .text import check_bytes

    _check_width_options(d_model, heads)
    N = batch.N
    fixed = 8 * d_model * (len(batch.vocab) + 4 * d_model)  # E (vocab×d), four d×d weights
    # X, Q, K, V, H (N×d) and the T×T float64 stages S, M, Z, A, with room for temporaries
    per = 8 * (5 * d_model * N + 8 * heads * N * N)
    check_bytes(
        f"the seeded weights and one sentence's trace (d_model = {d_model}, {heads} "
        f"heads, N = {N})",
        fixed + per,
        max_bytes,
        "lower --d-model or --max-len, or raise --max-bytes",
    )
    return per


def _seeded_attention(batch, d_model: int, seed: int):
    """Random (seeded) embeddings and weights -> one float64 trace over the whole batch."""
    import numpy as np

    from .reference import trace as run_trace

    rng = np.random.default_rng(seed)
    E = rng.normal(size=(len(batch.vocab), d_model))  # one embedding per vocabulary id
    W_q, W_k, W_v = (rng.normal(size=(d_model, d_model)) / np.sqrt(d_model) for _ in range(3))
    X = E[batch.ids]  # (B, N, d_model)
    return run_trace(X, W_q, W_k, W_v, mask=batch.mask)


@app.command()
def demo(
    d_model: int = typer.Option(8, "--d-model", help="Width of the random embeddings."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random embeddings and weights."),
    max_bytes: int = typer.Option(DEFAULT_MAX_BYTES, "--max-bytes", help=_MAX_BYTES_HELP),
    as_json: _Json = False,
) -> None:
    """The seed's four sentences end to end, then the chapter's four-token trace."""
    from . import text
    from .check import audit
    from .reference import trace as run_trace

    _check_width_options(d_model, 1)
    with _library_errors():
        batch = _encode_quiet(list(text.SEED_SENTENCES))
        _check_widths(batch, d_model, 1, max_bytes)
        tr = _seeded_attention(batch, d_model, seed)
        report = _one_based(audit(tr))
        chapter = run_trace(**dict(_CHAPTER))
        ex = chapter.explain(3)
    last = batch.B - 1
    if as_json:
        _print_json(
            {
                "sentences": list(text.SEED_SENTENCES),
                "vocab": batch.vocab.tokens,
                "tokens": batch.tokens,
                "ids": batch.ids,
                "lengths": batch.lengths,
                "causal": batch.causal_mask,
                "combined_sentence_4": batch.mask[last],
                "attention": {
                    "d_model": d_model,
                    "seed": seed,
                    "A_sentence_4": tr.A[last],
                    "audit": report.to_dict(),
                },
                "chapter": {
                    "S_4": chapter.S[3],
                    "A_4": chapter.A[3],
                    "h_4": chapter.H[3],
                    "explain": _explain_json(ex),
                },
            }
        )
        if not report.ok:
            raise typer.Exit(1)
        return

    from rich.table import Table
    from rich.text import Text

    console = _console()
    console.rule("1. The corpus, tokenized")
    vt = Table(
        title=f"Vocabulary ({len(batch.vocab)} ids, by first appearance)",
        title_justify="left",
        box=None,
    )
    for _ in range(4):
        vt.add_column("id", justify="right", style="dim")
        vt.add_column("token")
    toks = batch.vocab.tokens
    per = -(-len(toks) // 4)
    for r in range(per):
        cells = []
        for c in range(4):
            k = c * per + r
            cells += [str(k), toks[k]] if k < len(toks) else ["", ""]
        vt.add_row(*cells)
    console.print(vt)
    console.print()
    pt = Table(title=f"Padded to N = {batch.N} tokens", title_justify="left", box=None)
    pt.add_column("#")
    pt.add_column("len", justify="right")
    pt.add_column("tokens")
    pt.add_column("ids")
    for b in range(batch.B):
        pt.add_row(
            str(b + 1),
            str(batch.lengths[b]),
            " ".join(batch.tokens[b]),
            " ".join(map(str, batch.ids[b])),
        )
    console.print(pt)
    console.print()

    console.rule("2. Masks (rows are queries, columns keys)")
    s1 = batch.tokens[0]
    _print_tables(
        console,
        [_mask_table(f"causal mask M, {batch.N}×{batch.N}", batch.causal_mask, s1, s1, "additive")],
    )
    s4 = batch.tokens[last]
    _print_tables(
        console,
        _mask_pair(f"sentence {last + 1}, causal AND padding", batch.mask[last], s4, s4, "both"),
    )

    console.rule(f"3. One seeded self-attention over the batch (d_model = {d_model}, seed {seed})")
    console.print(
        f"X = E\\[ids] is {'×'.join(map(str, tr.X.shape))}; "
        f"A is {'×'.join(map(str, tr.A.shape))}; H is {'×'.join(map(str, tr.H.shape))}"
    )
    at = Table(
        title=f"A for sentence {last + 1} (rows sum to 1; padding rows are 0)",
        title_justify="left",
        box=None,
    )
    at.add_column("query \\ key", style="bold")
    for j, c in enumerate(s4):
        at.add_column(Text(f"{j + 1}\n{c[:5]}"), justify="right")
    for i, r in enumerate(s4):
        at.add_row(Text(f"{i + 1} {r}"), *(f"{a:.2f}" if a else "·" for a in tr.A[last, i]))
    console.print(at)
    console.print(str(report), markup=False, style="green" if report.ok else "bold red")
    console.print()

    console.rule("4. The chapter's four-token trace")
    console.print(
        "X = [[1,0],[0,1],[1,1],[-1,1]], W_Q = W_K = I, W_V = [[1,1],[1,-1]]", markup=False
    )
    console.print(f"scores of query 4   S_4 = {_fmt(chapter.S[3])}", markup=False)
    console.print(f"its weights         A_4 = {_fmt(chapter.A[3])}", markup=False)
    console.print(f"weighted values     h_4 = {_fmt(chapter.H[3])}", markup=False)
    console.print("The four quantities for query 4 (h_4; explain(3) in Python, 0-based):")
    console.print(ex.format(base=1), markup=False)
    console.print()
    console.print(
        "Learn it by doing: `causalattn learn` asks the chapter's check questions; "
        "`causalattn learn --exercise attention` writes an exercise to grade.",
        markup=False,
    )
    if not report.ok:
        raise typer.Exit(1)


_POSITION_KEYS = ("index", "rows", "cols")  # evidence that names positions (0-based in Python)


def _one_based(report):
    """A copy of an audit Report whose evidence positions count from 1, as the CLI's do."""
    import dataclasses

    def shift(ev: dict) -> dict:
        out = dict(ev)
        for k in _POSITION_KEYS:
            if k in out and out[k] is not None:
                v = out[k]
                out[k] = [int(x) + 1 for x in v] if isinstance(v, (list, tuple)) else int(v) + 1
        return out

    checks = [dataclasses.replace(c, evidence=shift(c.evidence)) for c in report.checks]
    return dataclasses.replace(
        report, checks=checks, empty_rows=[shift(r) for r in report.empty_rows]
    )


def _numbers(text: str | None, name: str, kind=float):
    """'0.5,0.25' -> [0.5, 0.25]; None stays None."""
    if text is None:
        return None
    try:
        return [kind(t) for t in text.split(",") if t.strip()]
    except ValueError:
        _fail(f"{name}: expected comma-separated {kind.__name__}s, got {text!r}")


def _declared(
    window, chunk, lengths, prefix_lengths, softcap, sinks, alibi_slopes, bidirectional
) -> dict:
    """The pattern keywords of causalattn.attention, from the audit/diagnose options."""
    kw = {
        "causal": not bidirectional,
        "window": window,
        "chunk": chunk,
        "softcap": softcap,
        "lengths": _numbers(lengths, "--lengths", int),
        "prefix_lengths": _numbers(prefix_lengths, "--prefix-lengths", int),
        "sinks": _numbers(sinks, "--sinks"),
        "alibi_slopes": _numbers(alibi_slopes, "--alibi-slopes"),
    }
    return {k: v for k, v in kw.items() if v is not None}


_PATTERN_HELP = "The declared pattern, as for causalattn.attention (default: plain causal)."

# The options that declare a pattern, one definition for audit and diagnose (the keywords
# of causalattn.attention; _declared turns them into those keywords).
_Window = Annotated[int, typer.Option("--window", help="Sliding window w: " + _PATTERN_HELP)]
_Chunk = Annotated[int, typer.Option("--chunk", help="Chunks of c positions.")]
_Lengths = Annotated[str, typer.Option("--lengths", help="Sequence lengths, e.g. 6,3.")]
_PrefixLengths = Annotated[str, typer.Option("--prefix-lengths", help="Bidirectional prefixes.")]
_Softcap = Annotated[float, typer.Option("--softcap", help="Scores capped as c·tanh(S/c).")]
_Sinks = Annotated[str, typer.Option("--sinks", help="One sink logit per head, e.g. 0.5,0.1.")]
_AlibiSlopes = Annotated[str, typer.Option("--alibi-slopes", help="One ALiBi slope per head.")]
_Bidirectional = Annotated[bool, typer.Option("--bidirectional", help="No causal rule.")]
# code causalattn runs (diagnose FILE, learn --check) runs in the isolation runner
_MaxMemory = Annotated[
    str,
    typer.Option(
        "--max-memory",
        help="Memory the code may take beyond its start: bytes, or 512M, 2G (default: 4G, "
        "or a quarter of a smaller machine's memory).",
    ),
]


def _memory_bytes(text: str | None) -> int:
    """--max-memory: a number of bytes, or one with a K/M/G suffix (powers of 1024)."""
    from .check import runner

    if text is None:
        return runner.DEFAULT_MAX_MEMORY
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(t[-1:], 1)
    digits = t[:-1] if mult > 1 else t
    if not digits.isdigit() or int(digits) <= 0:
        _fail(f"--max-memory must be a number of bytes > 0 (or 512M, 2G), got {text!r}")
    return int(digits) * mult


_Scale = Annotated[float, typer.Option("--scale", help="The scale on Q Kᵀ (default 1/√d_k).")]


@app.command("audit")
def audit_cmd(
    file: str = typer.Argument(
        None,
        help="A .npz, a .npy, a folder of .npy files or a .safetensors; with --model, the text.",
    ),
    model: Path = typer.Option(
        None,
        "--model",
        help="A Hugging Face causal LM folder (save_pretrained): run it on the "
        "text and audit every layer's attention.",
    ),
    layers: str = typer.Option(
        None, "--layers", help="With --model: which layers, e.g. '0,3,5-7'."
    ),
    max_bytes: int = typer.Option(2 * 2**30, "--max-bytes", help="Refuse arrays larger than this."),
    window: _Window = None,
    chunk: _Chunk = None,
    lengths: _Lengths = None,
    prefix_lengths: _PrefixLengths = None,
    softcap: _Softcap = None,
    sinks: _Sinks = None,
    alibi_slopes: _AlibiSlopes = None,
    bidirectional: _Bidirectional = False,
    scale: _Scale = None,
    as_json: _Json = False,
):
    """Check named arrays in dependency order. Exit 0 clean, 1 a check fails, 2 unusable input."""
    from .check import audit

    if model is not None:
        _audit_model(model, file, layers, as_json)
        return
    if file is None:
        _fail('give a file of arrays to audit, or --model DIR "text"')
    declared = _declared(
        window, chunk, lengths, prefix_lengths, softcap, sinks, alibi_slopes, bidirectional
    )
    try:
        report = _one_based(audit(file, max_bytes=max_bytes, scale=scale, **declared))
    except (ValueError, OSError) as exc:
        _fail(str(exc))
    if as_json:
        _print_json({"positions": "1-based", **report.to_dict()})
    else:
        _console().print(str(report), markup=False)
    if not report.ok:
        raise typer.Exit(1)


def _captured(model_dir: Path, text: str | None, layers: str | None, generate: int | None = None):
    """(model, traces) of a Hugging Face model folder run on one text (and ``generate``
    greedy tokens after it)."""
    from .integrations import hf_model

    if text is None:
        _fail('--model needs the text to run the model on, e.g. --model DIR "The cat sat."')
    with _library_errors():
        model, tokenizer = hf_model.load(model_dir)
        ids = hf_model.encode(tokenizer, text, model)
        from .integrations.hf_capture import capture

        traces = capture(
            model,
            ids,
            layers=hf_model.parse_layers(layers),
            tokenizer=tokenizer,
            generate=generate,
        )
    return model, traces


def _audit_model(model_dir: Path, text: str | None, layers: str | None, as_json: bool) -> None:
    from .integrations import hf_model

    model, traces = _captured(model_dir, text, layers)
    rows = hf_model.audit_layers(traces)
    ok = all(r.ok for r in rows)
    if as_json:
        _print_json(
            {
                "model": str(model_dir),
                "architecture": type(model).__name__,
                "tokens": traces[0].tokens,
                "pattern": [t.pattern.describe() for t in traces],
                "ok": ok,
                "layers": [r.to_dict() for r in rows],
            }
        )
    else:  # plain lines, never wrapped: the table stays a table in a narrow terminal
        out = typer.echo
        out(
            f"{type(model).__name__} from {model_dir}: {len(rows)} layer(s) audited on "
            f"{len(traces[0].tokens)} tokens"
        )
        out(
            f"{'layer':>5}  {'heads':>5}  {'pattern':<30}  {'verdict':<12}  "
            f"{'worst |row sum - 1|':>19}  {'empty rows':>10}"
        )
        for r, tr in zip(rows, traces):
            verdict = "ok" if r.ok else f"FAILED at {r.stage}"
            out(
                f"{r.layer:>5}  {r.heads:>5}  {tr.pattern.describe():<30}  {verdict:<12}  "
                f"{r.worst_row_sum_error:>19.3g}  {r.empty_rows:>10}"
            )
        for r in rows:
            if not r.ok:
                out(
                    f"layer {r.layer}, stage {r.stage}: {r.check}: {r.message}"
                    + (f"\n  hint: {r.hint}" if r.hint else "")
                )
        out("audit: ok" if ok else "audit: FAILED")
    if not ok:
        raise typer.Exit(1)


@app.command("diagnose")
def diagnose_cmd(
    target: str = typer.Argument(
        ..., help="path/to/file.py:function_or_class (the file is executed)."
    ),
    signature: str = typer.Option(
        None, "--signature", help="qkv | x-weights | module (default: discovered)."
    ),
    timeout: float = typer.Option(
        60.0, "--timeout", help="Seconds before the user's code is stopped."
    ),
    window: _Window = None,
    chunk: _Chunk = None,
    lengths: _Lengths = None,
    prefix_lengths: _PrefixLengths = None,
    softcap: _Softcap = None,
    sinks: _Sinks = None,
    alibi_slopes: _AlibiSlopes = None,
    bidirectional: _Bidirectional = False,
    scale: _Scale = None,
    max_memory: _MaxMemory = None,
    as_json: _Json = False,
):
    """Measure an attention function or module; name the first stage that differs.
    Exit 0 clean, 1 it differs, 2 it could not run.

    The target file is EXECUTED, in a worker process stopped after --timeout seconds.
    """
    from .check import diagnose

    if ":" not in target:
        _fail(f"expected path/to/file.py:function_or_class, got {target!r}")
    declared = _declared(
        window, chunk, lengths, prefix_lengths, softcap, sinks, alibi_slopes, bidirectional
    )
    with _library_errors():
        d = diagnose(
            target,
            signature=signature,
            timeout=timeout,
            scale=scale,
            max_memory=_memory_bytes(max_memory),
            **declared,
        )
    if as_json:
        _print_json({"positions": "1-based", **_one_based_findings(d.to_dict())})
    else:
        # every finding, one line each (never wrapped), the first in full
        _console().print(str(d), markup=False, soft_wrap=True)
    if d.not_run:
        raise typer.Exit(2)
    if not d.ok:
        raise typer.Exit(1)


def _one_based_findings(d: dict) -> dict:
    """Diagnosis JSON with each finding's rows, slice, heads, patched and value rows 1-based."""

    def shift(f: dict) -> dict:
        m = dict(f.get("measurement") or {})
        for k in ("heads", "patched_rows", "value_rows"):
            if isinstance(m.get(k), list):
                m[k] = [i + 1 for i in m[k]]
        rows, sl = [i + 1 for i in f.get("rows", [])], [i + 1 for i in f.get("slice", [])]
        return {**f, "rows": rows, "slice": sl, "measurement": m}

    return {**d, "findings": [shift(f) for f in d.get("findings", [])]}


# -- causalattn learn -------------------------------------------------------------------


@app.command()
def learn(
    seed: int = typer.Option(0, "--seed", help="Seed of the question set (hand out the same one)."),
    n: int = typer.Option(None, "--n", "-n", help="Number of questions (default: one per kind)."),
    kind: list[str] = typer.Option(None, "--kind", help="Only these kinds (repeat; see --json)."),
    exercise: str = typer.Option(
        None, "--exercise", help="Write a scaffold: scores|mask|softmax|attention|multihead."
    ),
    output: Path = typer.Option(None, "--output", "-o", help="Scaffold path (default NAME.py)."),
    framework: str = typer.Option("numpy", "--framework", help="numpy | torch (the scaffold's)."),
    force: bool = typer.Option(False, "--force", help="Write the scaffold over an existing file."),
    check: Path = typer.Option(None, "--check", help="Grade a filled-in exercise (EXECUTES it)."),
    timeout: float = typer.Option(
        None, "--timeout", help="Seconds before --check stops the file (default 60)."
    ),
    max_memory: _MaxMemory = None,
    as_json: bool = typer.Option(False, "--json", help="The question bank (or the grade) as JSON."),
) -> None:
    """Check questions (answers from stdin or the keyboard), scaffolds, graded exercises.

    --check exits 0 when every stage is right, 1 when a stage is wrong, 2 when it could not run.
    """
    from .learn import exercises, grade, questions, session

    if (output is not None or force or framework != "numpy") and (exercise is None or check):
        _fail("--output, --framework and --force go with --exercise NAME (writing a scaffold)")
    if check is None and (timeout is not None or max_memory is not None):
        _fail("--timeout and --max-memory go with --check FILE (grading a file)")
    if check is not None:
        limit = 60.0 if timeout is None else timeout
        with _library_errors():
            g = grade.check(check, exercise, timeout=limit, max_memory=_memory_bytes(max_memory))
        if as_json:
            _print_json(g.to_dict())
        else:
            session.render_grade(g, _console())
        raise typer.Exit(g.exit_code)
    if exercise is not None:
        with _library_errors():
            p = exercises.write(exercise, output, framework, force=force)
        if as_json:
            _print_json({"exercise": exercise, "framework": framework, "output": str(p)})
            return
        typer.echo(f"wrote {p}: fill in the function, then run `causalattn learn --check {p}`")
        return
    with _library_errors():
        qs = questions(seed=seed, n=n, kinds=kind or None)
    if as_json:
        _print_json(qs)
        return
    console = _console()
    console.rule(f"causalattn learn: {len(qs)} question{'s' * (len(qs) != 1)} (seed {seed})")
    session.run_quiz(qs, console, session.stdin_reader(console=console))


# -- causalattn explore -----------------------------------------------------------------


# The page takes sentences while its estimated size fits --max-page-bytes (the explorer
# enforces the same budget on its matrices): per sentence the page holds about 600 bytes
# plus 32 a token position (name, tokens, ids, mask kinds; Q, K, V are computed on the page
# from the shared weights), as measured on 3,000 and 10,000 sentences of 5 and 3-30 words;
# sentences past the budget are not even traced, which bounds the time and the memory.
_PAGE_BYTES = 4 * 2**20


@app.command("heads")
def heads_cmd(
    model: Path = typer.Option(
        ..., "--model", help="A Hugging Face causal LM folder (save_pretrained) or cached hub id."
    ),
    ablate: bool = typer.Option(
        False,
        "--ablate",
        help="Add each head's effect on the loss: the second-repeat loss "
        "with that head ablated, and its ratio to the model's own.",
    ),
    how: str = typer.Option("zero", "--how", help="With --ablate: 'zero' or 'mean' ablation."),
    length: int = typer.Option(24, "--length", help="Random tokens in the sequence repeated."),
    sequences: int = typer.Option(16, "--sequences", help="How many such sequences."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random tokens."),
    as_json: _Json = False,
) -> None:
    """Each head's role (previous-token, induction, first-token), measured on random tokens
    repeated twice; layers and heads are 1-based."""
    from .integrations import hf_heads, hf_model

    with _library_errors():
        lm, tokenizer = hf_model.load(model)
        table = hf_heads.measure(
            lm, tokenizer, length=length, sequences=sequences, seed=seed, ablate=ablate, how=how
        )
    if as_json:
        _print_json(table.rows())
    else:
        typer.echo(table.format())


def _page_sentences(batch, page_bytes: int) -> int:
    """How many sentences (from the first) fit a page of ``page_bytes``; at least one."""
    per = 32 * batch.N + 600
    return max(1, min(batch.B, (page_bytes - 2**18) // per))  # less the script and style


@app.command()
def explore(
    sentences: list[str] = typer.Argument(None, help="Sentences (default: the seed's four)."),
    file: Path = typer.Option(None, "--file", "-f", help="Corpus file, one sentence a line."),
    trace_file: Path = typer.Option(
        None, "--trace", help="A trace saved by `trace --save` (.npz)."
    ),
    model: Path = typer.Option(
        None,
        "--model",
        help="A Hugging Face causal LM folder (save_pretrained): explore its "
        "layers on the one text given.",
    ),
    layers: str = typer.Option(
        None, "--layers", help="With --model: which layers, e.g. '0,3,5-7'."
    ),
    generate: int = typer.Option(
        None, "--generate", help="With --model: N greedy tokens after the text (marked as such)."
    ),
    output: Path = typer.Option(
        Path("explorer.html"), "--output", "-o", help="HTML file to write."
    ),
    max_len: int = typer.Option(None, "--max-len", help="Pad/truncate to this many tokens."),
    d_model: int = typer.Option(16, "--d-model", help="Width of the random embeddings."),
    heads: int = typer.Option(2, "--heads", help="Number of heads h."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random embeddings and weights."),
    max_page_bytes: int = typer.Option(
        _PAGE_BYTES,
        "--max-page-bytes",
        help="Put only the sentences that fit a page of this size (default 4 MiB).",
    ),
    max_bytes: int = typer.Option(DEFAULT_MAX_BYTES, "--max-bytes", help=_MAX_BYTES_HELP),
    questions: int = typer.Option(
        0,
        "--questions",
        help="Add a 'check yourself' panel of this many questions "
        "(`causalattn learn`'s, drawn with --seed).",
    ),
    as_json: _Json = False,
) -> None:
    """One self-contained HTML page (no network) to explore masks, S, A and each query's row."""
    import dataclasses

    from . import text, viz
    from .trace import Trace

    qs = None
    if questions < 0:
        _fail(f"--questions must be 0 (none) or more, got {questions}")
    if questions:
        from . import learn

        with _library_errors():
            qs = learn.questions(seed, questions)

    if generate is not None and model is None:
        _fail("--generate needs --model (a model generates the tokens)")
    if model is not None:
        if file is not None or trace_file is not None:
            _fail("--model takes the text as its argument; leave out --file and --trace")
        if sentences and len(sentences) > 1:
            _fail(f"--model takes one text (quote it); got {len(sentences)} arguments")
        lm, traces = _captured(model, sentences[0] if sentences else None, layers, generate)
        with _library_errors():
            title = (
                f"causalattn explorer: {type(lm).__name__} from {model.name}, "
                f"{len(traces[0].tokens)} tokens"
            )
            viz.write_explorer(traces, output, layers=True, title=title, questions=qs)
        n = len(traces)
        if as_json:
            _print_json({"output": str(output), "layers": n, "bytes": output.stat().st_size})
        else:
            _console().print(
                f"wrote {output} ({_human_bytes(output.stat().st_size)}): "
                f"{n} layer(s) of {type(lm).__name__}",
                markup=False,
            )
        return
    if sum(x is not None and x != [] for x in (sentences, file, trace_file)) > 1:
        _fail("give sentences, --file or --trace, only one of them")
    if max_page_bytes < 1:
        _fail(f"--max-page-bytes must be a positive integer, got {max_page_bytes}")
    _check_width_options(d_model, heads)
    _check_out_file("--output", output)
    with _library_errors():
        if trace_file is not None:
            tr = Trace.load(trace_file, max_bytes=max_bytes)  # the one reader, headers first
            title = f"causalattn explorer: {trace_file.name}"
            viz.write_explorer(tr, output, title=title, questions=qs)
            n = len(viz.kinds.sequences(tr))
        else:
            corpus = (
                _read_corpus(file, max_bytes)
                if file is not None
                else (sentences or list(text.SEED_SENTENCES))
            )
            batch = _encode_quiet(corpus, max_len=max_len, max_bytes=max_bytes)
            per = _check_widths(batch, d_model, heads, max_bytes)
            n_page = _page_sentences(batch, max_page_bytes)
            n_mem = max(1, max_bytes // per)  # their traces are held until the page is written
            n = min(n_page, n_mem)
            if n < batch.B:
                why = (
                    f"as many as fit {_human_bytes(max_page_bytes)} (--max-page-bytes to show more)"
                    if n == n_page
                    else f"as many as {_human_bytes(max_bytes)} of "
                    f"memory can trace at N = {batch.N} (--max-bytes to show more)"
                )
                typer.echo(f"note: the page shows sentences 1..{n} of {batch.B}, {why}", err=True)
            traces = []
            step = min(512, n)  # sentences per call (batched): the same seeded weights every call
            for b0 in _progress(range(0, n, step), "tracing", as_json):
                part = slice(b0, min(b0 + step, n))
                sub = dataclasses.replace(
                    batch,
                    ids=batch.ids[part],
                    lengths=batch.lengths[part],
                    tokens=batch.tokens[part],
                    truncated=(),
                )
                traces += viz.batch_traces(sub, d_model=d_model, n_heads=heads, seed=seed)
            title = (
                f"causalattn explorer: {n} sentence(s), seeded random weights "
                f"(d_model = {d_model}, {heads} heads, seed {seed})"
            )
            names = viz.sentence_names(batch)[:n]
            viz.write_explorer(
                traces, output, names=names, title=title, questions=qs, max_bytes=max_page_bytes
            )
    size = output.stat().st_size
    if as_json:
        _print_json({"output": str(output), "sequences": n, "bytes": size})
        return
    typer.echo(f"wrote {output} ({_human_bytes(size)}): open it in any browser, offline")


@app.command()
def bench(
    quick: bool = typer.Option(False, "--quick", help="a subset that runs in under a minute"),
    as_json: bool = typer.Option(False, "--json", help="print the rows as a JSON list"),
    layer: bool = typer.Option(
        False,
        "--layer",
        help="the whole CausalSelfAttention layer at GPT-2 small, fwd and fwd+bwd, vs SDPA",
    ),
    patterns: bool = typer.Option(
        False,
        "--patterns",
        help=(
            "window, packed documents, softcap, sinks, ALiBi and dropout on the tiled engine "
            "vs their peers"
        ),
    ),
    io: bool = typer.Option(
        False,
        "--io",
        help="huge input through the CLI (100,000 words, 10,000 sentences): time, memory",
    ),
    tune: bool = typer.Option(
        False,
        "--tune",
        help="measure tiled vs SDPA per problem kind and write the table engine='auto' "
        "reads ($XDG_CACHE_HOME/causalattn or ~/.cache/causalattn)",
    ),
    out: Path | None = typer.Option(
        None, "--out", help="with --tune: write the table here instead"
    ),
):
    """Time the tiled engine against PyTorch's SDPA and naive attention (CPU), in alternation."""
    if io:
        from .bench import io as io_bench

        rows = io_bench.run(reps=1 if quick else 2, quick=quick)
        if as_json:
            _print_json(rows)
        else:
            io_bench.render(rows, _console())
        return
    from .bench import cpu
    from .bench import layer as layer_bench
    from .bench import patterns as patterns_bench

    if tune:
        from .bench import tune as tuner

        path, table = tuner.tune(out)
        if as_json:
            _print_json(table)
            return
        tuner.render(table, path, _console())
        return
    if out is not None:
        raise typer.BadParameter("--out goes with --tune")
    if patterns:
        mod, rows = patterns_bench, patterns_bench.run(quick=quick)
    else:
        mod = layer_bench if layer else cpu
        rows = layer_bench.run(budget_s=8.0 if quick else 20.0) if layer else cpu.run(quick=quick)
    if as_json:
        _print_json(rows)
        return
    mod.render(rows, _console())


# `demo` is the main job: list it first in --help (typer lists in registration order).
app.registered_commands.sort(key=lambda c: c.callback.__name__ != "demo")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
