"""causalattn as a PyTorch operator: torch.compile(fullgraph=True), torch.export, meta
tensors, torch.func, and clear trace-time errors.

Most compiles use the ``aot_eager`` backend: it runs Dynamo (graph breaks fail under
``fullgraph=True``) and AOTAutograd (the fake implementations, the registered backward,
functionalization) without generating C++, which takes minutes on a small CI machine; one
``slow`` test compiles with the default Inductor backend.
"""

from __future__ import annotations

import pytest
import torch

import causalattn as ca
from causalattn.engines import contract, make_problem, ops

FLOOR = 1e-6
CPU_ENGINES = ["auto", "tiled", "reference", "sdpa"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def assert_accurate(out, ref64, plain_t):
    """docs/design.md's rule: max|out - ref64| <= 2·max|plain_t - ref64| + floor."""
    err = (out.double() - ref64).abs().max().item()
    bound = 2 * (plain_t.double() - ref64).abs().max().item() + FLOOR
    assert err <= bound, f"max|out - ref64| = {err:.3g} > {bound:.3g}"


def inputs(B=2, Hq=4, Hkv=2, T_q=12, T_k=12, d=8, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, T_q, d, generator=g)
    k = torch.randn(B, Hkv, T_k, d, generator=g)
    v = torch.randn(B, Hkv, T_k, d, generator=g)
    return [t.requires_grad_(grad) for t in (q, k, v)]


# every mask keyword, each as one attention call of the same compiled function
LEGACY = ("plain", "full", "lengths", "key_padding_mask", "cu_seqlens", "decode")
SDPA_TOO = ("window", "chunk", "prefix_lengths", "mask", "alibi_slopes", "dropout_p")
ONLY_OURS = ("softcap", "sinks")
KEYWORDS = {
    "auto": LEGACY + SDPA_TOO + ONLY_OURS,
    "reference": LEGACY + SDPA_TOO + ONLY_OURS,
    "tiled": LEGACY,
    "sdpa": LEGACY + SDPA_TOO[:-1],  # SDPA's dropout is its own draw
}


KPM = torch.ones(2, 12, dtype=torch.bool)
KPM[1, 7:] = False
KPM[0, 2] = False
DENSE = torch.rand(2, 1, 12, 12, generator=torch.Generator().manual_seed(3)) > 0.3


def _all_masks(q, k, v, sinks, engine):
    H, T = q.shape[1], q.shape[2]
    kpm, dense = KPM, DENSE
    calls = {
        "plain": lambda: ca.attention(q, k, v, engine=engine),
        "full": lambda: ca.attention(q, k, v, engine=engine, causal=False),
        "lengths": lambda: ca.attention(q, k, v, engine=engine, lengths=torch.tensor([T, 5])),
        "key_padding_mask": lambda: ca.attention(q, k, v, engine=engine, key_padding_mask=kpm),
        "cu_seqlens": lambda: ca.attention(
            q[:1], k[:1], v[:1], engine=engine, cu_seqlens=torch.tensor([0, 5, 9, T])
        ),
        "decode": lambda: ca.attention(q[:, :, -3:], k, v, engine=engine),  # T_q < T_k
        "window": lambda: ca.attention(q, k, v, engine=engine, window=3),
        "chunk": lambda: ca.attention(q, k, v, engine=engine, chunk=4),
        "prefix_lengths": lambda: ca.attention(
            q, k, v, engine=engine, prefix_lengths=torch.tensor([4, 2])
        ),
        "mask": lambda: ca.attention(q, k, v, engine=engine, mask=dense),
        "alibi_slopes": lambda: ca.attention(
            q, k, v, engine=engine, alibi_slopes=torch.linspace(0.1, 1, H)
        ),
        "dropout_p": lambda: ca.attention(q, k, v, engine=engine, dropout_p=0.25),
        "softcap": lambda: ca.attention(q, k, v, engine=engine, softcap=2.0),
        "sinks": lambda: ca.attention(q, k, v, engine=engine, sinks=sinks),
    }
    return [calls[n]() for n in KEYWORDS[engine]]


def _loss(outs):
    return sum((o * torch.linspace(-1, 1, o.shape[-1])).sum() for o in outs)


@pytest.mark.parametrize("engine", CPU_ENGINES)
def test_compile_fullgraph_every_mask_matches_eager_with_gradients(engine):
    q, k, v = inputs()
    sinks = torch.nn.Parameter(torch.linspace(-1, 1, q.shape[1]))
    leaves = (q, k, v, sinks)
    compiled = torch.compile(_all_masks, fullgraph=True, backend="aot_eager")
    torch.manual_seed(7)  # the dropout seed is drawn inside the graph: the same draw
    got = compiled(q, k, v, sinks, engine)
    g_got = torch.autograd.grad(_loss(got), leaves, allow_unused=True)
    torch.manual_seed(7)
    want = _all_masks(q, k, v, sinks, engine)
    g_want = torch.autograd.grad(_loss(want), leaves, allow_unused=True)
    for name, a, b in zip(KEYWORDS[engine], got, want):  # the same engine, the same numbers
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
    for a, b in zip(g_got, g_want):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    if "sinks" in KEYWORDS[engine]:
        assert g_got[3] is not None and g_got[3].abs().sum() > 0  # the learned sinks learn


def test_sinks_gradient_equals_the_reference_autograd():
    q, k, v = inputs(grad=False)
    sinks = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    f = torch.compile(
        lambda q, s: ca.attention(q, k, v, sinks=s, window=5), fullgraph=True, backend="aot_eager"
    )
    f(q, sinks).square().sum().backward()
    got = sinks.grad.clone()
    s64 = sinks.detach().double().requires_grad_()
    out = ca.attention(q.double(), k.double(), v.double(), sinks=s64, window=5, engine="reference")
    out.square().sum().backward()
    torch.testing.assert_close(got.double(), s64.grad, rtol=1e-4, atol=1e-5)


def test_compiled_attention_meets_the_accuracy_rule():
    q, k, v = inputs(grad=False)
    lengths = torch.tensor([12, 7])
    f = torch.compile(
        lambda q, k, v: ca.attention(q, k, v, lengths=lengths), fullgraph=True, backend="aot_eager"
    )
    out = f(q, k, v)
    ref64 = ca.attention(q.double(), k.double(), v.double(), lengths=lengths, engine="reference")
    plain_t = contract.plain(make_problem(q, k, v, lengths=lengths), q.dtype)
    assert_accurate(out, ref64, plain_t)


def test_return_lse_compiles_and_its_gradient_flows():
    q, k, v = inputs()
    f = torch.compile(
        lambda q, k, v: ca.attention(q, k, v, return_lse=True), fullgraph=True, backend="aot_eager"
    )
    out, lse = f(q, k, v)
    (out.sum() + lse.sum()).backward()
    g = q.grad.clone()
    q.grad = None
    out2, lse2 = ca.attention(q, k, v, return_lse=True, engine="reference")
    (out2.sum() + lse2.sum()).backward()
    torch.testing.assert_close(lse, lse2, rtol=0, atol=1e-5)
    torch.testing.assert_close(g, q.grad, rtol=0, atol=1e-5)


# ---- the layer ---------------------------------------------------------------------------


def _layer(**kw):
    torch.manual_seed(0)
    return ca.CausalSelfAttention(32, 4, n_kv_heads=2, proj_bias=True, **kw)


def test_layer_compiles_forward_and_backward():
    layer = _layer()
    x = torch.randn(2, 9, 32)
    lengths = torch.tensor([9, 4])
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    out = compiled(x, lengths=lengths)
    out.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    want = layer(x, lengths=lengths)
    want.square().sum().backward()
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
    for n, p in layer.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=0, atol=1e-5, msg=n)


def test_layer_with_kv_cache_compiles_and_decodes_as_eager():
    layer = _layer().eval()
    x = torch.randn(2, 8, 32)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    mine, theirs = ca.KVCache(capacity=16), ca.KVCache(capacity=16)
    with torch.no_grad():
        steps = [x[:, :4]] + [x[:, i : i + 1] for i in range(4, 8)]
        for s in steps:
            torch.testing.assert_close(
                compiled(s, kv_cache=mine), layer(s, kv_cache=theirs), rtol=0, atol=1e-6
            )
    assert len(mine) == 8
    other = _layer()
    with pytest.raises(ValueError, match="another CausalSelfAttention layer"):
        other(x[:, :1], kv_cache=mine)


@pytest.mark.slow
def test_layer_compiles_with_inductor_within_the_accuracy_rule():
    layer = _layer().eval()
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        out = torch.compile(layer, fullgraph=True)(x)
        ref = layer.double()(x.double())
        plain_out = layer.float()(x)  # the eager fp32 layer (itself within the rule)
    assert_accurate(out, ref, plain_out)


# ---- export ------------------------------------------------------------------------------


def test_export_layer_with_a_dynamic_sequence_length():
    layer = _layer().eval()
    T = torch.export.Dim("T", min=2, max=512)
    x = torch.randn(2, 9, 32)
    ep = torch.export.export(layer, (x,), dynamic_shapes={"x": {1: T}})
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.causalattn.fwd.default in targets
    for n in (9, 17, 40):
        x = torch.randn(2, n, 32)
        torch.testing.assert_close(ep.module()(x), layer(x), rtol=0, atol=1e-6)


# ---- meta, torch.func ------------------------------------------------------------------


def test_attention_on_meta_tensors_gives_meta_of_the_right_shape():
    q = torch.empty(2, 4, 6, 8, device="meta")
    k = torch.empty(2, 2, 10, 8, device="meta")
    v = torch.empty(2, 2, 10, 5, device="meta")
    out, lse = ca.attention(
        q,
        k,
        v,
        lengths=torch.tensor([10, 7], device="meta"),
        sinks=torch.zeros(4, device="meta"),
        window=3,
        return_lse=True,
    )
    assert out.device.type == "meta" and out.shape == (2, 4, 6, 5) and out.dtype == q.dtype
    assert lse.device.type == "meta" and lse.shape == (2, 4, 6) and lse.dtype == torch.float32


def test_layer_built_on_meta_then_materialized_and_loaded():
    src = _layer()
    with torch.device("meta"):
        layer = ca.CausalSelfAttention(32, 4, n_kv_heads=2, proj_bias=True)
    assert layer.W_q.device.type == "meta"
    x_meta = torch.empty(2, 5, 32, device="meta")
    assert layer(x_meta).shape == (2, 5, 32)
    layer.to_empty(device="cpu")
    layer.load_state_dict(src.state_dict())
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(layer(x), src(x), rtol=0, atol=0)


def test_torch_func_grad_equals_autograd():
    q, k, v = inputs(grad=False)
    g = torch.func.grad(
        lambda q, k: ca.attention(q, k, v, engine="tiled").square().sum(), argnums=(0, 1)
    )(q, k)
    q2, k2 = q.clone().requires_grad_(), k.clone().requires_grad_()
    ca.attention(q2, k2, v, engine="tiled").square().sum().backward()
    torch.testing.assert_close(g[0], q2.grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(g[1], k2.grad, rtol=0, atol=1e-6)


def test_torch_func_vmap_over_a_leading_axis():
    q, k, v = inputs(grad=False)
    qs, ks, vs = (torch.stack([t, t.flip(2)]) for t in (q, k, v))
    got = torch.func.vmap(lambda q, k, v: ca.attention(q, k, v, lengths=[12, 5]))(qs, ks, vs)
    for i in range(2):
        torch.testing.assert_close(got[i], ca.attention(qs[i], ks[i], vs[i], lengths=[12, 5]))
    # and the gradient of a vmapped function (vmap over the backward operator too)
    gq = torch.func.vmap(torch.func.grad(lambda q: ca.attention(q, k, v).square().sum()))(qs)
    for i in range(2):
        q1 = qs[i].clone().requires_grad_()
        ca.attention(q1, k, v).square().sum().backward()
        torch.testing.assert_close(gq[i], q1.grad, rtol=0, atol=1e-6)


# ---- errors while tracing ----------------------------------------------------------------


def test_trace_time_errors_name_the_argument():
    q, k, v = inputs(grad=False)
    bad_engine = torch.compile(
        lambda q: ca.attention(q, q, q, engine="fast"), fullgraph=True, backend="aot_eager"
    )
    with pytest.raises(Exception, match="unknown engine 'fast'"):
        bad_engine(q)
    bad_shape = torch.compile(
        lambda q, k: ca.attention(q, k, k), fullgraph=True, backend="aot_eager"
    )
    with pytest.raises(Exception, match="inner d_k axes must match"):
        bad_shape(q, torch.randn(2, 2, 12, 5))


def test_data_checks_run_inside_the_operator_when_compiled():
    q, k, v = inputs(grad=False)
    f = torch.compile(
        lambda q, k, v, L: ca.attention(q, k, v, lengths=L), fullgraph=True, backend="aot_eager"
    )
    f(q, k, v, torch.tensor([12, 3]))
    with pytest.raises(ValueError, match=r"lengths: each must lie in \[0, T_k=12\]"):
        f(q, k, v, torch.tensor([12, 13]))


def _op_args(q, k, v, engine, **kw):
    tensors = [kw.get(n) for n in ops.TENSORS]
    seed = torch.tensor([3, 4]) if kw.get("dropout_p") else None
    return (
        q,
        k,
        v,
        *tensors,
        [],  # captured: the tensors a score_mod reads (none)
        seed,
        True,
        kw.get("window"),
        None,
        kw.get("softcap"),
        0.3,
        kw.get("dropout_p", 0.0),
        0,  # mods: no mask_mod, no score_mod
        engine,
    )


UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


def test_fake_and_real_operators_agree():
    q, k, v = inputs()
    sinks = torch.randn(4, requires_grad=True)
    cases = [
        ("tiled", {"lengths": torch.tensor([12, 5])}),
        ("sdpa", {"window": 3}),
        ("reference", {"sinks": sinks, "softcap": 3.0, "dropout_p": 0.2}),
    ]
    for engine, kw in cases:
        args = _op_args(q, k, v, engine, **kw)
        torch.library.opcheck(torch.ops.causalattn.fwd.default, (*args, False), test_utils=UTILS)
        out, lse = ops.fwd(*args, False)
        dout = torch.randn_like(out)
        det = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
        want = int("sinks" in kw)  # bit 0: LEARNED[0], the sinks
        bargs = (dout, None, *det[:3], out.detach(), lse.detach(), *det[3:], want)
        torch.library.opcheck(torch.ops.causalattn.bwd.default, bargs, test_utils=UTILS[:2])


# ---- Hugging Face ------------------------------------------------------------------------


def _hf_model(name):
    """A one-layer tiny random model (_hf_tiny's config) on attn_implementation='causalattn'."""
    transformers = pytest.importorskip("transformers")
    import _hf_tiny as tiny

    from causalattn.integrations.transformers import register

    register()
    cfg = tiny.CONFIGS[name]()
    setattr(cfg, "n_layer" if name == "gpt2" else "num_hidden_layers", 1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="causalattn")
    ids = torch.randint(3, tiny.VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    am = torch.ones(2, 10, dtype=torch.long)
    am[1, 7:] = 0  # right padding: HF hands the attention function a boolean mask
    return model, ids, am


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hf_model_compiles_fullgraph_forward_and_backward(name):
    model, ids, am = _hf_model(name)
    model.train()  # no dropout in these configs; gradients on

    def loss(m):
        logits = m(ids, attention_mask=am, use_cache=False).logits
        return (logits.float().square() * am[..., None]).mean()

    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    got = loss(compiled)
    got.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    want = loss(model)
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert grads
    for n, p in model.named_parameters():
        if n in grads:
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.slow
def test_hf_model_exports_and_the_program_matches():
    model, ids, am = _hf_model("llama")
    model.eval()
    with torch.no_grad():
        want = model(ids, attention_mask=am, use_cache=False).logits
    ep = torch.export.export(model, (ids,), kwargs={"attention_mask": am, "use_cache": False})
    assert any(n.target == torch.ops.causalattn.fwd.default for n in ep.graph.nodes)
    got = ep.module()(ids, attention_mask=am, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
