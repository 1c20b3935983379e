"""A learned pattern tensor gets its gradient when q, k and v need none (frozen projections).

Each learnable input that is not q, k or v — a score_mod's captured tensor, ``bias``,
``rel_bias``, learnable ``alibi_slopes`` and learned ``sinks`` — on every CPU engine that
takes it: the output has a grad_fn, the gradient equals the float64 reference's autograd and
is the same bits on 1 and 2 threads; eagerly, under ``torch.compile`` and under
``torch.func.grad``; with q, k, v frozen and with only one of them requiring a gradient.
"""

from __future__ import annotations

import pytest
import torch

import causalattn as ca

F64 = torch.float64
B, H, H_KV, T_Q, T_K, D = 2, 4, 2, 7, 11, 8  # GQA, T_q < T_k (decoding-like), odd sizes
LEARNED = ("score_mod", "bias", "rel_bias", "alibi_slopes", "sinks")
ENGINES = ("reference", "tiled", "cpp", "sdpa", "auto")
# what an engine does not take (it names who does; pinned below)
REFUSED = {("sdpa", "score_mod"), ("sdpa", "sinks")}


def _leaf(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash(name) % 1000)
    shape = {
        "score_mod": (H,),  # a learned relative-position slope per head
        "bias": (1, H, T_Q, T_K),
        "rel_bias": (H, 2 * T_K - 1),
        "alibi_slopes": (H,),
        "sinks": (H,),
    }[name]
    x = torch.rand(shape, generator=g, dtype=F64)
    return x * 0.5 if name != "bias" else x - 0.5


def _keywords(name: str, leaf: torch.Tensor) -> dict:
    if name == "score_mod":

        def slope_mod(score, b, h, q_idx, kv_idx):
            return score - leaf[h] * (q_idx - kv_idx).abs()

        return {"score_mod": slope_mod}
    return {name: leaf}


def _qkv(needs: str = "") -> tuple:
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, T_Q, D, generator=g, dtype=F64)
    k = torch.randn(B, H_KV, T_K, D, generator=g, dtype=F64)
    v = torch.randn(B, H_KV, T_K, D, generator=g, dtype=F64)
    out = {"q": q, "k": k, "v": v}
    if needs:
        out[needs].requires_grad_(True)
    return out["q"], out["k"], out["v"]


def _want(name: str, needs: str) -> tuple:
    """The reference's autograd: the learned tensor's gradient (and the one input's)."""
    q, k, v = _qkv(needs)
    leaf = _leaf(name).requires_grad_(True)
    out = ca.attention(q, k, v, engine="reference", **_keywords(name, leaf))
    wrt = [leaf] + ([{"q": q, "k": k, "v": v}[needs]] if needs else [])
    return torch.autograd.grad((out * out).sum(), wrt)


def _eager(engine: str, name: str, needs: str) -> tuple:
    q, k, v = _qkv(needs)
    leaf = _leaf(name).requires_grad_(True)
    out = ca.attention(q, k, v, engine=engine, **_keywords(name, leaf))
    assert out.grad_fn is not None, (engine, name)
    wrt = [leaf] + ([{"q": q, "k": k, "v": v}[needs]] if needs else [])
    return torch.autograd.grad((out * out).sum(), wrt)


def _threads(n: int, fn):
    was = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(was)


CASES = [(e, n) for e in ENGINES for n in LEARNED]


@pytest.mark.parametrize("needs", ["", "q", "k", "v"])
@pytest.mark.parametrize(("engine", "name"), CASES)
def test_a_learned_tensor_gets_its_gradient_with_q_k_v_frozen(engine, name, needs):
    if (engine, name) in REFUSED:
        q, k, v = _qkv(needs)
        with pytest.raises(ValueError, match=f"engine '{engine}'") as e:
            ca.attention(q, k, v, engine=engine, **_keywords(name, _leaf(name)))
        assert "engines that run it" in str(e.value) or "use '" in str(e.value)
        return
    want = _want(name, needs)
    one = _threads(1, lambda: _eager(engine, name, needs))
    two = _threads(2, lambda: _eager(engine, name, needs))
    for w, a, b in zip(want, one, two):
        assert torch.equal(a, b), (engine, name, "1 and 2 threads differ")
        assert a.abs().sum() > 0  # the gradient is really there
        torch.testing.assert_close(a, w, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("engine", ["reference", "tiled", "cpp"])
@pytest.mark.parametrize("name", LEARNED)
def test_compiled_attention_keeps_the_learned_tensors_link(engine, name):
    if (engine, name) in REFUSED:
        pytest.skip(f"{engine} does not take {name} (pinned eagerly above)")
    torch._dynamo.reset()
    q, k, v = _qkv()
    leaf = _leaf(name).requires_grad_(True)
    kw = _keywords(name, leaf)  # the score_mod is made outside the compiled region
    f = torch.compile(lambda q, k, v: ca.attention(q, k, v, engine=engine, **kw), fullgraph=True)
    if (engine, name) == ("cpp", "score_mod"):  # traced programs run eagerly only
        with pytest.raises(Exception, match="engine 'cpp': a score_mod under torch.compile"):
            f(q, k, v)
        return
    out = f(q, k, v)
    assert out.grad_fn is not None
    (got,) = torch.autograd.grad((out * out).sum(), leaf)
    torch.testing.assert_close(got, _want(name, "")[0], rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("engine", ["reference", "tiled", "cpp"])
@pytest.mark.parametrize("name", LEARNED)
def test_func_grad_reaches_the_learned_tensor(engine, name):
    if (engine, name) in REFUSED:
        pytest.skip(f"{engine} does not take {name} (pinned eagerly above)")
    q, k, v = _qkv()

    def loss(leaf):
        out = ca.attention(q, k, v, engine=engine, **_keywords(name, leaf))
        return (out * out).sum()

    got = torch.func.grad(loss)(_leaf(name))
    torch.testing.assert_close(got, _want(name, "")[0], rtol=1e-9, atol=1e-11)


def test_nothing_needs_a_gradient_gives_no_graph():
    """The other side: frozen q, k, v and a score_mod that reads only frozen tensors."""
    q, k, v = _qkv()
    out = ca.attention(q, k, v, engine="tiled", **_keywords("score_mod", _leaf("score_mod")))
    assert out.grad_fn is None
    with torch.no_grad():
        leaf = _leaf("score_mod").requires_grad_(True)
        out = ca.attention(q, k, v, engine="tiled", **_keywords("score_mod", leaf))
    assert out.grad_fn is None


SLOPE = torch.tensor(0.25, dtype=F64, requires_grad=True)  # a module-level learned slope


def test_a_score_mod_made_inside_the_compiled_region_keeps_its_link():
    """An inline function reading a learned global: compiled, the gradient is eager's."""
    torch._dynamo.reset()
    q, k, v = _qkv()

    def f(q, k, v):
        return ca.attention(
            q, k, v, engine="tiled", score_mod=lambda s, b, h, i, j: s - SLOPE * (i - j).abs()
        )

    (want,) = torch.autograd.grad(f(q, k, v).square().sum(), SLOPE)
    out = torch.compile(f, fullgraph=True)(q, k, v)
    assert out.grad_fn is not None
    (got,) = torch.autograd.grad(out.square().sum(), SLOPE)
    assert want != 0
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    with torch.no_grad():  # and with nothing to learn, it compiles as before
        torch.testing.assert_close(torch.compile(f, fullgraph=True)(q, k, v), f(q, k, v))
