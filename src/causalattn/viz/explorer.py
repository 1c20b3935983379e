"""The offline explorer: one self-contained HTML page (or notebook fragment).

All script and style are inline and nothing is fetched: the page works from a file,
behind a firewall, in an e-mail. Data travel as JSON in ``<script type="application/json">``
blocks, with ``<``, ``>`` and ``&`` escaped, and the page's script touches tokens only through
``textContent`` and canvas text, so a token is always shown as text. The canvas, not the
DOM, draws the cells.

What is shown: sequences (sentences) × layers × heads. A list of Traces that share their
tokens is read as the layers of one model (what
:func:`causalattn.integrations.transformers.capture` returns) and gets a *model view*: a grid
of layers × heads thumbnails with a summary per head; any other list is read as one sequence
per Trace (``layers=`` decides explicitly).

Paging: the first block holds the index (names and lengths); each sequence's tokens, mask
kinds and thumbnails, and each layer's heads, are blocks of their own, parsed only when
opened, so a page of 10,000 sentences opens as fast as one of ten.

What is stored, per head: when the trace's S and A are what Q, K, the scale and the mask
give, the page carries Q and K and recomputes S and the masked softmax itself (Q, K are
T×d_k, far smaller than T×T); otherwise S and A themselves (readable entries only). The
precision follows the page's size budget (``max_bytes``, the file size aimed at): float64
while it fits, else float32, else float16 with V cut to its first :data:`V_SHOWN` components plus
its exact norms (the side
panel shows no more). The page says which, and how far its recomputed A is from the
trace's (measured here, in float64). Thumbnails are max-pooled to at most 48×48. Should
the sequences still not fit, the page keeps the first ones and says so (one sequence is
never cut).

The steps, a module each: :mod:`.explorer_read` (what was given, as sequences × layers),
:mod:`.explorer_precision` (how each array travels), :mod:`.explorer_verify` (what the page
may recompute, checked against the trace), :mod:`.explorer_encode` (the JSON blocks); this
module groups the layers, assembles the page and inlines its script, the modules of
``js/`` in the order of :data:`SCRIPTS`. The page's recompute (``js/decode.js``) is pinned
to :mod:`causalattn.matrix_form` for every modifier and mask rule by the browser tests.
"""

from __future__ import annotations

import html
import json
import secrets
from importlib import resources
from pathlib import Path

import numpy as np

from .explorer_encode import Shared, encode_group, json_for_script, sequence_meta
from .explorer_precision import V_SHOWN, page_precision, qk_at, tolerance
from .explorer_read import Layer, named_sequences, stacked
from .explorer_verify import (
    CHUNK_CELLS,
    Scores,
    check_scores,
    check_values,
    from_weights,
    modifiers,
)
from .kinds import KINDS
from .learnpanel import learn_data

__all__ = [
    "explorer_data",
    "explorer_html",
    "explorer_fragment",
    "write_explorer",
    "MAX_BYTES",
    "V_SHOWN",
]

MAX_BYTES = 18 * 2**20  # the size a page aims at (see the module docstring)


# -- the heads' blocks -----------------------------------------------------------------------
def _layers_data(
    layers: list[Layer], prec: str, shared: Shared | None = None
) -> list[tuple[dict, list[float | None]]]:
    """Each layer's block (scale and heads) at precision ``prec``, with the page's error on A
    per head (None: S and A carried as they are). Layers of the same shapes are done
    together, a few million cells at a time: 10,000 sentences cost about as much as one."""
    groups: dict[tuple, list[int]] = {}
    for k, lay in enumerate(layers):
        tr = lay.trace
        A = stacked(tr, "A")
        al = np.broadcast_to(lay.kinds == 0, A.shape)
        if tr.allowed is not None and not np.array_equal(np.broadcast_to(tr.allowed, A.shape), al):
            raise ValueError(
                f"explorer: {lay.name}: a head has another mask than the layer's "
                "kinds; the explorer draws one mask per layer"
            )
        names = tuple(n for n in ("Q", "K", "V", "S", "A", "H") if n in tr)
        weights = tuple(n in tr for n in ("X", "W_q", "W_k", "W_v"))  # X W checked per group
        key = (names, weights, tr.scale, json.dumps(modifiers(tr, A.shape[0]))) + tuple(
            (stacked(tr, n).shape, stacked(tr, n).dtype.str) for n in names
        )
        groups.setdefault(key, []).append(k)
    out: list = [None] * len(layers)
    for members in groups.values():
        H, T = stacked(layers[members[0]].trace, "A").shape[:2]
        step = max(1, CHUNK_CELLS // max(1, H * T * T))
        for c in range(0, len(members), step):
            part = members[c : c + step]
            for k, res in zip(part, _group_data([layers[k] for k in part], prec, shared)):
                out[k] = res
    return out


def _group_data(
    layers: list[Layer], prec: str, shared: Shared | None = None
) -> list[tuple[dict, list[float | None]]]:
    """:func:`_layers_data` for layers of identical shapes, stacked to ``(n, h, T, ·)``: the
    three steps, verify (what the page may recompute), precision (how Q and K travel; inside
    the check, as the page recomputes from what it is given) and encode."""
    tr0 = layers[0].trace
    st = {
        n: (
            stacked(tr0, n)[None]
            if len(layers) == 1  # a view: no copy of a big layer
            else np.stack([stacked(lay.trace, n) for lay in layers])
        )
        for n in ("Q", "K", "V", "S", "A", "H")
        if n in tr0
    }
    al = np.stack([lay.kinds == 0 for lay in layers])[:, None]  # (n, 1, T, T)
    n, H = st["V"].shape[:2]
    mods = modifiers(tr0, H)
    fromW = np.zeros(n, bool)
    if shared is not None and "Q" in st and "K" in st:
        fromW = from_weights(layers, st)
    scores, qk = Scores(np.zeros((n, H), bool), np.full((n, H), np.nan)), None
    if (
        tr0.scale is not None
        and mods is not None
        and all(k in st for k in ("Q", "K", "S", "A"))
        and st["Q"].shape == st["K"].shape
    ):
        qk = qk_at(st["Q"], st["K"], prec, bool(fromW.all()))
        Qc, pq, Kc, pk = qk
        scores = check_scores(Qc, Kc, st["Q"], st["K"], st, al, tr0.scale, mods, tolerance(pq, pk))
    not_av = check_values(st, al)  # H is not A V (a recorded bug)
    xform = fromW & scores.ok.all(axis=1) & ~not_av.any(axis=1)
    return encode_group(layers, st, al, prec, mods, qk, scores, not_av, xform, shared)


# -- the page's data -------------------------------------------------------------------------
_NOTE_PREC = {
    "f8": "",
    "f4": "Q, K and V are stored as float32 to keep the file small",
    "f2": (
        "Q and K are stored as float16 and v_j as its first {v} components (float16) with "
        "its exact norm, to keep the file small"
    ),
}


def _build(obj, *, names, title, layers, max_bytes, questions):
    """(index, blocks): the page's first JSON block and its paged blocks, in order."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, (int, np.integer)) or max_bytes < 1:
        raise ValueError(f"explorer: max_bytes must be a positive integer, got {max_bytes!r}")
    seqs = named_sequences(obj, names, layers)
    prec = page_precision(seqs, max_bytes)
    blocks: list[str] = []
    index, notes, errs, cache, shared = [], [], [], {}, Shared()
    used, chunk = 0, 256  # sequences prepared together (see _layers_data)
    for c0 in range(0, len(seqs), chunk):
        part = seqs[c0 : c0 + chunk]
        done = iter(_layers_data([lay for seq in part for lay in seq.layers], prec, shared))
        for seq in part:
            if used > max_bytes:
                break
            first = len(blocks) + 1  # the layers' blocks follow the sequence's own block
            blocks.append(json_for_script(sequence_meta(seq, lambda k, f=first: f + k, cache)))
            for data, e in (next(done) for _ in seq.layers):
                errs += e
                blocks.append(json_for_script(data))
            used += sum(len(b) for b in blocks[first - 1 :])
            index.append(
                {
                    "name": seq.name,
                    "T": int(seq.layers[0].kinds.shape[0]),
                    "n_layers": len(seq.layers),
                    "block": first - 1,
                }
            )
        if used > max_bytes and len(index) < len(seqs):
            notes.append(
                f"Showing the first {len(index)} of {len(seqs)} sequences: the page "
                f"would pass its size limit (max_bytes = {max_bytes}). Give fewer, or "
                "raise it."
            )
            break
    xsets = []
    for k in range(len(shared.sets)):  # after the sequences, but sent before the script
        xsets.append(len(blocks))
        blocks.append(json_for_script(shared.block(k)))
    uses_prec = any('"form":"qk"' in b or '"form":"dense"' in b for b in blocks)
    if prec != "f8" and uses_prec:
        notes.append(_NOTE_PREC[prec].format(v=V_SHOWN) + ".")
    done = [e for e in errs if e is not None]
    if done and max(done) > 1e-9:
        notes.append(
            f"S and A are recomputed in the page from Q and K: at most "
            f"{max(done):.1e} from the trace's own A."
        )
    data = {
        "version": 2,
        "title": str(title),
        "notes": notes,
        "kinds": [k._asdict() for k in KINDS.values()],
        "sequences": index,
        "xsets": xsets,
        "learn": None if questions is None else learn_data(questions),
    }
    return data, blocks


def explorer_data(
    obj,
    *,
    names=None,
    title: str = "causalattn explorer",
    layers=None,
    max_bytes: int = MAX_BYTES,
    questions=None,
) -> dict:
    """The JSON-ready data the page draws, every block parsed: ``{"sequences": [{"name", "T",
    "tokens", "pad", "layers": [{"name", "kinds", "heads": [...], ...}]}], ...}``."""
    index, blocks = _build(
        obj, names=names, title=title, layers=layers, max_bytes=max_bytes, questions=questions
    )
    parsed = [json.loads(b) for b in blocks]
    for s in index["sequences"]:
        meta = parsed[s["block"]]
        s.update(tokens=meta["tokens"], pad=meta["pad"], layers=meta["layers"])
        for lay in s["layers"]:
            lay.update(parsed[lay["block"]])
    index["xsets"] = [parsed[k] for k in index["xsets"]]
    return index


# The page's script: one module per concern, inlined in this order into one <script> (each
# a factory the later ones call: decode needs nothing, main builds the rest), so the page
# stays one self-contained file.
SCRIPTS = ("decode", "util", "paint", "side", "model", "learn", "main")


def _asset(*parts: str) -> str:
    """A file beside this module (``parts``: folders, then its name)."""
    where, name = resources.files(__package__), "/".join(parts)
    for part in parts:
        where = where.joinpath(part)
    text = where.read_text(encoding="utf-8")
    if "</script" in text.lower() or "</style" in text.lower():
        raise RuntimeError(f"explorer asset {name} must not contain a closing script/style tag")
    return text


def script_source(*modules: str) -> str:
    """The explorer's JavaScript modules (default: all of :data:`SCRIPTS`, in order), as the
    page inlines them."""
    return "\n".join(_asset("js", f"{m}.js") for m in (modules or SCRIPTS))


def explorer_fragment(
    obj,
    *,
    names=None,
    title: str = "causalattn explorer",
    nonce: str | None = None,
    layers=None,
    max_bytes: int = MAX_BYTES,
    questions=None,
) -> str:
    """A ``<div>`` with its own style, data and script: for notebooks and for the page."""
    index, blocks = _build(
        obj, names=names, title=title, layers=layers, max_bytes=max_bytes, questions=questions
    )
    uid = "ca-x-" + secrets.token_hex(6)
    n = f' nonce="{nonce}"' if nonce else ""
    T = max(s["T"] for s in index["sequences"])
    L = max(s["n_layers"] for s in index["sequences"])
    summary = html.escape(
        f"{title}: {len(index['sequences'])} sequence(s), up to {T} tokens"
        + (f", {L} layers" if L > 1 else ""),
        quote=True,
    )
    # The blocks of the first view come before the script, the rest after it: the page
    # draws while the browser is still reading the other layers and sentences.
    paged = [
        f'<script type="application/json" class="ca-block" data-k="{k}">{b}</script>'
        for k, b in enumerate(blocks)
    ]
    first = 1 + index["sequences"][0]["n_layers"] if blocks else 0
    early = set(range(first)) | set(index["xsets"])  # what the first view needs
    return (
        f'<div class="ca-explorer" id="{uid}">'
        f"<style{n}>{_asset('explorer.css')}</style>"
        f'<div class="ca-fallback">{summary} (the explorer needs JavaScript; in Jupyter, trust '
        "the notebook)</div>"
        f'<script type="application/json" class="ca-data">{json_for_script(index)}</script>'
        + "".join(b for k, b in enumerate(paged) if k in early)
        + f"<script{n}>(function () {{\n{script_source()}\n"
        f'var root = document.getElementById("{uid}");\n'
        'causalattnExplorer(root, JSON.parse(root.querySelector("script.ca-data").textContent));\n'
        "})();</script>" + "".join(b for k, b in enumerate(paged) if k not in early) + "</div>"
    )


def explorer_html(
    obj,
    *,
    names=None,
    title: str = "causalattn explorer",
    layers=None,
    max_bytes: int = MAX_BYTES,
    questions=None,
) -> str:
    """A complete, self-contained HTML page; its CSP forbids every network request."""
    nonce = secrets.token_urlsafe(16)
    csp = (
        f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'unsafe-inline'; "
        "img-src data:; connect-src 'none'; base-uri 'none'; form-action 'none'"
    )
    body = explorer_fragment(
        obj,
        names=names,
        title=title,
        nonce=nonce,
        layers=layers,
        max_bytes=max_bytes,
        questions=questions,
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(str(title))}</title></head>\n<body>{body}</body></html>\n"
    )


def write_explorer(
    traces,
    path,
    *,
    names=None,
    title: str = "causalattn explorer",
    layers=None,
    max_bytes: int = MAX_BYTES,
    questions=None,
) -> Path:
    """Write the explorer page for ``traces`` to ``path`` (UTF-8) and return the path.

    ``traces``: a Trace (any batch/head axes), a :class:`causalattn.text.Batch`, or a list
    of Traces: the layers of one model (heads on a leading axis, the same tokens; what
    ``capture()`` returns) or one Trace per sentence (what ``batch_traces`` returns);
    ``layers=True/False`` says which when the guess (shared tokens = layers) would be wrong.
    ``questions``: check questions (``causalattn.learn.questions(...)``) for the page's
    "check yourself" panel. ``max_bytes``: see the module docstring.
    """
    path = Path(path)
    if not path.parent.is_dir():  # as Trace.save: no folder is created behind the caller's back
        raise ValueError(f"explorer: the folder {path.parent} does not exist (create it first)")
    path.write_text(
        explorer_html(
            traces,
            names=names,
            title=title,
            layers=layers,
            max_bytes=max_bytes,
            questions=questions,
        ),
        encoding="utf-8",
    )
    return path
