"""Cases for tests/engines/test_triton.py: the Triton engine against the float64 reference.

Imported by test_triton.py only where the kernels can run in this process: on a GPU, or
on the CPU under TRITON_INTERPRET=1 (which must be set before triton is first imported,
hence the subprocess in test_triton.py). Shapes are tiny because the interpreter is slow.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from causalattn.engines import attention, contract, make_problem, pick_engine
from causalattn.engines import exact as ref_engine
from causalattn.engines import triton as tri
from causalattn.engines.triton_plan import Plan
from causalattn.masks import Pattern

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
DEV = "cuda" if ON_GPU else "cpu"

FLOOR = {torch.float32: 1e-5, torch.bfloat16: 1e-3, torch.float16: 1e-3}


def _plain(p, dtype):
    """The accuracy rule's yardstick (contract.plain) with its own leaves q, k, v."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (p.q, p.k, p.v))
    return q, k, v, contract.plain(replace(p, q=q, k=k, v=v), dtype, ref_engine.dropout_mask(p))


def _inputs(B, H, H_kv, T_q, T_k, d, d_v=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEV, dtype).requires_grad_()  # noqa: E731
    return mk(B, H, T_q, d), mk(B, H_kv, T_k, d), mk(B, H_kv, T_k, d_v or d)


def _check(q, k, v, dtype=torch.float32, grads=True, **kw):
    """Forward, lse and (optionally) dQ, dK, dV (and learned sinks' gradient) by the
    accuracy rule of docs/design.md, against the float64 reference engine. With dropout the two
    runs draw the same seed from ``kw["generator"]``'s state."""
    gen = kw.pop("generator", None)
    state = gen.get_state() if gen is not None else None
    out, lse = attention(q, k, v, engine="triton", return_lse=True, generator=gen, **kw)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    kw64 = dict(kw)
    sinks = kw.get("sinks")
    learned = isinstance(sinks, torch.Tensor) and sinks.requires_grad
    if learned:
        kw64["sinks"] = sinks.detach().double().requires_grad_()
    if gen is not None:
        gen.set_state(state)
    p64 = make_problem(q64, k64, v64, generator=gen, **kw64)
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
    if learned:
        want = kw64["sinks"].grad
        err = (sinks.grad.double() - want).abs().max().item()
        assert err <= 1e-4 * (1 + want.abs().max().item()), f"dsinks: max error {err:.3g}"
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
    key_padding = torch.rand(2, 17, generator=torch.Generator().manual_seed(3)) > 0.4
    key_padding[1, :] = False  # batch 1 reads nothing: zero rows everywhere
    key_padding[1, 16] = True  # ... except the last key, readable causally only by the last query
    _check(q, k, v, key_padding_mask=key_padding.to(DEV))
    _check(q, k, v, causal=False, key_padding_mask=key_padding.to(DEV), grads=False)


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
    from causalattn.engines import auto, registry

    q, k, v = _inputs(1, 1, 1, 4, 4, 16)
    with pytest.raises(
        ValueError,
        match=r"float64 is not one of its float16, bfloat16, float32; engines that run",
    ):
        attention(q.double(), k.double(), v.double(), engine="triton")
    p = make_problem(q, k, v)
    on_cpu = make_problem(q.cpu(), k.cpu(), v.cpu())
    assert not tri.prefers(registry.of_problem(on_cpu))
    # CPU: the native engine where it is built, else the measured table (tests/engines/test_auto.py)
    assert pick_engine(on_cpu) == auto.pick(registry.of_problem(on_cpu))
    if not ON_GPU:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(tri, "_interpreting", lambda: False)
            with pytest.raises(ValueError, match="CUDA"):
                tri.forward(p)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tri, "triton", None)
        registry._refusal.cache_clear()
        auto._ladder_for.cache_clear()
        with pytest.raises(ValueError, match="not installed"):
            tri.forward(p)
        f = registry.Features("cuda", "float16", 16, 16, 1, 1, 4, 4)
        assert not tri.prefers(f)
        # "auto" on CUDA without triton: SDPA (the reference for lse), never an error
        assert auto.pick(f) == "sdpa"
        assert auto.pick(registry.Features("cuda", "float16", 16, 16, 1, 1, 4, 4, lse=True)) == (
            "reference"
        )
    registry._refusal.cache_clear()
    auto._ladder_for.cache_clear()


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


# ---- patterns, modifiers and dropout --------------------------------------
def _gen(seed=5):
    return torch.Generator().manual_seed(seed)


def _per_head_mask(B, H, T_q, T_k, seed=7):
    """A dense mask with a different pattern per head, an empty 16×16 tile, a full one and
    a row that reads nothing."""
    m = torch.rand(B, H, T_q, T_k, generator=torch.Generator().manual_seed(seed)) > 0.4
    m[:, :, :16, 16:32] = False  # nothing readable: the tile is skipped
    m[:, 0, 16:32, :16] = True  # all readable: no mask load
    m[:, -1, 3] = False  # a row with no readable key
    return m


PATTERNS = {  # name -> (B, H_q, H_kv, T_q, T_k, pattern keywords)
    "window": (2, 2, 1, 40, 40, dict(window=9)),
    "window_decoding": (1, 2, 1, 9, 40, dict(window=20, lengths=torch.tensor([37]))),
    "window_not_causal": (1, 2, 2, 33, 33, dict(causal=False, window=7)),
    "chunk": (1, 2, 1, 40, 40, dict(chunk=12)),
    "documents_window_chunk": (
        1,
        2,
        1,
        40,
        40,
        dict(cu_seqlens=torch.tensor([0, 5, 5, 29, 40]), window=10, chunk=8),
    ),
    "prefix_lengths": (
        3,
        2,
        1,
        34,
        34,
        dict(prefix_lengths=torch.tensor([20, 0, 7]), lengths=torch.tensor([34, 19, 7])),
    ),
    "dense_mask": (2, 2, 1, 32, 32, dict(mask=_per_head_mask(2, 2, 32, 32))),  # no padding
    "mask_and_key_padding": (
        1,
        2,
        2,
        33,
        33,
        dict(
            mask=_per_head_mask(1, 1, 33, 33)[0, 0],
            key_padding_mask=(torch.arange(33) % 5 != 2)[None],
        ),
    ),
    "softcap": (1, 2, 1, 35, 35, dict(softcap=2.0, lengths=torch.tensor([30]))),
    "alibi": (
        2,
        2,
        1,
        35,
        35,
        dict(alibi_slopes=torch.tensor([[0.5, 0.125], [0.25, 1.0]]), window=20),
    ),
    "sinks": (
        2,
        2,
        1,
        35,
        35,
        dict(sinks=torch.tensor([0.5, -1.0], requires_grad=True), lengths=torch.tensor([35, 12])),
    ),
    "dropout": (2, 2, 1, 35, 35, dict(dropout_p=0.3, generator=_gen())),
    "everything": (
        1,
        2,
        1,
        37,
        37,
        dict(
            window=16,
            softcap=3.0,
            alibi_slopes=[0.3, 0.1],
            sinks=torch.tensor([0.0, 1.0], requires_grad=True),
            dropout_p=0.2,
            generator=_gen(6),
        ),
    ),
}


@pytest.mark.parametrize("name", list(PATTERNS))
def test_pattern_matches_the_reference(name):
    """Each rule of M, each modifier and dropout, forward, lse and gradients (and the sinks'
    gradient) against the float64 reference engine, over several 16×16 tiles."""
    B, H, H_kv, T_q, T_k, kw = PATTERNS[name]
    kw = {
        n: (
            x.detach().clone().requires_grad_()
            if isinstance(x, torch.Tensor) and x.requires_grad
            else x
        )
        for n, x in kw.items()
    }
    if "generator" in kw:
        kw["generator"] = _gen(kw["generator"].initial_seed())
    _check(*_inputs(B, H, H_kv, T_q, T_k, 16), **kw)


def test_dropout_pattern_is_the_reference_keep_mask_bit_for_bit():
    """One-hot values read the weights back: the kept cells are exactly keep_mask's, over
    several tiles and heads; p = 0 is the plain result and p = 1 gives zeros."""
    T = 40
    q = torch.zeros(2, 2, T, 16, device=DEV)  # uniform weights: every readable cell > 0
    v = torch.eye(T, device=DEV).expand(2, 1, T, T).contiguous()
    k = torch.zeros(2, 1, T, 16, device=DEV)
    out = attention(q, k, v, engine="triton", dropout_p=0.4, generator=_gen(3))
    p = make_problem(q, k, v, dropout_p=0.4, generator=_gen(3))
    keep = ref_engine.dropout_mask(p).to(DEV) & p.allowed()
    assert 0.45 < keep.float().sum() / p.allowed().expand_as(keep).float().sum() < 0.75
    assert torch.equal(out != 0, keep)
    plain = attention(q, k, v, engine="triton")
    assert torch.equal(attention(q, k, v, engine="triton", dropout_p=0.0), plain)
    assert torch.equal(
        attention(q, k, v, engine="triton", dropout_p=1.0, generator=_gen()),
        torch.zeros_like(plain),
    )


def test_window_keeps_old_nan_and_inf_out_of_later_rows_bit_for_bit():
    """Keys that slid out of the window (NaN, inf in q, k, v there) never reach later rows:
    H and dQ of those rows are bit-identical."""
    q, k, v = _inputs(1, 2, 1, 40, 40, 16)
    w, bad = 8, slice(3, 12)  # rows >= 12 + 8 - 1 cannot read keys 3..11

    def run(q, k, v):
        q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
        out = attention(q, k, v, engine="triton", window=w)
        (out * torch.linspace(-1, 1, 16, device=DEV)).sum().backward()
        return out.detach(), q.grad

    out, dq = run(q, k, v)
    qn, kn, vn = (x.detach().clone() for x in (q, k, v))
    kn[:, :, bad] = float("nan")
    vn[:, :, bad] = float("inf")
    out2, dq2 = run(qn, kn, vn)
    rows = slice(12 + w - 1, None)
    assert torch.equal(out[:, :, rows], out2[:, :, rows])
    assert torch.equal(dq[:, :, rows], dq2[:, :, rows])


def test_dense_mask_skipped_tiles_and_blocked_cells_never_leak():
    """NaN and inf at keys the dense mask blocks for every row (a whole skipped tile and
    scattered columns) change no output and no gradient of q, bit for bit."""
    q, k, v = _inputs(1, 2, 1, 35, 35, 16)
    m = _per_head_mask(1, 2, 35, 35)
    m[..., 16:32] = False
    m[..., 5] = False
    m[..., 33] = False

    def run(k, v):
        qq = q.detach().clone().requires_grad_()
        out = attention(qq, k, v, engine="triton", causal=False, mask=m.to(DEV))
        out.sum().backward()
        return out.detach(), qq.grad

    out, dq = run(k.detach(), v.detach())
    kn, vn = k.detach().clone(), v.detach().clone()
    for c in (slice(16, 32), 5, 33):
        kn[:, :, c] = float("nan")
        vn[:, :, c] = float("-inf")
    out2, dq2 = run(kn, vn)
    assert torch.equal(out, out2) and torch.equal(dq, dq2)
    assert (out[0, -1, 3] == 0).all()  # the row with no readable key: zero


def test_a_3d_mask_is_read_per_head_and_shared_by_the_batch_rows():
    """A (H, T_q, T_k) mask goes to the kernels with batch stride 0 and its own head stride
    (one pattern per head, not per batch row) and gives the (1, H, T_q, T_k) mask's outputs
    and gradients bit for bit."""
    q, k, v = _inputs(2, 2, 1, 32, 32, 16, seed=4)
    m = _per_head_mask(1, 2, 32, 32)[0]
    plan = Plan(make_problem(q, k, v, causal=False, mask=m.to(DEV)))
    assert plan.dense_mask_strides == (0, 32 * 32, 32)
    runs = []
    for mask in (m, m[None]):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = attention(*leaves, engine="triton", causal=False, mask=mask.to(DEV))
        out.sum().backward()
        runs.append((out.detach(), *(t.grad for t in leaves)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_row_ranges_are_the_pattern_exactly():
    """The kernels' per-row intervals (with the key padding and dense masks ANDed in) are
    the pattern's dense mask, for every keyword, also placed as a ring block pair."""

    cases = [
        dict(window=3),
        dict(chunk=4, causal=False),
        dict(prefix_lengths=[5, 0]),
        dict(cu_seqlens=[0, 4, 4, 11, 13], chunk=3, window=5),
        dict(lengths=[13, 6], window=4, prefix_lengths=[3, 6]),
        dict(window=4, q_start=20, k_start=13),
        dict(chunk=5, q_start=3, k_start=8),
    ]
    for kw in cases:
        B = 1 if "cu_seqlens" in kw else 2
        pat = Pattern(**kw)
        lo, hi = pat.row_ranges(13, 13)
        j = torch.arange(13)
        got = (j >= torch.as_tensor(lo)[..., None]) & (j < torch.as_tensor(hi)[..., None])
        want = torch.as_tensor(pat.allowed(B, 1, 13, 13))[:, 0]
        assert torch.equal(got.expand_as(want), want), kw
        assert (lo[:, 1:] >= lo[:, :-1]).all() and (hi[:, 1:] >= hi[:, :-1]).all(), kw


def test_raw_sinks_grad_is_the_autograd_one():
    """sinks_grad(p, out, lse, dout, dlse) (the raw pass ring attention and custom ops call)
    gives what autograd gives the learned sinks, with an lse gradient too."""
    q, k, v = _inputs(1, 2, 1, 20, 20, 16)
    s = torch.tensor([0.3, -0.5], device=DEV, requires_grad=True)
    out, lse = attention(q, k, v, engine="triton", sinks=s, window=6, return_lse=True)
    dH = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(DEV)
    dL = torch.randn(lse.shape, generator=torch.Generator().manual_seed(3)).to(DEV)
    ((out * dH).sum() + (lse * dL).sum()).backward()
    p = make_problem(*(t.detach() for t in (q, k, v)), sinks=s.detach(), window=6)
    got = tri.sinks_grad(p, out.detach(), lse.detach(), dH, dL)
    assert (got - s.grad).abs().max().item() <= 1e-5 * (1 + s.grad.abs().max().item())
    assert s.grad.abs().min() > 0  # a gradient that can fail


def test_placed_block_pair_raw_passes_match_the_reference():
    """A ring block pair (queries at 44..63, keys at 10..45: q_start, k_start) with a
    window, ALiBi and dropout: the raw fwd and bwd (with an lse gradient) against the
    reference's autograd, all in global positions."""
    from causalattn.engines import run

    pat = Pattern(window=12, alibi_slopes=[0.2, 0.05], q_start=44, k_start=10)
    q, k, v = (t.detach() for t in _inputs(1, 2, 1, 20, 36, 16))
    p = make_problem(q, k, v, pattern=pat, dropout_p=0.25, generator=_gen(8))
    out, lse = tri.fwd(p)
    dout = torch.randn(out.shape, generator=_gen(1)).to(DEV)
    dlse = torch.randn(lse.shape, generator=_gen(2)).to(DEV)
    got = tri.bwd(p, out, lse, dout, dlse)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    p64 = make_problem(q64, k64, v64, pattern=pat, dropout_p=0.25, generator=_gen(8))
    ref, ref_lse = run(p64, "reference", return_lse=True)
    assert (out.double() - ref).abs().max() < 1e-5
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert torch.isinf(lse).any() and torch.isfinite(lse).any()  # rows past the window
    ((ref * dout.double()).sum() + (ref_lse.nan_to_num(0, 0, 0).double() * dlse).sum()).backward()
    for g, r in zip(got, (q64, k64, v64)):
        assert (g.double() - r.grad).abs().max() < 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_with_window_modifiers_and_dropout(dtype):
    kw = dict(
        window=12,
        softcap=4.0,
        alibi_slopes=[0.1, 0.02],
        sinks=[0.5, -0.5],
        dropout_p=0.1,
        generator=_gen(9),
    )
    _check(*_inputs(1, 2, 1, 33, 33, 32, dtype=dtype), dtype=dtype, **kw)


def test_a_mask_mod_and_a_bias():
    """A rule given as a function (its partial tiles handed over as tile masks, kinds shared
    by the heads it does not read) and an additive bias, forward and gradients."""
    q, k, v = _inputs(2, 2, 2, 40, 40, 16)

    def no_far_keys(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < 9

    _check(q, k, v, mask_mod=no_far_keys)
    q, k, v = _inputs(2, 2, 2, 40, 40, 16, seed=1)  # fresh leaves: no gradient accumulated
    bias = torch.randn(1, 2, 40, 40, generator=torch.Generator().manual_seed(3)).to(DEV)
    _check(q, k, v, mask_mod=no_far_keys, bias=bias)
