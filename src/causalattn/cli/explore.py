"""``causalattn explore text|trace|model``: one self-contained HTML page (no network) to
explore masks, S, A and each query's row."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from .. import learn, text, viz
from .._trace import Trace
from ._app import (
    _MAX_BYTES_HELP,
    DEFAULT_MAX_BYTES,
    SEQ_LEN,
    _fail,
    _Json,
    _library_errors,
    _ModeCommand,
    command_app,
)
from ._inputs import _captured, _check_width_options, _check_widths, _encode_quiet, _read_corpus
from ._output import _check_out_file, _console, _human_bytes, _print_json, _progress

command = command_app(
    "explore",
    "One self-contained HTML page (no network) to explore masks, S, A and each query's row: "
    "of sentences (text), of a saved trace (trace) or of a Hugging Face model (model).",
)

# The page takes sentences while its estimated size fits --max-page-bytes (the explorer
# enforces the same budget on its matrices): per sentence the page holds about 600 bytes
# plus 32 a token position (name, tokens, ids, mask kinds; Q, K, V are computed on the page
# from the shared weights), as measured on 3,000 and 10,000 sentences of 5 and 3-30 words;
# sentences past the budget are not even traced, which bounds the time and the memory.
_PAGE_BYTES = 4 * 2**20

# the options, one definition for every mode that takes them
_Sentences = Annotated[
    list[str], typer.Argument(help="Sentences (default: the seed's four).", show_default=False)
]
_File = Annotated[Path, typer.Option("--file", "-f", help="Corpus file, one sentence a line.")]
_Output = Annotated[Path, typer.Option("--output", "-o", help="HTML file to write.")]
_MaxLen = Annotated[int, typer.Option(SEQ_LEN, help="Pad/truncate to this many tokens.")]
_DModel = Annotated[int, typer.Option("--d-model", help="Width of the random embeddings.")]
_Heads = Annotated[int, typer.Option("--heads", help="Number of heads h.")]
_Seed = Annotated[int, typer.Option("--seed", help="Seed of the random embeddings and weights.")]
_QSeed = Annotated[int, typer.Option("--seed", help="Seed of the --questions.")]
_MaxPageBytes = Annotated[
    int,
    typer.Option(
        "--max-page-bytes",
        help="Put only the sentences that fit a page of this size (default 4 MiB).",
    ),
]
_MaxBytes = Annotated[int, typer.Option("--max-bytes", help=_MAX_BYTES_HELP)]
_Questions = Annotated[
    int,
    typer.Option(
        "--questions",
        help="Add a 'check yourself' panel of this many questions "
        "(`causalattn learn`'s, drawn with --seed).",
    ),
]
_Layers = Annotated[str, typer.Option("--layers", help="Which layers, from 1, e.g. '1,3,5-7'.")]
_Generate = Annotated[
    int, typer.Option("--generate", help="N greedy tokens after the text (marked as such).")
]
_OUTPUT = Path("explorer.html")


@command.command("text", cls=_ModeCommand)
def explore_text(
    sentences: _Sentences = None,
    file: _File = None,
    output: _Output = _OUTPUT,
    max_len: _MaxLen = None,
    d_model: _DModel = 16,
    heads: _Heads = 2,
    seed: _Seed = 0,
    max_page_bytes: _MaxPageBytes = _PAGE_BYTES,
    max_bytes: _MaxBytes = DEFAULT_MAX_BYTES,
    questions: _Questions = 0,
    as_json: _Json = False,
) -> None:
    """Sentences (or a corpus file) through seeded random weights."""
    qs = _questions(questions, seed)
    if sentences and file is not None:
        _fail("give sentences or --file, not both")
    _check_page_options(max_page_bytes, d_model, heads, output)
    with _library_errors():
        n = _write_text(
            sentences,
            file,
            output,
            max_len,
            d_model,
            heads,
            seed,
            max_page_bytes,
            max_bytes,
            qs,
            as_json,
        )
    _wrote(output, n, as_json)


@command.command("trace", cls=_ModeCommand)
def explore_trace(
    trace_file: Annotated[
        Path, typer.Argument(help="A trace saved by `trace --save` (.npz).", show_default=False)
    ],
    output: _Output = _OUTPUT,
    max_bytes: _MaxBytes = DEFAULT_MAX_BYTES,
    questions: _Questions = 0,
    seed: _QSeed = 0,
    as_json: _Json = False,
) -> None:
    """A trace saved by `causalattn trace --save`."""
    qs = _questions(questions, seed)
    _check_out_file("--output", output)
    with _library_errors():
        n = _write_trace(trace_file, output, max_bytes, qs)
    _wrote(output, n, as_json)


@command.command("model", cls=_ModeCommand)
def explore_model(
    model: Annotated[
        Path,
        typer.Argument(
            help="A Hugging Face causal LM folder (save_pretrained).", show_default=False
        ),
    ],
    prompt: Annotated[
        str, typer.Argument(help="The text to run the model on.", show_default=False)
    ] = None,
    layers: _Layers = None,
    generate: _Generate = None,
    output: _Output = _OUTPUT,
    questions: _Questions = 0,
    seed: _QSeed = 0,
    as_json: _Json = False,
) -> None:
    """A Hugging Face model's layers on one text."""
    qs = _questions(questions, seed)
    _write_model(model, prompt, layers, generate, output, qs, as_json)


# -- what the modes share ------------------------------------------------------------------


def _questions(questions: int, seed: int):
    """--questions N: N of `causalattn learn`'s questions drawn with --seed (None for 0)."""
    if questions < 0:
        _fail(f"--questions must be 0 (none) or more, got {questions}")
    if not questions:
        return None
    with _library_errors():
        return learn.questions(seed, questions)


def _check_page_options(max_page_bytes: int, d_model: int, heads: int, output: Path) -> None:
    if max_page_bytes < 1:
        _fail(f"--max-page-bytes must be a positive integer, got {max_page_bytes}")
    _check_width_options(d_model, heads)
    _check_out_file("--output", output)


def _wrote(output: Path, n: int, as_json: bool) -> None:
    size = output.stat().st_size
    if as_json:
        _print_json({"output": str(output), "sequences": n, "bytes": size})
        return
    typer.echo(f"wrote {output} ({_human_bytes(size)}): open it in any browser, offline")


def _page_sentences(batch, page_bytes: int) -> int:
    """How many sentences (from the first) fit a page of ``page_bytes``; at least one."""
    per = 32 * batch.N + 600
    return max(1, min(batch.B, (page_bytes - 2**18) // per))  # less the script and style


def _write_trace(trace_file: Path, output: Path, max_bytes: int, qs) -> int:
    """The page of a saved trace; returns how many sequences it shows."""
    tr = Trace.load(trace_file, max_bytes=max_bytes)  # the one reader, headers first
    title = f"causalattn explorer: {trace_file.name}"
    viz.write_explorer(tr, output, title=title, questions=qs)
    return len(viz.kinds.sequences(tr))


def _write_text(
    sentences, file, output, max_len, d_model, heads, seed, max_page_bytes, max_bytes, qs, as_json
) -> int:
    """The page of sentences through seeded random weights; returns how many it shows."""
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
    return n


def _write_model(model: Path, prompt, layers, generate, output: Path, qs, as_json: bool) -> None:
    """The page of a Hugging Face model's layers on one text (``generate`` tokens after it)."""
    lm, traces = _captured(model, prompt, layers, generate)
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
