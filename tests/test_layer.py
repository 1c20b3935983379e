"""CausalSelfAttention: against a hand-written float64 layer, KV-cache decoding, loading, errors;
and the pattern it speaks: window, chunk, ALiBi, softcap, learned sinks, dropout."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from causalattn import CausalSelfAttention, KVCache, masks

ENGINES = ["auto", "reference", "sdpa"]
FLOOR = 1e-6


def manual(layer: CausalSelfAttention, x: torch.Tensor, lengths=None, dtype=torch.float64):
    """The layer written out head by head with loops over b and h: the seed's equations."""
    p = {n: (None if t is None else t.detach().to(dtype)) for n, t in layer.named_parameters()}
    for n in ("b_q", "b_k", "b_v", "b_o"):
        p.setdefault(n, None)
    X = x.detach().to(dtype)
    B, T, _ = X.shape
    h, g, dk, dv = layer.n_heads, layer.n_heads // layer.n_kv_heads, layer.d_k, layer.d_v
    scale = layer.scale if layer.scale is not None else 1 / math.sqrt(dk)

    def proj(W, b):
        return X @ W + (0 if b is None else b)

    Q, K, V = proj(p["W_q"], p["b_q"]), proj(p["W_k"], p["b_k"]), proj(p["W_v"], p["b_v"])
    out = torch.zeros(B, T, h * dv, dtype=dtype)
    for b in range(B):
        n = T if lengths is None else int(lengths[b])
        for i_h in range(h):
            kv = i_h // g
            q = Q[b, :, i_h * dk : (i_h + 1) * dk]
            k = K[b, :, kv * dk : (kv + 1) * dk]
            v = V[b, :, kv * dv : (kv + 1) * dv]
            S = q @ k.T * scale
            allowed = torch.as_tensor(masks.Pattern(lengths=[n]).allowed(1, 1, T, T)[0, 0])
            Z = S.masked_fill(~allowed, float("-inf"))
            A = torch.softmax(Z, dim=-1).nan_to_num(0.0)  # padding rows: no readable key -> 0
            out[b, :, i_h * dv : (i_h + 1) * dv] = A @ v
    O = out @ p["W_o"]
    return O if p["b_o"] is None else O + p["b_o"]


def check_accuracy(out, ref64, plain):
    err = (out.double() - ref64).abs().max().item()
    bound = 2 * (plain.double() - ref64).abs().max().item() + FLOOR
    assert err <= bound, f"max|out - ref64| = {err:.3g} > {bound:.3g}"


def make_layer(seed=0, **kw) -> CausalSelfAttention:
    torch.manual_seed(seed)
    layer = CausalSelfAttention(**{"d_model": 32, "n_heads": 4, **kw})
    with torch.no_grad():
        for b in (layer.b_q, layer.b_k, layer.b_v, layer.b_o):
            if b is not None:
                b.normal_()
    return layer


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"proj_bias": True},
        {"n_kv_heads": 2},
        {"n_kv_heads": 1, "d_k": 5, "d_v": 3, "proj_bias": True},
    ],
    ids=["plain", "bias", "gqa", "mqa-dk5-dv3"],
)
def test_layer_matches_hand_written_reference(engine, kw):
    layer = make_layer(engine=engine, **kw)
    x = torch.randn(2, 37, 32)
    check_accuracy(layer(x), manual(layer, x), manual(layer, x, dtype=torch.float32))


@pytest.mark.parametrize("engine", ENGINES)
def test_lengths_and_key_padding_mask(engine):
    layer = make_layer(engine=engine, proj_bias=True)
    x = torch.randn(3, 11, 32)
    lengths = torch.tensor([11, 6, 1])
    out = layer(x, lengths=lengths)
    check_accuracy(out, manual(layer, x, lengths), manual(layer, x, lengths, torch.float32))
    # padding query rows: H is zero, so O is exactly b_o
    assert torch.equal(out[1, 6:], layer.b_o.detach().expand(5, -1))
    # a key-padding mask blocks keys only: real rows equal the lengths version
    kpm = torch.arange(11)[None, :] < lengths[:, None]
    out_k = layer(x, key_padding_mask=kpm)
    real = kpm
    assert (out_k - out)[real].abs().max() < 1e-5


def test_padding_positions_never_reach_real_rows():
    # docs/design.md: values at unreadable positions, even NaN, never change a readable
    # output, bit for bit
    layer = make_layer(engine="auto", n_kv_heads=2, proj_bias=True)
    x = torch.randn(2, 10, 32)
    lengths = torch.tensor([10, 6])
    poisoned = x.clone()
    poisoned[1, 6:] = float("nan")
    a, b = layer(x, lengths=lengths), layer(poisoned, lengths=lengths)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1, :6], b[1, :6])


@pytest.mark.parametrize("engine", ENGINES)
def test_kv_cache_decoding_equals_full_pass(engine):
    layer = make_layer(engine=engine, n_kv_heads=2, proj_bias=True)
    x = torch.randn(2, 12, 32)
    full = layer(x)
    cache = KVCache(capacity=2)  # small, so decoding grows it
    chunks = [layer(x[:, :5], kv_cache=cache)]
    chunks += [layer(x[:, t : t + 1], kv_cache=cache) for t in range(5, 9)]
    chunks.append(layer(x[:, 9:], kv_cache=cache))  # a chunk of 3 queries, bottom-right aligned
    assert len(cache) == 12
    assert (torch.cat(chunks, dim=1) - full).abs().max() < 1e-5


def test_backward_matches_reference_engine():
    x = torch.randn(2, 40, 32, requires_grad=True)
    grads = {}
    for engine in ("auto", "reference"):
        layer = make_layer(engine=engine, n_kv_heads=2, proj_bias=True)
        x.grad = None
        layer(x).square().sum().backward()
        grads[engine] = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    for a, b in zip(grads["auto"], grads["reference"]):
        assert (a - b).abs().max() <= 1e-4 * (1 + b.abs().max())


def test_trace_is_the_same_layer():
    layer = make_layer(engine="reference", n_kv_heads=2, proj_bias=True)
    x = torch.randn(2, 6, 32)
    lengths = torch.tensor([6, 4])
    tr = layer.trace(x, lengths=lengths)
    assert tr.n_heads == 4 and tr.Q.shape == (2, 4, 6, 8) and tr.A.shape == (2, 4, 6, 6)
    out = layer(x, lengths=lengths).detach().double().numpy()
    np.testing.assert_allclose(tr.O + layer.b_o.detach().double().numpy(), out, atol=1e-5)
    assert np.all(tr.A[1, :, 4:] == 0) and np.allclose(tr.A[1, :, :4].sum(-1), 1)
    assert np.all(np.triu(tr.A[0], 1) == 0)  # causal: the future gets exactly zero weight
    single = layer.trace(x[0])  # T×d_model works too
    np.testing.assert_allclose(single.O, tr.O[0], atol=1e-12)


def test_trace_refuses_large_T():
    layer = CausalSelfAttention(64, 8)
    with pytest.raises(ValueError, match=r"trace: .*MiB"):
        layer.trace(torch.zeros(1, 2048, 64))


def test_shape_table_follows_the_layer():
    rows = {r.symbol: r for r in CausalSelfAttention(48, 4, d_v=6).shape_table(10)}
    assert rows["Q"].shape == (4, 10, 12) and rows["V"].shape == (4, 10, 6)
    assert rows["W_O"].shape == (24, 48) and rows["W_Q"].shape == (48, 48)


class NanoGPTAttention(nn.Module):
    """nanoGPT's CausalSelfAttention (nn.Linear c_attn / c_proj), written out."""

    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


def test_from_nanogpt_state_dict():
    torch.manual_seed(1)
    nano = NanoGPTAttention(32, 4)
    sd = {f"transformer.h.0.attn.{k}": v for k, v in nano.state_dict().items()}
    sd["transformer.h.0.attn.bias"] = torch.ones(1, 1, 8, 8)  # nanoGPT's mask buffer: ignored
    layer = CausalSelfAttention.from_nanogpt_state_dict(sd, 4, prefix="transformer.h.0.attn.")
    # nn.Linear stores the transpose of the seed's W
    assert torch.equal(layer.W_q, nano.c_attn.weight[:32].T)
    x = torch.randn(2, 9, 32)
    assert (layer(x) - nano(x)).abs().max() < 1e-5
    with pytest.raises(ValueError, match="c_attn.weight"):
        CausalSelfAttention.from_nanogpt_state_dict(nano.state_dict(), 4, prefix="x.")


def test_bad_input_names_the_argument():
    layer = make_layer(engine="reference")
    x = torch.randn(2, 5, 32)
    with pytest.raises(
        ValueError, match=r"x must be \(B, T, d_model\) with d_model=32, got \(2, 5, 16\)"
    ):
        layer(torch.randn(2, 5, 16))
    with pytest.raises(ValueError, match=r"x must be .* got \(5, 32\)"):
        layer(torch.randn(5, 32))
    with pytest.raises(ValueError, match=r"key_padding_mask: .*\(2, 5\).*\(2, 4\)"):
        layer(x, key_padding_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"key_padding_mask: .*torch.int64"):
        layer(x, key_padding_mask=torch.ones(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"lengths: .*\(2,\).*\(3,\)"):
        layer(x, lengths=torch.tensor([5, 5, 5]))
    with pytest.raises(ValueError, match=r"x is torch.float64 but the weights are torch.float32"):
        layer(x.double())
    with pytest.raises(ValueError, match="n_heads=4 must be a multiple of n_kv_heads=3"):
        CausalSelfAttention(32, 4, n_kv_heads=3)
    with pytest.raises(ValueError, match="d_model=30 is not divisible by n_heads=4"):
        CausalSelfAttention(30, 4)


def test_bad_kv_cache():
    layer, other = make_layer(engine="reference"), make_layer(engine="reference")
    x = torch.randn(2, 5, 32)
    cache = KVCache()
    layer(x, kv_cache=cache)
    with pytest.raises(ValueError, match="kv_cache: .*another CausalSelfAttention layer"):
        other(x[:, :1], kv_cache=cache)
    with pytest.raises(ValueError, match=r"kv_cache: holds k \(2, 4, 5, 8\).*x \(3, 1, 32\)"):
        layer(torch.randn(3, 1, 32), kv_cache=cache)
    with pytest.raises(ValueError, match="kv_cache: .* another layer or batch size"):
        CausalSelfAttention(32, 2, engine="reference")(x[:, :1], kv_cache=cache)
    with pytest.raises(ValueError, match=r"key_padding_mask: .*\(2, 6\)"):  # T_k counts the cache
        layer(x[:, :1], kv_cache=cache, key_padding_mask=torch.ones(2, 1, dtype=torch.bool))
    assert len(cache) == 5  # refused calls left the cache as it was
    with pytest.raises(ValueError, match="kv_cache: expected a causalattn.KVCache"):
        layer(x, kv_cache={})


def test_layer_bench_rows():
    from causalattn.bench import layer as bench_layer

    rows = bench_layer.run(1, 48, 16, 2, budget_s=0.05, passes=("fwd", "fwd+bwd"))
    # auto names the engine it chose: the native one where it is built (tests/engines/test_auto.py)
    from causalattn.engines import cpp

    chosen = "auto (tiled)" if cpp.unavailable() else "auto (cpp)"
    assert [(r["pass"], r["engine"].replace("(sdpa)", "(tiled)")) for r in rows] == [
        ("fwd", chosen),
        ("fwd", "sdpa"),
        ("fwd+bwd", chosen),
        ("fwd+bwd", "sdpa"),
    ]
    assert all(r["ms"] > 0 and r["vs_sdpa"] > 0 and r["reps"] >= 3 for r in rows)
    assert rows[1]["vs_sdpa"] == 1.0 and rows[0]["max_abs_diff_vs_sdpa"] < 1e-5


# --- the pattern on the layer ------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        {"window": 3},
        {"chunk": 4},
        {"alibi_slopes": True},
        {"softcap": 5.0},
        {"sinks": True},
        {"window": 2, "alibi_slopes": True, "sinks": True, "softcap": 3.0},
    ],
)
def test_the_layer_equals_its_own_float64_trace(kw):
    torch.manual_seed(0)
    layer = CausalSelfAttention(16, 4, engine="reference", **kw).double()
    if layer.sinks is not None:
        with torch.no_grad():
            layer.sinks.copy_(torch.randn(4))
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    out = layer(x)
    tr = layer.trace(x)
    np.testing.assert_allclose(out.detach().numpy(), tr.O, atol=1e-10)
    if "window" in kw:
        assert (tr.A[..., 8, : 8 - kw["window"] + 1] == 0).all()


def test_learned_sinks_get_a_gradient_and_alibi_slopes_are_not_saved():
    layer = CausalSelfAttention(8, 2, sinks=True, alibi_slopes=True, engine="reference")
    layer(torch.randn(1, 5, 8)).sum().backward()
    assert layer.sinks.grad is not None and torch.isfinite(layer.sinks.grad).all()
    assert "alibi_slopes" not in layer.state_dict() and "sinks" in layer.state_dict()
    np.testing.assert_allclose(layer.alibi_slopes.numpy(), masks.alibi_slopes(2))
    assert "window" not in repr(layer) and "sinks=True" in repr(layer)


def test_attention_dropout_acts_in_train_mode_only():
    torch.manual_seed(1)
    layer = CausalSelfAttention(8, 2, dropout_p=0.5, engine="reference")
    x = torch.randn(1, 6, 8)
    layer.eval()
    a, b = layer(x), layer(x)
    assert torch.equal(a, b)
    layer.train()
    torch.manual_seed(2)
    c = layer(x)
    torch.manual_seed(2)
    d = layer(x)
    assert torch.equal(c, d) and not torch.allclose(c, a)


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"window": 0}, "window"),
        ({"chunk": 1.5}, "chunk"),
        ({"softcap": -1.0}, "softcap"),
        ({"dropout_p": 1.5}, "dropout_p"),
        ({"alibi_slopes": 1}, "alibi_slopes"),
        ({"scale": float("nan")}, "scale"),
        ({"sinks": "yes"}, "sinks"),
    ],
)
def test_bad_pattern_arguments_are_refused_at_construction(kw, msg):
    with pytest.raises(ValueError, match=msg):
        CausalSelfAttention(8, 2, **kw)
