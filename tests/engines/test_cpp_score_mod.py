"""score_mod on the native engine (its traced program, causalattn.engines.score_program):
forward, dq, dk, dv and the captured tensors' gradients against the reference, bits across
thread counts, what "auto" picks, what falls back to "tiled", and bad input."""

from __future__ import annotations

import pytest
import torch

import causalattn as ca
from causalattn.engines import auto, cpp, registry, score_program

pytestmark = pytest.mark.skipif(bool(cpp.unavailable()), reason=cpp.unavailable() or "built")

F64 = torch.float64
B, H, H_KV, T_Q, T_K, D = 2, 4, 2, 37, 101, 16  # GQA, T_q < T_k, no multiple of a block


def _leaves(dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T_Q, D, generator=g, dtype=dtype)
    k = torch.randn(B, H_KV, T_K, D, generator=g, dtype=dtype)
    v = torch.randn(B, H_KV, T_K, D, generator=g, dtype=dtype)
    tables = {
        "rel": torch.randn(H, 2 * T_K - 1, generator=g, dtype=dtype),
        "slopes": torch.rand(H, generator=g, dtype=dtype),
        "buf": torch.randn(T_K, generator=g, dtype=dtype),
        "qbuf": torch.randn(T_K, generator=g, dtype=dtype),
    }
    return [t.requires_grad_() for t in (q, k, v)], {
        n: t.requires_grad_() for n, t in tables.items()
    }


def _mods(t):
    return {
        "identity": lambda s, b, h, qi, kj: s,
        "times two": lambda s, b, h, qi, kj: s * 2,
        "squared": lambda s, b, h, qi, kj: s * s,
        "head offset": lambda s, b, h, qi, kj: s + h,
        "trig": lambda s, b, h, qi, kj: torch.sin(s) * torch.cos(s),
        "relative bias": lambda s, b, h, qi, kj: s + t["rel"][h, qi - kj + T_K - 1],
        "alibi": lambda s, b, h, qi, kj: s - t["slopes"][h] * (qi - kj).abs(),
        "softcap": lambda s, b, h, qi, kj: 5.0 * torch.tanh(s / 5.0),
        "buffer": lambda s, b, h, qi, kj: s + t["buf"][kj] * torch.tanh(s) - t["qbuf"][qi] ** 2,
        "where": lambda s, b, h, qi, kj: torch.where(qi - kj < 20, s, s - 2.0 * b),
        # three tables: each one's gradient found at its own place in the kernels' flat sums
        "three tables": lambda s, b, h, qi, kj: s + t["buf"][kj] - t["qbuf"][qi] * t["slopes"][h],
    }


NAMES = list(_mods({}))


def _grads(engine, name, dtype=F64, **kw):
    (q, k, v), t = _leaves(dtype)
    mod = _mods(t)[name]
    out = ca.attention(q, k, v, engine=engine, score_mod=mod, **kw)
    leaves = [q, k, v, *t.values()]
    grads = torch.autograd.grad((out * out).sum(), leaves, allow_unused=True)
    return out, [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)]


@pytest.mark.parametrize("name", NAMES)
def test_score_mod_on_cpp_matches_the_reference(name):
    qkv, t = _leaves()
    assert cpp.supports(registry.features(*qkv, tensors={}, score_mod=_mods(t)[name])) is None
    out, grads = _grads("cpp", name)
    ref, ref_grads = _grads("reference", name)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-11)
    for what, g, r in zip(("dq", "dk", "dv", "rel", "slopes", "buf", "qbuf"), grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-10, msg=f"{name}: {what}")


@pytest.mark.parametrize("name", ["relative bias", "alibi", "softcap", "buffer"])
def test_score_mod_beside_the_keyword_modifiers_and_a_window_in_fp32(name):
    kw = dict(window=29, softcap=8.0, alibi_slopes=torch.rand(H, dtype=torch.float32))
    out, grads = _grads("cpp", name, torch.float32, **kw)
    ref, ref_grads = _grads("reference", name, torch.float32, **kw)
    torch.testing.assert_close(out, ref, rtol=2e-4, atol=2e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=2e-3, atol=2e-4)


def test_learned_tensors_get_the_references_gradient_through_lse_too():
    """A loss that reads the log-sum-exp as well as H: q, k, v, a learned bias, rel_bias,
    ALiBi slopes and the score_mod's tables all get the reference's gradient."""
    grads = []
    for engine in ("cpp", "reference"):
        (q, k, v), t = _leaves(seed=3)
        g = torch.Generator().manual_seed(4)
        learned = {
            "bias": torch.randn(1, H, T_Q, T_K, generator=g, dtype=F64),
            "rel_bias": torch.randn(H, 2 * T_K - 1, generator=g, dtype=F64),
            "alibi_slopes": torch.rand(H, generator=g, dtype=F64),
        }
        learned = {n: x.requires_grad_() for n, x in learned.items()}
        mod = _mods(t)["three tables"]
        out, lse = ca.attention(q, k, v, engine=engine, score_mod=mod, return_lse=True, **learned)
        leaves = [q, k, v, *learned.values(), t["buf"], t["qbuf"], t["slopes"]]
        grads.append(torch.autograd.grad(out.square().sum() + lse.sin().sum(), leaves))
    for n, a, b in zip(("q", "k", "v", *learned, "buf", "qbuf", "slopes"), *grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=n)


def test_the_same_bits_on_one_and_two_threads():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        first = _grads("cpp", "buffer", torch.float32)
        again = _grads("cpp", "buffer", torch.float32)
        torch.set_num_threads(1)
        single = _grads("cpp", "buffer", torch.float32)
    finally:
        torch.set_num_threads(threads)
    for a, b, c in zip([first[0], *first[1]], [again[0], *again[1]], [single[0], *single[1]]):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_auto_runs_a_traced_score_mod_on_cpp_and_an_untraceable_one_on_tiled():
    (q, k, v), t = _leaves(torch.float32)
    traced = _mods(t)["relative bias"]

    def branchy(s, b, h, qi, kj):  # Python control flow on a traced value: no program
        return s * 2 if s.sum() > 0 else s

    f = registry.features(q, k, v, tensors={}, score_mod=traced, grad=True, captured=[t["rel"]])
    assert auto.pick(f) == "cpp"
    g = registry.features(q, k, v, tensors={}, score_mod=branchy)
    why = registry.refusal("cpp", g)
    assert "score_mod branchy" in why and "'tiled'" in why
    assert auto.pick(g) == "tiled"
    with pytest.raises(ValueError, match="score_mod branchy.*'tiled'"):
        ca.attention(q, k, v, engine="cpp", score_mod=branchy)
    torch.testing.assert_close(
        ca.attention(q, k, v, score_mod=branchy),
        ca.attention(q, k, v, engine="reference", score_mod=branchy),
    )


def test_the_program_is_made_once_per_function():
    (q, k, v), t = _leaves(torch.float32)
    mod = _mods(t)["alibi"]
    assert score_program.program(mod) is score_program.program(mod)
    prog = score_program.program(mod)
    assert prog.tables and prog.tables[0] is t["slopes"]
    # the slope gather reads only h: once per panel of columns, not per key
    code, *_ = prog.arrays(torch.float32)
    gathers = [row for row in code.tolist() if row[0] == score_program.OP["gather"]]
    assert gathers and all(row[7] == 0 for row in gathers)


_WIDE = torch.randn(64, dtype=torch.float64)


@pytest.mark.parametrize(
    "mod,match",
    [  # the pattern's own check, before any engine runs: the same message on every engine
        (lambda s, b, h, qi, kj: s.sum(-1), r"score_mod: lambda returned shape \(2, 4, 16\)"),
        (lambda s, b, h, qi, kj: 1.0, "score_mod: lambda returned float, not an array"),
        (lambda s, b, h, qi, kj: s > 0, "score_mod: lambda returned dtype torch.bool"),
        # the native engine's: float32 scores plus a float64 table are not cast back silently
        (
            lambda s, b, h, qi, kj: s + _WIDE[h],
            "score_mod: lambda returned dtype torch.float64 .*engine 'cpp'",
        ),
    ],
)
def test_a_bad_score_mod_is_named(mod, match):
    q, k, v = (t.detach().float() for t in _leaves()[0])
    with pytest.raises(ValueError, match=match):
        ca.attention(q, k, v, engine="cpp", score_mod=mod)


def test_an_index_out_of_range_at_a_readable_cell_is_an_error():
    q, k, v = (t.detach().float() for t in _leaves()[0])
    short = torch.randn(T_K // 2)
    with pytest.raises(ValueError, match="score_mod: a captured tensor was indexed out of range"):
        ca.attention(q, k, v, engine="cpp", score_mod=lambda s, b, h, qi, kj: s + short[kj])


def test_an_identity_score_mod_runs_as_none():
    """score_mod=lambda s, ...: s is no score_mod: the same path, so the same bits (the
    decoding path's key splits included)."""
    g = torch.Generator().manual_seed(6)
    for T_q in (1, 40):
        q = torch.randn(1, 2, T_q, 8, generator=g)
        k, v = (torch.randn(1, 2, 1200, 8, generator=g) for _ in range(2))
        same = ca.attention(q, k, v, engine="cpp", score_mod=lambda s, b, h, qi, kj: s)
        assert torch.equal(same, ca.attention(q, k, v, engine="cpp")), T_q


def _reading(buf, frozen):
    return lambda s, b, h, qi, kj: s + buf[kj] - frozen[qi]


def test_one_learned_table_beside_a_frozen_one():
    """Only the captured tensors that require a gradient get one; a frozen table beside a
    learned one is read, and the learned one's gradient is the reference's."""
    grads = []
    for engine in ("cpp", "reference"):
        (q, k, v), t = _leaves(seed=7)
        mod = _reading(t["buf"], t["qbuf"].detach())  # its closure holds these two only
        out = ca.attention(q, k, v, engine=engine, score_mod=mod)
        grads.append(torch.autograd.grad(out.square().sum(), [q, t["buf"]]))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def _through_a_field(cfg):
    def mod(s, b, h, qi, kj):
        return s - cfg.slopes[h] * (qi - kj)

    return mod


def test_a_learned_table_held_as_a_plain_objects_field_gets_its_gradient():
    """A score_mod reading its table through an object's field (a config, a namespace): the
    table's gradient is the reference's, as for a table in the closure."""
    import types

    grads = []
    for engine in ("cpp", "reference"):
        (q, k, v), t = _leaves(seed=3)
        mod = _through_a_field(types.SimpleNamespace(slopes=t["slopes"]))
        out = ca.attention(q, k, v, engine=engine, score_mod=mod)
        grads.append(torch.autograd.grad(out.square().sum(), [q, t["slopes"]]))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_a_direct_call_with_an_untraceable_score_mod_names_the_engines_that_run_it():
    from causalattn.engines import make_problem

    q, k, v = (t.detach().float() for t in _leaves()[0])

    def branchy(s, b, h, qi, kj):
        return s * 2 if s.sum() > 0 else s

    p = make_problem(q, k, v, score_mod=branchy)
    with pytest.raises(
        ValueError, match=r"^engine 'cpp': .*branchy.*; engines that run it: 'tiled'"
    ):
        cpp.fwd(p)
