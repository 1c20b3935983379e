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
    # the native engine where it is built, else tiled (tests/engines/test_auto.py)
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


# ---- the learned tensors' gradients (bias, rel_bias, ALiBi slopes, a score_mod's tensors) --
def _learned_case(name, B, H, Tq, Tk, g):
    """(keywords, leaves) of one learned tensor; the score_mod reads b, h, q_idx, kv_idx."""
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64).requires_grad_()  # noqa: E731
    if name.startswith("bias"):
        shape = {
            "bias": (B, H, Tq, Tk),
            "bias-head": (1, H, Tq, Tk),
            "bias-key": (B, 1, 1, Tk),
            "bias-query": (1, 1, Tq, 1),
            "bias-3d": (H, Tq, Tk),
            "bias-2d": (Tq, Tk),
            "bias-scalar": (1, H, 1, 1),
        }[name]
        t = r(*shape)
        return {"bias": t}, [t]
    if name == "rel_bias":
        t = r(H, 2 * Tk - 1)
        return {"rel_bias": t}, [t]
    if name == "alibi_slopes":
        t = torch.rand(H, generator=g, dtype=F64).requires_grad_()
        return {"alibi_slopes": t}, [t]
    if name == "alibi_slopes-batch":
        t = torch.rand(B, H, generator=g, dtype=F64).requires_grad_()
        return {"alibi_slopes": t}, [t]
    table, scale, unused = r(H, 2 * Tk - 1), r(B), r(3)
    on = [True]  # `unused` is captured but never read: its gradient is zeros

    def smod(s, b, h, q_idx, kv_idx):
        s = s + table[h, q_idx - kv_idx + Tk - 1] + scale[b] * torch.tanh(s)
        return s if on[0] else s + unused.sum()

    return {"score_mod": smod}, [table, scale, unused]


def _grads_of(engine, q, k, v, kw, leaves, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = attention(q, k, v, engine=engine, return_lse=True, **kw)
    grads = torch.autograd.grad((out * dout).sum(), (q, k, v, *leaves), allow_unused=True)
    return out.detach(), lse.detach(), grads


LEARNED = [
    "bias", "bias-head", "bias-key", "bias-query", "bias-3d", "bias-2d", "bias-scalar",
    "rel_bias", "alibi_slopes", "alibi_slopes-batch", "score_mod",
]  # fmt: skip


@pytest.mark.parametrize("blocks", [(3, 4), (8, 16), None], ids=["3x4", "8x16", "auto"])
@pytest.mark.parametrize("name", LEARNED)
def test_learned_tensor_gradients_match_the_reference(monkeypatch, name, blocks):
    """Every learned tensor's gradient, and dq, dk, dv beside it, against the float64
    reference: grouped-query heads, two batch rows of different lengths (one job each),
    a window, bottom-right decoding, small and default blocks (masked, partly read tiles)."""
    monkeypatch.setattr(tiled, "BLOCKS", blocks)
    for Tq, Tk, extra in ((11, 11, {"lengths": [11, 6]}), (5, 13, {"window": 6})):
        B, Hq, Hkv = 2, 4, 2
        g = torch.Generator().manual_seed(len(name) + Tq)
        q, k, v = _inputs(B, Hq, Hkv, Tq, Tk, 5, 3, seed=Tq)
        kw, leaves = _learned_case(name, B, Hq, Tq, Tk, g)
        dout = torch.randn(B, Hq, Tq, 3, generator=g, dtype=F64)
        got = _grads_of("tiled", q, k, v, {**kw, **extra}, leaves, dout)
        want = _grads_of("reference", q, k, v, {**kw, **extra}, leaves, dout)
        torch.testing.assert_close(got[0], want[0], atol=1e-12, rtol=1e-12)
        fin = torch.isfinite(want[1])
        assert torch.equal(fin, torch.isfinite(got[1]))
        torch.testing.assert_close(got[1][fin], want[1][fin], atol=1e-6, rtol=1e-6)
        for i, (a, b) in enumerate(zip(got[2], want[2])):
            if b is None:  # the reference's autograd never reached it: zeros here
                assert a is None or not a.any(), i
                continue
            assert a is not None and a.shape == b.shape and a.dtype == b.dtype, i
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=f"grad {i}")


def test_learned_gradients_over_many_tiles_parts_and_threads():
    """Enough work for several workers and dQ lanes (parts summed in order): every learned
    tensor at once, against the reference; no readable key anywhere: zero gradients."""
    B, H, T, d = 1, 2, 256, 16
    g = torch.Generator().manual_seed(7)
    q, k, v = _inputs(B, H, H, T, T, d, d, seed=7)
    bias = torch.randn(1, H, T, T, generator=g, dtype=F64).requires_grad_()
    rel = torch.randn(H, 2 * T - 1, generator=g, dtype=F64).requires_grad_()
    slopes = torch.rand(H, generator=g, dtype=F64).requires_grad_()
    table = torch.randn(H, 2 * T - 1, generator=g, dtype=F64).requires_grad_()

    def smod(s, b, h, q_idx, kv_idx):
        return s + table[h, q_idx - kv_idx + T - 1]

    kw = {"bias": bias, "rel_bias": rel, "alibi_slopes": slopes, "score_mod": smod}
    leaves = [bias, rel, slopes, table]
    dout = torch.randn(B, H, T, d, generator=g, dtype=F64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        got = _grads_of("tiled", q, k, v, kw, leaves, dout)
    finally:
        torch.set_num_threads(threads)
    want = _grads_of("reference", q, k, v, kw, leaves, dout)
    torch.testing.assert_close(got[0], want[0], atol=1e-11, rtol=1e-11)
    for i, (a, b) in enumerate(zip(got[2], want[2])):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9, msg=f"grad {i}")
    none = _grads_of("tiled", q, k, v, {**kw, "lengths": [0]}, leaves, dout)
    for i, (t, a) in enumerate(zip([q, k, v, *leaves], none[2])):
        assert a is not None and a.shape == t.shape and not a.any(), i


def test_forward_entry_is_differentiable_and_refuses_another_device():
    q, k, v = _inputs(1, 2, 1, 7, 7, 4, 3, seed=17)
    p = make_problem(q.requires_grad_(), k, v, window=3)
    out, lse = tiled.forward(p, return_lse=True)
    want_out, want_lse = tiled.fwd(p)
    assert torch.equal(out, want_out) and lse.dtype == torch.float32  # fp32 lse by contract
    assert torch.equal(lse, want_lse.float())
    only = tiled.forward(p)
    assert torch.equal(only, want_out) and only.requires_grad
    (dq,) = torch.autograd.grad(only.sum(), q)
    ref = attention(q, k, v, window=3, engine="reference")
    torch.testing.assert_close(dq, torch.autograd.grad(ref.sum(), q)[0], atol=1e-12, rtol=0)
    from dataclasses import replace

    meta = replace(p, q=torch.empty(q.shape, dtype=F64, device="meta"))
    with pytest.raises(ValueError) as e:
        tiled.forward(meta)
    assert str(e.value) == "engine 'tiled': runs on the CPU; q is on meta"
    assert tiled.refusal(None) == ""


# ---- the engine's rules on their own: block sizes, the split of the work, the guards -------
def test_plan_block_sizes_follow_the_documented_rule(monkeypatch):
    """Query blocks of 128 rows, key blocks of 256 (512 past d = 128), as many heads as fit
    TILE_ELEMS = 2^17 scores; decoding widens the key block to fill the tile; the backward
    takes square blocks (64 past d = 128); a forced BLOCKS is clipped to the shape alone."""
    P = tiled._plan
    assert P(8, 1000, 1000, 64) == (4, 128, 256)
    assert P(8, 1000, 1000, 128) == (4, 128, 256) and P(8, 1000, 1000, 129) == (2, 128, 512)
    assert P(1, 1000, 1000, 64) == (1, 128, 1000) and P(3, 1000, 5000, 64) == (3, 128, 341)
    assert P(8, 1000, 1000, 64, bwd=True) == (8, 128, 128)
    assert P(8, 1000, 1000, 128, bwd=True) == (8, 128, 128)  # up to d = 128
    assert P(20, 1000, 1000, 64, bwd=True) == (8, 128, 128)
    assert P(20, 1000, 1000, 200, bwd=True) == (20, 64, 64)
    assert P(2, 1000, 1000, 129, bwd=True) == (2, 64, 64)
    assert P(4, 1, 5000, 64) == (4, 1, 5000) and P(4, 1, 50000, 64) == (4, 1, 32768)
    assert P(4, 1, 5000, 64, bwd=True) == (4, 1, 128)
    assert P(2, 0, 0, 8) == (2, 1, 1)  # empty: blocks of one
    assert P(600, 100, 300, 8) == (5, 100, 262)  # 2^17 // (100·256) = 5 heads
    monkeypatch.setattr(tiled, "BLOCKS", (3, 5))
    assert P(8, 1000, 1000, 64) == (8, 3, 5) and P(8, 2, 4, 64, bwd=True) == (8, 2, 4)
    assert P(9000, 10, 10, 8) == (8738, 3, 5)  # 2^17 // 15 heads
    assert P(4, 1, 5000, 64) == (4, 1, 5)  # no widening when the blocks are forced


def test_job_plan_keeps_a_query_group_in_one_tile():
    q = torch.zeros(3, 4, 1000, 64)  # N = 3 key/value heads, g = 4 query heads each
    assert tiled._job_plan(q, 1000) == (1, 128, 256)  # _plan(12, ...) gives 4 query heads
    assert tiled._job_plan(torch.zeros(3, 1, 1000, 64), 1000) == (3, 128, 341)
    assert tiled._job_plan(torch.zeros(3, 8, 1000, 64), 1000) == (1, 128, 256)  # at least 1
    assert tiled._job_plan(q, 1000, bwd=True) == (2, 128, 128)


def test_job_views_fold_batch_rows_and_key_heads():
    x = torch.arange(2 * 4 * 3 * 2).view(2, 4, 3, 2)  # (B, H_q, T, e), H_kv = 2: g = 2
    v = tiled._job_view(x, 1, 2, 2)
    assert (
        v.shape == (2, 2, 3, 2) and torch.equal(v[1, 0], x[1, 2]) and torch.equal(v[0, 1], x[1, 1])
    )
    kv = tiled._kv(x, 0, 2)
    assert kv.shape == (8, 3, 2) and torch.equal(kv[5], x[1, 1])


def test_balanced_deals_the_largest_task_to_the_least_loaded_part():
    from causalattn.engines.tiled_pool import _balanced

    tasks = [(c,) for c in (3, 7, 1, 5, 2, 6, 4)]
    cost = lambda t: t[0]  # noqa: E731
    assert _balanced(tasks, cost, 3) == [[(7,), (2,), (1,)], [(6,), (3,)], [(5,), (4,)]]
    assert _balanced(tasks, cost, 1) == [sorted(tasks, reverse=True)]
    assert _balanced(tasks, cost, 0) == [sorted(tasks, reverse=True)]
    assert _balanced(tasks[:2], cost, 5) == [[(7,)], [(3,)]]  # no empty parts
    assert _balanced([], cost, 4) == []
    assert _balanced([(2,), (2,), (1,)], cost, 2) == [[(2,), (1,)], [(2,)]]
    by_cost = lambda t: t[1]  # noqa: E731  (the largest cost first, not the largest tuple)
    assert _balanced([(0, 5), (1, 9), (2, 1)], by_cost, 2) == [[(1, 9)], [(0, 5), (2, 1)]]


def test_workers_and_lanes_from_the_work_at_2_to_the_22():
    from causalattn.engines.tiled_pool import LANES, _lanes, _workers

    def prob(Tq, Tk, d, dv, B=1, H=1):
        return make_problem(
            torch.zeros(B, H, Tq, d), torch.zeros(B, H, Tk, d), torch.zeros(B, H, Tk, dv)
        )

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        at = prob(512, 512, 10, 6)  # 512·512·16 = 2^22 exactly
        below = prob(511, 512, 10, 6)
        assert _workers(at) == 3 and _lanes(at) == LANES == 4
        assert _workers(below) == 1 and _lanes(below) == 1
        assert _workers(prob(256, 512, 10, 6, B=2)) == 3 and _lanes(prob(256, 512, 10, 6, H=2)) == 4
        assert _workers(prob(256, 1024, 10, 6)) == 3  # T_k counts, not T_q twice
        assert _workers(prob(256, 512, 10, 6, H=2)) == 3 and _workers(prob(511, 512, 10, 6)) == 1
        assert _workers(prob(512, 512, 6, 10)) == 3 and _lanes(prob(512, 512, 15, 1)) == 4
    finally:
        torch.set_num_threads(threads)


def test_parallel_runs_single_threaded_torch_and_restores_the_count():
    from causalattn.engines.tiled_pool import _parallel

    seen = []

    def run(part):
        seen.append((torch.get_num_threads(), torch.is_grad_enabled()))
        return sum(part)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert _parallel([[1, 2], [3], [4, 5]], run, 1) == [3, 3, 9]  # in the caller, in order
        assert _parallel([[1], [2]], run, 4) == [1, 2]
        assert _parallel([], run, 4) == []
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert seen and all(s == (1, False) for s in seen)

    def boom(part):
        raise RuntimeError("tile failed")

    torch.set_num_threads(2)
    try:
        with pytest.raises(RuntimeError, match="tile failed"):
            _parallel([[1]], boom, 1)
        assert torch.get_num_threads() == 2  # restored on the way out
    finally:
        torch.set_num_threads(threads)


def test_finite_and_flag_find_the_positions_that_hold_a_non_finite():
    from causalattn.engines.tiled_tiles import _finite, _flag

    X = torch.ones(2, 5, 3)
    assert _finite(X)[0] is X and _finite(X)[1] is None
    big = torch.full((2, 5, 3), 3e38)  # the sum overflows; every entry is finite
    assert _finite(big)[1] is None
    assert _finite(torch.zeros(0, 4, 3))[1] is None
    X[1, 1, 2] = float("nan")
    X[0, 3, 0] = float("-inf")
    X0, cum = _finite(X)
    assert cum.dtype == torch.int64 and cum.tolist() == [0, 0, 1, 1, 2, 2]
    assert torch.equal(X0, torch.nan_to_num(X, nan=0.0, posinf=0.0, neginf=0.0))
    assert X0[1, 1, 2] == 0 and X0[0, 3, 0] == 0 and torch.isnan(X[1, 1, 2])  # X kept
    assert _flag(None, 0, 5) is None
    assert [_flag(cum, c, c + 1) for c in range(5)] == [False, True, False, True, False]
    assert _flag(cum, 2, 3) is False and _flag(cum, 0, 5) is True and _flag(cum, 4, 5) is False


def test_nonfinite_terms_adds_only_where_a_is_nonzero_in_chunks_of_2_to_the_22(monkeypatch):
    """out += A @ X over X's non-finite entries alone (an exact 0 in A adds nothing, not
    0·NaN), in column chunks whose products stay within 2^22 elements."""
    from causalattn.engines import tiled_tiles

    g = torch.Generator().manual_seed(0)
    A = torch.randn(2, 3, 6, generator=g, dtype=F64)
    A[0, 1, 2] = 0.0
    X = torch.randn(2, 6, 4, generator=g, dtype=F64)
    X[0, 2, 1] = float("nan")  # read by rows 0 and 2 of head 0, not by row 1 (A = 0)
    X[1, 4, 3] = float("inf")
    X[1, 4, 0] = float("nan")
    out = torch.zeros(2, 3, 4, dtype=F64)
    tiled_tiles._nonfinite_terms(out, A, X)
    want = torch.zeros(2, 3, 4, dtype=F64)
    for n, r, c, e in torch.nonzero(~torch.isfinite(X)[:, None].expand(2, 3, 6, 4)).tolist():
        if A[n, r, c] != 0:
            want[n, r, e] += A[n, r, c] * X[n, c, e]
    assert torch.equal(torch.isnan(out), torch.isnan(want))
    assert torch.equal(out.nan_to_num(), want.nan_to_num())
    assert not torch.isnan(out[0, 1]).any() and out[1, :, 1].eq(0).all()  # finite entries: 0

    class Chunks:  # torch as _nonfinite_terms sees it: the column count of each product
        def __init__(self):
            self.widths = []

        def __getattr__(self, name):
            return getattr(torch, name)

        def where(self, cond, a, b):
            if cond.dim() == 4:
                self.widths.append(cond.shape[2])
            return torch.where(cond, a, b)

    for N, r, e, n_bad, step in (
        (1, 1024, 1024, 9, 4),
        (1, 4096, 2048, 3, 1),
        (2, 4, 4, 5, 131072),
    ):
        A = torch.ones(N, r, n_bad)
        X = torch.full((N, n_bad, e), float("nan"))
        ch = Chunks()
        monkeypatch.setattr(tiled_tiles, "torch", ch)
        tiled_tiles._nonfinite_terms(torch.zeros(N, r, e), A, X)
        monkeypatch.undo()
        assert step == max(1, (1 << 22) // (N * r * e))
        assert ch.widths == [min(step, n_bad - s) for s in range(0, n_bad, step)], ch.widths


def test_a_value_row_with_one_non_finite_feature_leaves_the_others_exact():
    """Masked tiles meet a value row whose feature 0 is NaN and feature 1 is inf: the rows
    that read it get NaN / inf there and the reference's values in every other feature;
    the rows that cannot read it get the reference's values in all."""
    q, k, v = _inputs(1, 2, 1, 12, 12, 4, 3, seed=21)
    v[0, 0, 5, 0] = float("nan")
    v[0, 0, 7, 1] = float("inf")
    for blocks in ((4, 4), (3, 5), None):
        old, tiled.BLOCKS = tiled.BLOCKS, blocks
        try:
            for kw in ({"window": 4}, {}, {"bias": torch.zeros(12, 12, dtype=F64)}):
                out = attention(q, k, v, engine="tiled", **kw)
                ref = attention(q, k, v, engine="reference", **kw)
                torch.testing.assert_close(out, ref, atol=1e-12, rtol=0, equal_nan=True)
        finally:
            tiled.BLOCKS = old


def test_sinks_gradient_is_computed_in_float64_from_out_lse_dout_and_dlse():
    """d s_h = -Σ exp(s_h - lse)·(rowsum(dO ∘ O) - dlse), in float64 whatever the inputs'
    dtype; rows with lse = -inf add nothing, even with a dlse."""
    g = torch.Generator().manual_seed(3)
    q, k, v = _inputs(2, 2, 2, 6, 6, 4, 3, dtype=torch.float32, seed=3)
    p = make_problem(q, k, v, lengths=[6, 0], sinks=[0.3, -0.7])
    out, lse = tiled.fwd(p)
    dout = torch.randn(out.shape, generator=g)
    dlse = torch.randn(lse.shape, generator=g)
    got = tiled.sinks_grad(p, out, lse, dout, dlse)
    D = (dout.double() * out.double()).sum(-1) - dlse.double()
    L = lse.double()
    w = torch.exp(torch.tensor([0.3, -0.7], dtype=F64)[None, :, None] - L)
    w = torch.where(torch.isneginf(L), 0.0, w)
    assert got.dtype == F64 and torch.equal(got, -(w * D).sum(dim=(0, 2)))
    assert torch.isneginf(lse[1]).all()  # batch row 1 reads nothing
    D0 = (dout.double() * out.double()).sum(-1)
    assert torch.equal(tiled.sinks_grad(p, out, lse, dout), -(w * D0).sum(dim=(0, 2)))


@pytest.mark.parametrize("name", ["rel_bias", "alibi_slopes", "score_mod", "bias-key"])
def test_placed_blocks_read_the_modifiers_at_their_global_positions(name):
    """Blocks placed in a longer sequence (q_start, k_start: the ring's blocks): two key
    halves and a query block whose start is not the bottom-right one. Merged by lse they
    give the whole problem's out; their backward, given the merged out and lse, sums to the
    whole problem's gradients, the learned tensor's included."""
    from causalattn.masks import Pattern

    T, H = 12, 2
    g = torch.Generator().manual_seed(9)
    q, k, v = _inputs(1, H, H, T, T, 4, 3, seed=9)
    kw, leaves = _learned_case(name, 1, H, T, T, g)
    if name == "bias-key":  # a key bias is sliced by the block's own key range
        kw = {"bias": leaves[0][..., :]}
    leaf = leaves[0]
    dout = torch.randn(1, H, T, 3, generator=g, dtype=F64)
    ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
    from causalattn.engines import exact

    o, L = exact.forward(make_problem(ql, kl, vl, **kw), return_lse=True)  # lse: fp32
    want = torch.autograd.grad((o * dout).sum(), (ql, kl, vl, *leaves), allow_unused=True)
    want_name = {"bias-key": "bias", "score_mod": "captured"}.get(name, name)

    def placed(qs, ks, qa, ka):
        bkw = dict(kw)
        if name == "bias-key":
            bkw["bias"] = leaf[..., ks]
        pattern = Pattern(q_start=qa, k_start=ka, **bkw)
        return make_problem(q[:, :, qs], k[:, :, ks], v[:, :, ks], pattern=pattern)

    halves = [placed(slice(None), slice(0, 6), 0, 0), placed(slice(None), slice(6, 12), 0, 6)]
    (o1, l1), (o2, l2) = (tiled.fwd(p) for p in halves)
    Lm = torch.logaddexp(l1, l2)
    out = o1 * (l1 - Lm).exp()[..., None] + o2 * (l2 - Lm).exp()[..., None]
    torch.testing.assert_close(out, o.detach(), atol=1e-12, rtol=0)
    torch.testing.assert_close(Lm.float(), L.detach(), atol=1e-6, rtol=0)
    parts = [tiled.bwd_grads(p, out, Lm, dout, want=(want_name,)) for p in halves]
    dq = parts[0][0] + parts[1][0]
    dk, dv = (torch.cat([parts[0][i], parts[1][i]], 2) for i in (1, 2))
    for n, a, w in zip("qkv", (dq, dk, dv), want[:3]):
        torch.testing.assert_close(a, w, atol=1e-10, rtol=0, msg=f"d{n}")
    if name == "bias-key":
        dleaf = torch.cat([parts[0][3]["bias"], parts[1][3]["bias"]], -1)
        torch.testing.assert_close(dleaf, want[3], atol=1e-10, rtol=0)
    elif name == "score_mod":  # the captured tensors, in captured_of's order
        from causalattn.engines.registry import captured_of

        order = [
            next(i for i, t in enumerate(leaves) if t is c) for c in captured_of(kw["score_mod"])
        ]
        assert sorted(order) == [0, 1, 2]
        for i, j in enumerate(order):
            a = parts[0][3]["captured"][i] + parts[1][3]["captured"][i]
            w = want[3 + j]
            torch.testing.assert_close(
                a, torch.zeros_like(a) if w is None else w, atol=1e-10, rtol=0
            )
    else:
        a = parts[0][3][name] + parts[1][3][name]
        torch.testing.assert_close(a.reshape(want[3].shape), want[3], atol=1e-10, rtol=0)
    # a query block that is not bottom-right: rows 0..5 against all 12 keys, q_start = 0
    top = placed(slice(0, 6), slice(None), 0, 0)
    o_top, l_top = tiled.fwd(top)
    torch.testing.assert_close(o_top, o.detach()[:, :, :6], atol=1e-12, rtol=0)
    torch.testing.assert_close(l_top.float(), L.detach()[:, :, :6], atol=1e-6, rtol=0)


def test_a_bias_of_two_rows_or_keys_is_sliced_per_tile(monkeypatch):
    """A broadcast axis is one of size 1, not of size 2: a (2, 2) bias read by 1×1 tiles."""
    monkeypatch.setattr(tiled, "BLOCKS", (1, 1))
    g = torch.Generator().manual_seed(4)
    for Tq, Tk in ((2, 2), (1, 2), (2, 3)):
        q, k, v = _inputs(2, 2, 2, Tq, Tk, 3, 2, seed=Tq + Tk)
        for shape in ((Tq, Tk), (2, 2, Tq, Tk), (2, 1, Tq, 1), (1, 2, 1, Tk)):
            bias = torch.randn(*shape, generator=g, dtype=F64).requires_grad_()
            dout = torch.randn(2, 2, Tq, 2, generator=g, dtype=F64)
            got = _grads_of("tiled", q, k, v, {"bias": bias}, [bias], dout)
            want = _grads_of("reference", q, k, v, {"bias": bias}, [bias], dout)
            torch.testing.assert_close(got[0], want[0], atol=1e-12, rtol=0)
            for a, b in zip(got[2], want[2]):
                torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_a_bias_enters_in_the_compute_dtype():
    """A float64 bias beside float32 inputs: the same bits as the bias cast to float32 (the
    tile adds it in the compute dtype), forward and backward."""
    q, k, v = _inputs(1, 2, 2, 40, 40, 8, 8, dtype=torch.float32, seed=5)
    b64 = torch.randn(2, 40, 40, generator=torch.Generator().manual_seed(6), dtype=F64)
    dout = torch.randn(1, 2, 40, 8, generator=torch.Generator().manual_seed(7))
    a = _grads_of("tiled", q, k, v, {"bias": b64, "window": 9}, [], dout)
    b = _grads_of("tiled", q, k, v, {"bias": b64.float(), "window": 9}, [], dout)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for x, y in zip(a[2], b[2]):
        assert torch.equal(x, y)


NONFINITE_FEATURES = {
    "causal": {},
    "window": {"window": 5},
    "lengths": {"lengths": [13, 7]},
    "bias": {"bias": "bias"},
    "score_mod": {"score_mod": lambda s, b, h, q_idx, kv_idx: s * 0.5 + 0.1 * (q_idx - kv_idx)},
    "softcap+alibi": {"softcap": 4.0, "alibi_slopes": [0.3, 0.1]},
    "sinks": {"sinks": [0.5, -1.0]},
    "full": {"causal": False},
}  # not dropout: a dropped weight is 0 and the engines keep it from a NaN value, the
# reference does not (0·NaN = NaN); a difference between engines, noted in docs/design.md
POISON = {  # (tensor, batch, key/query position, feature, value)
    "q-nan": ("q", 0, 6, None, float("nan")),
    "k-nan": ("k", 0, 4, None, float("nan")),
    "k-inf": ("k", 1, 5, 0, float("inf")),
    "v-nan": ("v", 0, 3, 1, float("nan")),
    "v-ninf": ("v", 1, 8, None, float("-inf")),
    "q-inf": ("q", 1, 7, 2, float("inf")),
}


def _feature_kw(feature: str) -> dict:
    """NONFINITE_FEATURES' keywords, the bias built here (no tensor at import: conftest)."""
    kw = dict(NONFINITE_FEATURES[feature])
    if kw.get("bias") == "bias":
        kw["bias"] = torch.randn(2, 13, 13, generator=torch.Generator().manual_seed(2), dtype=F64)
    return kw


def _assert_clean_outside_the_reach(got, clean, R, KR, out: bool) -> None:
    """Rows outside R keep their (out and) dq, keys outside KR their dk, dv: finite and the
    clean run's. got, clean: _run's (out, lse, (dq, dk, dv)); R (B, H, T_q), KR (B, H, T_k)."""
    checks = [("dq", 0, ~R), ("dk", 1, ~KR), ("dv", 2, ~KR)]
    pairs = [("out", got[0], clean[0], ~R)] if out else []
    pairs += [(what, got[2][i], clean[2][i], keep) for what, i, keep in checks]
    for what, a, c, keep in pairs:
        assert torch.isfinite(a[keep]).all(), f"{what}: a non-finite value leaked"
        torch.testing.assert_close(a[keep], c[keep], atol=1e-12, rtol=0, msg=what)


@pytest.mark.parametrize("blocks", [(3, 4), (8, 16)], ids=["3x4", "8x16"])
@pytest.mark.parametrize("poison", list(POISON))
@pytest.mark.parametrize("feature", list(NONFINITE_FEATURES))
def test_non_finite_inputs_reach_only_the_rows_and_keys_that_read_them(
    monkeypatch, feature, poison, blocks
):
    """A NaN or inf in one row of q, k or v, beside each modifier, in masked tiles. The
    output and lse are the reference's, NaN where it is NaN. Every row that does not read
    the poisoned position (R), and every key that no row of R reads, keeps its clean output
    and gradients, finite: blocked weights never meet the poison (0·NaN). (The reference's
    own autograd spreads NaN wider, so the clean run is the yardstick here.)"""
    monkeypatch.setattr(tiled, "BLOCKS", blocks)
    q, k, v = _inputs(2, 2, 2, 13, 13, 4, 3, seed=11)
    name, b, pos, feat, val = POISON[poison]
    kw = _feature_kw(feature)
    clean = _run("tiled", q, k, v, **kw)
    bad = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
    bad[name][b, :, pos, slice(None) if feat is None else feat] = val
    got = _run("tiled", bad["q"], bad["k"], bad["v"], **kw)
    want = _run("reference", bad["q"], bad["k"], bad["v"], **kw)
    torch.testing.assert_close(got[0], want[0], atol=1e-12, rtol=0, equal_nan=True)
    assert torch.equal(torch.isnan(got[1]), torch.isnan(want[1]))
    fin = torch.isfinite(want[1])
    torch.testing.assert_close(got[1][fin], want[1][fin], atol=1e-5, rtol=0)
    E = torch.as_tensor(make_problem(q, k, v, **kw).allowed()).expand(2, 2, 13, 13)
    R = torch.zeros(2, 2, 13, dtype=torch.bool)  # the rows that read the poison
    if name == "q":
        R[b, :, pos] = True
    else:
        R[b] = E[b, :, :, pos]
    KR = (R[..., None] & E).any(-2)  # the keys those rows read
    if name != "q":
        KR[b, :, pos] = True
    _assert_clean_outside_the_reach(got, clean, R, KR, out=True)
    if val != val:  # a NaN reaches every row that reads it, and so each of their dq rows
        assert (~torch.isfinite(got[2][0])).any(-1)[R].all()


def test_a_score_mods_gradient_under_a_mask_that_differs_by_head(monkeypatch):
    """A per-head dense mask beside a score_mod with a learned table: each head's blocked
    cells send nothing to the table, in tiles that hold several heads."""
    monkeypatch.setattr(tiled, "BLOCKS", (4, 4))
    T, H = 9, 3
    g = torch.Generator().manual_seed(12)
    q, k, v = _inputs(1, H, H, T, T, 4, 3, seed=12)
    mask = torch.rand(H, T, T, generator=g) > 0.4
    mask |= torch.eye(T, dtype=torch.bool)
    kw, leaves = _learned_case("score_mod", 1, H, T, T, g)
    dout = torch.randn(1, H, T, 3, generator=g, dtype=F64)
    got = _grads_of("tiled", q, k, v, {**kw, "mask": mask}, leaves, dout)
    want = _grads_of("reference", q, k, v, {**kw, "mask": mask}, leaves, dout)
    torch.testing.assert_close(got[0], want[0], atol=1e-12, rtol=0)
    for i, (a, b) in enumerate(zip(got[2], want[2])):
        if b is None:
            assert a is None or not a.any(), i
        else:
            torch.testing.assert_close(a, b, atol=1e-10, rtol=0, msg=f"grad {i}")


def test_row_blocks_never_straddle_an_edge_and_split_evenly():
    """Query blocks: equal pieces of at most bq rows between the edges where the readable
    set changes (documents, chunks of MIN_PIECE keys or more, a row's length or prefix)."""
    from causalattn.engines.tiled_tiles import MIN_PIECE, _row_blocks

    def blocks(Tq, Tk, bq, b=0, B=1, **kw):
        q, k = torch.zeros(B, 1, Tq, 2), torch.zeros(B, 1, Tk, 2)
        return _row_blocks(make_problem(q, k, k, **kw), b, bq)

    assert MIN_PIECE == 32
    assert blocks(10, 10, 4) == [(0, 3), (3, 6), (6, 10)]
    assert blocks(8, 8, 4) == [(0, 4), (4, 8)] and blocks(3, 3, 8) == [(0, 3)]
    assert blocks(10, 10, 4, cu_seqlens=[0, 3, 10]) == [(0, 3), (3, 6), (6, 10)]
    assert blocks(10, 10, 4, cu_seqlens=[0, 2, 2, 9, 10]) == [(0, 2), (2, 5), (5, 9), (9, 10)]
    assert blocks(70, 70, 16, chunk=32) == [(0, 16), (16, 32), (32, 48), (48, 64), (64, 70)]
    assert blocks(70, 70, 40, chunk=31) == [(0, 35), (35, 70)]  # below MIN_PIECE: no edges
    assert blocks(70, 70, 64, chunk=32, cu_seqlens=[0, 40, 70]) == [
        (0, 32), (32, 40), (40, 70),
    ]  # fmt: skip
    assert blocks(10, 10, 8, B=2, b=1, lengths=[10, 7]) == [(0, 7), (7, 10)]
    assert blocks(10, 10, 8, B=2, b=0, lengths=[10, 7]) == [(0, 5), (5, 10)]
    assert blocks(10, 10, 8, B=2, b=1, prefix_lengths=[2, 3]) == [(0, 3), (3, 10)]
    # decoding: the queries start at T_k - T_q, and edges are key positions
    assert blocks(4, 10, 8, lengths=[7]) == [(0, 1), (1, 4)]
    assert blocks(4, 10, 8, lengths=[3]) == [(0, 4)]  # the edge lies before the queries
    assert blocks(0, 5, 4) == []


def test_jobs_split_the_batch_only_for_a_pattern_per_row():
    from causalattn.engines.tiled_tiles import _jobs

    z = torch.zeros(3, 1, 4, 2)
    assert _jobs(make_problem(z, z, z)) == [(0, 3)]
    assert _jobs(make_problem(z, z, z, lengths=[4, 2, 3])) == [(0, 1), (1, 2), (2, 3)]
    e = torch.zeros(0, 1, 4, 2)
    assert _jobs(make_problem(e, e, e)) == []


def test_tiles_list_only_readable_blocks_and_share_a_diagonals_mask():
    from causalattn.engines.tiled_tiles import NEG_INF, _Mask, _Tiles

    z = torch.zeros(1, 2, 8, 2)
    t = _Tiles(make_problem(z, z, z), 0, 4, 4, F64, aligned=False)
    (a0, b0, r0), (a1, b1, r1) = t.blocks
    assert (a0, b0, [c[:2] for c in r0]) == (0, 4, [(0, 4)])
    assert (a1, b1, [c[:2] for c in r1]) == (4, 8, [(0, 4), (4, 8)])
    assert r1[0][2] is None and isinstance(r0[0][2], _Mask)
    assert r1[1][2] is r0[0][2]  # the same offset on the diagonal: one mask, computed once
    m = r0[0][2]
    assert torch.equal(m.allowed[0], torch.ones(4, 4, dtype=torch.bool).tril())
    assert m.bias.dtype == F64 and torch.equal(m.bias[0] == NEG_INF, ~m.allowed[0])
    assert t.work(0) == 16 and t.work(1) == 32
    # a window: unaligned blocks start at the first readable key, aligned ones at its block
    w = make_problem(z, z, z, window=2)
    un = _Tiles(w, 0, 4, 3, F64, aligned=False).blocks
    al = _Tiles(w, 0, 4, 3, F64, aligned=True).blocks
    assert [c[:2] for c in un[1][2]] == [(3, 6), (6, 8)]
    assert [c[:2] for c in al[1][2]] == [(3, 6), (6, 8)]
    assert [c[:2] for c in _Tiles(w, 0, 4, 5, F64, aligned=True).blocks[1][2]] == [(0, 5), (5, 8)]
    assert [c[:2] for c in _Tiles(w, 0, 4, 5, F64, aligned=False).blocks[1][2]] == [(3, 8)]
    # per-row lengths: nothing is shared along the diagonal, and unreadable tiles are skipped
    lp = make_problem(torch.zeros(2, 1, 8, 2), torch.zeros(2, 1, 8, 2), torch.zeros(2, 1, 8, 2),
                      lengths=[8, 4])  # fmt: skip
    t1 = _Tiles(lp, 1, 4, 4, F64, aligned=False)
    assert [[c[:2] for c in r] for _, _, r in t1.blocks] == [[(0, 4)], []]
    t0 = _Tiles(lp, 0, 4, 4, F64, aligned=False)
    assert t0.blocks[1][2][1][2] is not t0.blocks[0][2][0][2]
    # a mask that differs by head: one row of allowed per head
    mask = torch.ones(2, 8, 8, dtype=torch.bool).tril()
    mask[1, 5, 1] = False
    th = _Tiles(make_problem(z, z, z, mask=mask), 0, 4, 4, F64, aligned=False)
    m1 = th.blocks[1][2][0][2]
    assert m1.allowed.shape == (2, 4, 4) and not m1.allowed[1, 1, 1] and m1.allowed[0, 1, 1]
    heads = torch.tensor([[1], [0]])
    assert torch.equal(m1.pick(m1.allowed, heads), m1.allowed[heads])
    assert torch.equal(m1.pick(m1.allowed, None), m1.allowed[0])
    assert torch.equal(m.pick(m.bias, heads), m.bias[0])  # one head's mask serves all


def test_acc_keeps_exact_zeros_from_non_finite_rows():
    from causalattn.engines.tiled_tiles import _acc, _finite

    A = torch.tensor([[[0.5, 0.0], [0.25, 0.75]]], dtype=F64)
    X = torch.tensor([[[1.0, 2.0], [float("nan"), 4.0]]], dtype=F64)
    X0, bad = _finite(X)
    out = torch.ones(1, 2, 2, dtype=F64)
    _acc(out, A, X, X0, True, True)  # masked: row 0's 0 never meets the NaN
    assert out[0, 0].tolist() == [1.5, 2.0] and torch.isnan(out[0, 1, 0]) and out[0, 1, 1] == 4.5
    out = torch.ones(1, 2, 2, dtype=F64)
    _acc(out, A, X, X0, True, False)  # not masked: the plain product, 0·NaN = NaN
    assert torch.isnan(out[0, 0, 0])
    out = torch.ones(1, 2, 2, dtype=F64)
    _acc(out, A, X, X0, None, True)  # the caller says X is finite: the plain product
    assert torch.isnan(out[0, 0, 0])
    out = torch.ones(1, 2, 2, dtype=F64)
    _acc(out, A, X, X0, False, True)  # this block of X is finite: X0 alone
    assert out[0].tolist() == [[1.5, 2.0], [1.25, 4.5]]


@pytest.mark.parametrize("kw", [{}, {"window": 3, "sinks": [0.5, 0.1]}], ids=["causal", "window"])
def test_dropout_1_gives_zeros_and_zero_gradients(monkeypatch, kw):
    """p = 1 drops every weight: a zero output and zero gradients (no 1/(1 - p) = 1/0), the
    lse of the weights before dropout."""
    monkeypatch.setattr(tiled, "BLOCKS", (3, 4))
    q, k, v = _inputs(1, 2, 2, 9, 9, 4, 3, seed=19)
    out, lse, grads = _run("tiled", q, k, v, dropout_p=1.0, **kw)
    assert not out.any() and all(not g.any() for g in grads)
    _, want_lse, _ = _run("tiled", q, k, v, **kw)
    assert torch.equal(lse, want_lse)


def test_forward_and_backward_plan_their_own_blocks(monkeypatch):
    """The forward plans (query, key) blocks for T_k keys; the backward plans its square
    ones (bwd=True) for the same T_k."""
    seen = []
    plan = tiled._plan

    def spy(N, m, n, d, bwd=False):
        seen.append((m, n, bwd))
        return plan(N, m, n, d, bwd)

    monkeypatch.setattr(tiled, "_plan", spy)
    q, k, v = _inputs(1, 2, 2, 5, 9, 4, 3, seed=2)
    p = make_problem(q, k, v)
    out, lse = tiled.fwd(p)
    assert seen == [(5, 9, False)]
    tiled.bwd(p, out, lse, torch.ones_like(out))
    assert seen[1:] == [(5, 9, True)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_raw_passes_return_the_inputs_dtypes(dtype):
    """fwd: out in q's dtype, lse in fp32; bwd: dq, dk, dv in q's, k's and v's dtypes (the
    ring calls them without autograd, which would cast)."""
    q, k, v = _inputs(1, 2, 1, 6, 6, 4, 3, dtype=dtype, seed=8)
    p = make_problem(q, k, v, window=3)
    out, lse = tiled.fwd(p)
    assert out.dtype == dtype and lse.dtype == torch.float32
    dq, dk, dv = tiled.bwd(p, out, lse, torch.ones_like(out))
    assert (dq.dtype, dk.dtype, dv.dtype) == (dtype, dtype, dtype)
    dq, dk, dv, extra = tiled.bwd_grads(p, out, lse, torch.ones_like(out))
    assert (dq.dtype, dk.dtype, dv.dtype, extra) == (dtype, dtype, dtype, {})


@pytest.mark.parametrize("blocks", [(3, 4), (8, 16)], ids=["3x4", "8x16"])
@pytest.mark.parametrize("feature", list(NONFINITE_FEATURES))
@pytest.mark.parametrize("val", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_non_finite_upstream_gradient_row_reaches_only_what_that_row_read(
    monkeypatch, feature, blocks, val
):
    """dO with a NaN or inf in query row 6: the gradients of the other rows' queries and of
    the keys row 6 does not read are the clean ones, finite (a blocked P or dS of row 6 is
    an exact 0 that never meets its dO); dV's feature 1 is non-finite at the keys it read."""
    monkeypatch.setattr(tiled, "BLOCKS", blocks)
    q, k, v = _inputs(2, 2, 2, 13, 13, 4, 3, seed=13)
    kw = _feature_kw(feature)
    dout = torch.randn(2, 2, 13, 3, generator=torch.Generator().manual_seed(3), dtype=F64)
    clean = _run("tiled", q, k, v, dout=dout, **kw)
    bad = dout.clone()
    bad[0, :, 6, 1] = val
    got = _run("tiled", q, k, v, dout=bad, **kw)
    E = torch.as_tensor(make_problem(q, k, v, **kw).allowed()).expand(2, 2, 13, 13)
    R = torch.zeros(2, 2, 13, dtype=torch.bool)
    R[0, :, 6] = True
    KR = (R[..., None] & E).any(-2)
    _assert_clean_outside_the_reach(got, clean, R, KR, out=False)
    # and it reaches what row 6 read: dV's feature 1 there (P > 0 times dO's non-finite)
    assert not torch.isfinite(got[2][2][..., 1][KR]).any()
    assert torch.isfinite(got[2][2][..., 0]).all() and torch.isfinite(got[2][2][..., 2]).all()


@pytest.mark.parametrize("fill", [float("inf"), float("-inf"), float("nan")], ids=str)
def test_a_bias_at_blocked_cells_never_matters(monkeypatch, fill):
    """A bias of inf, -inf or NaN at the cells the pattern blocks gives the same output,
    lse and gradients as a finite one there: masks are filled, never added to such scores."""
    monkeypatch.setattr(tiled, "BLOCKS", (3, 4))
    q, k, v = _inputs(1, 2, 2, 11, 11, 4, 3, seed=23)
    g = torch.Generator().manual_seed(24)
    bias = torch.randn(2, 11, 11, generator=g, dtype=F64)
    blocked = ~torch.as_tensor(make_problem(q, k, v, window=4).allowed())[0]
    other = bias.masked_fill(blocked, fill)
    a = _run("tiled", q, k, v, window=4, bias=bias)
    b = _run("tiled", q, k, v, window=4, bias=other)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for x, y in zip(a[2], b[2]):
        assert torch.equal(x, y)


def test_heads_split_into_chunks_read_their_own_modifiers(monkeypatch):
    """Tiles of two heads out of four (TILE_ELEMS small): each chunk reads its own heads'
    slopes, rel_bias rows, bias rows, score_mod indices, mask and dropout, forward and
    backward, with every learned tensor's gradient, against the reference."""
    monkeypatch.setattr(tiled, "BLOCKS", (3, 4))
    monkeypatch.setattr(tiled, "TILE_ELEMS", 24)  # 24 // 12 = 2 heads a tile
    B, H, T = 2, 4, 9
    g = torch.Generator().manual_seed(31)
    q, k, v = _inputs(B, H, H, T, T, 4, 3, seed=31)
    bias = torch.randn(B, H, T, T, generator=g, dtype=F64).requires_grad_()
    rel = torch.randn(H, 2 * T - 1, generator=g, dtype=F64).requires_grad_()
    slopes = torch.rand(B, H, generator=g, dtype=F64).requires_grad_()
    table = torch.randn(H, 2 * T - 1, generator=g, dtype=F64).requires_grad_()
    mask = torch.rand(H, T, T, generator=g) > 0.3
    mask |= torch.eye(T, dtype=torch.bool)

    def smod(s, b, h, q_idx, kv_idx):
        return s + table[h, q_idx - kv_idx + T - 1] * (b + 1)

    leaves = [bias, rel, slopes, table]
    dout = torch.randn(B, H, T, 3, generator=g, dtype=F64)
    for extra in ({}, {"dropout_p": 0.3}):
        kw = dict(bias=bias, rel_bias=rel, alibi_slopes=slopes, score_mod=smod, mask=mask,
                  sinks=[0.2, -0.1, 0.4, 0.0], **extra)  # fmt: skip

        got, want = (
            _grads_of(
                engine,
                q,
                k,
                v,
                {**kw, "generator": torch.Generator().manual_seed(7)} if extra else kw,
                leaves,
                dout,
            )
            for engine in ("tiled", "reference")
        )
        torch.testing.assert_close(got[0], want[0], atol=1e-12, rtol=0)
        for i, (a, b) in enumerate(zip(got[2], want[2])):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=0, msg=f"grad {i}")


def test_a_score_mod_that_blocks_whole_key_blocks_leaves_later_blocks_exact(monkeypatch):
    """A score_mod returning -inf over the first two key blocks of a row (a mask written as
    a score_mod): the row max stays -inf across fully readable tiles, and the next block
    starts the online softmax afresh (no -inf - -inf)."""
    monkeypatch.setattr(tiled, "BLOCKS", (3, 4))
    q, k, v = _inputs(1, 2, 2, 13, 13, 4, 3, seed=29)

    def smod(s, b, h, q_idx, kv_idx):
        return torch.where(kv_idx < 8, float("-inf"), s)

    out, lse, grads = _run("tiled", q, k, v, score_mod=smod)
    rout, rlse, rgrads = _run("reference", q, k, v, score_mod=smod)
    torch.testing.assert_close(out, rout, atol=1e-12, rtol=0)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rlse))
    for a, b in zip(grads, rgrads):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_softcap_beside_a_mask_per_head_keeps_a_nan_key_from_rows_that_cannot_read_it(
    monkeypatch,
):
    monkeypatch.setattr(tiled, "BLOCKS", (3, 4))
    q, k, v = _inputs(1, 2, 2, 13, 13, 4, 3, seed=30)
    mask = torch.ones(2, 13, 13, dtype=torch.bool).tril()
    mask[1, :, 4] = False  # head 1 reads key 4 nowhere, head 0 from row 4 on
    clean = _run("tiled", q, k, v, softcap=3.0, mask=mask)
    kn = k.clone()
    kn[:, :, 4] = float("nan")
    got = _run("tiled", q, kn, v, softcap=3.0, mask=mask)
    dq, clean_dq = got[2][0], clean[2][0]
    assert torch.isfinite(dq[:, 1]).all() and torch.isfinite(dq[:, 0, :4]).all()
    torch.testing.assert_close(dq[:, 1], clean_dq[:, 1], atol=1e-12, rtol=0)
    torch.testing.assert_close(dq[:, 0, :4], clean_dq[:, 0, :4], atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    "kw",
    [
        {"cu_seqlens": [0, 5, 13]},
        {"prefix_lengths": [5]},
        {"mask_mod": lambda b, h, q_idx, kv_idx: ((q_idx + kv_idx) % 3 != 1) | (q_idx == kv_idx)},
        {"chunk": 5},
    ],
    ids=["documents", "prefix", "mask_mod", "chunk"],
)
def test_tiles_of_patterns_that_change_along_a_diagonal_are_not_shared(monkeypatch, kw):
    """Documents, prefixes, chunks and a mask_mod are not the same along a diagonal: each
    small tile gets its own mask (forward and backward against the reference)."""
    monkeypatch.setattr(tiled, "BLOCKS", (3, 4))
    _assert_matches_reference(*_inputs(1, 2, 2, 13, 13, 4, 3, seed=41), **kw)
