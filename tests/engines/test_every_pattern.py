"""Every pattern of M and every score modifier on the engines, against a row-by-row statement
of the definition and against each other; the bad inputs of the patterns and of dropout."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from causalattn import dropout
from causalattn.engines import attention, contract, exact, make_problem

F64 = torch.float64


def _inputs(B, Hq, Hkv, Tq, Tk, d, dv, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Tq, d, generator=g).to(dtype)
    k = torch.randn(B, Hkv, Tk, d, generator=g).to(dtype)
    v = torch.randn(B, Hkv, Tk, dv, generator=g).to(dtype)
    return q, k, v


def by_rows(q, k, v, kw, keep=None, p=0.0):
    """The definition one query row at a time, float64: scores, softcap, ALiBi, M, softmax
    with the sink in the denominator, dropout (``keep`` (B, H, T_q, T_k)) and the sum."""
    B, H, Tq, _ = q.shape
    Tk = k.shape[2]
    g = H // k.shape[1]
    pk = {n: x for n, x in kw.items() if n not in ("scale",)}
    allowed = make_problem(q, k, v, **pk).allowed().expand(B, H, Tq, Tk)
    scale = kw.get("scale") or 1 / math.sqrt(q.shape[-1])
    out = torch.zeros(B, H, Tq, v.shape[-1], dtype=F64)
    for b in range(B):
        for h in range(H):
            for i in range(Tq):
                cols = allowed[b, h, i].nonzero().flatten()
                if cols.numel() == 0:
                    continue
                s = (k[b, h // g, cols].double() @ q[b, h, i].double()) * scale
                if kw.get("softcap") is not None:
                    c = kw["softcap"]
                    s = c * torch.tanh(s / c)
                if kw.get("alibi_slopes") is not None:
                    sl = torch.as_tensor(kw["alibi_slopes"], dtype=F64)
                    sl = sl[h] if sl.dim() == 1 else sl[b, h]
                    s = s - sl * (i + Tk - Tq - cols).abs().double()
                terms = s
                if kw.get("sinks") is not None:
                    terms = torch.cat([s, torch.as_tensor(kw["sinks"], dtype=F64)[h : h + 1]])
                a = torch.exp(s - terms.max()) / torch.exp(terms - terms.max()).sum()
                if p > 0:
                    a = torch.where(keep[b, h, i, cols], a / (1 - p), 0.0) if p < 1 else a * 0
                out[b, h, i] = a @ v[b, h // g, cols].double()
    return out


@st.composite
def cases(draw, modifiers=True, max_T=24):
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    Hq = Hkv * draw(st.sampled_from([1, 2]))
    Tk = draw(st.integers(1, max_T))
    Tq = draw(st.one_of(st.just(Tk), st.integers(1, Tk)))
    kw = {"causal": draw(st.booleans())}
    if draw(st.booleans()):
        kw["window"] = draw(st.integers(1, 8))
    if draw(st.booleans()):
        kw["chunk"] = draw(st.integers(1, 7))
    if B == 1 and Tq == Tk and draw(st.booleans()):
        kw["cu_seqlens"] = [0, *sorted(draw(st.lists(st.integers(0, Tk), max_size=3))), Tk]
    else:
        if draw(st.booleans()):
            kw["lengths"] = draw(st.lists(st.integers(0, Tk), min_size=B, max_size=B))
        if draw(st.booleans()):
            kw["key_padding_mask"] = torch.tensor(
                draw(st.lists(st.booleans(), min_size=B * Tk, max_size=B * Tk))
            ).view(B, Tk)
        if draw(st.booleans()):
            top = kw.get("lengths", [Tk] * B)
            kw["prefix_lengths"] = [draw(st.integers(0, t)) for t in top]
        if draw(st.booleans()):
            bb, hh = draw(st.sampled_from([1, B])), draw(st.sampled_from([1, Hq]))
            g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
            kw["mask"] = torch.rand(bb, hh, Tq, Tk, generator=g) < draw(
                st.sampled_from([0.1, 0.5, 0.9])
            )
    if modifiers:
        if draw(st.booleans()):
            kw["softcap"] = draw(st.sampled_from([0.5, 2.0, 30.0]))
        if draw(st.booleans()):
            shape = draw(st.sampled_from([(Hq,), (B, Hq)]))
            kw["alibi_slopes"] = torch.rand(
                shape, generator=torch.Generator().manual_seed(3), dtype=F64
            )
        if draw(st.booleans()):
            kw["sinks"] = torch.randn(Hq, generator=torch.Generator().manual_seed(4), dtype=F64)
    d = draw(st.integers(1, 9))
    dv = draw(st.one_of(st.just(d), st.integers(1, 6)))
    seed = draw(st.integers(0, 2**16))
    return _inputs(B, Hq, Hkv, Tq, Tk, d, dv, seed=seed), kw


@settings(max_examples=40, deadline=None)
@given(cases(), st.sampled_from([0.0, 0.3]))
def test_reference_is_the_definition_row_by_row(case, p):
    (q, k, v), kw = case
    gen = torch.Generator().manual_seed(5)
    out, lse = attention(
        q, k, v, engine="reference", return_lse=True, dropout_p=p, generator=gen, **kw
    )
    prob = make_problem(q, k, v, dropout_p=p, generator=torch.Generator().manual_seed(5), **kw)
    keep = exact.dropout_mask(prob)
    want = by_rows(q, k, v, kw, keep, p)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-10)
    empty = ~prob.allowed().expand(lse.shape + (k.shape[2],)).any(-1)
    assert torch.equal(torch.isneginf(lse), empty)  # -inf exactly on rows that read nothing
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))


@settings(max_examples=30, deadline=None)
@given(cases())
def test_sdpa_matches_reference_where_it_can_express_the_pattern(case):
    (q, k, v), kw = case
    if kw.get("sinks") is not None or kw.get("softcap") is not None:
        with pytest.raises(ValueError, match="sinks|softcap"):
            attention(q, k, v, engine="sdpa", **kw)
        return
    ref = attention(q, k, v, engine="reference", **kw)
    got = attention(q, k, v, engine="sdpa", **kw)
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-10)


def test_sinks_gradient_reaches_a_learned_parameter():
    q, k, v = _inputs(1, 2, 2, 5, 5, 4, 4)
    sinks = torch.nn.Parameter(torch.tensor([0.5, -1.0], dtype=F64))
    out = attention(q, k, v, sinks=sinks, window=2, engine="reference")
    (g,) = torch.autograd.grad(out.sum(), (sinks,))
    assert g.shape == (2,) and (g != 0).all()
    assert torch.autograd.gradcheck(
        lambda s: attention(q, k, v, sinks=s, window=2, engine="reference"),
        (sinks.detach().clone().requires_grad_(),),
    )


def test_reference_dropout_explicit_pattern_and_inspection():
    q, k, v = _inputs(2, 2, 1, 6, 6, 4, 4, seed=2)
    p = make_problem(q, k, v, window=3, dropout_p=0.4, generator=torch.Generator().manual_seed(1))
    keep = exact.dropout_mask(p)
    assert keep.shape == (2, 2, 6, 6) and keep.dtype == torch.bool
    again = dropout.keep_mask(*p.dropout_seed, 1, 0, torch.arange(6), torch.arange(6), 0.4)
    assert torch.equal(keep[1, 0], again)  # the pattern is the hash of global positions
    assert torch.equal(exact.attend(p, keep=keep), exact.forward(p))
    other = ~keep
    assert not torch.equal(exact.attend(p, keep=other), exact.forward(p))
    torch.testing.assert_close(
        exact.attend(p, keep=other), by_rows(q, k, v, {"window": 3}, other, 0.4)
    )


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"window": 0}, ["window", ">= 1"]),
        ({"chunk": -2}, ["chunk"]),
        ({"window": 2.5}, ["window"]),
        ({"prefix_lengths": [7, 1]}, ["prefix_lengths", "T_k=6"]),
        ({"prefix_lengths": [3, 4], "lengths": [6, 2]}, ["prefix_lengths", "length"]),
        ({"prefix_lengths": [1]}, ["prefix_lengths", "(2,)", "(1,)"]),
        ({"alibi_slopes": torch.ones(3)}, ["alibi_slopes", "(4,)", "(3,)"]),
        ({"alibi_slopes": [float("nan")] * 4}, ["alibi_slopes", "finite"]),
        ({"softcap": 0.0}, ["softcap"]),
        ({"softcap": float("inf")}, ["softcap"]),
        ({"sinks": torch.zeros(2)}, ["sinks", "(4,)", "(2,)"]),
        ({"mask": torch.ones(2, 1, 6, 5, dtype=torch.bool)}, ["mask", "(2, 1, 6, 5)"]),
        ({"mask": torch.ones(2, 1, 6, 6)}, ["mask", "bool"]),
        ({"mask": torch.ones(1, 6, 6, dtype=torch.bool), "cu_seqlens": [0, 6]}, ["cu_seqlens"]),
        ({"dropout_p": 1.5}, ["dropout_p", "[0, 1]"]),
        ({"dropout_p": -0.1}, ["dropout_p"]),
        ({"dropout_p": "0.1"}, ["dropout_p"]),
        ({"dropout_p": float("nan")}, ["dropout_p"]),
        ({"dropout_p": 0.1, "generator": 3}, ["generator"]),
        ({"scale": "x"}, ["scale"]),
    ],
)
@pytest.mark.parametrize("engine", ["reference", "sdpa", "tiled"])
def test_bad_input_is_refused_by_name(kw, words, engine):
    q, k, v = _inputs(2, 4, 2, 6, 6, 8, 8)
    with pytest.raises(ValueError) as e:
        attention(q, k, v, engine=engine, **kw)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_sdpa_refuses_what_it_cannot_express():
    q, k, v = _inputs(1, 2, 2, 4, 4, 8, 8)
    for kw, word in (({"sinks": torch.zeros(2)}, "sinks"), ({"softcap": 5.0}, "softcap")):
        with pytest.raises(ValueError, match=f"engine 'sdpa': {word}"):
            attention(q, k, v, engine="sdpa", **kw)
    with pytest.raises(ValueError, match="return_lse"):
        attention(q, k, v, engine="sdpa", return_lse=True)


def test_sdpa_dropout_is_its_own_but_unbiased_in_shape():
    q, k, v = _inputs(1, 2, 2, 8, 8, 4, 4, dtype=torch.float32)
    torch.manual_seed(0)
    a = attention(q, k, v, engine="sdpa", dropout_p=0.5, window=4)
    assert a.shape == q.shape and torch.isfinite(a).all()
    assert not torch.equal(a, attention(q, k, v, engine="sdpa", window=4))
    assert torch.equal(
        attention(q, k, v, engine="sdpa", dropout_p=0.0, window=4),
        attention(q, k, v, engine="sdpa", window=4),
    )


def test_problem_fields():
    q, k, v = _inputs(2, 4, 2, 6, 6, 8, 8)
    p = make_problem(q, k, v, window=3, dropout_p=0.25)
    assert p.pattern.window == 3 and p.dropout_p == 0.25 and len(p.dropout_seed) == 2
    assert make_problem(q, k, v).dropout_seed is None
    torch.manual_seed(9)
    s1 = make_problem(q, k, v, dropout_p=0.1).dropout_seed
    torch.manual_seed(9)
    assert make_problem(q, k, v, dropout_p=0.1).dropout_seed == s1
    assert np.array_equal(p.allowed().numpy(), p.pattern.allowed(2, 4, 6, 6))


# ---- the tiled engine against the reference ---------------------------------------------------
def _grads(engine, q, k, v, kw, p=0.0, seed=5, with_lse=True):
    """out, lse and the gradients (q, k, v[, sinks]) of sum(out·dO) + sum(lse·dL) over the
    finite lse; a fresh generator per call, so both engines draw the same dropout seed."""
    kw = dict(kw)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if kw.get("sinks") is not None:
        kw["sinks"] = torch.nn.Parameter(torch.as_tensor(kw["sinks"], dtype=q.dtype).clone())
        leaves.append(kw["sinks"])
    out, lse = attention(
        *leaves[:3],
        engine=engine,
        return_lse=True,
        dropout_p=p,
        generator=torch.Generator().manual_seed(seed),
        **kw,
    )
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(out.shape, generator=g, dtype=F64).to(out.dtype)
    dl = torch.randn(lse.shape, generator=g, dtype=F64).to(lse.dtype)
    loss = (out * dout).sum()
    if with_lse:
        loss = loss + torch.where(torch.isfinite(lse), lse * dl, 0.0).sum()
    return out.detach(), lse.detach(), torch.autograd.grad(loss, leaves)


def _same(q, k, v, kw, p=0.0, tol=1e-9):
    out, lse, grads = _grads("tiled", q, k, v, kw, p)
    rout, rlse, rgrads = _grads("reference", q, k, v, kw, p)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rlse))
    fin = torch.isfinite(rlse)
    torch.testing.assert_close(lse[fin], rlse[fin], atol=1e-5, rtol=1e-6)  # fp32 by contract
    torch.testing.assert_close(out, rout, atol=tol, rtol=tol)
    for name, a, b in zip(["dq", "dk", "dv", "dsinks"], grads, rgrads):
        torch.testing.assert_close(a, b, atol=tol * 10, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")


@settings(max_examples=60, deadline=None)
@given(cases(max_T=40), st.sampled_from([0.0, 0.0, 0.3]))
def test_tiled_matches_reference_on_every_pattern(case, p):
    (q, k, v), kw = case
    _same(q, k, v, kw, p)


@settings(max_examples=15, deadline=None)
@given(cases(max_T=40), st.sampled_from([(1, 1), (3, 5), (7, 2), (16, 16)]))
def test_tiled_matches_reference_with_tiny_blocks(case, blocks):
    """Many tiles per problem: skipping, partial tiles and the online softmax across them."""
    from causalattn.engines import tiled

    (q, k, v), kw = case
    old, tiled.BLOCKS = tiled.BLOCKS, blocks
    try:
        _same(q, k, v, kw, 0.3)
    finally:
        tiled.BLOCKS = old


ALIBI = torch.linspace(0.01, 0.2, 2, dtype=F64)
SINKS = torch.tensor([0.3, -0.7], dtype=F64)


@pytest.mark.parametrize(
    "T,kw,p",
    [
        (700, {"window": 130}, 0.0),
        (700, {"window": 300, "softcap": 5.0, "alibi_slopes": ALIBI, "sinks": SINKS}, 0.2),
        (640, {"chunk": 200, "prefix_lengths": [150]}, 0.0),
        (900, {"cu_seqlens": [0, 5, 300, 301, 700, 900], "window": 260}, 0.1),
        (600, {"lengths": [600], "causal": False, "window": 100}, 0.0),
    ],
)
def test_tiled_matches_reference_across_blocks(T, kw, p):
    q, k, v = _inputs(1, 2, 1, T, T, 8, 8, seed=T)
    _same(q, k, v, kw, p)


def test_tiled_dense_mask_per_head_across_blocks():
    q, k, v = _inputs(2, 2, 2, 600, 610, 8, 8, seed=8)
    mask = torch.rand(1, 2, 600, 610, generator=torch.Generator().manual_seed(2)) > 0.4
    mask[0, 1, :, 300:] = False  # head 1 never reads the second half: those tiles are skipped
    _same(q, k, v, {"mask": mask, "causal": False}, 0.25)


@pytest.mark.parametrize(
    "kw,p",
    [
        ({"window": 2, "softcap": 3.0, "alibi_slopes": ALIBI, "sinks": SINKS}, 0.0),
        ({"chunk": 3, "prefix_lengths": [2, 4]}, 0.3),
        ({"mask": torch.rand(1, 2, 5, 7, generator=torch.Generator().manual_seed(0)) > 0.3}, 0.5),
    ],
)
def test_gradcheck_float64(kw, p):
    q, k, v = _inputs(2, 2, 1, 5, 7, 3, 3, seed=11)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kw = dict(kw)
    if "sinks" in kw:
        leaves.append(kw.pop("sinks").clone().requires_grad_())

    def f(*xs):
        s = {"sinks": xs[3]} if len(xs) > 3 else {}
        return attention(
            *xs[:3],
            engine="tiled",
            dropout_p=p,
            **kw,
            **s,  # lse: fp32, no
            generator=torch.Generator().manual_seed(3),
        )  # (its grad: _same)

    assert torch.autograd.gradcheck(f, tuple(leaves))


@pytest.mark.parametrize(
    "dtype,floor", [(torch.float32, 1e-6), (torch.bfloat16, 1e-3), (torch.float16, 1e-4)]
)
def test_accuracy_rule_low_precision_with_window_and_modifiers(dtype, floor):
    """max|tiled - ref64| <= 2·max|plain_t - ref64| + floor, output and gradients; plain_t:
    the reference's own math run in the low precision (materialized, same modifiers)."""
    kw = {"window": 90, "softcap": 20.0, "alibi_slopes": ALIBI, "lengths": [300, 211]}
    q64, k64, v64 = _inputs(2, 2, 1, 300, 300, 32, 32, seed=12)
    ref, _, rg = _grads("reference", q64, k64, v64, kw, with_lse=False)
    lo = [t.to(dtype) for t in (q64, k64, v64)]
    out, _, g = _grads("tiled", *lo, kw, with_lse=False)
    p = make_problem(*[t.detach().clone().requires_grad_() for t in lo], **kw)
    plain = contract.plain(p, dtype)
    gen = torch.Generator().manual_seed(1)
    dout = torch.randn(plain.shape, generator=gen, dtype=F64).to(dtype)
    pg = list(torch.autograd.grad((plain * dout).sum(), (p.q, p.k, p.v)))

    def err(a, b):
        return (a.double() - b).abs().max().item()

    assert err(out, ref) <= 2 * err(plain, ref) + floor
    for name, a, pl, r in zip("qkv", g, pg, rg):
        assert err(a, r) <= 2 * err(pl, r) + floor, f"d{name}: {err(a, r)} vs {err(pl, r)}"


def test_unreadable_nan_never_reaches_readable_rows_with_window_and_chunks():
    """Key t is outside every window of rows >= t + w and outside other chunks: poisoning it
    (NaN, inf) leaves those rows' outputs and dq bit-identical."""
    for kw, first in (({"window": 40}, 60 + 40), ({"chunk": 64}, 64)):
        q, k, v = _inputs(1, 2, 2, 300, 300, 8, 8, dtype=torch.float32, seed=21)
        kn, vn = k.clone(), v.clone()
        kn[:, :, 60], vn[:, :, 60] = float("inf"), float("nan")
        rows = slice(first, None)
        outs = []
        for kk, vv in ((k, v), (kn, vn)):
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, kk, vv))
            out = attention(qq, kk, vv, engine="tiled", **kw)
            dout = torch.zeros_like(out)
            dout[:, :, rows] = 1.0
            (dq,) = torch.autograd.grad((out * dout).sum(), (qq,))
            outs.append((out.detach()[:, :, rows], dq[:, :, rows]))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_rows_with_no_readable_key_stay_zero_with_sinks():
    q, k, v = _inputs(1, 2, 2, 6, 6, 4, 4)
    sinks = torch.nn.Parameter(torch.tensor([3.0, -2.0], dtype=F64))
    qq = q.clone().requires_grad_()
    out, lse = attention(qq, k, v, lengths=[3], sinks=sinks, engine="tiled", return_lse=True)
    assert not out[:, :, 3:].any() and torch.isneginf(lse[:, :, 3:]).all()
    assert torch.isfinite(lse[:, :, :3]).all()
    dq, ds = torch.autograd.grad(out.sum(), (qq, sinks))
    assert not dq[:, :, 3:].any() and torch.isfinite(ds).all()


def _out_grads(engine, q, k, v, kw):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, engine=engine, **kw)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    return (out.detach(), *torch.autograd.grad((out * dout.to(out.dtype)).sum(), leaves))


@pytest.mark.parametrize("engine", ["reference", "tiled", "sdpa"])
def test_a_3d_mask_is_per_head_and_runs_as_its_4d_form(engine):
    """A (H, T_q, T_k) mask is one mask per head shared by every batch row: the same
    outputs and gradients, bit for bit, as the (1, H, T_q, T_k) mask, equal to the
    reference, and the tiled engine runs all batch rows as one job (no per-row jobs)."""
    from causalattn.engines import tiled

    q, k, v = _inputs(3, 4, 2, 20, 26, 5, 4, seed=12)
    m = torch.rand(4, 20, 26, generator=torch.Generator().manual_seed(3)) > 0.5
    m[1] = False  # a head that reads nothing
    m[2, :, 13:] = False
    kw3, kw4 = {"causal": False, "mask": m}, {"causal": False, "mask": m[None]}
    p3 = make_problem(q, k, v, **kw3)
    assert not p3.pattern.per_batch and p3.pattern.per_head
    assert tiled._jobs(p3) == [(0, 3)] and p3.allowed().shape == (1, 4, 20, 26)
    got = _out_grads(engine, q, k, v, kw3)
    for a, b in zip(got, _out_grads(engine, q, k, v, kw4)):
        assert torch.equal(a, b)
    assert torch.equal(got[0][:, 1], torch.zeros_like(got[0][:, 1]))
    for a, b in zip(got, _out_grads("reference", q, k, v, kw4)):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)
