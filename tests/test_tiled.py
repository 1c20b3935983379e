"""The tiled CPU engine against the float64 reference: values, gradients, guarantees, errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from causalattn.engines import KVCache, attention, make_problem, pick_engine, tiled, tiled_fwd

F64 = torch.float64
FAST = settings(max_examples=25, deadline=None)


def _inputs(B, Hq, Hkv, Tq, Tk, d, dv, dtype=F64, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, Hq, Tq, d, generator=g) * scale).to(dtype)
    k = (torch.randn(B, Hkv, Tk, d, generator=g) * scale).to(dtype)
    v = torch.randn(B, Hkv, Tk, dv, generator=g).to(dtype)
    return q, k, v


def _run(engine, q, k, v, dout=None, **kw):
    """Output, lse and (q, k, v) gradients of sum(out * dout) on one engine."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = attention(q, k, v, engine=engine, return_lse=True, **kw)
    if dout is None:
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    grads = torch.autograd.grad((out * dout).sum(), (q, k, v))
    return out.detach(), lse.detach(), grads


def _assert_matches_reference(q, k, v, tol=1e-9, **kw):
    out, lse, grads = _run("tiled", q, k, v, **kw)
    rout, rlse, rgrads = _run("reference", q, k, v, **kw)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rlse))
    fin = torch.isfinite(rlse)
    assert torch.allclose(lse[fin], rlse[fin], atol=1e-5)  # lse is fp32 by contract
    torch.testing.assert_close(out, rout, atol=tol, rtol=tol)
    for name, a, b in zip("qkv", grads, rgrads):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=lambda m, n=name: f"d{n}: {m}")


@st.composite
def problems(draw):
    B = draw(st.integers(1, 3))
    Hkv = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 1, 2, 3]))
    Tk = draw(st.integers(1, 300))
    Tq = draw(st.one_of(st.just(Tk), st.integers(1, Tk)))
    d = draw(st.integers(1, 160))
    dv = draw(st.one_of(st.just(d), st.integers(1, 40)))
    kw = {"causal": draw(st.booleans()) or Tq < Tk}
    mode = draw(st.sampled_from(["plain", "lengths", "kpm", "packed"]))
    if mode == "lengths":
        kw["lengths"] = draw(st.lists(st.integers(0, Tk), min_size=B, max_size=B))
    elif mode == "kpm":
        bits = draw(st.lists(st.booleans(), min_size=B * Tk, max_size=B * Tk))
        kw["key_padding_mask"] = torch.tensor(bits).view(B, Tk)
    elif mode == "packed" and Tq == Tk:
        B = 1
        cuts = sorted(draw(st.lists(st.integers(0, Tk), max_size=4)))
        kw["cu_seqlens"] = [0, *cuts, Tk]
    seed = draw(st.integers(0, 2**16))
    return _inputs(B, Hkv * group, Hkv, Tq, Tk, d, dv, seed=seed), kw


@FAST
@given(problems())
def test_matches_reference_on_random_shapes(case):
    (q, k, v), kw = case
    _assert_matches_reference(q, k, v, **kw)


@pytest.mark.parametrize(
    "shape,kw",
    [
        ((2, 4, 2, 700, 700, 16, 16), {}),  # several blocks, GQA, two workers
        ((1, 2, 2, 3, 700, 8, 8), {}),  # T_q < T_k: bottom-right
        ((2, 2, 1, 600, 600, 8, 8), {"lengths": [0, 517]}),
        ((1, 3, 3, 900, 900, 8, 5), {"cu_seqlens": [0, 3, 3, 400, 900]}),
        ((2, 2, 2, 500, 500, 8, 8), {"causal": False}),
    ],
)
def test_matches_reference_across_blocks(shape, kw):
    _assert_matches_reference(*_inputs(*shape, seed=3), **kw)


def test_key_padding_mask_across_blocks():
    q, k, v = _inputs(3, 2, 1, 600, 600, 8, 8, seed=4)
    kpm = torch.rand(3, 600, generator=torch.Generator().manual_seed(5)) > 0.5
    kpm[1] = False
    kpm[2, :400] = False
    _assert_matches_reference(q, k, v, key_padding_mask=kpm)
    _assert_matches_reference(q, k, v, key_padding_mask=kpm, lengths=[500, 600, 550])


def test_decode_token_by_token_equals_full_pass():
    q, k, v = _inputs(2, 4, 2, 40, 40, 16, 8, dtype=torch.float32, seed=13)
    full = attention(q, k, v, engine="tiled")
    cache = KVCache(capacity=8)  # grows by doubling on the way
    cache.append(k[:, :, :10], v[:, :, :10])  # a prompt of 10 tokens, then one token at a time
    steps = [attention(q[:, :, :10], cache.k, cache.v, engine="tiled")]
    for t in range(10, 40):
        kc, vc = cache.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        steps.append(attention(q[:, :, t : t + 1], kc, vc, engine="tiled"))
    torch.testing.assert_close(torch.cat(steps, dim=2), full, atol=1e-6, rtol=1e-5)


def _grads_with(q, k, v, rows, **kw):
    """Output and gradients of sum(out[:, :, rows]) (other rows carry no gradient)."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = attention(q, k, v, engine="tiled", **kw)
    dout = torch.zeros_like(out)
    dout[:, :, rows] = torch.linspace(-1, 1, out.shape[-1])
    return out.detach(), torch.autograd.grad((out * dout).sum(), (q, k, v))


def test_auto_asked_for_lse_on_cpu_picks_an_engine_with_it_and_lse_is_fp32():
    # the native engine where it is built, else tiled (tests/test_auto.py)
    from causalattn.engines import cpp

    q, k, v = _inputs(1, 1, 1, 5, 5, 4, 4, dtype=torch.bfloat16)
    want = "tiled" if cpp.unavailable() else "cpp"
    assert pick_engine(make_problem(q, k, v), return_lse=True) == want
    out, lse = attention(q, k, v, return_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32


@pytest.mark.parametrize(
    "make,words",
    [
        (lambda q, k, v: (q, k[:1], v[:1]), ["batch", "(2, 4, 6, 8)", "(1, 2, 6, 8)"]),
        (lambda q, k, v: (q[:, :3], k, v), ["H_q=3", "H_kv=2"]),
        (lambda q, k, v: (q, k, v[:, :, :5]), ["k (2, 2, 6, 8)", "v (2, 2, 5, 8)"]),
        (lambda q, k, v: (q[..., :7], k, v), ["d_k", "(2, 4, 6, 7)", "(2, 2, 6, 8)"]),
        (lambda q, k, v: (q.long(), k, v), ["q", "int64", "(2, 4, 6, 8)"]),
    ],
)
def test_bad_tensors_name_the_argument_and_shapes(make, words):
    q, k, v = _inputs(2, 4, 2, 6, 6, 8, 8)
    with pytest.raises(ValueError) as e:
        attention(*make(q, k, v), engine="tiled")
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"lengths": [3, 7]}, ["lengths", "T_k=6", "[3, 7]"]),
        ({"lengths": [1.5, 2.0]}, ["lengths", "(2,)"]),
        (
            {"key_padding_mask": torch.ones(2, 5, dtype=torch.bool)},
            ["key_padding_mask", "(2, 6)", "(2, 5)"],
        ),
        ({"key_padding_mask": torch.ones(2, 6)}, ["key_padding_mask", "bool"]),
    ],
)
def test_bad_masks_name_the_argument_and_shapes(kw, words):
    q, k, v = _inputs(2, 4, 2, 6, 6, 8, 8)
    with pytest.raises(ValueError) as e:
        attention(q, k, v, engine="tiled", **kw)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_bad_cu_seqlens():
    q, k, v = _inputs(1, 2, 2, 6, 6, 8, 8)
    for cu, word in (
        ([0, 4, 2, 6], "never decrease"),
        ([0, 3, 5], "end at T=6"),
        ([1, 6], "start at 0"),
    ):
        with pytest.raises(ValueError, match="cu_seqlens") as e:
            attention(q, k, v, cu_seqlens=cu, engine="tiled")
        assert word in str(e.value)
    q2, k2, v2 = _inputs(2, 2, 2, 6, 6, 8, 8)
    with pytest.raises(ValueError, match=r"cu_seqlens.*\(1, H, T, d\)"):
        attention(q2, k2, v2, cu_seqlens=[0, 6], engine="tiled")


def test_nan_query_row_leaves_other_rows_and_later_keys_bit_identical():
    """A NaN query row i (every head) changes nothing that row i does not read or produce."""
    q, k, v = _inputs(1, 48, 48, 40, 40, 8, 8, dtype=torch.float32, seed=29)
    out, grads = _grads_with(q, k, v, slice(None))
    qn = q.clone()
    qn[:, :, 5] = float("nan")
    out2, (dq2, dk2, dv2) = _grads_with(qn, k, v, slice(None))
    others = [i for i in range(40) if i != 5]
    assert torch.equal(out[:, :, others], out2[:, :, others])
    assert torch.equal(grads[0][:, :, others], dq2[:, :, others])
    assert torch.equal(grads[1][:, :, 6:], dk2[:, :, 6:]) and torch.equal(
        grads[2][:, :, 6:], dv2[:, :, 6:]
    )


def test_non_contiguous_inputs():
    """(B, T, H, d) tensors transposed to (B, H, T, d), as a model's projections give them."""
    g = torch.Generator().manual_seed(31)
    q, k, v = (torch.randn(2, 300, 4, 16, generator=g, dtype=F64).transpose(1, 2) for _ in range(3))
    _assert_matches_reference(q, k[:, :2], v[:, :2], lengths=[300, 123])


class _CountScores:
    """torch as tiled's forward pass sees it, counting the score GEMMs' key columns (K block:
    (M, d, cols))."""

    def __init__(self, d):
        self.d, self.cells = d, 0

    def __getattr__(self, name):
        return getattr(torch, name)

    def bmm(self, a, b, out=None):
        if b.shape[1] == self.d:  # S = Q Kᵀ, not P V (d_v differs from d here)
            self.cells += a.shape[1] * b.shape[2]
        return torch.bmm(a, b, out=out)


def _holed_mask():
    m = torch.ones(80, 80, dtype=torch.bool)
    m[:, 16:32] = False  # a key block nobody reads, between readable ones
    return m


@pytest.mark.parametrize(
    "kw",
    [
        {"window": 10},
        {"cu_seqlens": [0, 30, 33, 80]},
        {"chunk": 16},
        {"lengths": [50]},
        {"mask": _holed_mask()},
    ],
    ids=["window", "documents", "chunk", "lengths", "holed-mask"],
)
def test_forward_touches_no_fully_blocked_key_block(monkeypatch, kw):
    """The forward computes scores only for key blocks the pattern lets some query read:
    the score cells it computes are at most those of the tiles block_kind does not skip
    (and at least the readable cells)."""
    monkeypatch.setattr(tiled, "BLOCKS", (8, 16))
    q, k, v = _inputs(1, 1, 1, 80, 80, 6, 4, dtype=torch.float32, seed=29)
    p = make_problem(q, k, v, **kw)
    count = _CountScores(6)
    monkeypatch.setattr(tiled_fwd, "torch", count)  # the forward pass's module
    tiled.fwd(p)
    monkeypatch.undo()
    want = 0
    for a in range(0, 80, 8):
        lo, hi = p.pattern.key_range(0, a, a + 8, 80, 80)
        for c in range(lo, hi, 16):
            if p.pattern.block_kind(0, a, a + 8, c, min(hi, c + 16), 80, 80) != "skip":
                want += 8 * (min(hi, c + 16) - c)
    assert int(p.allowed().sum()) <= count.cells <= want, (count.cells, want)


# chunk sizes against block sizes: (query block, key block) that divide the chunk, that it
# divides, and that do neither; chunks below and above MIN_PIECE (those cut query blocks)
CHUNK_BLOCKS = [
    (c, blocks) for blocks in ((4, 8), (8, 8), (5, 7), (16, 12)) for c in (1, 3, 8, 12, 33, 40)
]


@pytest.mark.parametrize(
    "chunk,blocks", CHUNK_BLOCKS, ids=[f"c{c}-b{a}x{b}" for c, (a, b) in CHUNK_BLOCKS]
)
def test_chunks_against_block_sizes_that_do_and_do_not_divide_them(monkeypatch, chunk, blocks):
    """No per-batch rule (one job for every batch row): the chunk's tiles are not the same
    along a diagonal unless the blocks line up with it, so none may be shared; forward,
    lse and every gradient equal the reference for square and bottom-right problems."""
    monkeypatch.setattr(tiled, "BLOCKS", blocks)
    for Tq, Tk in ((70, 70), (29, 75)):
        q, k, v = _inputs(2, 2, 1, Tq, Tk, 4, 3, seed=chunk)
        _assert_matches_reference(q, k, v, chunk=chunk)
        _assert_matches_reference(q, k, v, chunk=chunk, causal=False)


def test_the_pool_keeps_its_own_worker_count():
    """The thread pool's size is the engine's own record (tiled_pool._POOL_WORKERS), not
    ThreadPoolExecutor's private _max_workers: the pool is kept while it has enough
    threads and replaced by a larger one when more are asked for; results in part order."""
    import threading

    from causalattn.engines import tiled_pool

    parts = [[i] for i in range(6)]

    def run(part):
        return part[0], threading.current_thread().name

    out = tiled_pool._parallel(parts, run, 3)
    assert [i for i, _ in out] == list(range(6))
    assert all(name.startswith("causalattn-tiled") for _, name in out)
    pool, n = tiled_pool._POOL, tiled_pool._POOL_WORKERS
    assert n >= 3
    tiled_pool._parallel(parts, run, 2)
    assert tiled_pool._POOL is pool and tiled_pool._POOL_WORKERS == n
    tiled_pool._parallel(parts, run, n + 1)
    assert tiled_pool._POOL is not pool and tiled_pool._POOL_WORKERS == n + 1
