"""The engine contract (causalattn.engines.contract), once, for every engine.

A new engine is one line in ROWS: its name and what it can be asked. Each guarantee below is
parametrized over ROWS. Shapes span several key blocks (tiled with forced small blocks,
triton's interpreter tiles are small). Triton runs where its kernels can: on a GPU, or in
Triton's interpreter on the CPU — TRITON_INTERPRET=1 must be set before triton is first
imported, so without a GPU this module reruns its triton rows in a subprocess.
Engine-specific tests (block plans, kernels' configs) stay in test_tiled.py / test_triton.py.
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch

from causalattn import engines
from causalattn.engines import attention, contract, make_problem
from causalattn.engines import exact as ref_engine


class Row:
    """What an engine can be asked: lse (return_lse), f64 (float64 inputs), kernels (raw
    fwd/bwd: BlockKernels), future (bit-for-bit NaN causality at future keys), guarded_grads
    (that promise also for the gradients), gpu (runs only on CUDA or the interpreter)."""

    def __init__(
        self, lse=True, f64=True, kernels=False, future=True, guarded_grads=True, gpu=False
    ):
        self.lse, self.f64, self.kernels, self.future, self.gpu = lse, f64, kernels, future, gpu
        self.guarded_grads = guarded_grads


ROWS = {
    "reference": Row(guarded_grads=False),  # autograd: inf·0 in its backward
    "sdpa": Row(lse=False, future=False, guarded_grads=False),  # a peer: see engines/sdpa.py
    "tiled": Row(kernels=True),
    "cpp": Row(kernels=True),
    "triton": Row(f64=False, kernels=True, gpu=True),
}

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
ON_GPU = torch.cuda.is_available() and not INTERPRETED


def _runnable(name: str) -> bool:
    if not ROWS[name].gpu:
        return not INTERPRETED  # the subprocess runs only the GPU engines
    if not (ON_GPU or INTERPRETED):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


NAMES = [n for n in ROWS if _runnable(n)]
DEV = "cuda" if ON_GPU else "cpu"


def _dev(name):
    return DEV if ROWS[name].gpu else "cpu"


@pytest.fixture(autouse=True)
def _small_tiled_blocks(monkeypatch):
    """tiled with 8-row, 16-column blocks: the guarantees are checked across key blocks."""
    from causalattn.engines import tiled

    monkeypatch.setattr(tiled, "BLOCKS", (8, 16))


def _inputs(name, B, H, H_kv, T_q, T_k, d, d_v=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(_dev(name), dtype)  # noqa: E731
    return mk(B, H, T_q, d), mk(B, H_kv, T_k, d), mk(B, H_kv, T_k, d_v or d)


def _grads(name, q, k, v, dout, **kw):
    """H and (dq, dk, dv) of sum(H·dout)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = attention(q, k, v, engine=name, **kw)
    return out.detach(), torch.autograd.grad((out * dout).sum(), (q, k, v))


# ---- the protocols ---------------------------------------------------------------------------
def test_every_engine_has_a_row_and_meets_the_protocols():

    assert set(ROWS) == set(engines.ENGINES), "add the new engine to ROWS (one line)"
    for name in NAMES:
        mod = engines.ENGINES[name].load()
        assert isinstance(mod, contract.Engine), name
        want = list(inspect.signature(contract.Engine.forward).parameters)[1:]
        assert list(inspect.signature(mod.forward).parameters) == want, name
        assert isinstance(mod, contract.BlockKernels) == ROWS[name].kernels, name
        if ROWS[name].kernels:
            for fn in ("fwd", "bwd", "sinks_grad"):
                want = list(inspect.signature(getattr(contract.BlockKernels, fn)).parameters)
                got = list(inspect.signature(getattr(mod, fn)).parameters)
                assert got == want[1:], (name, fn, got)


# ---- zero rows -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_rows_with_no_readable_key_are_zero_with_zero_gradient(name):
    dt = torch.float64 if ROWS[name].f64 else torch.float32
    q, k, v = _inputs(name, 3, 1, 1, 20, 20, 4, dtype=dt)
    kpm = torch.ones(3, 20, dtype=torch.bool)
    kpm[1] = False  # nothing readable in sequence 1
    kpm[2, :5] = False  # queries 0..4 of sequence 2 see no key (causal)
    kw = dict(key_padding_mask=kpm.to(q.device), lengths=[0, 20, 20])
    if ROWS[name].lse:
        out, lse = attention(q, k, v, engine=name, return_lse=True, **kw)
        assert lse.dtype == torch.float32 and lse.shape == out.shape[:3]
    dout = torch.linspace(-1, 1, 4, device=q.device, dtype=dt).expand(3, 1, 20, 4)
    out, (dq, dk, dv) = _grads(name, q, k, v, dout, **kw)
    assert torch.isfinite(out).all() and torch.isfinite(dq).all()
    for b, rows in ((0, slice(None)), (1, slice(None)), (2, slice(0, 5))):
        assert not out[b, :, rows].any() and not dq[b, :, rows].any()
        if ROWS[name].lse:
            assert torch.isneginf(lse[b, :, rows]).all()
    assert not dk[:2].any() and not dv[:2].any() and not dk[2, :, :5].any()


# ---- NaN causality, bit for bit --------------------------------------------------------------
@pytest.mark.parametrize("t", [0, 20, 36])
@pytest.mark.parametrize("name", NAMES)
def test_future_nan_and_inf_leave_the_past_bit_identical(name, t):
    """Future q, k, v (inside the diagonal block too) never reach earlier rows: H and dQ."""
    if not ROWS[name].future:
        pytest.skip(f"{name}: no bit-for-bit promise at future keys")
    q, k, v = _inputs(name, 1, 2, 1, 37, 37, 16, seed=17)
    dout = torch.zeros(1, 2, 37, 16, device=q.device)
    dout[:, :, : t + 1] = torch.linspace(-1, 1, 16, device=q.device)
    out, (dq, _, _) = _grads(name, q, k, v, dout)
    qn, kn, vn = q.clone(), k.clone(), v.clone()
    qn[:, :, t + 1 :] = float("nan")
    kn[:, :, t + 1 :] = float("inf")
    vn[:, :, t + 1 :: 2] = float("nan")
    vn[:, :, t + 2 :: 2] = float("-inf")
    out2, (dq2, _, _) = _grads(name, qn, kn, vn, dout)
    assert torch.equal(out[:, :, : t + 1], out2[:, :, : t + 1])
    if ROWS[name].guarded_grads:
        assert torch.equal(dq[:, :, : t + 1], dq2[:, :, : t + 1])


@pytest.mark.parametrize("name", NAMES)
def test_unreadable_nan_never_reaches_a_readable_row(name):
    """NaN and inf past a length, at masked keys and in the other packed document change
    neither H nor the gradients of anything readable; padding query rows are zero."""
    q, k, v = _inputs(name, 2, 1, 1, 24, 24, 16, seed=19)
    dev = q.device
    dout = torch.linspace(-1, 1, 16, device=dev).expand(2, 1, 24, 16)
    kpm = torch.rand(2, 24, generator=torch.Generator().manual_seed(3)) > 0.3
    kpm[:, 0] = True
    for kw, bad in (
        ({"lengths": torch.tensor([24, 13])}, (1, slice(13, None))),
        ({"key_padding_mask": kpm.to(dev)}, None),
    ):
        out, grads = _grads(name, q, k, v, dout, **kw)
        qn, kn, vn = q.clone(), k.clone(), v.clone()
        if bad is not None:
            for x in (qn, kn, vn):
                x[bad[0], :, bad[1]] = float("nan")
            readable = torch.ones(2, 1, 24, 1, dtype=torch.bool, device=dev)
            readable[bad[0], :, bad[1]] = False
        else:
            readable = kpm[:, None, :, None].to(dev)
            kn = kn.masked_fill(~readable, float("nan"))
            vn = vn.masked_fill(~readable, float("inf"))
        out2, grads2 = _grads(name, qn, kn, vn, dout, **kw)
        rows = readable if bad is not None else torch.ones_like(readable)
        assert torch.equal(out[rows.expand_as(out)], out2[rows.expand_as(out)]), kw
        if ROWS[name].guarded_grads:
            assert torch.equal(grads[0][rows.expand_as(q)], grads2[0][rows.expand_as(q)]), kw
            for g, g2 in zip(grads[1:], grads2[1:]):
                assert torch.equal(g[readable.expand_as(g)], g2[readable.expand_as(g)]), kw
        if bad is not None:
            assert not out2[bad[0], :, bad[1]].any()  # padding query rows: zero
    if not ROWS[name].future:  # the other document is partly in the future
        return
    q1, k1, v1 = (x[:1] for x in (q, k, v))  # packed: the other document's NaN stays there
    cu = torch.tensor([0, 9, 24], device=dev)
    out, grads = _grads(name, q1, k1, v1, dout[:1], cu_seqlens=cu)
    qn, kn, vn = (x.clone() for x in (q1, k1, v1))
    for x in (qn, kn, vn):
        x[:, :, 9:] = float("nan")
    out2, grads2 = _grads(name, qn, kn, vn, dout[:1], cu_seqlens=cu)
    assert torch.equal(out[:, :, :9], out2[:, :, :9])
    if ROWS[name].guarded_grads:
        assert all(torch.equal(a[:, :, :9], b[:, :, :9]) for a, b in zip(grads, grads2))


@pytest.mark.parametrize("name", NAMES)
def test_a_nan_a_row_reads_propagates_to_that_row(name):
    if not ROWS[name].future:
        pytest.skip(f"{name}: future keys' 0·NaN is the peer's own")
    q, k, v = _inputs(name, 1, 1, 1, 50, 50, 4)
    v[0, 0, 10] = float("nan")
    out = attention(q, k, v, engine=name)
    rows = torch.isnan(out[0, 0]).any(-1)
    assert not rows[:10].any() and rows[10:].all()


@pytest.mark.parametrize("name", NAMES)
def test_non_finite_values_reach_exactly_the_rows_that_read_them(name):
    """Row 0 reads only key 0: its NaN is row 0's alone to carry. A +inf value (all values
    positive) makes the rows that read it +inf: no 0·inf NaN from the keys they do not read."""
    if not ROWS[name].future:
        pytest.skip(f"{name}: future keys' 0·NaN is the peer's own")
    q, k, v = _inputs(name, 1, 1, 1, 12, 12, 4)
    v = v.abs()
    v0 = v.clone()
    v0[0, 0, 0] = float("nan")
    assert torch.isnan(attention(q, k, v0, engine=name)[0, 0]).all()
    v[0, 0, 5] = float("inf")
    v[0, 0, 9] = float("inf")
    out = attention(q, k, v, engine=name)[0, 0]
    assert torch.isfinite(out[:5]).all()
    assert torch.isposinf(out[5:]).all(), out[5:]


# ---- the accuracy rule -----------------------------------------------------------------------
FLOOR = {torch.float32: 1e-5, torch.bfloat16: 1e-3, torch.float16: 1e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", NAMES)
def test_accuracy_rule(name, dtype):
    """max|X - X64| <= 2·max|plain_X - X64| + floor for H, dQ, dK, dV (docs/design.md),
    grouped-query, bottom-right (T_q < T_k), a padded row, several key blocks."""
    q64, k64, v64 = _inputs(name, 1, 4, 2, 21, 33, 16, d_v=8, dtype=torch.float64, seed=11)
    q64, k64, v64 = (t.cpu() for t in (q64, k64, v64))
    kw = {"lengths": [25]}  # queries 13.. (at positions 25..) are padding
    dout = torch.randn(1, 4, 21, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ref, rgrads = _grads("reference", q64, k64, v64, dout, **kw)
    dev = _dev(name)
    q, k, v = (t.to(dev, dtype) for t in (q64, k64, v64))
    out, grads = _grads(name, q, k, v, dout.to(dev, dtype), **kw)
    assert out.dtype == dtype
    leaves = [t.to(dtype).requires_grad_() for t in (q64, k64, v64)]
    plain = contract.plain(make_problem(*leaves, **kw), dtype)
    pgrads = torch.autograd.grad((plain * dout.to(dtype)).sum(), leaves)

    def err(a, b):
        return (a.detach().cpu().double() - b).abs().max().item()

    floor = FLOOR[dtype]
    assert err(out, ref) <= 2 * err(plain, ref) + floor
    for n, a, pl, r in zip("qkv", grads, pgrads, rgrads):
        assert err(a, r) <= 2 * err(pl, r) + floor, f"d{n}: {err(a, r)} vs plain {err(pl, r)}"


@pytest.mark.parametrize("name", NAMES)
def test_gradcheck_float64(name):
    if not ROWS[name].f64:
        pytest.skip(f"{name}: no float64")
    for shape, kw in (
        ((1, 2, 1, 6, 6, 3, 2), {}),
        ((2, 1, 1, 5, 5, 2, 2), {"lengths": [3, 5]}),
        ((1, 2, 2, 7, 7, 3, 3), {"cu_seqlens": [0, 2, 7]}),
    ):
        q, k, v = (t.requires_grad_() for t in _inputs(name, *shape, dtype=torch.float64, seed=7))
        fn = lambda a, b, c, kw=kw: attention(a, b, c, engine=name, **kw)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (q, k, v)), kw


# ---- block kernels: the log-sum-exp contract -------------------------------------------------
@pytest.mark.parametrize("name", [n for n in NAMES if ROWS[n].kernels])
def test_block_results_merge_by_lse_and_bwd_takes_the_global_softmax(name):
    """Two key halves: fwd's (out, lse) merge into the whole problem's, and bwd given the
    merged out, lse (and dlse) returns each half's share of the gradients."""

    kern = engines.ENGINES[name].load()
    q, k, v = _inputs(name, 1, 2, 1, 24, 48, 8, d_v=4, seed=23)
    halves = [
        make_problem(q, k[:, :, s], v[:, :, s], causal=False)
        for s in (slice(0, 24), slice(24, None))
    ]
    (o1, l1), (o2, l2) = (kern.fwd(p) for p in halves)
    L = torch.logaddexp(l1, l2)
    out = o1 * (l1 - L).exp()[..., None] + o2 * (l2 - L).exp()[..., None]
    whole = make_problem(q, k, v, causal=False)
    want_out, want_L = ref_engine.forward(whole, return_lse=True)
    torch.testing.assert_close(out.float(), want_out.float(), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(L.float(), want_L, atol=1e-5, rtol=1e-5)
    g = torch.Generator().manual_seed(5)
    dout = torch.randn(out.shape, generator=g).to(out)
    dlse = torch.randn(L.shape, generator=g).to(out)
    (dq1, dk1, dv1), (dq2, dk2, dv2) = (kern.bwd(p, out, L, dout, dlse) for p in halves)
    leaves = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    o64, l64 = ref_engine.forward(make_problem(*leaves, causal=False), return_lse=True)
    want = torch.autograd.grad(
        (o64 * dout.cpu().double()).sum() + (l64 * dlse.cpu().double()).sum(), leaves
    )
    got = (dq1 + dq2, torch.cat([dk1, dk2], 2), torch.cat([dv1, dv2], 2))
    for n, a, w in zip("qkv", got, want):
        assert (a.cpu().double() - w).abs().max() < 1e-4, f"d{n}"


# ---- triton without a GPU: this module's triton rows in the interpreter ---------------------
if not INTERPRETED and not torch.cuda.is_available():

    def test_triton_meets_the_contract_in_the_interpreter():
        pytest.importorskip("triton")
        from _helpers import run_in_triton_interpreter

        print(run_in_triton_interpreter(__file__))
