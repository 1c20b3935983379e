"""Attention dropout on the engines: exactness at p = 0 and 1, unbiasedness and the
drop rate within bounds derived from the variance, reproducibility across threads and block
sizes, the tiled engine against the reference given the same pattern, gradcheck."""

from __future__ import annotations

import pytest
import torch

from causalattn.engines import attention, exact, make_problem, tiled

F64 = torch.float64


def _inputs(B, H, T, d, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, T, d, generator=g).to(dtype) for _ in range(3))


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _out_and_grads(engine, q, k, v, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, engine=engine, **kw)
    dout = torch.randn(out.shape, generator=_gen(9), dtype=F64).to(out.dtype)
    return out.detach(), torch.autograd.grad((out * dout).sum(), leaves)


@pytest.mark.parametrize("engine", ["reference", "tiled", "sdpa"])
def test_p0_is_bit_for_bit_no_dropout_and_p1_gives_zeros(engine):
    q, k, v = _inputs(2, 2, 9, 4, dtype=torch.float32)
    kw = {"window": 4}
    plain, pg = _out_and_grads(engine, q, k, v, **kw)
    zero, zg = _out_and_grads(engine, q, k, v, dropout_p=0.0, generator=_gen(), **kw)
    assert torch.equal(plain, zero) and all(torch.equal(a, b) for a, b in zip(pg, zg))
    one, og = _out_and_grads(engine, q, k, v, dropout_p=1.0, **kw)
    assert torch.equal(one, torch.zeros_like(one))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in og)


@pytest.mark.parametrize("engine", ["reference", "tiled"])
def test_unbiased_mean_within_a_bound_from_the_variance(engine):
    """E[out] = the no-dropout output: over n seeds the mean of each element lies within
    z·s/√n of it (s: the sample standard deviation), z = 5 with a Bonferroni margin."""
    q, k, v = _inputs(1, 2, 12, 4)
    truth = attention(q, k, v, engine=engine, window=6)
    n = 300
    outs = torch.stack(
        [
            attention(q, k, v, engine=engine, window=6, dropout_p=0.3, generator=_gen(s))
            for s in range(n)
        ]
    )
    mean, sd = outs.mean(0), outs.std(0)
    z = (mean - truth).abs() / (sd / n**0.5).clamp_min(1e-12)
    assert z.max() < 5.5, z.max()  # 96 elements: P(any |z| > 5.5) ~ 4e-6
    assert (sd[:, :, 1:] > 0).all()  # rows reading more than one key really vary


def test_drop_fraction_of_readable_weights_within_a_binomial_bound():
    q, k, v = _inputs(2, 3, 64, 4)
    for p_drop in (0.1, 0.5, 0.9):
        p = make_problem(q, k, v, window=20, lengths=[64, 40], dropout_p=p_drop, generator=_gen(4))
        keep = exact.dropout_mask(p)
        readable = p.allowed().expand_as(keep)
        n = int(readable.sum())
        dropped = int((readable & ~keep).sum()) / n
        assert abs(dropped - p_drop) < 5 * (p_drop * (1 - p_drop) / n) ** 0.5


def test_same_seed_same_bits_across_thread_counts():
    q, k, v = _inputs(1, 4, 520, 32, dtype=torch.float32)
    kw = {"window": 300, "dropout_p": 0.2}
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append(_out_and_grads("tiled", q, k, v, generator=_gen(7), **kw))
    finally:
        torch.set_num_threads(threads)
    (o0, g0) = runs[0]
    for o, g in runs[1:]:
        assert torch.equal(o, o0) and all(torch.equal(a, b) for a, b in zip(g, g0))
    torch.manual_seed(3)
    a = attention(q, k, v, engine="tiled", **kw)
    torch.manual_seed(3)
    assert torch.equal(a, attention(q, k, v, engine="tiled", **kw))  # manual_seed works too


@pytest.mark.parametrize("blocks", [None, (7, 13), (64, 32), (128, 600)])
def test_tiled_equals_reference_given_the_same_pattern_whatever_the_block_sizes(blocks):
    """The keep pattern is a function of global positions: every block split draws the very
    same one (a different pattern would move the output by O(0.1), far above 1e-10)."""
    q, k, v = _inputs(1, 2, 300, 8, seed=5)
    p = make_problem(q, k, v, window=100, dropout_p=0.4, generator=_gen(2))
    want = exact.attend(p, keep=exact.dropout_mask(p))
    old, tiled.BLOCKS = tiled.BLOCKS, blocks
    try:
        got = attention(q, k, v, engine="tiled", window=100, dropout_p=0.4, generator=_gen(2))
        out, lse = tiled.fwd(p)
        dout = torch.randn(out.shape, generator=_gen(1), dtype=F64)
        grads = tiled.bwd(p, out, lse, dout)
    finally:
        tiled.BLOCKS = old
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    pr = make_problem(*leaves, window=100, dropout_p=0.4, generator=_gen(2))
    rgrads = torch.autograd.grad((exact.forward(pr) * dout).sum(), leaves)
    for a, b in zip(grads, rgrads):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("engine", ["reference", "tiled", "sdpa"])
def test_gradcheck_float64_with_a_fixed_seed(engine):
    q, k, v = (t.requires_grad_() for t in _inputs(1, 2, 6, 3, seed=3))

    def f(a, b, c):
        if engine == "sdpa":  # SDPA draws from torch's global RNG
            torch.manual_seed(0)
        return attention(a, b, c, engine=engine, window=4, dropout_p=0.3, generator=_gen(1))

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_dropout_with_return_lse_is_honoured_and_lse_is_the_softmax_one():
    q, k, v = _inputs(1, 2, 10, 4)
    _, lse0 = attention(q, k, v, engine="tiled", return_lse=True)
    for engine in ("tiled", "reference"):
        _, lse = attention(q, k, v, engine=engine, return_lse=True, dropout_p=0.5)
        torch.testing.assert_close(lse, lse0)
    with pytest.raises(ValueError, match="return_lse"):
        attention(q, k, v, engine="sdpa", return_lse=True, dropout_p=0.5)


def test_the_cpu_hash_is_the_same_arithmetic_as_the_torch_one():
    """keep_mask's per-cell step runs in NumPy uint32 on the CPU; the int64 torch form (the
    one the GPU runs) gives the same bits, for large seeds and positions too."""
    from causalattn import dropout

    g = _gen(0)
    for _ in range(5):
        seed, off = (int(x) for x in torch.randint(0, 2**31 - 1, (2,), generator=g))
        i = torch.randint(0, 2**31 - 1, (37,), generator=g)
        j = torch.randint(0, 2**31 - 1, (53,), generator=g)
        b, h = torch.arange(3)[:, None], torch.arange(4)[None, :]
        head = dropout._fmix(
            (dropout._int(b, None) * dropout._GOLD + h + off * 0x27D4EB2F) & dropout.M32
        )
        head = dropout._fmix(head ^ seed)
        row = dropout._fmix(head[..., None] ^ ((i * dropout._GOLD + dropout._ROW) & dropout.M32))
        col = dropout._fmix((j * dropout._GOLD + dropout._COL) & dropout.M32)
        for p in (0.1, 0.5, 0.97):
            thr = dropout.threshold(p)
            assert torch.equal(
                dropout._cells_numpy(row, col, thr), dropout._cells_torch(row, col, thr)
            )
            assert torch.equal(
                dropout.keep_mask(seed, off, b, h, i, j, p), dropout._cells_torch(row, col, thr)
            )


def test_placed_key_halves_merge_to_the_whole_as_ring_ranks_do():
    """Each half of the keys, placed with Pattern.k_start, draws its part of the very same
    dropout pattern: merging the halves by their lse gives the whole problem's output."""
    from causalattn.masks import Pattern

    q, k, v = _inputs(1, 2, 200, 8, seed=4)
    full = make_problem(q, k, v, window=60, dropout_p=0.3, generator=_gen(6))
    want, want_lse = tiled.fwd(full)
    parts = []
    for k0, k1 in ((0, 120), (120, 200)):
        pat = Pattern(window=60, q_start=0, k_start=k0)
        p = make_problem(
            q, k[:, :, k0:k1], v[:, :, k0:k1], pattern=pat, dropout_p=0.3, generator=_gen(6)
        )
        parts.append(tiled.fwd(p))
        ref = exact.forward(p)
        torch.testing.assert_close(parts[-1][0], ref, atol=1e-12, rtol=1e-12)
    lse = torch.logaddexp(parts[0][1], parts[1][1])
    out = sum(
        torch.where(torch.isneginf(lh), 0.0, (lh - lse).exp())[..., None] * oh for oh, lh in parts
    )
    torch.testing.assert_close(lse, want_lse)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("call", [attention, make_problem], ids=["attention", "make_problem"])
@pytest.mark.parametrize("generator", ["seed", 7])
def test_a_generator_that_is_not_a_cpu_torch_generator_is_refused_naming_it(call, generator):
    q, k, v = _inputs(1, 1, 4, 2)
    with pytest.raises(ValueError, match=r"^attention: generator must be a CPU torch.Generator"):
        call(q, k, v, dropout_p=0.1, generator=generator)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_apply_zeroes_dropped_weights_scales_kept_ones_and_p1_gives_zeros(dtype):
    """dropout.apply, the one place the 1/(1-p) scale is written: kept A_ij/(1-p), dropped
    exactly 0, in A's dtype; p = 1 keeps nothing (all zeros, no division by 1 - p = 0)."""
    from causalattn import dropout

    A = torch.rand(2, 3, 5, 7, generator=_gen(3)).to(dtype)
    keep = torch.rand(2, 3, 5, 7, generator=_gen(4)) > 0.5
    for p in (0.0, 0.25, 0.5, 0.9):
        got = dropout.apply(A, keep, p)
        assert got.dtype == dtype and got.shape == A.shape
        assert torch.equal(got[~keep], torch.zeros_like(got[~keep]))
        assert torch.equal(got[keep], A[keep] * (1.0 / (1.0 - p)))
    for p in (1.0, 1):
        one = dropout.apply(A, torch.ones_like(keep), p)  # even cells marked kept
        assert one.dtype == dtype and torch.equal(one, torch.zeros_like(A))


def test_the_yardstick_with_p1_and_a_keep_pattern_is_all_zeros():
    """contract.plain (the accuracy rule's yardstick) drops through dropout.apply: at p = 1
    it gives zeros whatever the keep pattern says."""
    from causalattn.engines import contract

    q, k, v = _inputs(1, 2, 6, 3)
    p = make_problem(q, k, v, dropout_p=1.0, generator=_gen(1))
    keep = torch.ones(1, 2, 6, 6, dtype=torch.bool)
    assert torch.equal(contract.plain(p, F64, keep), torch.zeros(1, 2, 6, 3, dtype=F64))


M = 0xFFFFFFFF


def _fmix32(x: int) -> int:
    """MurmurHash3's 32-bit finalizer on a Python int (the published constants)."""
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & M
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & M
    return x ^ (x >> 16)


def _kept(seed, offset, b, h, i, j, p) -> bool:
    """The module docstring's three levels, in plain integers, with the constants the Triton
    kernels use: a key for (seed, offset, b, h), one per row, one mix per cell."""
    head = _fmix32((b * 0x9E3779B9 + h + offset * 0x27D4EB2F) & M)
    head = _fmix32(head ^ (seed & M))
    row = _fmix32(head ^ ((i * 0x9E3779B9 + 0x632BE5AB) & M))
    col = _fmix32((j * 0x9E3779B9 + 0x1B873593) & M)
    return (_fmix32(row ^ col) >> 8) >= round(p * 2**24)


def test_fmix32_is_murmurhash3s_finalizer():
    from causalattn import dropout

    assert _fmix32(0) == 0 and _fmix32(1) == 0x514E28B7  # MurmurHash3's own test value
    xs = [0, 1, 2, 0x7FFFFFFF, 0x80000000, M, 0xDEADBEEF, 12345678]
    got = dropout._fmix(torch.tensor(xs, dtype=torch.int64))
    assert got.tolist() == [_fmix32(x) for x in xs]


@pytest.mark.parametrize("device_path", ["numpy", "torch"])
def test_keep_mask_is_the_documented_hash_cell_by_cell(device_path, monkeypatch):
    """Every cell of keep_mask, on both per-cell paths (NumPy on the CPU, torch elsewhere), is
    the documented hash of (seed, offset, b, h, i, j) against round(p·2²⁴): the bits the
    Triton kernels draw, for small and 31-bit seeds, offsets and positions."""
    from causalattn import dropout

    if device_path == "torch":  # the GPU's path, run on CPU tensors
        monkeypatch.setattr(dropout, "_cells_numpy", dropout._cells_torch)
    g = _gen(2)
    for seed, off in ((0, 0), (1, 2), (2**31 - 2, 2**31 - 5), (7, 123456789)):
        b, h = torch.arange(2)[:, None], torch.tensor([0, 3])[None, :]
        i = torch.cat([torch.arange(3), torch.randint(0, 2**31 - 1, (2,), generator=g)])
        j = torch.cat([torch.arange(4), torch.randint(0, 2**31 - 1, (2,), generator=g)])
        for p in (0.0, 0.3, 0.5, 1 - 2**-24, 1.0):
            got = dropout.keep_mask(seed, off, b, h, i, j, p)
            assert got.shape == (2, 2, 5, 6) and got.dtype == torch.bool
            want = [
                [
                    [
                        [_kept(seed, off, bb, hh, ii, jj, p) for jj in j.tolist()]
                        for ii in i.tolist()
                    ]
                    for hh in (0, 3)
                ]
                for bb in (0, 1)
            ]
            assert got.tolist() == want, (seed, off, p)
    assert dropout.threshold(0.5) == 2**23 and dropout.threshold(1.0) == 2**24
    assert dropout.threshold(0.0) == 0 and dropout.threshold(0.3) == round(0.3 * 2**24)


@pytest.mark.parametrize("value", [0, 0.0, 0.5, 1, 1.0, 1e-9])
def test_check_p_takes_a_probability_as_a_float(value):
    from causalattn import dropout

    got = dropout.check_p(value)
    assert type(got) is float and got == float(value)


@pytest.mark.parametrize(
    "value,words",
    [
        (-0.1, "must lie in [0, 1], got -0.1"),
        (1.5, "must lie in [0, 1], got 1.5"),
        (float("nan"), "must lie in [0, 1], got nan"),
        (float("inf"), "must lie in [0, 1], got inf"),
        ("0.1", "must be a float in [0, 1], got '0.1'"),
        (True, "must be a float in [0, 1], got True"),
        (None, "must be a float in [0, 1], got None"),
        (torch.tensor(0.1), "must be a float in [0, 1], got tensor(0.1000)"),
    ],
)
def test_check_p_refuses_what_is_not_a_probability_naming_the_caller(value, words):
    from causalattn import dropout

    with pytest.raises(ValueError) as e:
        dropout.check_p(value)
    assert str(e.value) == f"attention: dropout_p {words}"
    with pytest.raises(ValueError, match=r"^layer: dropout_p "):
        dropout.check_p(value, "layer")


def test_seeds_are_two_31_bit_draws_from_the_generator_or_torchs_rng():
    from causalattn import dropout

    s = dropout.seed_tensor(_gen(3))
    assert s.dtype == torch.int64 and s.shape == (2,) and s.device.type == "cpu"
    assert torch.equal(s, torch.randint(0, 2**31 - 1, (2,), generator=_gen(3)))
    a = dropout.seed_from(_gen(3))
    assert a == tuple(s.tolist()) and all(type(x) is int for x in a)
    assert dropout.seed_from(_gen(4)) != a
    torch.manual_seed(8)
    b = dropout.seed_from()
    torch.manual_seed(8)
    assert dropout.seed_from() == b and dropout.seed_tensor().tolist() != list(b)
    draws = torch.stack([dropout.seed_tensor(_gen(n)) for n in range(200)])
    assert draws.min() >= 0 and draws.max() < 2**31 - 1 and draws.max() > 2**30


def test_keep_mask_stays_on_the_positions_device_and_reads_any_integer_dtype():
    """The result is on ``device`` (default: the row positions' device), via the torch
    path there (meta here: the GPU's path without a GPU); int32 positions give the bits of
    int64 ones (the hash runs in int64 whatever comes in)."""
    from causalattn import dropout

    meta = [torch.arange(n, device="meta") for n in (2, 3, 4)]
    m = dropout.keep_mask(1, 2, meta[0][:, None], 0, meta[1], meta[2], 0.5)
    assert (m.device.type, m.shape, m.dtype) == ("meta", (2, 1, 3, 4), torch.bool)
    m = dropout.keep_mask(1, 2, torch.arange(2)[:, None], 0, meta[1], meta[2], 0.5)  # b on the CPU
    assert (m.device.type, m.shape) == ("meta", (2, 1, 3, 4))
    m = dropout.keep_mask(1, 2, 0, 0, torch.arange(3), torch.arange(4), 0.5, device="meta")
    assert (m.device.type, m.shape) == ("meta", (3, 4))
    cpu = dropout.keep_mask(1, 2, 0, 0, torch.arange(3), torch.arange(4), 0.5)
    assert cpu.device.type == "cpu" and cpu.shape == (3, 4)
    b, h = torch.arange(3)[:, None] * 100_000, torch.tensor([5])
    i, j = torch.arange(5) * 10**8, torch.arange(4) * 10**8
    want = dropout.keep_mask(2**30, 7, b, h, i, j, 0.5)
    got = dropout.keep_mask(2**30, 7, *(t.to(torch.int32) for t in (b, h, i, j)), 0.5)
    assert torch.equal(got, want)
    assert torch.equal(
        dropout.keep_mask(2**30, 7, 200_000, 5, i.tolist(), j.tolist(), 0.5), want[2, 0]
    )


def test_a_cell_whose_hash_equals_the_threshold_is_kept():
    """Dropped when the 24-bit hash is *below* round(p·2²⁴): at p = 0 nothing is dropped,
    not even a cell whose hash is 0 (fmix32(0) = 0), on both per-cell paths."""
    from causalattn import dropout

    zero = torch.tensor([0])
    for cells in (dropout._cells_torch, dropout._cells_numpy):
        assert cells(zero, zero, 0).tolist() == [[True]]
        assert cells(zero, zero, 1).tolist() == [[False]]


def test_the_seed_is_drawn_on_the_cpu_whatever_the_default_device():
    from causalattn import dropout

    with torch.device("meta"):
        s = dropout.seed_tensor(_gen(3))
    assert s.device.type == "cpu" and s.tolist() == dropout.seed_tensor(_gen(3)).tolist()


def test_apply_makes_its_zeros_on_the_weights_device_whatever_the_default_device():
    """The dropped cells' zero is built on A's device (a zero on the default device would
    not mix with A: here the default is meta, A is on the CPU)."""
    from causalattn import dropout

    A = torch.tensor([[0.25, 0.5], [0.75, 1.0]], dtype=torch.float64)
    keep = torch.tensor([[True, False], [False, True]])
    with torch.device("meta"):
        out = dropout.apply(A, keep, 0.5)
    assert out.device.type == "cpu" and out.tolist() == [[0.5, 0.0], [0.0, 2.0]]


def test_cpu_positions_are_hashed_in_numpy_and_others_in_torch(monkeypatch):
    """The per-cell step runs in NumPy for CPU tensors (it releases the GIL: the tiled engine
    hashes tiles on many threads), in torch on any other device."""
    from causalattn import dropout

    want = dropout.keep_mask(3, 1, 0, 0, torch.arange(4), torch.arange(5), 0.5)

    def refuse(*args):
        raise AssertionError("wrong per-cell path")

    monkeypatch.setattr(dropout, "_cells_torch", refuse)
    assert torch.equal(dropout.keep_mask(3, 1, 0, 0, torch.arange(4), torch.arange(5), 0.5), want)
    monkeypatch.undo()
    monkeypatch.setattr(dropout, "_cells_numpy", refuse)
    meta = dropout.keep_mask(3, 1, 0, 0, torch.arange(4, device="meta"), torch.arange(5), 0.5)
    assert meta.device.type == "meta" and meta.shape == (4, 5)
