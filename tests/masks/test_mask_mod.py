"""mask_mod: any rule a user writes, block by block, on every engine; the reasons
it gives; FlexAttention's BlockMask both ways; and each bad input refused by name."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import causalattn as ca
from causalattn import masks, masks_mod
from causalattn.engines import cpp, make_problem
from causalattn.masks import Pattern

F64 = torch.float64
HAS_CPP = not cpp.unavailable()
BIT_ENGINES = ["reference"] + (["cpp"] if HAS_CPP else [])  # the same dense M, the same bits
ENGINES = BIT_ENGINES + ["tiled"]


def _qkv(B=2, H=2, T_q=40, T_k=40, d=8, seed=0, dtype=F64, H_kv=None):
    g = torch.Generator().manual_seed(seed)
    H_kv = H_kv or H
    return (
        torch.randn(B, H, T_q, d, generator=g, dtype=dtype),
        torch.randn(B, H_kv, T_k, d, generator=g, dtype=dtype),
        torch.randn(B, H_kv, T_k, d, generator=g, dtype=dtype),
    )


# each keyword rule, as attention's keywords (B = 2, T_q = T_k = 40 unless it says otherwise)
RULES = {
    "causal": {},
    "window": {"window": 7},
    "chunk": {"chunk": 9},
    "lengths": {"lengths": [40, 23]},
    "key_padding": {"key_padding_mask": torch.arange(40)[None].repeat(2, 1) % 7 != 3},
    "documents": {"cu_seqlens": [0, 11, 30, 40]},
    "prefix": {"prefix_lengths": [5, 12], "window": 6},
    "dense mask": {
        "mask": torch.rand(2, 1, 40, 40, generator=torch.Generator().manual_seed(3)) > 0.4
    },
    "bidirectional window": {"causal": False, "window": 5},
    "decode": {"window": 12, "T_q": 3},  # queries are the last 3 positions
}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("rule", list(RULES))
def test_a_mask_mod_equal_to_a_keyword_rule_gives_its_output(rule, engine):
    """Pattern(rule).to_mask_mod() as the whole M gives the rule's own output and gradients:
    the same bits on the engines that read one dense M (the reference, the native engine's
    tile masks), and within a few ulp on the tiled engine (its tiles then differ) and in the
    native engine's decoding path (it splits the readable keys, which the intervals set)."""
    kw = dict(RULES[rule])
    T_q = kw.pop("T_q", 40)
    B = 1 if "cu_seqlens" in kw else 2
    q, k, v = (t.requires_grad_() for t in _qkv(B=B, T_q=T_q))
    mod = Pattern(**kw).to_mask_mod()
    a = ca.attention(q, k, v, engine=engine, **kw)
    ga = torch.autograd.grad(a.sum(), (q, k, v))
    b = ca.attention(q, k, v, engine=engine, causal=False, mask_mod=mod)
    gb = torch.autograd.grad(b.sum(), (q, k, v))
    if engine in BIT_ENGINES and not (engine == "cpp" and T_q <= cpp.DECODE_ROWS):
        assert torch.equal(a, b)
        for x, y in zip(ga, gb):
            assert torch.equal(x, y)
    else:
        torch.testing.assert_close(b, a, rtol=0, atol=1e-13)
        for x, y in zip(ga, gb):
            torch.testing.assert_close(y, x, rtol=0, atol=1e-12)


def test_a_mask_mod_is_anded_with_the_keyword_rules_and_the_mask():
    q, k, v = _qkv(B=1)
    dense = torch.rand(1, 1, 40, 40, generator=torch.Generator().manual_seed(1)) > 0.3

    def even_keys(b, h, q_idx, kv_idx):
        return kv_idx % 2 == 0

    pt = Pattern(window=9, mask=dense, mask_mod=even_keys)
    want = Pattern(window=9, mask=dense).allowed(1, 1, 40, 40) & (np.arange(40) % 2 == 0)
    assert np.array_equal(pt.allowed(1, 1, 40, 40), want)
    for engine in ENGINES:
        got = ca.attention(q, k, v, engine=engine, window=9, mask=dense, mask_mod=even_keys)
        ref = ca.attention(q, k, v, engine="reference", causal=False, mask=torch.as_tensor(want))
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-13)


def test_a_mask_mod_reads_batch_rows_and_heads():
    """A rule per (b, h): b and h are index tensors, the tile kinds are per row and head."""
    q, k, v = _qkv(B=2, H=4, H_kv=2)
    offset = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])

    def per_head(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx >= 0) & (q_idx - kv_idx < offset[b, h])

    want = ca.attention(q, k, v, engine="reference", mask_mod=per_head)
    for engine in ENGINES:
        torch.testing.assert_close(
            ca.attention(q, k, v, engine=engine, mask_mod=per_head), want, rtol=0, atol=1e-13
        )
    A = Pattern(mask_mod=per_head).allowed(2, 4, 40, 40)
    assert A.shape == (2, 4, 40, 40) and A[1, 3, 30].sum() == 8 and A[0, 0, 30].sum() == 1


# ---- random rules built from the keywords' pieces, with and / or / not -----------------------
def _atom(draw):
    kind = draw(st.sampled_from(["causal", "window", "local", "chunk", "doc", "keys", "rows"]))
    n = draw(st.integers(1, 9))
    doc = torch.tensor(np.cumsum(np.random.default_rng(n).random(48) < 0.15))
    return {
        "causal": lambda b, h, q, kv: kv <= q,
        "window": lambda b, h, q, kv: q - kv < n,
        "local": lambda b, h, q, kv: (q - kv).abs() < n,
        "chunk": lambda b, h, q, kv: q // n == kv // n,
        "doc": lambda b, h, q, kv: doc[q] == doc[kv],
        "keys": lambda b, h, q, kv: kv % (n + 1) != 0,
        "rows": lambda b, h, q, kv: (q + b) % (n + 2) != 1,
    }[kind]


@st.composite
def rules(draw, depth=0):
    if depth >= 2 or draw(st.booleans()):
        return _atom(draw)
    op = draw(st.sampled_from(["and", "or", "not"]))
    a = draw(rules(depth=depth + 1))
    if op == "not":
        return lambda b, h, q, kv: ~a(b, h, q, kv)
    c = draw(rules(depth=depth + 1))
    if op == "and":
        return lambda b, h, q, kv: a(b, h, q, kv) & c(b, h, q, kv)
    return lambda b, h, q, kv: a(b, h, q, kv) | c(b, h, q, kv)


@settings(max_examples=15, deadline=None)
@given(rule=rules(), T=st.integers(1, 48), causal=st.booleans())
def test_random_mask_mods_zero_rows_and_nan_causality(rule, T, causal):
    """Every engine against the reference; a row that reads nothing is zero (never NaN);
    NaN at keys no row may read changes no output, bit for bit."""
    q, k, v = _qkv(B=2, T_q=T, T_k=T, seed=T)
    A = Pattern(causal=causal, mask_mod=rule).allowed(2, 1, T, T, like=q)
    want = ca.attention(q, k, v, engine="reference", causal=causal, mask_mod=rule)
    empty = ~A.expand(2, 2, T, T).any(-1)
    assert torch.equal(want[empty], torch.zeros_like(want[empty]))
    unread = ~A.any(2).any(1)  # (B, T_k): keys no row of the sequence reads
    k2, v2 = k.clone(), v.clone()
    k2[unread[:, None, :].expand_as(k2[..., 0])] = float("nan")
    v2[unread[:, None, :].expand_as(v2[..., 0])] = float("nan")
    for engine in ENGINES:
        got = ca.attention(q, k, v, engine=engine, causal=causal, mask_mod=rule)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        poisoned = ca.attention(q, k2, v2, engine=engine, causal=causal, mask_mod=rule)
        assert torch.equal(poisoned, got), engine


# ---- block by block -------------------------------------------------------------------------
def test_the_mask_mod_is_never_called_on_the_whole_matrix():
    """Tiles of a few blocks at most, on every engine and in the tables, at T = 2048: the
    largest call sees far fewer cells than T×T (4M)."""
    T = 2048
    seen = []

    def local(b, h, q_idx, kv_idx):
        seen.append(q_idx.numel() * kv_idx.numel())
        return (q_idx - kv_idx).abs() < 100

    q, k, v = _qkv(B=1, H=1, T_q=T, T_k=T, d=4, dtype=torch.float32)
    for engine in ["tiled"] + (["cpp"] if HAS_CPP else []):
        seen.clear()
        ca.attention(q, k, v, engine=engine, mask_mod=local)
        assert seen and max(seen) <= masks_mod.TILE_CELLS, (engine, max(seen))
    seen.clear()
    Pattern(mask_mod=local).to_block_mask(T, T)
    assert max(seen) <= 128 * 128


MEMORY_SCRIPT = r"""
import sys, torch, causalattn as ca
from causalattn import memory
engine, T = sys.argv[1], int(sys.argv[2])
doc = torch.arange(T) // 1000
def window_docs(b, h, q, kv):
    return (doc[q] == doc[kv]) & (q - kv < 256) & (kv <= q)
q, k, v = (torch.randn(1, 2, T, 16, requires_grad=True) for _ in range(3))
ca.attention(q[:, :, :256], k[:, :, :256], v[:, :, :256], engine=engine, mask_mod=window_docs)
memory.reset_peak(); base = memory.status_kib("VmHWM")
out = ca.attention(q, k, v, engine=engine, mask_mod=window_docs)
out.sum().backward()
print((memory.status_kib("VmHWM") - base) / 1024)
"""


@pytest.mark.parametrize("engine", ["tiled"] + (["cpp"] if HAS_CPP else []))
def test_mask_mod_memory_is_linear_in_T(engine):
    """A window plus documents as a mask_mod at T = 8192, forward and backward, in a capped
    subprocess: its peak stays far below one T×T bool (64 MiB)."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("no /proc/self/clear_refs here: the peak cannot be reset")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    run = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, engine, "8192"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    peak = float(run.stdout.split()[-1])
    assert peak < 48, f"{engine}: {peak:.1f} MiB beyond the inputs"


# ---- reasons, trace, explain --------------------------------------------------------------
def test_the_blocked_reason_is_the_functions_name():
    def no_far_keys(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < 3

    pt = Pattern(window=5, mask_mod=no_far_keys)
    codes = pt.reasons(1, 1, 8, 8)[0, 0]
    assert codes[7, 4] == masks.MASK_MOD and codes[7, 1] == masks.WINDOW  # window comes first
    assert pt.reason_name(masks.MASK_MOD) == "no_far_keys"
    assert "mask_mod no_far_keys" in pt.describe()
    X = np.random.default_rng(0).normal(size=(8, 4))
    tr = ca.trace(X, np.eye(4), np.eye(4), np.eye(4), window=5, mask_mod=no_far_keys)
    why = tr.explain(7).blocked_by
    assert why[4] == "no_far_keys" and why[2] == "window" and why[7] == ""
    assert ca.audit(tr).ok


def test_the_reference_trace_takes_numpy_and_torch_mask_mods():
    X = np.random.default_rng(1).normal(size=(6, 4))
    W = np.eye(4)
    doc = torch.tensor([0, 0, 0, 1, 1, 1])
    a = ca.trace(X, W, W, W, mask_mod=lambda b, h, q, kv: q - kv < 2)  # NumPy indices
    b = ca.trace(X, W, W, W, mask_mod=lambda b, h, q, kv: torch.as_tensor(q - kv < 2))
    c = ca.trace(X, W, W, W, mask_mod=lambda b, h, q, kv: doc[q] == doc[kv])  # torch data
    assert np.array_equal(a.allowed, b.allowed) and np.array_equal(a.H, b.H)
    assert not c.allowed[4, 2] and c.allowed[4, 3]


def test_layer_audit_and_diagnose_take_a_mask_mod():
    def three(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < 3

    layer = ca.CausalSelfAttention(16, 2, mask_mod=three, engine="tiled").double()
    x = torch.randn(2, 10, 16, dtype=F64)
    plain = ca.CausalSelfAttention(16, 2, window=3, engine="tiled").double()
    plain.load_state_dict(layer.state_dict())
    torch.testing.assert_close(layer(x), plain(x), rtol=0, atol=1e-13)
    assert "mask_mod=three" in repr(layer)
    tr = layer.trace(x[0, :6])
    assert tr.select(1).explain(5).blocked_by[1] == "three"
    tr_window = ca.trace(np.eye(6, 4), np.eye(4), np.eye(4), np.eye(4), window=3)
    assert ca.audit(tr_window, mask_mod=three).ok
    assert not ca.audit(tr_window, mask_mod=lambda b, h, q, kv: q - kv < 2).ok


def test_compiled_mask_mod_reads_its_tensors_at_run_time():
    """One opaque operator (fullgraph): the function runs inside it, so a tensor it reads,
    changed after compiling, is read as it is when the graph runs."""
    doc = torch.tensor([0] * 20 + [1] * 44)

    def same_doc(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    q, k, v = _qkv(B=1, T_q=64, T_k=64, dtype=torch.float32)
    f = torch.compile(
        lambda q, k, v: ca.attention(q, k, v, mask_mod=same_doc, engine="tiled"), fullgraph=True
    )
    torch.testing.assert_close(f(q, k, v), ca.attention(q, k, v, cu_seqlens=[0, 20, 64]))
    doc[40:] = 2
    torch.testing.assert_close(f(q, k, v), ca.attention(q, k, v, cu_seqlens=[0, 20, 40, 64]))


# ---- FlexAttention both ways ---------------------------------------------------------------
flex = pytest.importorskip("torch.nn.attention.flex_attention")


@pytest.mark.parametrize(
    "kw",
    [
        {"window": 40, "cu_seqlens": [0, 100, 300]},
        {"chunk": 64, "lengths": [300, 170]},
        {"causal": False, "key_padding_mask": torch.arange(300)[None].repeat(2, 1) < 250},
    ],
    ids=["window-documents", "chunk-lengths", "key-padding"],
)
def test_to_block_mask_is_flexs_create_block_mask(kw):
    pt = Pattern(**kw)
    B = pt.batch_size()
    T = 300
    ours = pt.to_block_mask(T, T, block_size=128)
    theirs = flex.create_block_mask(
        pt.to_mask_mod(T, T), B, None, T, T, device="cpu", BLOCK_SIZE=128
    )
    assert ours.seq_lengths == (T, T) and ours.BLOCK_SIZE == (128, 128)
    assert torch.equal(ours.to_dense(), theirs.to_dense())  # the same blocks are visited
    # where Flex calls an edge block partial (its padding past T reads nothing), ours may
    # call it full (every cell inside T reads): never the other way round
    full_ours = ours.full_kv_num_blocks
    full_theirs = theirs.full_kv_num_blocks.expand_as(full_ours)
    assert bool((full_ours >= full_theirs).all())
    visited = ours.kv_num_blocks + full_ours
    assert torch.equal(
        visited, (theirs.kv_num_blocks + theirs.full_kv_num_blocks).expand_as(visited)
    )
    # and back: the BlockMask's M is the pattern's, cell for cell
    back = Pattern.from_block_mask(ours)
    assert np.array_equal(
        np.broadcast_to(back.allowed(B, 1, T, T), (B, 1, T, T)),
        np.broadcast_to(pt.allowed(B, 1, T, T), (B, 1, T, T)),
    )


def test_a_blockmask_for_another_length_is_refused_never_cut():
    bm = Pattern(window=8).to_block_mask(256, 256, block_size=64)
    pt = Pattern.from_block_mask(bm)
    q, k, v = _qkv(B=1, T_q=200, T_k=200)
    with pytest.raises(
        ValueError, match=r"BlockMask built for \(T_q, T_k\) = \(256, 256\).*\(200, 200\)"
    ):
        ca.attention(q, k, v, causal=False, mask_mod=pt.mask_mod)
    with pytest.raises(ValueError, match="BlockMask for B=3"):
        three = flex.create_block_mask(lambda b, h, q, kv: kv <= q, 3, None, 64, 64, device="cpu")
        Pattern.from_block_mask(three).allowed(2, 1, 64, 64)
    with pytest.raises(ValueError, match="from_block_mask: expected"):
        Pattern.from_block_mask(np.ones((4, 4), bool))


def test_flex_compiled_on_the_cpu_gives_causalattns_output():
    """FlexAttention (compiled, CPU, forward) on the pattern's BlockMask, against causalattn
    on the pattern and on its BlockMask as a mask_mod."""
    T = 256
    kw = {"window": 40, "cu_seqlens": [0, 100, 256]}
    bm = Pattern(**kw).to_block_mask(T, T, block_size=128)
    q, k, v = _qkv(B=1, H=2, T_q=T, T_k=T, d=16, dtype=torch.float32)
    got = torch.compile(flex.flex_attention)(q, k, v, block_mask=bm)
    want = ca.attention(q, k, v, **kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    again = ca.attention(q, k, v, causal=False, mask_mod=Pattern.from_block_mask(bm).mask_mod)
    torch.testing.assert_close(again, want, rtol=0, atol=1e-6)


# ---- bad input -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fn,match",
    [
        (
            lambda b, h, q, kv: (q - kv).float(),
            r"mask_mod: lambda returned Tensor \(1, 1, \d+, \d+\) of dtype torch.float32 for "
            r"index tensors .*; it must return booleans",
        ),
        (
            lambda b, h, q, kv: torch.ones(3, 5, dtype=torch.bool),
            r"mask_mod: lambda returned shape \(3, 5\) for index tensors b \(2, 1, 1, 1\)",
        ),
        (
            lambda b, h, q, kv: 1 / 0,
            r"mask_mod: lambda raised ZeroDivisionError: division by zero "
            r"\(called on b \(2, 1, 1, 1\)",
        ),
        (
            lambda b, h, q, kv: torch.rand(q.shape[2], kv.shape[3]) > 0.5,
            "mask_mod: lambda answered differently on a second evaluation of the same cells",
        ),
        (lambda b, h, q, kv: True, "mask_mod: lambda returned bool of dtype bool"),
    ],
    ids=["float", "shape", "raises", "impure", "python-bool"],
)
def test_bad_mask_mods_are_refused_by_name(fn, match):
    q, k, v = _qkv()
    for engine in ("reference", "tiled"):
        with pytest.raises(ValueError, match=match):
            ca.attention(q, k, v, engine=engine, mask_mod=fn)
    with pytest.raises(ValueError, match="mask_mod"):
        make_problem(q, k, v, mask_mod=fn)


def test_a_mask_mod_must_be_a_function():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"mask: mask_mod must be a function .* got ndarray"):
        ca.attention(q, k, v, mask_mod=np.ones((40, 40), bool))
    with pytest.raises(ValueError, match="score_mod must be a function"):
        Pattern(score_mod=3)


def test_tile_tables_store_each_partial_tile_once():
    """The native engine's table for a causal mask_mod: diagonal tiles are one tile mask."""
    pt = Pattern(causal=False, mask_mod=lambda b, h, q, kv: kv <= q)
    lo, hi = Pattern(causal=False).row_ranges(512, 512)
    kinds, tiles = masks_mod.tile_table(pt, 1, 1, 512, 512, 128, 128, lo, hi)
    assert kinds.shape == (1, 1, 4, 4) and tiles.shape == (1, 128, 128)
    k = kinds[0, 0]
    assert torch.equal(torch.diagonal(k), torch.full((4,), 3, dtype=torch.int32))
    assert bool((torch.tril(k, -1)[torch.tril(torch.ones(4, 4), -1) > 0] == 1).all())
    assert bool((torch.triu(k, 1) == 0).all())
    assert math.isclose(tiles[0].float().mean().item(), (128 * 129 / 2) / 128**2)


def test_tile_kinds_differ_by_head_only_where_the_rule_reads_h():
    """A rule that does not read h gets one table for every head (its partial tiles made
    once); one that reads h gets a table per head."""

    def table(fn, B=1):
        lo, hi = Pattern(causal=False).row_ranges(256, 256)
        pt = Pattern(causal=False, mask_mod=fn)
        return masks_mod.tile_table(pt, B, 3, 256, 256, 64, 64, lo, hi)

    kinds, tiles = table(lambda b, h, q, kv: kv <= q)
    assert kinds.shape == (1, 1, 4, 4) and tiles.shape[0] == 1
    kinds, _ = table(lambda b, h, q, kv: kv <= q - h)
    assert kinds.shape == (1, 3, 4, 4) and not torch.equal(kinds[0, 0], kinds[0, 2])
    kinds, _ = table(lambda b, h, q, kv: (kv <= q) | (b == 1), B=2)  # rows: B's own axis
    assert kinds.shape == (2, 1, 4, 4) and bool((kinds[1, 0] == 1).all())


# -- what a score_mod's gradient can flow to ---------------------------------------------------
_GLOBAL_W = None  # set by the test below: a tensor a score_mod reads by its global name


def _reads_global(score, b, h, q_idx, kv_idx):
    return score + _GLOBAL_W[h]


def test_captured_tensors_finds_each_place_a_rule_can_read_a_tensor_from():
    import functools

    from causalattn.masks_mod import captured_tensors

    global _GLOBAL_W

    def w():
        return torch.zeros(2, requires_grad=True)

    def ids(fn, **kw):
        return {id(t) for t in captured_tensors(fn, **kw)}

    a, frozen = w(), torch.zeros(2)
    assert ids(lambda s, b, h, q, k: s + a[h] + frozen[h]) == {id(a)}  # closure; grad only
    assert ids(lambda s, b, h, q, k, t=a: s + t[h]) == {id(a)}  # default
    assert ids(lambda s, b, h, q, k, *, t=a: s + t[h]) == {id(a)}  # keyword-only default
    _GLOBAL_W = w()
    assert ids(_reads_global) == {id(_GLOBAL_W)}
    assert ids(functools.partial(lambda s, b, h, q, k, t: s + t[h], t=a)) == {id(a)}
    assert ids(functools.partial(lambda t, s, b, h, q, k: s + t[h], a)) == {id(a)}

    class Bias(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.p = torch.nn.Parameter(torch.zeros(2))

        def forward(self, s, b, h, q, k):
            return s + self.p[h] + _GLOBAL_W[h]

    mod = Bias()
    assert ids(mod) == {id(mod.p), id(_GLOBAL_W)}  # its parameters and its forward's globals
    assert ids(mod.forward) == {id(mod.p), id(_GLOBAL_W)}  # a bound method: its object too

    class Callable:
        def __init__(self, t):
            self.t = t

        def __call__(self, s, b, h, q, k):
            return s + self.t[h]

    c = w()
    assert ids(Callable(c)) == {id(c)}  # a callable object's attributes
    nested = Callable(Callable(c))  # attributes of attributes, within the depth
    assert ids(nested) == {id(c)}
    assert ids(lambda s, b, h, q, k: s + a[h] + c[h], limit=1) in ({id(a)}, {id(c)})

    def chain(n):  # a function whose closure holds one that holds ... the tensor, n deep
        f = lambda s, b, h, q, k: s + a[h]  # noqa: E731
        for _ in range(n):
            f = (lambda g: lambda s, b, h, q, k: g(s, b, h, q, k))(f)
        return f

    assert ids(chain(3)) == {id(a)} and ids(chain(4)) == set()  # followed to depth 4 only
    loop = [a]
    loop.append(loop)  # a cycle is walked once
    assert ids(lambda s, b, h, q, k: s + loop[0][h]) == {id(a)}


_GLOBAL_V = torch.zeros(2, requires_grad=True)  # read by _Reads and _Empty.read below


class _Reads(torch.nn.Module):  # no parameters: its forward reads a global tensor
    def forward(self, s, b, h, q, k):
        return s + _GLOBAL_V[h]


class _Holder(list):  # a list whose bound methods carry it
    def read(self, s, b, h, q, k):
        return s + self[0][h]


class _Empty:
    def read(self, s, b, h, q, k):
        return s + _GLOBAL_V[h]


class _CallsGlobal:  # a callable object with no fields: its __call__ reads a global tensor
    def __call__(self, s, b, h, q, k):
        return s + _GLOBAL_V[h]


class _Fields:  # a plain object, not callable, holding a tensor as a field
    def __init__(self, t):
        self.t = t


def _param_module():
    m = torch.nn.Module()
    m.p = torch.nn.Parameter(torch.zeros(2))
    return m, m.p


def _partial_of(t):
    import functools

    return functools.partial(lambda t, s, b, h, q, k: s + t[h], t), t


def _partial_of_closure(t):
    import functools

    return functools.partial(lambda s, b, h, q, k: s + t[h]), t


@pytest.mark.parametrize(
    "carrier, hops",
    [
        (lambda: (torch.zeros(2, requires_grad=True),) * 2, 0),  # the tensor itself
        (_param_module, 1),  # a module's parameter
        (lambda: (_Reads(), _GLOBAL_V), 2),  # a module's forward's global
        (lambda: _partial_of(torch.zeros(2, requires_grad=True)), 1),  # a partial's argument
        (lambda: _partial_of_closure(torch.zeros(2, requires_grad=True)), 2),  # its function's
        (lambda: (lambda t: (_Holder([t]).read, t))(torch.zeros(2, requires_grad=True)), 2),
        (lambda: (_Empty().read, _GLOBAL_V), 2),  # a bound method's function's global
        (lambda: (lambda t: ({"t": t}, t))(torch.zeros(2, requires_grad=True)), 1),  # a dict's
        (lambda: (_CallsGlobal(), _GLOBAL_V), 2),  # a callable object's __call__'s global
        (lambda: (lambda t: (_Fields(t), t))(torch.zeros(2, requires_grad=True)), 2),  # a field
    ],
    ids=[
        "tensor",
        "parameter",
        "forward",
        "partial-arg",
        "partial-fn",
        "self",
        "func",
        "dict",
        "call",
        "field",
    ],
)
def test_captured_tensors_reach_depth_four_whichever_way_a_tensor_is_held(carrier, hops):
    """A tensor is found exactly when it lies within 4 steps of the rule (a closure cell, a
    list item, a module's parameter or forward, a partial's function or argument, a bound
    method's object or function: one step each), however deep its holder sits."""
    from causalattn.masks_mod import captured_tensors

    for depth in range(1, 6):
        held, t = carrier()
        box = held
        for _ in range(depth - 1):  # the holder `depth` steps from the rule
            box = [box]

        def rule(s, b, h, q, k, box=box):  # a default: one step, as a closure cell
            return s + 0 * len(box)

        found = {id(x) for x in captured_tensors(rule)}
        assert found == ({id(t)} if depth + hops <= 4 else set()), (depth, hops)


def test_captured_tensors_walks_a_holder_again_when_reached_nearer_the_rule():
    """An object reached first by a long path and then by a short one is read along the
    short one: the tensor it holds is found though the long path alone is too deep."""
    from causalattn.masks_mod import captured_tensors

    a = torch.zeros(2, requires_grad=True)
    inner = [a]
    deep = [[[inner]]]  # inner 4 steps from the rule through its closure, a at 5

    def rule(s, b, h, q, k, t=inner):  # the default: inner 1 step away, walked after
        return s + deep[0][0][0][0][h] + t[0][h]

    assert [id(x) for x in captured_tensors(rule)] == [id(a)]
    assert captured_tensors(lambda s, b, h, q, k: s + deep[0][0][0][0][h]) == []


def test_captured_tensors_stops_at_its_limit_and_walks_each_object_once():
    from causalattn.masks_mod import captured_tensors

    many = [torch.zeros(1, requires_grad=True) for _ in range(100)]
    rule = lambda s, b, h, q, k: s + many[0][0]  # noqa: E731
    assert [id(x) for x in captured_tensors(rule)] == [id(t) for t in many[:64]]  # default
    assert [id(x) for x in captured_tensors(rule, limit=5)] == [id(t) for t in many[:5]]

    reads = []

    class Counted(list):  # counts the walks through it (each reads a slice of it)
        def __getitem__(self, i):
            reads.append(i)
            return super().__getitem__(i)

    loop = Counted()
    loop.extend([loop] * 8)  # without the walked set: 1 + 8 + 64 + ... walks
    same = loop  # and reached twice at the same depth
    assert captured_tensors(lambda s, b, h, q, k: s + len(loop) + len(same)) == []
    assert len(reads) == 1
    wide = [[[float(i)] * 64 for _ in range(64)] for i in range(64)]  # 4,161 lists, 64 floats
    assert sum(1 for _ in masks_mod.reach(lambda s, b, h, q, k: wide)) == 64 * 64  # its bound


def test_and_masks_and_or_masks_pass_every_index_to_every_rule():

    lengths = torch.tensor([2, 3])
    in_length = lambda b, h, q, k: k < lengths[b]  # noqa: E731 - reads b
    head_one = lambda b, h, q, k: h == 1  # noqa: E731 - reads h
    b = torch.arange(2).view(2, 1, 1, 1)
    h = torch.arange(2).view(1, 2, 1, 1)
    q = torch.arange(4).view(1, 1, 4, 1)
    k = torch.arange(4).view(1, 1, 1, 4)
    want_len = (k < lengths.view(2, 1, 1, 1)).expand(2, 2, 4, 4)
    want_head = (h == 1).expand(2, 2, 4, 4)
    for rules in ((in_length, head_one), (head_one, in_length)):  # each rule first and later
        both = masks.and_masks(*rules)(b, h, q, k)
        either = masks.or_masks(*rules)(b, h, q, k)
        assert torch.equal(both.expand(2, 2, 4, 4), want_len & want_head)
        assert torch.equal(either.expand(2, 2, 4, 4), want_len | want_head)
    for combine, what in ((masks.and_masks, "and_masks"), (masks.or_masks, "or_masks")):
        with pytest.raises(ValueError) as e:
            combine(in_length, 3)
        assert str(e.value) == (
            f"{what}: argument 1 must be a mask_mod (mask_mod(b, h, q_idx, kv_idx) -> bool), "
            "got int"
        )
