"""The `causalattn` command: a thin shell over the library (typer + rich).

Every command takes ``--json`` for machine-readable output. Positions on the command
line are 1-based, as in the chapter (h_1 … h_T); the Python API is 0-based.
"""

from __future__ import annotations

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Causal self-attention in matrix form: H = softmax_last(Q Kᵀ/√d_k + M) V.",
)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
