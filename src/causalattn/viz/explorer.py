"""The offline explorer: one self-contained HTML page (or notebook fragment) per set of traces.

All script and style are inline and nothing is fetched: the page works from a file,
behind a firewall, in an e-mail. The data travel as JSON in a
``<script type="application/json">`` block, with ``<``, ``>`` and ``&`` escaped, and the
page's script touches tokens only through ``textContent`` and canvas text, so a token
is always shown as text. Arrays travel as little-endian floats in base64. When a head's
S and A are exactly what its Q, K and mask give, the page carries Q and K (T×d_k) and
recomputes S and the masked softmax, so a 2048-token page stays about a megabyte;
otherwise it carries S and A themselves (Float32, readable entries only). The canvas,
not the DOM, draws the cells.

    html = explorer_html(tr)                         # a Trace (any batch/head axes)
    write_explorer(sentence_traces(["I love pizza"]), "report.html")
"""

from __future__ import annotations

import base64
import html
import json
import secrets
from importlib import resources
from pathlib import Path

import numpy as np

from ..reference import softmax_last
from ..reference import trace as _trace
from ..trace import Trace
from .kinds import allowed_2d, heads, padding_positions, sequences, tokens_of

__all__ = ["explorer_data", "explorer_html", "write_explorer", "sentence_traces", "batch_traces"]


def _b64(a: np.ndarray, dtype: str = "<f4") -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype=dtype).tobytes()).decode("ascii")


def _finite_or_none(x) -> float | None:
    return float(x) if x is not None and np.isfinite(x) else None


def _recomputable(h: Trace, allowed: np.ndarray, scale) -> bool:
    """True when S and A are exactly what Q, K, the scale and the mask give (float64, 1e-9).

    Then the page carries Q and K and recomputes S = Q Kᵀ·scale and the masked row
    softmax itself, the way :func:`causalattn.reference.softmax_last` does; a trace
    whose S or A differ (a recorded bug, an edited file) is carried as it is.
    """
    if scale is None or not all(n in h for n in ("Q", "K", "S", "A")):
        return False
    Q, K, S, A = h["Q"], h["K"], h["S"], h["A"]
    if Q.ndim != 2 or K.shape != Q.shape or not (np.isfinite(Q).all() and np.isfinite(K).all()):
        return False
    with np.errstate(all="ignore"):
        S2 = (Q @ K.T) * scale
        if not np.allclose(S2[allowed], S[allowed], rtol=1e-9, atol=1e-12):
            return False
        return bool(np.allclose(softmax_last(S2, allowed), A, rtol=1e-9, atol=1e-12))


def _sequence_data(name: str, tr: Trace) -> dict:
    hs = heads(tr)
    allowed = allowed_2d(hs[0])
    T = allowed.shape[0]
    for k, h in enumerate(hs[1:], start=2):
        if not np.array_equal(allowed_2d(h), allowed):
            raise ValueError(f"explorer: {name}: head {k} has another mask than head 1; "
                             "the explorer draws one mask per sequence")
    has_tokens = tr.tokens is not None and len(tr.tokens) == T
    pad = padding_positions(allowed, tr.tokens if has_tokens else None)
    head_data = []
    for h in hs:
        V = h["V"]
        d = {"V": _b64(V, "<f8"), "H": _b64(h["H"], "<f8") if "H" in h else None,
             "d_v": int(V.shape[-1])}
        if _recomputable(h, allowed, tr.scale):  # Q and K are T×d_k: far smaller than T×T
            d.update(form="qk", Q=_b64(h["Q"], "<f8"), K=_b64(h["K"], "<f8"), d_k=int(h["Q"].shape[-1]))
        else:  # readable entries only, row-major
            d.update(form="dense", S=_b64(h["S"][allowed]), A=_b64(h["A"][allowed]))
        head_data.append(d)
    return {
        "name": name,
        "T": int(T),
        "tokens": tokens_of(tr, T),
        "pad": pad.astype(int).tolist(),
        "allowed": base64.b64encode(np.packbits(allowed.ravel())).decode("ascii"),
        "scale": _finite_or_none(tr.scale),
        "heads": head_data,
    }


def _named_sequences(obj, names) -> list[tuple[str, Trace]]:
    """Accept a Trace, a list of Traces, or a text.Batch; split batches into sequences."""
    from ..text import Batch

    if isinstance(obj, Batch):
        names = sentence_names(obj) if names is None else names
        obj = batch_traces(obj)
    traces = [obj] if isinstance(obj, Trace) else list(obj)
    if not traces:
        raise ValueError("explorer: nothing to show; give at least one Trace")
    out = []
    for k, tr in enumerate(traces):
        parts = sequences(tr)
        for name, one in parts:
            label = name if len(traces) == 1 else f"trace {k + 1}" + (f" {name}" if len(parts) > 1 else "")
            out.append((label, one))
    if names is not None:
        names = [str(n) for n in names]
        if len(names) != len(out):
            raise ValueError(f"explorer: {len(names)} names for {len(out)} sequences")
        out = [(n, tr) for n, (_, tr) in zip(names, out)]
    return out


def explorer_data(obj, *, names=None, title: str = "causalattn explorer") -> dict:
    """The JSON-ready data the page draws: sequences, tokens, masks, S, A, V, H per head."""
    seqs = [_sequence_data(n, tr) for n, tr in _named_sequences(obj, names)]
    return {"version": 1, "title": str(title), "sequences": seqs}


def _json_for_script(data: dict) -> str:
    """JSON that cannot end its <script> element or open a comment: < > & as \\uXXXX."""
    text = json.dumps(data, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _asset(name: str) -> str:
    text = resources.files(__package__).joinpath(name).read_text(encoding="utf-8")
    if "</script" in text.lower() or "</style" in text.lower():
        raise RuntimeError(f"explorer asset {name} must not contain a closing script/style tag")
    return text


def explorer_fragment(obj, *, names=None, title: str = "causalattn explorer", nonce: str | None = None) -> str:
    """A ``<div>`` with its own style, data and script: for notebooks and for the page."""
    data = explorer_data(obj, names=names, title=title)
    uid = "ca-x-" + secrets.token_hex(6)
    n = f' nonce="{nonce}"' if nonce else ""
    T = max(s["T"] for s in data["sequences"])
    summary = html.escape(f"{title}: {len(data['sequences'])} sequence(s), up to {T} tokens", quote=True)
    return (
        f'<div class="ca-explorer" id="{uid}">'
        f"<style{n}>{_asset('explorer.css')}</style>"
        f'<div class="ca-fallback">{summary} (the explorer needs JavaScript; in Jupyter, trust '
        "the notebook)</div>"
        f'<script type="application/json" class="ca-data">{_json_for_script(data)}</script>'
        f"<script{n}>(function () {{\n{_asset('explorer.js')}\n"
        f'var root = document.getElementById("{uid}");\n'
        'causalattnExplorer(root, JSON.parse(root.querySelector("script.ca-data").textContent));\n'
        "})();</script></div>"
    )


def explorer_html(obj, *, names=None, title: str = "causalattn explorer") -> str:
    """A complete, self-contained HTML page; its CSP forbids every network request."""
    nonce = secrets.token_urlsafe(16)
    csp = (
        f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'unsafe-inline'; "
        "img-src data:; connect-src 'none'; base-uri 'none'; form-action 'none'"
    )
    body = explorer_fragment(obj, names=names, title=title, nonce=nonce)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(str(title))}</title></head>\n<body>{body}</body></html>\n"
    )


def write_explorer(obj, path, *, names=None, title: str = "causalattn explorer") -> Path:
    """Write :func:`explorer_html` to ``path`` (UTF-8) and return the path."""
    path = Path(path)
    if not path.parent.is_dir():  # as Trace.save: no folder is created behind the caller's back
        raise ValueError(f"explorer: the folder {path.parent} does not exist (create it first)")
    path.write_text(explorer_html(obj, names=names, title=title), encoding="utf-8")
    return path


def batch_traces(batch, *, d_model: int = 16, n_heads: int = 2, seed: int = 0) -> list[Trace]:
    """One Trace per sentence of a :class:`causalattn.text.Batch`, from seeded random weights.

    The embedding (vocabulary×d_model) and W_Q, W_K, W_V, W_O are drawn from
    ``numpy.random.default_rng(seed)``: the weights are made up, the mask and the
    arithmetic are real. ``batch.sentence_mask(b)`` brings causal and padding together
    (one N×N at a time: the batch's masks are built on demand).
    """
    for name, v in (("d_model", d_model), ("n_heads", n_heads)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"explorer: {name} must be a positive integer, got {v!r}")
    if d_model % n_heads:
        raise ValueError(f"explorer: d_model={d_model} is not divisible by n_heads={n_heads}")
    rng = np.random.default_rng(seed)
    E = rng.normal(size=(len(batch.vocab), d_model))
    W_q, W_k, W_v, W_o = (rng.normal(size=(d_model, d_model)) / np.sqrt(d_model) for _ in range(4))
    return [
        _trace(E[batch.ids[b]], W_q, W_k, W_v, W_o, mask=batch.sentence_mask(b),
                        n_heads=n_heads, tokens=list(batch.tokens[b]))
        for b in range(batch.ids.shape[0])
    ]


def sentence_traces(sentences, *, max_len: int | None = None, **kw) -> list[Trace]:
    """:func:`batch_traces` of ``text.encode(sentences, max_len)``."""
    from .. import text

    return batch_traces(text.encode(sentences, max_len=max_len), **kw)


def sentence_names(batch) -> list[str]:
    """Short names for a batch's sentences: their real tokens, cut at 60 characters."""
    names = []
    for b, toks in enumerate(batch.tokens):
        s = " ".join(toks[: int(batch.lengths[b])])
        names.append(f"{b + 1}: " + (s if len(s) <= 60 else s[:59] + "…"))
    return names
