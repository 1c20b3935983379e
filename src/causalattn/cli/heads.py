"""``causalattn heads``: each head's role in a Hugging Face model, measured on random tokens
repeated twice."""

from __future__ import annotations

from pathlib import Path

import typer

from ._app import SEQ_LEN, _Json, _library_errors, command_app
from ._output import _print_json
from ._positions import BASE

command = command_app()


@command.command("heads")
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
    length: int = typer.Option(
        24, SEQ_LEN, help="Random tokens in the sequence that is repeated (T = 2 × this)."
    ),
    sequences: int = typer.Option(16, "--sequences", help="How many such sequences."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random tokens."),
    as_json: _Json = False,
) -> None:
    """Each head's role (previous-token, induction, first-token), measured on random tokens
    repeated twice; layers and heads are 1-based."""
    # at call time: hf_heads imports torch, hf_model loads transformers
    from ..integrations import hf_heads, hf_model

    with _library_errors():
        lm, tokenizer = hf_model.load(model)
        table = hf_heads.measure(
            lm, tokenizer, length=length, sequences=sequences, seed=seed, ablate=ablate, how=how
        )
    if as_json:
        _print_json({"heads": table.rows(base=BASE)})
    else:
        typer.echo(table.format(base=BASE))
