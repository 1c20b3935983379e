"""The tiled CPU engine against the float64 reference: values, gradients, guarantees, errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from causalattn.engines import KVCache, attention, make_problem, pick_engine, tiled

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


@pytest.mark.parametrize(
    "shape,kw",
    [
        ((1, 2, 1, 6, 6, 3, 2), {}),
        ((2, 2, 2, 3, 7, 4, 3), {}),
        ((2, 1, 1, 5, 5, 2, 2), {"lengths": [3, 5]}),
        ((1, 2, 2, 7, 7, 3, 3), {"cu_seqlens": [0, 2, 7]}),
    ],
)
def test_gradcheck_float64(shape, kw):
    q, k, v = (t.requires_grad_() for t in _inputs(*shape, seed=7))
    assert torch.autograd.gradcheck(lambda a, b, c: attention(a, b, c, engine="tiled", **kw), (q, k, v))


def _plain(q, k, v, allowed, scale):
    """Plain PyTorch math in the inputs' dtype: matmul, masked softmax, matmul."""
    S = (q @ k.transpose(-1, -2)) * scale
    A = torch.softmax(S.masked_fill(~allowed, float("-inf")), dim=-1)
    return A.nan_to_num(0.0) @ v


@pytest.mark.parametrize("dtype,floor", [(torch.float32, 1e-6), (torch.bfloat16, 1e-3), (torch.float16, 1e-4)])
def test_accuracy_rule_low_precision(dtype, floor):
    """max|out - ref64| <= 2·max|plain_t - ref64| + floor, for the output and dQ, dK, dV."""
    q64, k64, v64 = _inputs(2, 4, 2, 300, 300, 64, 64, seed=11)
    kw = {"lengths": [300, 211]}
    dout = torch.randn(2, 4, 300, 64, generator=torch.Generator().manual_seed(2), dtype=F64)
    ref, _, rgrads = _run("reference", q64, k64, v64, dout=dout, **kw)
    q, k, v = (t.to(dtype) for t in (q64, k64, v64))
    out, _, grads = _run("tiled", q, k, v, dout=dout.to(dtype), **kw)
    assert out.dtype == dtype

    p = make_problem(q, k, v, **kw)
    qp, kp, vp = (t.detach().clone().requires_grad_() for t in (q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)))
    plain = _plain(qp, kp, vp, p.allowed(), p.scale)
    pgrads = torch.autograd.grad((plain * dout.to(dtype)).sum(), (qp, kp, vp))
    pgrads = (pgrads[0], pgrads[1].unflatten(1, (2, 2)).sum(2), pgrads[2].unflatten(1, (2, 2)).sum(2))

    def err(a, b):
        return (a.double() - b).abs().max().item()

    assert err(out, ref) <= 2 * err(plain, ref) + floor
    for name, a, pl, r in zip("qkv", grads, pgrads, rgrads):
        assert err(a, r) <= 2 * err(pl, r) + floor, f"d{name}: {err(a, r)} vs plain {err(pl, r)}"


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


@pytest.mark.parametrize("t", [0, 150, 299])
def test_future_nan_and_inf_leave_the_past_bit_identical(t):
    q, k, v = _inputs(2, 3, 3, 300, 300, 16, 16, dtype=torch.float32, seed=17)
    out, (dq, _, _) = _grads_with(q, k, v, slice(0, t + 1))
    qn, kn, vn = q.clone(), k.clone(), v.clone()
    qn[:, :, t + 1 :] = float("nan")
    kn[:, :, t + 1 :] = float("inf")
    vn[:, :, t + 1 :: 2] = float("nan")
    vn[:, :, t + 2 :: 2] = float("-inf")
    out2, (dq2, _, _) = _grads_with(qn, kn, vn, slice(0, t + 1))
    assert torch.equal(out[:, :, : t + 1], out2[:, :, : t + 1])
    assert torch.equal(dq[:, :, : t + 1], dq2[:, :, : t + 1])


def test_padding_nan_leaves_everything_readable_bit_identical():
    q, k, v = _inputs(2, 3, 3, 300, 300, 16, 16, dtype=torch.float32, seed=19)
    rows = slice(None)
    out, grads = _grads_with(q, k, v, rows, lengths=[200, 300])
    qn, kn, vn = q.clone(), k.clone(), v.clone()
    for x in (qn, kn, vn):
        x[0, :, 200:] = float("nan")
    out2, grads2 = _grads_with(qn, kn, vn, rows, lengths=[200, 300])
    assert torch.equal(out, out2)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads2))
    assert not out[0, :, 200:].any() and not any(g[0, :, 200:].any() for g in grads2)

    kpm = torch.rand(2, 300, generator=torch.Generator().manual_seed(3)) > 0.3
    out, grads = _grads_with(q, k, v, rows, key_padding_mask=kpm)
    blocked = ~kpm[:, None, :, None]
    kn, vn = k.masked_fill(blocked, float("nan")), v.masked_fill(blocked, float("inf"))
    out2, grads2 = _grads_with(q, kn, vn, rows, key_padding_mask=kpm)
    assert torch.equal(out, out2) and torch.equal(grads[0], grads2[0])
    readable = kpm[:, None, :, None].expand_as(grads[1])
    assert torch.equal(grads[1][readable], grads2[1][readable])
    assert torch.equal(grads[2][readable], grads2[2][readable])

    cu = [0, 120, 300]  # packed: the other sequence's NaN never reaches this one
    q1, k1, v1 = (x[:1] for x in (q, k, v))
    out, grads = _grads_with(q1, k1, v1, rows, cu_seqlens=cu)
    qn, kn, vn = (x.clone() for x in (q1, k1, v1))
    for x in (qn, kn, vn):
        x[:, :, 120:] = float("nan")
    out2, grads2 = _grads_with(qn, kn, vn, rows, cu_seqlens=cu)
    assert torch.equal(out[:, :, :120], out2[:, :, :120])
    assert all(torch.equal(a[:, :, :120], b[:, :, :120]) for a, b in zip(grads, grads2))


def test_readable_nan_still_propagates():
    q, k, v = _inputs(1, 1, 1, 50, 50, 4, 4, dtype=torch.float32)
    v[0, 0, 10] = float("nan")
    out = attention(q, k, v, engine="tiled")
    rows = torch.isnan(out[0, 0]).any(-1)
    assert not rows[:10].any() and rows[10:].all()


def test_rows_with_no_readable_key_are_zero_with_zero_gradient():
    q, k, v = _inputs(3, 2, 2, 20, 20, 4, 4)
    kpm = torch.ones(3, 20, dtype=torch.bool)
    kpm[1] = False  # nothing readable in sequence 1
    kpm[2, :5] = False  # queries 0..4 of sequence 2 see no key (causal)
    out, lse, (dq, dk, dv) = _run("tiled", q, k, v, key_padding_mask=kpm, lengths=[0, 20, 20])
    assert torch.isfinite(out).all() and torch.isfinite(dq).all()
    for b, rows in ((0, slice(None)), (1, slice(None)), (2, slice(0, 5))):
        assert not out[b, :, rows].any() and torch.isneginf(lse[b, :, rows]).all()
        assert not dq[b, :, rows].any()
    assert not dk[:2].any() and not dv[:2].any() and not dk[2, :, :5].any()


def test_raw_bwd_uses_the_given_global_lse_and_out():
    """What ring attention does: two key halves differentiated against the merged softmax."""
    q, k, v = _inputs(1, 2, 2, 64, 128, 8, 8, seed=23)
    half = 64
    parts = [make_problem(q, k[:, :, s], v[:, :, s], causal=False) for s in (slice(0, half), slice(half, None))]
    (o1, l1), (o2, l2) = (tiled.fwd(p) for p in parts)
    L = torch.logaddexp(l1, l2)
    out = o1 * (l1 - L).exp()[..., None] + o2 * (l2 - L).exp()[..., None]
    full_p = make_problem(q, k, v, causal=False)
    ref_out, ref_L = tiled.fwd(full_p)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(L, ref_L)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=F64)
    (dq1, dk1, dv1), (dq2, dk2, dv2) = (tiled.bwd(p, out, L, dout) for p in parts)
    dq, dk, dv = tiled.bwd(full_p, ref_out, ref_L, dout)
    torch.testing.assert_close(dq1 + dq2, dq)
    torch.testing.assert_close(torch.cat([dk1, dk2], 2), dk)
    torch.testing.assert_close(torch.cat([dv1, dv2], 2), dv)


def test_auto_picks_tiled_on_cpu_and_lse_is_fp32():
    q, k, v = _inputs(1, 1, 1, 5, 5, 4, 4, dtype=torch.bfloat16)
    assert pick_engine(make_problem(q, k, v)) == "tiled"
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
        ({"key_padding_mask": torch.ones(2, 5, dtype=torch.bool)}, ["key_padding_mask", "(2, 6)", "(2, 5)"]),
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
    for cu, word in (([0, 4, 2, 6], "never decrease"), ([0, 3, 5], "end at T=6"), ([1, 6], "start at 0")):
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
    assert torch.equal(grads[1][:, :, 6:], dk2[:, :, 6:]) and torch.equal(grads[2][:, :, 6:], dv2[:, :, 6:])


def test_non_contiguous_inputs():
    """(B, T, H, d) tensors transposed to (B, H, T, d), as a model's projections give them."""
    g = torch.Generator().manual_seed(31)
    q, k, v = (torch.randn(2, 300, 4, 16, generator=g, dtype=F64).transpose(1, 2) for _ in range(3))
    _assert_matches_reference(q, k[:, :2], v[:, :2], lengths=[300, 123])
