"""The `causalattn` command: a thin shell over the library (typer + rich).

Every command takes ``--json`` for machine-readable output. Positions on the command
line are 1-based, as in the chapter (h_1 … h_T); the Python API is 0-based.
"""

from __future__ import annotations

import json
import math
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Causal self-attention in matrix form: H = softmax_last(Q Kᵀ/√d_k + M) V.",
)


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


def _jsonable(obj):
    """NumPy arrays and scalars -> lists and numbers; non-finite floats -> "inf"/"-inf"/"nan"."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "tolist") and not isinstance(obj, str):
        return _jsonable(obj.tolist())
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    return obj


def _print_json(data) -> None:
    typer.echo(json.dumps(_jsonable(data), ensure_ascii=False, indent=2))


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


def _mask_table(title: str, allowed, rows: list[str], cols: list[str], form: str):
    """A token-labelled mask: rows are queries, columns keys; form 'additive' (0/-∞) or 'check' (✓/·)."""
    from rich.table import Table
    from rich.text import Text

    on, off = ("0", "-∞") if form == "additive" else ("✓", "·")
    t = Table(title=title, box=None, pad_edge=False, padding=(0, 1), title_justify="left")
    t.add_column("query \\ key", style="bold", no_wrap=True)
    for j, c in enumerate(cols):  # Text, not markup: tokens are user data
        t.add_column(Text(f"{j + 1}\n{c[:5]}"), justify="center", no_wrap=True)
    for i, r in enumerate(rows):
        cells = [Text(on, style="green") if a else Text(off, style="dim") for a in allowed[i]]
        t.add_row(Text(f"{i + 1} {r}" if len(rows) > 1 else r), *cells)
    return t


def _mask_pair(title: str, allowed, rows, cols, form: str) -> list:
    forms = ["additive", "check"] if form == "both" else [form]
    names = {"additive": "M, 0/-∞", "check": "may read, ✓/·"}
    return [_mask_table(f"{title}: {names[f]}", allowed, rows, cols, f) for f in forms]


def _print_tables(console, tables: list) -> None:
    from rich.columns import Columns

    console.print(Columns(tables, padding=(0, 4)) if len(tables) > 1 else tables[0])
    console.print()


def _encode_quiet(sentences, max_len=None):
    """text.encode, with its truncation warning shown as a note on stderr."""
    from . import text

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch = text.encode(sentences, max_len=max_len)
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
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
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

    t = Table(title=f"T = {seq_len}, d_model = {d_model}, heads = {heads}", title_justify="left",
              box=None)
    for c in ("Symbol", "Shape", "Params", "fp32", "bf16", "FLOPs"):
        t.add_column(c, no_wrap=True, justify="left" if c in ("Symbol", "Shape") else "right")
    for r in rows:
        t.add_row(
            r.symbol, r.notation, _si(r.params), _human_bytes(r.bytes_fp32),
            _human_bytes(r.bytes_bf16), _si(r.flops),
        )
    console = _console()
    console.print(t)
    console.print()
    for r in rows:
        console.print(f"[bold]{_markup_escape(r.symbol)}[/] ({r.name}): {_markup_escape(r.explanation)}")
    console.print(
        f"parameters {totals['params']:,}; attention FLOPs (QKᵀ + A V, DESIGN.md's 4·H·T²·d): "
        f"dense {_si(dense)}, causal {_si(dense // 2)}; all rows {_si(totals['flops'])}"
    )


# -- causalattn masks -------------------------------------------------------------------

_FORMS = ("both", "additive", "check")


def _read_corpus(path: Path) -> list[str]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        _fail(f"text: cannot read corpus file {path}: {exc}")
    return [ln for ln in lines if ln.strip()]


def _write_pngs(out_dir: Path, make) -> None:
    """Draw ``make(causalattn.viz)``'s named figures into ``out_dir`` as PNG (needs matplotlib)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        _fail("--png needs matplotlib: pip install 'causalattn[viz]'")
    from . import viz

    with _library_errors():
        paths = viz.write_figures(make(viz), out_dir)
    typer.echo(f"wrote {len(paths)} PNG files to {out_dir}", err=True)


@app.command()
def masks(
    sentences: list[str] = typer.Argument(None, help="Sentences (default: the seed's four)."),
    file: Path = typer.Option(None, "--file", "-f", help="Corpus file, one sentence a line."),
    max_len: int = typer.Option(None, "--max-len", help="Pad/truncate to this many tokens."),
    form: str = typer.Option("both", "--form", help="both | additive (0/-∞) | check (✓/·)."),
    png: Path = typer.Option(None, "--png", help="Also draw each sentence's mask into DIR as PNG."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Token-labelled causal, padding and combined masks for each sentence."""
    from . import text

    if form not in _FORMS:
        _fail(f"--form must be one of {', '.join(_FORMS)}, got {form!r}")
    if sentences and file is not None:
        _fail("give sentences or --file, not both")
    corpus = _read_corpus(file) if file is not None else (sentences or list(text.SEED_SENTENCES))
    with _library_errors():
        batch = _encode_quiet(corpus, max_len=max_len)
    if png is not None:
        _write_pngs(png, lambda viz: {f"mask_sentence{b + 1}": viz.plot_mask(batch.mask[b], batch.tokens[b])
                                      for b in range(batch.B)})
    if as_json:
        _print_json(
            {
                "N": batch.N,
                "vocab": batch.vocab.tokens,
                "causal": batch.causal_mask,
                "truncated": list(batch.truncated),
                "sentences": [
                    {
                        "tokens": batch.tokens[b],
                        "ids": batch.ids[b],
                        "length": batch.lengths[b],
                        "key_padding": batch.key_padding_mask[b],
                        "combined": batch.mask[b],
                    }
                    for b in range(batch.B)
                ],
            }
        )
        return
    console = _console()
    longest = batch.tokens[int(batch.lengths.argmax())]
    _print_tables(console, _mask_pair(f"causal {batch.N}×{batch.N}", batch.causal_mask,
                                      longest, longest, form))
    for b in range(batch.B):
        toks = batch.tokens[b]
        console.print(f"[bold]sentence {b + 1}[/] ({batch.lengths[b]} tokens): "
                      f"{_markup_escape(' '.join(toks))}")
        _print_tables(console, _mask_pair("key padding", batch.key_padding_mask[b][None],
                                          ["keys"], toks, form))
        _print_tables(console, _mask_pair("combined (causal AND padding)", batch.mask[b],
                                          toks, toks, form))


# -- causalattn trace -------------------------------------------------------------------

_CHAPTER = {  # the chapter's four-token example
    "X": [[1, 0], [0, 1], [1, 1], [-1, 1]],
    "W_q": [[1, 0], [0, 1]],
    "W_k": [[1, 0], [0, 1]],
    "W_v": [[1, 1], [1, -1]],
}
_TRACE_KEYS = ("X", "W_q", "W_k", "W_v")
_TRACE_OPTIONAL = ("W_o", "mask", "tokens")


def _load_trace_inputs(path: Path) -> dict:
    """X, W_q, W_k, W_v (optional W_o, mask, tokens) from a .npz or .json file."""
    import numpy as np

    try:
        if path.suffix.lower() == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(data, dict):
                _fail(f"trace input {path}: expected a JSON object with keys X, W_q, W_k, W_v")
        else:
            with np.load(path, allow_pickle=False) as f:
                data = {k: f[k] for k in f.files}
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        _fail(f"trace input {path}: cannot be read as .npz or JSON ({exc})")
    missing = [k for k in _TRACE_KEYS if k not in data]
    if missing:
        _fail(
            f"trace input {path}: missing {', '.join(missing)}; expected X, W_q, W_k, W_v "
            "(optional W_o, mask, tokens)"
        )
    unknown = sorted(set(data) - set(_TRACE_KEYS) - set(_TRACE_OPTIONAL))
    if unknown:
        _fail(f"trace input {path}: unknown keys {', '.join(unknown)}")
    if "mask" in data:
        data["mask"] = np.asarray(data["mask"])
    if "tokens" in data:
        data["tokens"] = [str(t) for t in np.asarray(data["tokens"]).tolist()]
    return data


def _explain_json(ex) -> dict:
    return {"query": ex.query + 1, "h": ex.h, "keys": ex.rows()}


@app.command("trace")
def trace_cmd(
    input_file: Path = typer.Option(
        None, "--input", "-i", help=".npz or .json with X, W_q, W_k, W_v (optional W_o, mask)."
    ),
    query: int = typer.Option(None, "--query", "-q", help="Explain query i (1-based, as h_i)."),
    save: Path = typer.Option(None, "--save", help="Write the whole trace to FILE.npz."),
    png: Path = typer.Option(None, "--png", help="Also draw M, S, A and ‖A_ij v_j‖ into DIR as PNG."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Every stage of attention in dependency order (default: the chapter's example)."""
    from .reference import trace as run_trace

    data = _load_trace_inputs(input_file) if input_file is not None else dict(_CHAPTER)
    with _library_errors():
        tr = run_trace(
            data["X"], data["W_q"], data["W_k"], data["W_v"], data.get("W_o"),
            mask=data.get("mask"), tokens=data.get("tokens"),
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
    if png is not None:
        _write_pngs(png, lambda viz: viz.trace_figures(tr))
    if as_json:
        out = {
            "scale": tr.scale,
            "stages": [
                {"name": st.name, "symbol": st.symbol, "formula": st.formula,
                 "notation": st.notation, "shape": list(st.shape), "value": st.value}
                for st in tr
            ],
        }
        if ex is not None:
            out["explain"] = _explain_json(ex)
        _print_json(out)
        return
    console = _console()
    for st in tr:
        console.print(f"[bold cyan]{st.symbol}[/]  {_markup_escape(st.formula)}   [dim]{st.notation} = "
                      f"{'×'.join(map(str, st.shape))}[/]")
        if st.value.size <= 256:
            console.print(_fmt(st.value), markup=False)
        else:
            console.print(f"({st.value.size} values: see --json or --save)", style="dim")
        console.print()
    if ex is not None:
        console.print(f"[bold]The four quantities for query {query} (h_{query}; "
                      f"0-based i = {query - 1} below):[/]")
        console.print(str(ex), markup=False)
    if save is not None:
        saved = save if save.suffix == ".npz" else save.with_name(save.name + ".npz")  # as np.savez
        console.print(f"saved the trace to {saved}", markup=False)


# -- causalattn demo --------------------------------------------------------------------


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
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """The seed's four sentences end to end, then the chapter's four-token trace."""
    from . import text
    from .check import audit
    from .reference import trace as run_trace

    with _library_errors():
        batch = _encode_quiet(list(text.SEED_SENTENCES))
        tr = _seeded_attention(batch, d_model, seed)
        report = audit(tr)
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
    vt = Table(title=f"Vocabulary ({len(batch.vocab)} ids, by first appearance)",
               title_justify="left", box=None)
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
        pt.add_row(str(b + 1), str(batch.lengths[b]), " ".join(batch.tokens[b]),
                   " ".join(map(str, batch.ids[b])))
    console.print(pt)
    console.print()

    console.rule("2. Masks (rows are queries, columns keys)")
    s1 = batch.tokens[0]
    _print_tables(console, [_mask_table(f"causal mask M, {batch.N}×{batch.N}", batch.causal_mask,
                                        s1, s1, "additive")])
    s4 = batch.tokens[last]
    _print_tables(console, _mask_pair(f"sentence {last + 1}, causal AND padding",
                                      batch.mask[last], s4, s4, "both"))

    console.rule(f"3. One seeded self-attention over the batch (d_model = {d_model}, seed {seed})")
    console.print(f"X = E\\[ids] is {'×'.join(map(str, tr.X.shape))}; "
                  f"A is {'×'.join(map(str, tr.A.shape))}; H is {'×'.join(map(str, tr.H.shape))}")
    at = Table(title=f"A for sentence {last + 1} (rows sum to 1; padding rows are 0)",
               title_justify="left", box=None)
    at.add_column("query \\ key", style="bold")
    for j, c in enumerate(s4):
        at.add_column(Text(f"{j + 1}\n{c[:5]}"), justify="right")
    for i, r in enumerate(s4):
        at.add_row(Text(f"{i + 1} {r}"), *(f"{a:.2f}" if a else "·" for a in tr.A[last, i]))
    console.print(at)
    console.print(str(report), markup=False, style="green" if report.ok else "bold red")
    console.print()

    console.rule("4. The chapter's four-token trace")
    console.print("X = [[1,0],[0,1],[1,1],[-1,1]], W_Q = W_K = I, W_V = [[1,1],[1,-1]]",
                  markup=False)
    console.print(f"scores of query 4   S_4 = {_fmt(chapter.S[3])}", markup=False)
    console.print(f"its weights         A_4 = {_fmt(chapter.A[3])}", markup=False)
    console.print(f"weighted values     h_4 = {_fmt(chapter.H[3])}", markup=False)
    console.print("explain(3), 0-based as in Python (i = 3 is the chapter's h_4):")
    console.print(str(ex), markup=False)
    console.print()
    console.print("Learn it by doing: `causalattn learn` asks the chapter's check questions; "
                  "`causalattn learn --exercise attention` writes an exercise to grade.",
                  markup=False)
    if not report.ok:
        raise typer.Exit(1)


@app.command("audit")
def audit_cmd(
    file: Path = typer.Argument(..., help="A .npz, a .npy, a folder of .npy files or a .safetensors."),
    max_bytes: int = typer.Option(2 * 2**30, "--max-bytes", help="Refuse arrays larger than this."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
):
    """Check named arrays in dependency order. Exit 0 clean, 1 a check fails, 2 unusable input."""
    from .check import audit

    try:
        report = audit(file, max_bytes=max_bytes)
    except (ValueError, OSError) as exc:
        _fail(str(exc))
    if as_json:
        _print_json(report.to_dict())
    else:
        _console().print(str(report), markup=False)
    if not report.ok:
        raise typer.Exit(1)


@app.command("diagnose")
def diagnose_cmd(
    target: str = typer.Argument(..., help="path/to/file.py:function_or_class (the file is executed)."),
    signature: str = typer.Option(None, "--signature", help="qkv | x-weights | module (default: discovered)."),
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds before the user's code is stopped."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
):
    """Name the fault in an attention function or module. Exit 0 clean, 1 a fault, 2 it could not run.

    The target file is EXECUTED, in a subprocess stopped after --timeout seconds.
    """
    from .check import diagnose

    if ":" not in target:
        _fail(f"expected path/to/file.py:function_or_class, got {target!r}")
    with _library_errors():
        d = diagnose(target, signature=signature, timeout=timeout)
    if as_json:
        _print_json(d.to_dict())
    else:
        _console().print(str(d), markup=False)
    if d.status in ("error", "timeout", "crashed"):
        raise typer.Exit(2)
    if not d.ok:
        raise typer.Exit(1)


# -- causalattn learn -------------------------------------------------------------------


@app.command()
def learn(
    seed: int = typer.Option(0, "--seed", help="Seed of the question set (hand out the same one)."),
    n: int = typer.Option(None, "--n", "-n", help="Number of questions (default: one per kind)."),
    exercise: str = typer.Option(
        None, "--exercise", help="Write a scaffold: scores | mask | softmax | attention | multihead."
    ),
    output: Path = typer.Option(None, "--output", "-o", help="Scaffold path (default NAME.py)."),
    framework: str = typer.Option("numpy", "--framework", help="numpy | torch (the scaffold's)."),
    force: bool = typer.Option(False, "--force", help="Write the scaffold over an existing file."),
    check: Path = typer.Option(None, "--check", help="Grade a filled-in exercise (EXECUTES it)."),
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds before --check stops the file."),
    as_json: bool = typer.Option(False, "--json", help="The question bank (or the grade) as JSON."),
) -> None:
    """Check questions (answers from stdin or the keyboard), scaffolds, graded exercises.

    --check exits 0 when every stage is right, 1 when a stage is wrong, 2 when it could not run.
    """
    from .learn import exercises, grade, questions, session

    if check is not None:
        with _library_errors():
            g = grade.check(check, exercise, timeout=timeout)
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
        qs = questions(seed=seed, n=n)
    if as_json:
        _print_json(qs)
        return
    console = _console()
    console.rule(f"causalattn learn: {len(qs)} question{'s' * (len(qs) != 1)} (seed {seed})")
    session.run_quiz(qs, console, session.stdin_reader(console=console))


# -- causalattn explore -----------------------------------------------------------------


@app.command()
def explore(
    sentences: list[str] = typer.Argument(None, help="Sentences (default: the seed's four)."),
    file: Path = typer.Option(None, "--file", "-f", help="Corpus file, one sentence a line."),
    trace_file: Path = typer.Option(None, "--trace", help="A trace saved by `trace --save` (.npz)."),
    output: Path = typer.Option(Path("explorer.html"), "--output", "-o", help="HTML file to write."),
    max_len: int = typer.Option(None, "--max-len", help="Pad/truncate to this many tokens."),
    d_model: int = typer.Option(16, "--d-model", help="Width of the random embeddings."),
    heads: int = typer.Option(2, "--heads", help="Number of heads h."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random embeddings and weights."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """One self-contained HTML page (no network) to explore masks, S, A and each query's row."""
    from . import text, viz
    from .trace import Trace

    if sum(x is not None and x != [] for x in (sentences, file, trace_file)) > 1:
        _fail("give sentences, --file or --trace, only one of them")
    with _library_errors():
        if trace_file is not None:
            tr = Trace.load(trace_file)
            title = f"causalattn explorer: {trace_file.name}"
            viz.write_explorer(tr, output, title=title)
            n = len(viz.kinds.sequences(tr))
        else:
            corpus = _read_corpus(file) if file is not None else (sentences or list(text.SEED_SENTENCES))
            if not corpus:
                _fail(f"text: the corpus file {file} has no sentences")
            batch = _encode_quiet(corpus, max_len=max_len)
            traces = viz.batch_traces(batch, d_model=d_model, n_heads=heads, seed=seed)
            title = (f"causalattn explorer: {batch.B} sentence(s), seeded random weights "
                     f"(d_model = {d_model}, {heads} heads, seed {seed})")
            viz.write_explorer(traces, output, names=viz.sentence_names(batch), title=title)
            n = batch.B
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
        False, "--layer", help="the whole CausalSelfAttention layer at GPT-2 small, fwd and fwd+bwd, vs SDPA"
    ),
):
    """Time the tiled engine against PyTorch's SDPA and naive attention (CPU), in alternation."""
    from .bench import cpu
    from .bench import layer as layer_bench

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
