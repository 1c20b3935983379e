"""``causalattn audit``: check named arrays in dependency order, a mask against the declared
pattern, or every layer of a Hugging Face model."""

from __future__ import annotations

from pathlib import Path

import typer

from ..check import audit
from ..check.compare import compare_lone_mask
from ._app import _fail, _Json, command_app
from ._inputs import _captured
from ._options import (
    _AlibiSlopes,
    _Bidirectional,
    _Chunk,
    _declared,
    _Lengths,
    _PrefixLengths,
    _Scale,
    _Sinks,
    _Softcap,
    _Window,
)
from ._output import _console, _one_based, _print_json

command = command_app()


@command.command("audit")
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
    """Check named arrays in dependency order (a file holding only a mask: compare it with the
    declared pattern, cell by cell). Exit 0 clean, 1 a check fails, 2 unusable input."""
    if model is not None:
        _audit_model(model, file, layers, as_json)
        return
    if file is None:
        _fail('give a file of arrays to audit, or --model DIR "text"')
    declared = _declared(
        window, chunk, lengths, prefix_lengths, softcap, sinks, alibi_slopes, bidirectional
    )
    if _audit_mask(file, max_bytes, declared, as_json):  # a file that holds only a mask
        return
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


def _audit_mask(file: str, max_bytes: int, declared: dict, as_json: bool) -> bool:
    """A file holding only a mask (one boolean array, or one named mask/attention_mask; bool,
    additive or 1/0, read as audit() reads it): compared cell for cell with the declared
    pattern (causalattn.check.compare_masks).
    False when the file holds something else (the stages audit checks)."""
    try:
        report = compare_lone_mask(file, max_bytes, declared)  # audit()'s door too
        if report is None:
            return False
    except (ValueError, OSError) as exc:
        _fail(str(exc))
    if as_json:
        _print_json({"positions": "1-based", **report.to_dict(base=1)})
    else:
        _console().print(report.format(base=1), markup=False)
    if not report.ok:
        raise typer.Exit(1)
    return True


def _audit_model(model_dir: Path, prompt: str | None, layers: str | None, as_json: bool) -> None:
    # at call time: the integrations load transformers (and torch)
    from ..integrations import hf_model

    model, traces = _captured(model_dir, prompt, layers)
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
