"""``causalattn demo``: the seed's four sentences end to end, then the chapter's trace."""

from __future__ import annotations

import typer
from rich.table import Table
from rich.text import Text

from .. import text
from ..check import audit
from ..matrix_form import trace as run_trace
from ._app import _MAX_BYTES_HELP, DEFAULT_MAX_BYTES, _Json, _library_errors, command_app
from ._inputs import _CHAPTER, _check_width_options, _check_widths, _encode_quiet, _seeded_attention
from ._output import _console, _explain_json, _fmt, _one_based, _print_json
from ._positions import shown
from ._present import _mask_pair, _mask_table, _print_tables

command = command_app()


@command.command("demo")
def demo(
    d_model: int = typer.Option(8, "--d-model", help="Width of the random embeddings."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random embeddings and weights."),
    max_bytes: int = typer.Option(DEFAULT_MAX_BYTES, "--max-bytes", help=_MAX_BYTES_HELP),
    as_json: _Json = False,
) -> None:
    """The seed's four sentences end to end, then the chapter's four-token trace."""
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
            str(shown(b)),
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
        _mask_pair(f"sentence {shown(last)}, causal AND padding", batch.mask[last], s4, s4, "both"),
    )

    console.rule(f"3. One seeded self-attention over the batch (d_model = {d_model}, seed {seed})")
    console.print(
        f"X = E\\[ids] is {'×'.join(map(str, tr.X.shape))}; "
        f"A is {'×'.join(map(str, tr.A.shape))}; H is {'×'.join(map(str, tr.H.shape))}"
    )
    at = Table(
        title=f"A for sentence {shown(last)} (rows sum to 1; padding rows are 0)",
        title_justify="left",
        box=None,
    )
    at.add_column("query \\ key", style="bold")
    for j, c in enumerate(s4):
        at.add_column(Text(f"{shown(j)}\n{c[:5]}"), justify="right")
    for i, r in enumerate(s4):
        at.add_row(Text(f"{shown(i)} {r}"), *(f"{a:.2f}" if a else "·" for a in tr.A[last, i]))
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
