"""score_mod, bias, rel_bias and learnable ALiBi slopes: values against the
definition, fp64 gradcheck of every learned tensor, gradient bits across runs and thread
counts, the engines that refuse them (naming who runs them) and what "auto" picks."""

from __future__ import annotations

import pytest
import torch

import causalattn as ca
from causalattn.engines import auto, cpp, make_problem, registry
from causalattn.masks import Pattern

F64 = torch.float64
HAS_CPP = not cpp.unavailable()


def _features(**kw):
    base = dict(device="cpu", dtype="float32", d_k=8, d_v=8, H_q=2, H_kv=2, T_q=64, T_k=64)
    return registry.Features(**{**base, **kw})


# what each learned tensor is, as the registry's features (with a gradient)
LEARNED_FEATURES = {
    "bias": dict(present=("bias",), grad=True, learned=("bias",)),
    "key bias": dict(present=("bias",), grad=True, learned=("bias",)),
    "rel_bias": dict(present=("rel_bias",), grad=True, learned=("rel_bias",)),
    "alibi_slopes": dict(present=("alibi_slopes",), grad=True, learned=("alibi_slopes",)),
    "score_mod": dict(score_mod=True, grad=True, learned=("captured",)),
}


def native_runs(**kw) -> bool:
    """Whether the native engine runs these features here: the engine lists below take
    "cpp" in by themselves once its kernels compute them (cpp.not_yet is the one gate)."""
    return HAS_CPP and not cpp.not_yet(_features(**kw))


def engines_for(*names) -> list[str]:
    out = ["reference", "tiled"]
    if all(native_runs(**LEARNED_FEATURES[n]) for n in names):
        out.append("cpp")
    return out


def _qkv(B=2, H=2, T=9, d=4, seed=0, dtype=F64, grad=False):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(B, H, T, d, generator=g, dtype=dtype) for _ in range(3)]
    return [t.requires_grad_(grad) for t in out]


def _rel_index(T):
    i = torch.arange(T)
    return (T - 1) + i[None, :] - i[:, None]  # c + j - pos(i)


def test_modifiers_are_the_definition():
    """S·scale, softcap, ALiBi, rel_bias[h, c + j − i], bias, then the score_mod, then M."""
    B, H, T = 2, 2, 9
    q, k, v = _qkv(B, H, T)
    bias = torch.randn(B, 1, T, T, dtype=F64)
    rel = torch.randn(H, 2 * T - 1, dtype=F64)
    slopes = torch.tensor([0.3, 0.7], dtype=F64)

    def smod(s, b, h, q_idx, kv_idx):
        return s * (1 + 0.1 * h) - 0.05 * (q_idx - kv_idx)

    kw = dict(window=5, softcap=4.0, alibi_slopes=slopes, rel_bias=rel, bias=bias, score_mod=smod)
    S = (q @ k.transpose(-1, -2)) / 2
    S = 4.0 * torch.tanh(S / 4.0)
    i = torch.arange(T)
    dist = (i[:, None] - i[None, :]).abs()
    S = S - slopes[None, :, None, None] * dist + rel[:, _rel_index(T)][None] + bias
    S_pre_mod = S
    hh = torch.arange(H)[None, :, None, None]
    S = S * (1 + 0.1 * hh) - 0.05 * (i[:, None] - i[None, :])
    allowed = torch.as_tensor(Pattern(window=5).allowed(1, 1, T, T))
    want = torch.softmax(S.masked_fill(~allowed, float("-inf")), -1) @ v
    for engine in engines_for("bias", "rel_bias", "alibi_slopes", "score_mod"):
        torch.testing.assert_close(ca.attention(q, k, v, engine=engine, **kw), want)
    # without the score_mod: the engines that run the biases and slopes (cpp when it does)
    S2 = S_pre_mod
    want2 = torch.softmax(S2.masked_fill(~allowed, float("-inf")), -1) @ v
    no_mod = {n: x for n, x in kw.items() if n != "score_mod"}
    for engine in engines_for("bias", "rel_bias", "alibi_slopes"):
        torch.testing.assert_close(ca.attention(q, k, v, engine=engine, **no_mod), want2)


def test_score_mod_written_as_the_keyword_modifiers():
    q, k, v = _qkv(T=30)
    slopes = torch.tensor([0.25, 0.5], dtype=F64)

    def capped(s, b, h, q_idx, kv_idx):
        return 3.0 * torch.tanh(s / 3.0)

    def alibi(s, b, h, q_idx, kv_idx):
        return s - slopes[h] * (q_idx - kv_idx).abs()

    for engine in ("reference", "tiled"):
        for mod, kw in ((capped, {"softcap": 3.0}), (alibi, {"alibi_slopes": slopes})):
            torch.testing.assert_close(
                ca.attention(q, k, v, engine=engine, window=11, score_mod=mod),
                ca.attention(q, k, v, engine="reference", window=11, **kw),
                rtol=0,
                atol=1e-13,
            )


# ---- gradients -------------------------------------------------------------------------------
def _learned(name):
    T, H = 9, 2
    g = torch.Generator().manual_seed(5)
    if name == "bias":
        return {"bias": torch.randn(1, H, T, T, generator=g, dtype=F64)}
    if name == "key bias":  # broadcast over heads and queries: dbias summed over them
        return {"bias": torch.randn(2, 1, 1, T, generator=g, dtype=F64)}
    if name == "rel_bias":
        return {"rel_bias": torch.randn(H, 2 * T - 1, generator=g, dtype=F64)}
    if name == "alibi_slopes":
        return {"alibi_slopes": torch.rand(H, generator=g, dtype=F64)}
    table = torch.randn(H, 2 * T - 1, generator=g, dtype=F64)
    return {"table": table}


def _kwargs(name, leaf):
    if name == "score_mod":
        T = 9
        return {"score_mod": lambda s, b, h, qi, kj: s + leaf[h, qi - kj + T - 1] * torch.tanh(s)}
    key = "bias" if name in ("bias", "key bias") else name
    return {key: leaf}


@pytest.mark.parametrize("engine", ["reference", "tiled", "cpp"])
@pytest.mark.parametrize("name", ["bias", "key bias", "rel_bias", "alibi_slopes", "score_mod"])
def test_gradcheck_of_every_learned_tensor(name, engine):
    if engine not in engines_for(name):
        why = cpp.not_yet(_features(**LEARNED_FEATURES[name])) or cpp.unavailable()
        pytest.skip(f"engine {engine!r} does not run a learnable {name} here: {why}")
    (leaf,) = (t.clone().requires_grad_() for t in _learned(name).values())
    q, k, v = _qkv(grad=True)

    def f(q, k, v, leaf):
        return ca.attention(q, k, v, window=5, engine=engine, **_kwargs(name, leaf))

    assert torch.autograd.gradcheck(f, (q, k, v, leaf), eps=1e-6, atol=1e-6)


def test_dbias_is_summed_over_the_broadcast_axes():
    q, k, v = _qkv(grad=True)
    bias = torch.zeros(1, 2, 1, 9, dtype=F64, requires_grad=True)
    full = torch.zeros(2, 2, 9, 9, dtype=F64, requires_grad=True)
    for engine in engines_for("bias"):
        (g1,) = torch.autograd.grad(ca.attention(q, k, v, bias=bias, engine=engine).sum(), bias)
        (g2,) = torch.autograd.grad(ca.attention(q, k, v, bias=full, engine=engine).sum(), full)
        assert g1.shape == bias.shape
        torch.testing.assert_close(g1, g2.sum(dim=(0, 2), keepdim=True))


def test_gradient_bits_are_the_same_across_runs_and_thread_counts():
    """The tiled backward over many tiles and workers: dq, dk, dv, dbias, drel_bias, dslopes
    and the score_mod's captured table, the same bits on 1 and 2 threads, run after run."""
    B, H, T, d = 1, 4, 256, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, d, generator=g).requires_grad_() for _ in range(3))
    bias = torch.randn(1, H, T, T, generator=g).requires_grad_()
    rel = torch.randn(H, 2 * T - 1, generator=g).requires_grad_()
    slopes = torch.rand(H, generator=g).requires_grad_()
    table = torch.randn(H, 2 * T - 1, generator=g).requires_grad_()

    def smod(s, b, h, q_idx, kv_idx):
        return s + table[h, q_idx - kv_idx + T - 1]

    leaves = (q, k, v, bias, rel, slopes, table)

    def grads(engine, mod):
        out = ca.attention(
            q, k, v, bias=bias, rel_bias=rel, alibi_slopes=slopes, score_mod=mod, engine=engine
        )
        return torch.autograd.grad((out * out).sum(), leaves if mod else leaves[:-1])

    runs = [("tiled", smod)]
    if "cpp" in engines_for("bias", "rel_bias", "alibi_slopes"):
        runs.append(("cpp", None))
    threads = torch.get_num_threads()
    for engine, mod in runs:
        try:
            torch.set_num_threads(2)
            first, second = grads(engine, mod), grads(engine, mod)
            torch.set_num_threads(1)
            single = grads(engine, mod)
        finally:
            torch.set_num_threads(threads)
        for a, b, c in zip(first, second, single):
            assert torch.equal(a, b) and torch.equal(a, c), engine


def test_compiled_score_mod_sends_gradients_to_its_tensors():
    T = 32
    table = torch.nn.Parameter(torch.randn(2, 2 * T - 1))

    def smod(s, b, h, q_idx, kv_idx):
        return s + table[h, q_idx - kv_idx + T - 1]

    q, k, v = _qkv(T=T, dtype=torch.float32, grad=True)
    f = lambda q, k, v: ca.attention(q, k, v, score_mod=smod)  # noqa: E731
    (want,) = torch.autograd.grad(f(q, k, v).sum(), table)
    (got,) = torch.autograd.grad(torch.compile(f, fullgraph=True)(q, k, v).sum(), table)
    torch.testing.assert_close(got, want)


def test_a_layer_takes_a_bias_per_call_with_its_gradient():
    layer = ca.CausalSelfAttention(16, 2, engine="tiled").double()
    x = torch.randn(2, 6, 16, dtype=F64)
    bias = torch.zeros(1, 2, 6, 6, dtype=F64, requires_grad=True)
    torch.testing.assert_close(layer(x, attn_bias=bias), layer(x))
    layer(x, attn_bias=bias).sum().backward()
    assert bias.grad is not None and bias.grad.abs().sum() > 0


def test_an_hf_style_additive_mask_as_bias_is_the_boolean_mask():
    q, k, v = _qkv(T=12)
    allowed = torch.as_tensor(Pattern(window=4).allowed(1, 1, 12, 12))
    for fill in (float("-inf"), torch.finfo(F64).min):
        additive = torch.zeros(1, 1, 12, 12, dtype=F64).masked_fill(~allowed, fill)
        for engine in ("reference", "tiled", "sdpa") + (
            ("cpp",) if native_runs(present=("bias",)) else ()
        ):
            torch.testing.assert_close(
                ca.attention(q, k, v, causal=False, bias=additive, engine=engine),
                ca.attention(q, k, v, window=4, engine="reference"),
            )


# ---- who runs what ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw,what",
    [
        ({"present": ("bias",)}, "bias"),
        ({"present": ("rel_bias",)}, "rel_bias"),
        ({"score_mod": True}, "score_mod"),
        ({"present": ("alibi_slopes",), "grad": True, "learned": ("alibi_slopes",)}, "learnable"),
    ],
)
def test_the_native_engine_refuses_what_it_cannot_run_and_auto_passes_it_by(kw, what):
    f = _features(**kw)
    runs = not cpp.not_yet(f)  # the native kernels compute it now: it must run, not refuse
    why = cpp.refusal(f)
    if not runs:
        assert what in why and "'tiled' and 'reference'" in why
        assert auto.pick(f) == "tiled"
    q, k, v = _qkv(dtype=torch.float32)
    args = {
        "bias": {"bias": torch.zeros(9, 9)},
        "rel_bias": {"rel_bias": torch.zeros(2, 17)},
        "score_mod": {"score_mod": lambda s, b, h, qi, kj: s},
        "learnable": {"alibi_slopes": torch.ones(2, requires_grad=True)},
    }[what]
    if what == "learnable":
        q.requires_grad_()
    if HAS_CPP and not runs:
        with pytest.raises(ValueError, match=what):
            ca.attention(q, k, v, engine="cpp", **args)
    if HAS_CPP and runs:
        torch.testing.assert_close(
            ca.attention(q, k, v, engine="cpp", **args),
            ca.attention(q, k, v, engine="reference", **args),
        )
    out = ca.attention(q, k, v, **args)  # auto: an engine that runs it
    torch.testing.assert_close(out, ca.attention(q, k, v, engine="reference", **args))


def test_a_learnable_slope_without_gradient_runs_natively():
    f = _features(present=("alibi_slopes",))
    assert "learnable" not in cpp.refusal(f)
    assert not cpp.not_yet(f) and cpp.not_yet(_features(mask_mod=True)) == ""


def test_sdpa_and_triton_refuse_a_score_mod_naming_who_runs_it():
    assert "'tiled' (CPU) and 'reference'" in registry.refusal("sdpa", _features(score_mod=True))
    why = registry.refusal("triton", _features(device="cuda", score_mod=True))
    assert "score_mod" in why and "'reference'" in why
    assert auto.pick(_features(device="cuda", score_mod=True)) == "reference"


# ---- bad input -------------------------------------------------------------------------------
def test_a_score_mod_that_changes_the_shape_is_refused():
    q, k, v = _qkv()
    for engine in ("reference", "tiled"):
        with pytest.raises(
            ValueError,
            match=r"score_mod: lambda returned shape \(2, 2, \d+\) for scores of shape "
            r"\(2, 2, \d+, \d+\)",
        ):
            ca.attention(q, k, v, engine=engine, score_mod=lambda s, b, h, qi, kj: s.sum(-1))
    with pytest.raises(ValueError, match="score_mod: lambda returned dtype torch.bool"):
        ca.attention(q, k, v, score_mod=lambda s, b, h, qi, kj: s > 0)
    with pytest.raises(ValueError, match="score_mod: lambda raised KeyError"):
        ca.attention(q, k, v, score_mod=lambda s, b, h, qi, kj: {}["x"])


def test_a_bias_that_does_not_broadcast_is_refused():
    q, k, v = _qkv()
    with pytest.raises(
        ValueError,
        match=r"bias: shape \(3, 9\) does not broadcast to \(B, H, T_q, T_k\) = \(2, 2, 9, 9\)",
    ):
        ca.attention(q, k, v, bias=torch.zeros(3, 9, dtype=F64))
    with pytest.raises(ValueError, match="bias: must be a float array"):
        make_problem(q, k, v, bias=torch.zeros(9, 9, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"rel_bias: expected \(H, 2·T−1\) = \(2, 17\)"):
        ca.attention(q, k, v, rel_bias=torch.zeros(2, 15, dtype=F64))
    with pytest.raises(ValueError, match=r"rel_bias: expected"):
        ca.attention(q, k, v, rel_bias=torch.zeros(3, 17, dtype=F64))
