"""What the native engine's Python side and masks_mod promise, each pinned by the behaviour
that would break: a Pattern reused at another shape gets tile tables of that shape; a bias in
another dtype than q, k, v runs in the compute dtype; a BlockMask made for T_q < T_k is read
at the right cells."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import causalattn as ca
from causalattn import engines
from causalattn.engines import cpp, make_problem
from causalattn.masks import Pattern

HAS_CPP = not cpp.unavailable()
needs_cpp = pytest.mark.skipif(not HAS_CPP, reason="the native engine is not built here")


def _qkv(B, H, T_q, T_k, d=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T_q, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, H, T_k, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, H, T_k, d, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


def _run(pt, engine, q, k, v):
    """The engine's H on the ONE Pattern object ``pt`` (what it remembers stays on it)."""
    return engines.run(make_problem(q, k, v, pattern=pt), engine=engine)


# one change at a time: the batch, the heads, the keys, the queries, then all of them
SHAPES = ((2, 2, 192, 192), (3, 2, 192, 192), (3, 3, 192, 192), (3, 3, 192, 288), (3, 3, 288, 288))
SHAPES += ((1, 2, 40, 288),)


def _blocks(monkeypatch, blocks):
    """Force the native engine's (bq, bk) (its plans per shape are remembered: forgotten)."""
    monkeypatch.setattr(cpp, "BLOCKS", blocks)
    cpp._plan.cache_clear()
    monkeypatch.setattr(cpp, "_plan", cpp._plan)  # (cleared again when the test ends)


def _stripes(b, h, q_idx, kv_idx):
    """A rule that differs by batch row and by head: partial tiles everywhere."""
    return ((q_idx + kv_idx + b + h) % 3) != 0


@needs_cpp
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
def test_a_pattern_reused_at_another_shape_matches_the_reference(grad, monkeypatch):
    _blocks(monkeypatch, (64, 96))  # several tiles, each partial (the smallest grid blocks() gives)
    mask = torch.rand(1, 1, 192, 192, generator=torch.Generator().manual_seed(3)) > 0.3
    for pt in (Pattern(mask_mod=_stripes), Pattern(mask_mod=_stripes, window=9)):
        for B, H, T_q, T_k in SHAPES:
            q, k, v = (t.requires_grad_(grad) for t in _qkv(B, H, T_q, T_k))
            got = _run(pt, "cpp", q, k, v)
            ref = [t.detach().double().requires_grad_(grad) for t in (q, k, v)]
            want = _run(pt, "reference", *ref)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
            if grad:
                got.backward(torch.ones_like(got))
                want.backward(torch.ones_like(want))
                for t, r in zip((q, k, v), ref):
                    torch.testing.assert_close(t.grad.double(), r.grad, rtol=1e-4, atol=1e-4)
        # a dense mask AND the rule, at one shape, then at a smaller batch
        both = Pattern(mask=mask, mask_mod=_stripes)
        for B in (2, 1):
            q, k, v = _qkv(B, 2, 192, 192)
            got = _run(both, "cpp", q, k, v)
            want = _run(both, "reference", q.double(), k.double(), v.double())
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@needs_cpp
def test_a_pattern_reused_at_another_block_grid_matches_the_reference(monkeypatch):
    pt = Pattern(mask_mod=_stripes)
    q, k, v = _qkv(2, 2, 192, 192)
    want = _run(pt, "reference", q.double(), k.double(), v.double())
    for blocks in ((64, 96), (128, 96), (64, 192)):
        _blocks(monkeypatch, blocks)
        got = _run(pt, "cpp", q, k, v)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@needs_cpp
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
def test_a_float64_bias_with_lower_precision_qkv_runs_in_the_compute_dtype(qdtype, grad):
    B, H, T = 2, 2, 12
    q, k, v = _qkv(B, H, T, T, dtype=qdtype)
    bias = torch.randn(B, H, T, T, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for b in (bias, bias[0, 0], bias[:, :1]):
        bb = b.clone().requires_grad_(grad)
        qq = q.clone().requires_grad_(grad)
        got = ca.attention(qq, k, v, bias=bb, engine="cpp")
        assert got.dtype == qdtype
        want = ca.attention(q.double(), k.double(), v.double(), bias=b.float().double())
        tol = 1e-4 if qdtype == torch.float32 else 3e-2
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
        if grad:
            got.sum().backward()
            assert bb.grad is not None and bb.grad.shape == b.shape
            assert qq.grad is not None and qq.grad.dtype == qdtype


@needs_cpp
def test_a_float32_bias_with_float64_qkv_runs_in_float64():
    q, k, v = _qkv(1, 2, 10, 10, dtype=torch.float64)
    bias = torch.randn(10, 10, generator=torch.Generator().manual_seed(2)).float()
    got = ca.attention(q, k, v, bias=bias, engine="cpp")
    want = ca.attention(q, k, v, bias=bias.double(), engine="reference")
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_biases_slopes_and_sinks_run_in_the_compute_dtype(dtype):
    """Each additive modifier given in bf16 or fp16 (NumPy holds neither) is read as the
    reference reads it."""
    q, k, v = _qkv(1, 2, 9, 9, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    for kw in (
        {"bias": torch.randn(1, 2, 9, 9, generator=g)},
        {"rel_bias": torch.randn(2, 17, generator=g)},
        {"alibi_slopes": torch.rand(2, generator=g)},
        {"sinks": torch.randn(2, generator=g)},
    ):
        half = {n: x.to(dtype) for n, x in kw.items()}
        got = ca.attention(q, k, v, engine="cpp", **half)
        want = ca.attention(q, k, v, engine="reference", **half)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_from_block_mask_made_for_fewer_queries_than_keys_reads_the_right_cells():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    T_q, T_k = 40, 100

    def rule(b, h, q_idx, kv_idx):  # FlexAttention's indices: q_idx counts from 0
        return ((kv_idx <= q_idx + (T_k - T_q)) & ((q_idx * 7 + kv_idx) % 5 != 0)) | (
            (b == 1) & (kv_idx == 0)
        )

    bm = flex.create_block_mask(rule, 2, None, T_q, T_k, device="cpu", BLOCK_SIZE=16)
    pt = Pattern.from_block_mask(bm)
    got = np.broadcast_to(pt.allowed(2, 1, T_q, T_k), (2, 1, T_q, T_k))
    b, q_idx, kv_idx = np.meshgrid(np.arange(2), np.arange(T_q), np.arange(T_k), indexing="ij")
    want = rule(*(torch.as_tensor(x) for x in (b, 0, q_idx, kv_idx))).numpy()
    assert np.array_equal(got[:, 0], want)
    # and attention through it is FlexAttention's rule, cell for cell
    q, k, v = _qkv(2, 1, T_q, T_k, dtype=torch.float64)
    out = ca.attention(q, k, v, causal=False, mask_mod=pt.mask_mod)
    ref = ca.attention(q, k, v, causal=False, mask=torch.as_tensor(want)[:, None])
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
