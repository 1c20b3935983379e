"""Property-based fuzzing of the CLI and of attention / trace / encode.

Run by tests/check/test_hostile.py in ONE subprocess capped with resource.setrlimit, so a
blow-up fails the test instead of the machine. Every property: a clean error (exit 2 and
one ``error:`` line; ValueError in Python) or a correct result, never a traceback, never
NaN in a row that reads keys.

    python tests/check/fuzz_inputs.py OUTDIR [EXAMPLES]
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import causalattn as ca
from causalattn import masks
from causalattn.cli import app
from causalattn.text import tokenize

OUT = Path(sys.argv[1])
N = int(sys.argv[2]) if len(sys.argv) > 2 else 60
SETTINGS = settings(
    max_examples=N,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)

# -- the CLI's argument space ---------------------------------------------------------------

WORDS = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30)
INTS = st.sampled_from(
    ["-1", "0", "1", "2", "3", "7", "100", "100000", "1000000000000", "x", "1.5", ""]
)
PATHS = st.sampled_from(
    [
        "missing.txt",
        "nodir/out.html",
        "corpus.txt",
        "mine.json",
        "empty.txt",
        "out.html",
        ".",
        "bad.json",
    ]
)
OPTS = {
    "masks": [
        ("--max-len", INTS),
        ("--form", st.sampled_from(["both", "check", "nope", ""])),
        ("--file", PATHS),
        ("--max-bytes", st.sampled_from(["0", "100", "1000000"])),
        ("--full", None),
        ("--json", None),
        ("--bogus", None),
    ],
    "trace": [
        ("-i", PATHS),
        ("-q", INTS),
        ("--save", PATHS),
        ("--json", None),
        ("--max-bytes", st.sampled_from(["0", "100", "1000000"])),
    ],
    "explore": [
        ("--max-len", INTS),
        ("--heads", INTS),
        ("--d-model", INTS),
        ("-o", PATHS),
        ("--file", PATHS),
        ("--max-page-bytes", INTS),
        ("--json", None),
        ("--trace", PATHS),
    ],
    "demo": [("--d-model", INTS), ("--seed", INTS), ("--json", None)],
    # the modes; `explore` above is their older spelling (--trace, a mode's option
    # given to another mode, must be one error line too)
    "explore text": [("--max-len", INTS), ("--heads", INTS), ("-o", PATHS), ("--trace", PATHS)],
    "explore trace": [("-o", PATHS), ("--max-bytes", INTS), ("--d-model", INTS)],
    "shapes": [("-T", INTS), ("--d-model", INTS), ("-H", INTS), ("--d-k", INTS), ("--json", None)],
    "nosuch": [],
}


@st.composite
def argv(draw):
    cmd = draw(st.sampled_from(sorted(OPTS)))
    args = cmd.split()
    opts = draw(st.lists(st.sampled_from(OPTS[cmd]), max_size=4)) if OPTS[cmd] else []
    for name, values in opts:
        args += [name] if values is None else [name, draw(values)]
    if cmd in ("masks", "explore", "explore text", "explore trace") and draw(st.booleans()):
        args += draw(st.lists(WORDS, min_size=1, max_size=3))
    return args


@SETTINGS
@given(argv())
def fuzz_cli(args):
    res = CliRunner().invoke(app, args)
    out = res.stdout + res.stderr
    assert "Traceback" not in out and "internal error" not in out, (args, out[-2000:])
    assert res.exit_code in (0, 1, 2), (args, res.exit_code, out[-2000:])
    if res.exit_code == 2:  # one error line (notes such as a truncation may come before it)
        lines = res.stderr.splitlines()
        errors = [k for k, ln in enumerate(lines) if ln.startswith("error: ")]
        assert len(errors) == 1, (args, res.stderr[-2000:])
        after = lines[errors[0] + 1 :]
        assert all(ln.startswith("Try '") for ln in after), (args, res.stderr[-2000:])
        assert all(ln.startswith("note: ") for ln in lines[: errors[0]]), (args, res.stderr)


# -- attention ---------------------------------------------------------------------------------

SCALES = st.one_of(
    st.none(),
    st.floats(-1e3, 1e3),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 0.0]),
    st.integers(-3, 3),
    st.text(max_size=3),
)
LENGTHS = st.one_of(
    st.none(),
    st.lists(st.integers(-2, 8), max_size=3),
    st.text(max_size=5),
    st.floats(),
    st.lists(st.floats(0, 8), max_size=3),
)


@SETTINGS
@given(
    B=st.integers(0, 2),
    H_kv=st.integers(1, 2),
    g=st.integers(1, 2),
    T_k=st.integers(1, 7),
    dT=st.integers(0, 3),
    d_k=st.integers(0, 5),
    d_v=st.integers(0, 5),
    scale=SCALES,
    causal=st.sampled_from([True, False, None, 0, 1, "yes"]),
    lengths=LENGTHS,
    dtype=st.sampled_from([torch.float32, torch.float64]),
    engine=st.sampled_from(["auto", "reference", "tiled", "sdpa"]),
    seed=st.integers(0, 99),
)
def fuzz_attention(B, H_kv, g, T_k, dT, d_k, d_v, scale, causal, lengths, dtype, engine, seed):
    T_q = max(1, T_k - dT)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H_kv * g, T_q, d_k, generator=gen, dtype=dtype)
    k = torch.randn(B, H_kv, T_k, d_k, generator=gen, dtype=dtype)
    v = torch.randn(B, H_kv, T_k, d_v, generator=gen, dtype=dtype)
    try:
        out = ca.attention(q, k, v, causal=causal, lengths=lengths, scale=scale, engine=engine)
    except ValueError:
        return
    assert isinstance(causal, bool) and (scale is None or np.isfinite(float(scale)))
    assert out.shape == (B, H_kv * g, T_q, d_v) and out.dtype == dtype
    pat = masks.Pattern(causal=causal, lengths=lengths)
    readable = torch.as_tensor(pat.allowed(B, 1, T_q, T_k)).any(-1)  # (B', 1, T_q)
    readable = readable.expand(B, H_kv * g, T_q)
    assert torch.isfinite(out[readable]).all(), "NaN or inf in a row that reads keys"
    assert (out[~readable] == 0).all(), "a row with no readable key is not zero"
    ref = ca.attention(
        q.double(),
        k.double(),
        v.double(),
        causal=causal,
        lengths=lengths,
        scale=scale,
        engine="reference",
    )
    if out.numel():
        tol = 1e-9 if dtype == torch.float64 else 2e-4 * (1 + ref.abs().max().item())
        assert (out.double() - ref).abs().max().item() <= tol


# -- trace ---------------------------------------------------------------------------------------


@SETTINGS
@given(
    T=st.integers(1, 6),
    d=st.integers(1, 4),
    d_k=st.integers(1, 4),
    heads=st.sampled_from([None, 1, 2, 0, -1]),
    scale=SCALES,
    use_mask=st.booleans(),
    seed=st.integers(0, 99),
    nan_future=st.booleans(),
)
def fuzz_trace(T, d, d_k, heads, scale, use_mask, seed, nan_future):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(T, d))
    Ws = [
        rng.normal(size=(d, d_k * (heads if isinstance(heads, int) and heads > 0 else 1)))
        for _ in range(3)
    ]
    mask = rng.random((T, T)) < 0.7 if use_mask else None
    if nan_future and T > 1:
        X[-1] = np.nan  # the last token: causally unreadable by every other query
        if mask is not None:
            mask &= masks.causal(T)
    try:
        tr = ca.trace(X, *Ws, mask=mask, scale=scale, n_heads=heads)
    except ValueError:
        return
    allowed = np.broadcast_to(tr.allowed, tr.A.shape)
    assert (tr.A[~allowed] == 0).all(), "a forbidden entry has weight"
    rows = allowed.any(-1)
    if nan_future and T > 1:
        rows[..., -1] = False  # the NaN token's own row reads NaN: not required finite
    assert np.isfinite(tr.A[rows]).all() and np.isfinite(tr.H[rows]).all()
    np.testing.assert_allclose(tr.A[rows].sum(-1), 1.0, rtol=1e-9)
    assert (tr.A[~allowed.any(-1)] == 0).all()


# -- encode --------------------------------------------------------------------------------------


@SETTINGS
@given(
    sentences=st.one_of(
        st.lists(WORDS, max_size=4),
        WORDS,
        st.integers(),
        st.none(),
        st.lists(st.one_of(WORDS, st.integers()), max_size=3),
    ),
    max_len=st.one_of(st.none(), st.integers(-2, 12), st.sampled_from([10**12, 2.5, "3"])),
)
def fuzz_encode(sentences, max_len):
    try:
        b = ca.encode(sentences, max_len=max_len)
    except ValueError:
        return
    texts = [sentences] if isinstance(sentences, str) else list(sentences)
    assert b.B == len(texts) and b.ids.shape == (b.B, b.N)
    for k, s in enumerate(texts):
        toks = tokenize(s)[: b.N]
        assert int(b.lengths[k]) == len(toks) and b.tokens[k][: len(toks)] == toks
    m = b.mask  # small here: the dense mask agrees with the counts
    assert b.mask_counts()["readable"].tolist() == [int(x.sum()) for x in m]


def _fixtures(folder: Path) -> None:
    (folder / "corpus.txt").write_text("I love pizza\nCheese and burgers go well together\n")
    (folder / "empty.txt").write_text("\n\n")
    (folder / "mine.json").write_text(
        '{"X": [[1, 0], [0, 1]], "W_q": [[1, 0], [0, 1]], '
        '"W_k": [[1, 0], [0, 1]], "W_v": [[1, 1], [1, -1]]}'
    )
    (folder / "bad.json").write_text('{"X": ' + "[" * 5000 + "]" * 5000 + "}")


if __name__ == "__main__":
    import os

    OUT.mkdir(parents=True, exist_ok=True)
    _fixtures(OUT)
    os.chdir(OUT)
    failed = 0
    for fuzz in (fuzz_cli, fuzz_attention, fuzz_trace, fuzz_encode):
        try:
            fuzz()
            print(f"ok {fuzz.__name__}")
        except Exception:  # report every property, then fail
            failed += 1
            print(f"FAILED {fuzz.__name__}\n{traceback.format_exc()[-6000:]}")
    sys.exit(1 if failed else 0)
