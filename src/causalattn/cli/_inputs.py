"""What the commands read and build before they compute: sentences (encoded, or a corpus
file), a trace's input arrays, the seeded random weights, a Hugging Face model's traces.
Every file is read by the one reader, :mod:`causalattn.io.files` (headers first, one
budget); every problem is one ``error:`` line."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import typer

from .. import text
from ..io.files import AuditInputError, read_arrays, read_text
from ..matrix_form import trace as run_trace
from ._app import DEFAULT_MAX_BYTES, _fail, _library_errors
from ._positions import given, given_list, shown


def _encode_quiet(sentences, max_len=None, max_bytes=DEFAULT_MAX_BYTES, **rules):
    """text.encode, with its truncation warning shown as a note on stderr."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch = text.encode(sentences, max_len=max_len, max_bytes=max_bytes, **rules)
    for w in caught:
        typer.echo(f"note: {w.message}", err=True)
    return batch


def _read_corpus(path: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> list[str]:
    """The non-blank lines of a UTF-8 corpus file (the one reader: a regular file within
    --max-bytes, checked before it is read)."""
    try:
        lines = read_text(path, max_bytes).splitlines()
    except AuditInputError as exc:
        _fail(f"text: cannot read corpus file {exc}")
    corpus = [ln for ln in lines if ln.strip()]
    if not corpus:
        _fail(f"text: the corpus file {path} has no sentences")
    return corpus


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
    one reader (:mod:`causalattn.io.files`: headers first, one budget); the format is
    read off the content, so a .txt holding JSON works; every problem is one ``error:`` line.
    """
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
        with _library_errors():
            text.check_bytes(
                f"trace: X {X.shape} makes T×T stages that",
                6 * 8 * lead * T * T,
                max_bytes,
                "trace a shorter sequence, or raise --max-bytes",
            )
    return data


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
    _check_width_options(d_model, heads)
    N = batch.N
    fixed = 8 * d_model * (len(batch.vocab) + 4 * d_model)  # E (vocab×d), four d×d weights
    # X, Q, K, V, H (N×d) and the T×T float64 stages S, M, Z, A, with room for temporaries
    per = 8 * (5 * d_model * N + 8 * heads * N * N)
    text.check_bytes(
        f"the seeded weights and one sentence's trace (d_model = {d_model}, {heads} "
        f"heads, N = {N})",
        fixed + per,
        max_bytes,
        "lower --d-model or --max-len, or raise --max-bytes",
    )
    return per


def _seeded_attention(batch, d_model: int, seed: int):
    """Random (seeded) embeddings and weights -> one float64 trace over the whole batch."""
    rng = np.random.default_rng(seed)
    E = rng.normal(size=(len(batch.vocab), d_model))  # one embedding per vocabulary id
    W_q, W_k, W_v = (rng.normal(size=(d_model, d_model)) / np.sqrt(d_model) for _ in range(3))
    X = E[batch.ids]  # (B, N, d_model)
    return run_trace(X, W_q, W_k, W_v, mask=batch.mask, causal=False)


def _captured(model_dir: Path, prompt: str | None, layers: str | None, generate: int | None = None):
    """(model, traces) of a Hugging Face model folder run on one text (and ``generate``
    greedy tokens after it); ``layers`` as the command line counts them, from 1."""
    # at call time: the integrations load transformers, and hf_capture imports torch
    from ..integrations import hf_model
    from ..integrations.hf_capture import capture, n_layers

    if prompt is None:
        _fail('--model needs the text to run the model on, e.g. --model DIR "The cat sat."')
    chosen = given_list(layers, "--layers")
    with _library_errors():
        model, tokenizer = hf_model.load(model_dir)
        if chosen is not None:
            count = n_layers(model)
            chosen = [given(shown(i), "--layers", count, "layer") for i in chosen]
        ids = hf_model.encode(tokenizer, prompt, model)
        traces = capture(model, ids, layers=chosen, tokenizer=tokenizer, generate=generate)
    return model, traces
