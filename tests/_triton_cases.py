"""Cases for tests/test_triton.py: the Triton engine against the float64 reference.

Imported by test_triton.py only where the kernels can run in this process: on a GPU, or
on the CPU under TRITON_INTERPRET=1 (which must be set before triton is first imported,
hence the subprocess in test_triton.py). Shapes are tiny because the interpreter is slow.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from causalattn.engines import attention, make_problem, pick_engine
from causalattn.engines import reference as ref_engine
from causalattn.engines import triton as tri
from causalattn.masks import Pattern

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
DEV = "cuda" if ON_GPU else "cpu"

FLOOR = {torch.float32: 1e-5, torch.bfloat16: 1e-3, torch.float16: 1e-3}


def _plain(p, dtype):
    """Plain PyTorch math in ``dtype`` (matmul, softmax, matmul): the accuracy rule's yardstick."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (p.q, p.k, p.v))
    kk, vv = k.repeat_interleave(p.group, 1), v.repeat_interleave(p.group, 1)
    allowed = p.allowed()
    has = allowed.any(-1, keepdim=True)
    Z = ((q @ kk.transpose(-1, -2)) * p.scale).masked_fill(~allowed, float("-inf"))
    Z = torch.where(has, Z, torch.zeros_like(Z))  # empty rows: finite, zeroed below
    A = torch.where(has, torch.softmax(Z.float(), -1).to(dtype), torch.zeros_like(Z))
    return q, k, v, A @ vv


def _inputs(B, H, H_kv, T_q, T_k, d, d_v=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEV, dtype).requires_grad_()  # noqa: E731
    return mk(B, H, T_q, d), mk(B, H_kv, T_k, d), mk(B, H_kv, T_k, d_v or d)


def _check(q, k, v, dtype=torch.float32, grads=True, **kw):
    """Forward, lse and (optionally) dQ, dK, dV by the accuracy rule of DESIGN.md."""
    out, lse = attention(q, k, v, engine="triton", return_lse=True, **kw)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    p64 = make_problem(q64, k64, v64, **kw)
    ref, ref_lse = ref_engine.forward(p64, return_lse=True)
    pq, pk, pv, plain = _plain(p64, dtype)
    floor = FLOOR[dtype]

    def rule(name, got, want, base):
        err = (got.double() - want).abs().max().item() if got.numel() else 0.0
        bound = 2 * (base.double() - want).abs().max().item() + floor if got.numel() else 0.0
        assert err <= bound, f"{name}: max error {err:.3g} > bound {bound:.3g}"

    assert out.dtype == dtype and out.shape == ref.shape
    rule("H", out, ref, plain)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse.to(lse.device)))
    fin = torch.isfinite(ref_lse)
    assert (lse[fin] - ref_lse[fin]).abs().max().item() <= 1e-3 if fin.any() else True
    if not grads:
        return out
    g = torch.Generator().manual_seed(1)
    dH = torch.randn(out.shape, generator=g, dtype=torch.float64).to(DEV)
    (out * dH.to(dtype)).sum().backward()
    (ref * dH).sum().backward()
    (plain * dH.to(dtype)).sum().backward()
    for name, a, r, b in (("dQ", q, q64, pq), ("dK", k, k64, pk), ("dV", v, v64, pv)):
        assert torch.isfinite(a.grad).all(), f"{name} is not finite"
        rule(name, a.grad, r.grad, b.grad)
    return out


@pytest.mark.parametrize("d", [16, 40, 64, 100, 128, 1000])
def test_forward_every_head_size(d):
    T = 5 if d == 1000 else 19  # odd T: partial tiles
    _check(*_inputs(1, 2, 2, T, T, d), grads=False)


@pytest.mark.parametrize("d", [16, 40, 100, 1000])
def test_gradients_every_head_size(d):
    T = 5 if d == 1000 else 19
    _check(*_inputs(1, 2, 1, T, T, d))  # with grouped-query heads (2 query heads, 1 kv head)


def test_padding_lengths():
    q, k, v = _inputs(3, 2, 2, 21, 21, 32)
    _check(q, k, v, lengths=torch.tensor([21, 9, 0]))


def test_packed_sequences():
    q, k, v = _inputs(1, 2, 1, 23, 23, 32)
    _check(q, k, v, cu_seqlens=torch.tensor([0, 7, 7, 18, 23]))


def test_grouped_query_and_bottom_right_alignment():
    q, k, v = _inputs(2, 4, 2, 7, 20, 24, d_v=40)  # T_q < T_k, d_k != d_v
    _check(q, k, v, lengths=torch.tensor([20, 12]))


def test_bottom_right_alignment_without_masks():
    _check(*_inputs(1, 2, 1, 5, 21, 16))  # the kernels' own causal intervals, T_q < T_k


def test_key_padding_mask_and_not_causal():
    q, k, v = _inputs(2, 2, 2, 17, 17, 32)
    kpm = torch.rand(2, 17, generator=torch.Generator().manual_seed(3)) > 0.4
    kpm[1, :] = False  # batch 1 reads nothing: zero rows everywhere
    kpm[1, 16] = True  # ... except the last key, readable causally only by the last query
    _check(q, k, v, key_padding_mask=kpm.to(DEV))
    _check(q, k, v, causal=False, key_padding_mask=kpm.to(DEV), grads=False)


def test_wide_head_path_on_a_small_head(monkeypatch):
    """d-chunked scores and column-split outputs, forced at d=40 (3 chunks, a ragged one)."""
    small = dict(BLOCK_DK=16, BLOCK_DV=16, BLOCK_C=16)
    monkeypatch.setattr(tri, "CONFIG_OVERRIDE", {"fwd": small, "dkdv": small, "dq": small})
    q, k, v = _inputs(1, 2, 1, 13, 13, 40)
    _check(q, k, v, lengths=torch.tensor([11]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    _check(*_inputs(1, 2, 2, 19, 19, 64, dtype=dtype), dtype=dtype)


def test_gradient_through_lse():
    q, k, v = _inputs(1, 1, 1, 13, 13, 16)
    out, lse = attention(q, k, v, engine="triton", return_lse=True, lengths=torch.tensor([10]))
    w = torch.linspace(-1, 1, 13, device=DEV)
    (out.sum() + torch.where(torch.isfinite(lse), lse * w, 0).sum()).backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o64, l64 = ref_engine.forward(make_problem(q64, k64, v64, lengths=torch.tensor([10])), True)
    (o64.sum() + torch.where(torch.isfinite(l64), l64 * w.double(), 0).sum()).backward()
    for a, r in ((q, q64), (k, k64), (v, v64)):
        assert (a.grad.double() - r.grad).abs().max() < 1e-4


def test_unreadable_positions_never_leak():
    """NaN and inf at keys no query may read (past a length, masked out) change nothing."""
    q, k, v = _inputs(2, 2, 2, 18, 18, 16)
    kpm = torch.ones(2, 18, dtype=torch.bool)
    kpm[0, 3] = kpm[0, 11] = False
    lengths = torch.tensor([18, 9])
    clean = attention(q, k, v, engine="triton", lengths=lengths, key_padding_mask=kpm.to(DEV))
    k2, v2 = k.detach().clone(), v.detach().clone().requires_grad_()
    k2[0, :, [3, 11]] = float("nan")
    v2.data[0, :, [3, 11]] = float("inf")
    k2[1, :, 9:] = float("inf")
    v2.data[1, :, 9:] = float("nan")
    dirty = attention(q, k2, v2, engine="triton", lengths=lengths, key_padding_mask=kpm.to(DEV))
    assert torch.equal(clean, dirty)
    assert (dirty[1, :, 9:] == 0).all()  # padding queries: zero rows
    dirty.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(v2.grad).all()


@pytest.mark.parametrize("t", [0, 20, 36])
def test_future_nan_and_inf_leave_the_past_bit_identical(t):
    """Future q, k, v (inside the diagonal tile too) never reach earlier rows: H and dQ."""
    q, k, v = _inputs(1, 2, 1, 37, 37, 16)
    dH = torch.zeros(1, 2, 37, 16, device=DEV)
    dH[:, :, : t + 1] = torch.linspace(-1, 1, 16, device=DEV)

    def run(q, k, v):
        q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
        out = attention(q, k, v, engine="triton")
        (out * dH).sum().backward()
        return out.detach(), q.grad

    out, dq = run(q, k, v)
    qn, kn, vn = (x.detach().clone() for x in (q, k, v))
    qn[:, :, t + 1 :] = float("nan")
    kn[:, :, t + 1 :] = float("inf")
    vn[:, :, t + 1 :: 2] = float("nan")
    vn[:, :, t + 2 :: 2] = float("-inf")
    out2, dq2 = run(qn, kn, vn)
    assert torch.equal(out[:, :, : t + 1], out2[:, :, : t + 1])
    assert torch.equal(dq[:, :, : t + 1], dq2[:, :, : t + 1])


def test_packed_neighbours_never_leak_and_read_nan_propagates():
    q, k, v = _inputs(1, 1, 1, 30, 30, 16)
    cu = torch.tensor([0, 13, 30])  # the boundary cuts a tile
    out = attention(q, k, v, engine="triton", cu_seqlens=cu)
    dH = torch.linspace(-1, 1, 16, device=DEV).expand(1, 1, 30, 16)
    g = torch.autograd.grad((out * dH).sum(), (q, k, v))
    qn, kn, vn = (x.detach().clone().requires_grad_() for x in (q, k, v))
    for x in (qn, kn, vn):
        x.data[:, :, 13:] = float("nan")
    out2 = attention(qn, kn, vn, engine="triton", cu_seqlens=cu)
    g2 = torch.autograd.grad((out2 * dH).sum(), (qn, kn, vn))
    assert torch.equal(out[:, :, :13], out2[:, :, :13])
    assert all(torch.equal(a[:, :, :13], b[:, :, :13]) for a, b in zip(g, g2))
    assert torch.isnan(out2[:, :, 13:]).all()  # the second sequence reads its NaN
    v1 = v.detach().clone()
    v1[0, 0, 5, 3] = float("inf")  # read by queries 5..12 only
    out3 = attention(q.detach(), k.detach(), v1, engine="triton", cu_seqlens=cu)
    assert torch.isinf(out3[0, 0, 5:13, 3]).all() and torch.isfinite(out3[0, 0, :5]).all()
    assert torch.isfinite(out3[0, 0, 13:]).all()


def test_errors_and_choice():
    q, k, v = _inputs(1, 1, 1, 4, 4, 16)
    with pytest.raises(ValueError, match="fp16, bf16 or fp32"):
        attention(q.double(), k.double(), v.double(), engine="triton")
    p = make_problem(q, k, v)
    assert not tri.prefers(make_problem(q.cpu(), k.cpu(), v.cpu()))
    assert pick_engine(make_problem(q.cpu(), k.cpu(), v.cpu())) == "tiled"
    if not ON_GPU:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(tri, "_interpreting", lambda: False)
            with pytest.raises(ValueError, match="CUDA"):
                tri.forward(p)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tri, "triton", None)
        with pytest.raises(ValueError, match="not installed"):
            tri.forward(p)
        assert not tri.prefers(p)
        on_cuda = SimpleNamespace(q=SimpleNamespace(device=SimpleNamespace(type="cuda")),
                                  pattern=Pattern(), dropout_p=0.0)
        assert pick_engine(on_cuda) == "sdpa"  # "auto" without triton: SDPA, never an error
        assert pick_engine(on_cuda, return_lse=True) == "reference"


def test_raw_passes_match_the_tiled_engine_with_a_given_global_lse():
    """fwd/bwd (what ring attention calls per block pair) agree with tiled.fwd/bwd, also when
    the lse and out handed to bwd come from a larger (global) problem, as in the ring."""
    from causalattn.engines import tiled

    q, k, v = _inputs(1, 4, 2, 12, 12, 24, d_v=20)
    k2, v2 = (t.detach() + 0.5 for t in (k, v))
    glob = make_problem(q.detach(), torch.cat([k2, k.detach()], 2), torch.cat([v2, v.detach()], 2))
    out_g, lse_g = tiled.fwd(make_problem(*(t.cpu() for t in (glob.q, glob.k, glob.v))))
    dout = torch.randn_like(out_g)
    for kw in ({"causal": True}, {"causal": True, "lengths": torch.tensor([7])}):
        p = make_problem(q.detach(), k.detach(), v.detach(), **kw)
        pc = make_problem(*(t.detach().cpu() for t in (q, k, v)), **kw)
        o, lse = tri.fwd(p)
        o_ref, lse_ref = tiled.fwd(pc)
        assert (o.cpu() - o_ref).abs().max() < 1e-4
        assert torch.allclose(lse.cpu(), lse_ref, atol=1e-4)  # -inf rows compare equal
        got = tri.bwd(p, out_g.to(DEV), lse_g.to(DEV), dout.to(DEV))
        want = tiled.bwd(pc, out_g, lse_g, dout)
        for g, w in zip(got, want):
            assert g.shape == w.shape and (g.cpu().float() - w.float()).abs().max() < 1e-4
